"""The decoder's side of PD: a bounded buffer of pushed chunks, served as a storage tier.

- `PDReceiveBuffer` is a tier (`StorageBackendInterface`, tier name `PDReceiveBuffer`) after the
  CPU tier: the engine's lookup finds a pushed chunk under the request's own tokens, and
  `get_blocking` claims it (copied into CPU-tier memory, the buffer's room freed at once).
  Its memory is one pool of `pd_buffer_size` bytes: a push that does not fit is refused (the
  decoder then recomputes those tokens). A chunk nobody claims within `ttl_s` is freed.
- `PushServer` (started by `PDReceiveBuffer.listen`) binds a ZeroMQ ROUTER socket on the configured host and port, reads pushes
  (`wire.read_push`: size-capped, checksummed) on one thread and answers each one, so a sender
  knows at once whether its chunk was taken. With a token (`auth.py`) a push is taken only from
  a sender that passed the handshake, signed with its session's key and not seen before; other
  pushes are refused, counted (`auth_refusals`) and logged, rate-limited, with the peer's address.
  Without one it listens only on loopback, unless `pd_no_auth` (protected mode). With
  `pd_encrypt` the socket is a CURVE server too; peers failing that are counted from its monitor.

Nothing is ever written by the engine's own stores here (`submit_put_task` ignores them): the
decoder is a `kv_consumer`, and this tier only holds what a prefiller pushed.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from lmcache.config import LMCacheEngineMetadata
from lmcache.experimental.memory_management import HostMemoryAllocator, MemoryFormat, MemoryObj
from lmcache.experimental.pd.auth import (
    HANDSHAKE_FAILED_EVENTS,
    NoSession,
    ReceiverAuth,
    check_encryption,
    check_protected_mode,
    encrypt_server,
)
from lmcache.experimental.pd.wire import (
    PUSH_FRAMES,
    Push,
    PushReply,
    WireError,
    peek_seq,
    read_auth,
    read_push,
    reply_frame,
)
from lmcache.experimental.stats import TierStats
from lmcache.experimental.storage_backend.abstract_backend import ClosedWrites, StorageBackendInterface
from lmcache.experimental.storage_backend.chunk_format import ChunkHeader, copy_into_new
from lmcache.experimental.storage_backend.local_cpu_backend import LocalCPUBackend
from lmcache.logging import init_logger
from lmcache.server.security import AuthRefused
from lmcache.utils import CacheEngineKey

logger = init_logger(__name__)

# Pushed KV that no lookup claims within this long is freed (its request never reached us).
UNCLAIMED_TTL_S = 60.0
# How often the server thread wakes to reap and to notice `close`.
POLL_MS = 200
# Headroom over one chunk's payload for a frame's header and metadata (zmq drops bigger frames).
FRAME_SLACK_BYTES = 64 * 1024
# Pushes queued per connected sender (a sender waits for each reply, so it has one in flight).
QUEUED_PUSHES_PER_PEER = 4
# Refused peers are logged once, then once per this many refusals.
AUTH_LOG_EVERY = 100


@dataclass
class _Held:
    obj: MemoryObj
    req_id: str
    deadline: float


class PDReceiveBuffer(StorageBackendInterface):
    """Pushed chunks waiting for this decoder's lookup, bounded in bytes and in time."""

    def __init__(
        self,
        metadata: LMCacheEngineMetadata,
        capacity_bytes: int,
        local_cpu_backend: LocalCPUBackend,
        stats: Optional[TierStats] = None,
        ttl_s: float = UNCLAIMED_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._metadata = metadata
        self._pool = HostMemoryAllocator(capacity_bytes)
        self.capacity = self._pool.total_bytes
        layers, kv, chunk, heads, head_size = metadata.kv_shape
        self.max_chunk_bytes = kv * layers * chunk * heads * head_size * metadata.kv_dtype.itemsize
        self._cpu = local_cpu_backend
        self._stats = stats if stats is not None else TierStats()
        self._ttl_s = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._held: "OrderedDict[CacheEngineKey, _Held]" = OrderedDict()  # oldest first
        self._server: Optional[PushServer] = None

    def listen(
        self, host: str, port: int, token: Optional[bytes] = None, no_auth: bool = False, encrypt: bool = False
    ) -> None:
        """Start taking pushes on `tcp://host:port` (stopped by `close`), only from senders
        that prove `token` when one is given; without one, beyond loopback only with `no_auth`.
        `encrypt`: CURVE-encrypted connections only (keys from `token`)."""
        check_protected_mode(host, port, token, no_auth)
        check_encryption(encrypt, token)
        server = PushServer(self, host, port, token, encrypt)
        server.start()
        self._server = server

    def record_auth_refusal(self) -> int:
        """Count a push or handshake refused for its token; the count so far."""
        self._stats.record_auth_refusal()
        return self._stats.snapshot().auth_refusals

    @property
    def used_bytes(self) -> int:
        return self._pool.used_bytes

    def held_keys(self) -> list[CacheEngineKey]:
        """The chunks waiting to be claimed, oldest first."""
        with self._lock:
            return list(self._held)

    # ----- filled by the server --------------------------------------------------------------

    def accept(self, push: Push) -> Optional[str]:
        """Keep the pushed chunk; None when taken (or already held), else why it was refused."""
        header = push.header
        try:
            key = CacheEngineKey.from_string(header.key)
        except ValueError as err:
            return f"bad key: {err}"
        problem = self._mismatch(key, header)
        if problem is not None:
            return problem
        self.reap()
        with self._lock:
            if key in self._held:
                return None
            obj = copy_into_new(header.key, push.payload, self._pool.allocate,
                                torch.Size(header.shape), header.dtype, header.fmt)
            if obj is None:
                self._stats.record_rejected()
                return (f"receive buffer full ({self._pool.used_bytes} of {self._pool.total_bytes} bytes "
                        f"used, pd_buffer_size); chunk of {header.payload_len} bytes refused")
            self._held[key] = _Held(obj, push.req_id, self._clock() + self._ttl_s)
        self._stats.record_write(header.payload_len)
        return None

    def _mismatch(self, key: CacheEngineKey, header: ChunkHeader) -> Optional[str]:
        """Why a chunk cannot be this decoder's KV (another model, worker, geometry), or None."""
        meta = self._metadata
        mine = (meta.fmt, meta.model_name, meta.world_size, meta.worker_id)
        theirs = (key.fmt, key.model_name, key.world_size, key.worker_id)
        if theirs != mine:
            return f"key {header.key} is not for this decoder (fmt, model, world size, worker = {mine})"
        layers, kv, chunk, heads, head_size = meta.kv_shape
        shape = header.shape
        if (header.fmt != MemoryFormat.KV_BLOB or header.dtype != meta.kv_dtype or len(shape) != 4
                or shape[0] != kv or shape[1] != layers or not 0 < shape[2] <= chunk
                or shape[3] != heads * head_size):
            return (f"chunk {key.chunk_hash}: {header.fmt.name} {list(shape)} {header.dtype} is not a KV chunk "
                    f"of this model ([{kv}, {layers}, 1..{chunk}, {heads * head_size}] {meta.kv_dtype})")
        return None

    def reap(self) -> int:
        """Free chunks whose deadline passed; how many."""
        now = self._clock()
        expired: list[tuple[CacheEngineKey, _Held]] = []
        with self._lock:
            for key, held in list(self._held.items()):
                if held.deadline <= now:
                    expired.append((key, held))
                    del self._held[key]
        for key, held in expired:
            held.obj.ref_count_down()
            self._stats.record_eviction(held.obj.get_size())
        if expired:
            logger.info("PD receive buffer: freed %d unclaimed chunks (requests %s) after %.0f s",
                        len(expired), sorted({h.req_id for _, h in expired}), self._ttl_s)
        return len(expired)

    # ----- the tier interface ------------------------------------------------------------------

    def submit_put_task(self, key: CacheEngineKey, obj: MemoryObj) -> None:
        """The engine's own stores do not land here (only pushes do)."""

    def exists_in_put_tasks(self, key: CacheEngineKey) -> bool:
        return False  # nothing is written in the background

    def submit_prefetch_task(self, key: CacheEngineKey) -> bool:
        return False  # a claim is a memory copy: nothing to overlap

    def contains(self, key: CacheEngineKey) -> bool:
        with self._lock:
            return key in self._held

    def get_blocking(self, key: CacheEngineKey) -> Optional[MemoryObj]:
        """Claim the chunk: a copy in CPU-tier memory (caller owns it); the buffer's room is freed."""
        with self._lock:
            held = self._held.pop(key, None)
        if held is None:
            return None
        try:
            meta = held.obj.metadata
            return copy_into_new(key.to_string(), memoryview(held.obj.byte_array).cast("B")[: held.obj.get_size()],
                                 self._cpu.allocate, meta.shape, meta.dtype, meta.fmt)
        finally:
            self._stats.record_read(held.obj.get_size())
            held.obj.ref_count_down()

    def remove(self, key: CacheEngineKey) -> bool:
        with self._lock:
            held = self._held.pop(key, None)
        if held is None:
            return False
        held.obj.ref_count_down()
        return True

    def close(self, timeout_s: Optional[float] = None) -> ClosedWrites:
        """Stop answering pushes and release what is held (nothing here is written anywhere)."""
        if self._server is not None:
            self._server.close()
            self._server = None
        with self._lock:
            held, self._held = list(self._held.values()), OrderedDict()
        for entry in held:
            entry.obj.ref_count_down()
        return ClosedWrites()


class PushServer:
    """Answers pushes on `tcp://host:port` into a `PDReceiveBuffer`, on one thread."""

    def __init__(
        self, buffer: PDReceiveBuffer, host: str, port: int, token: Optional[bytes] = None, encrypt: bool = False
    ) -> None:
        self._buffer = buffer
        self._auth = ReceiverAuth(token) if token is not None else None
        self.address = f"tcp://{host}:{port}"
        self._ctx = zmq.Context.instance()
        self._socket = self._ctx.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._monitor: Optional[zmq.Socket] = None
        if encrypt:
            assert token is not None  # `check_encryption`
            encrypt_server(self._socket, token)
            self._monitor = self._socket.get_monitor_socket(HANDSHAKE_FAILED_EVENTS)
        # A peer sending a frame bigger than one chunk is disconnected by zmq before it is buffered.
        self._socket.setsockopt(zmq.MAXMSGSIZE, buffer.max_chunk_bytes + FRAME_SLACK_BYTES)
        self._socket.setsockopt(zmq.RCVHWM, QUEUED_PUSHES_PER_PEER)
        try:
            self._socket.bind(self.address)
        except zmq.ZMQError as err:
            self._close_sockets()
            raise OSError(f"PD receiver cannot listen on {self.address} (pd_peer_host/pd_peer_init_port): {err}") from err
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="lmcache-pd-receiver", daemon=True)

    def start(self) -> None:
        self._thread.start()
        logger.info("PD receiver listening on %s (buffer %d bytes, %s%s)", self.address, self._buffer.capacity,
                    "token required" if self._auth is not None else "no authentication",
                    ", encrypted" if self._monitor is not None else "")

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        if self._monitor is not None:
            poller.register(self._monitor, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(POLL_MS))
                if self._socket in ready:
                    self._answer(self._socket.recv_multipart(copy=False))
                if self._monitor is not None and self._monitor in ready:
                    event = recv_monitor_message(self._monitor)
                    self._count_refusal("an address ZeroMQ does not report",
                                        f"failed the encrypted handshake ({event['value']!s}): another token, or no "
                                        "pd_encrypt")
                self._buffer.reap()
        except zmq.ZMQError as err:
            if not self._stop.is_set():
                logger.error("PD receiver on %s stopped: %s", self.address, err)
        finally:
            self._close_sockets()

    def _close_sockets(self) -> None:
        if self._monitor is not None:
            self._socket.disable_monitor()
            self._monitor.close()
        self._socket.close()

    def _answer(self, frames: list) -> None:
        identity, body = bytes(frames[0].buffer), [frame.buffer for frame in frames[1:]]
        refused_for_token = False
        try:
            reply = self._reply(identity, body)
        except AuthRefused as err:
            reply, refused_for_token = self._refuse(frames, body, err), True
        except WireError as err:
            reply = PushReply(peek_seq(body), False, f"bad push: {err}")
        except Exception as err:  # a bad push must not stop the receiver
            logger.exception("PD receiver: push failed")
            reply = PushReply(peek_seq(body), False, f"receiver error: {err}")
        if not reply.ok and not refused_for_token:
            logger.warning("PD receiver: refused a push: %s", reply.error)
        self._socket.send_multipart([identity, reply_frame(reply)])

    def _reply(self, identity: bytes, body: list) -> PushReply:
        """The answer to one message: a handshake step, or a push (checked by `auth` first)."""
        if self._auth is None:
            step = read_auth(body)
            if step is not None:
                return PushReply(step.seq, True)  # no token here: no proof (the sender says so)
            push = read_push(body)
        else:
            try:
                step = read_auth(body)
            except WireError as err:
                raise AuthRefused(f"not a handshake message: {err}") from None
            if step is not None:
                return PushReply(step.seq, True, auth=self._auth.step(identity, step))
            self._auth.check_push(identity, body)
            push = read_push(body[:PUSH_FRAMES])
            self._auth.take_seq(identity, push.seq)
        error = self._buffer.accept(push)
        return PushReply(push.seq, error is None, error or "")

    def _refuse(self, frames: list, body: list, err: AuthRefused) -> PushReply:
        """The reply to a message refused for its token, counted and logged."""
        self._count_refusal(_peer_address(frames), str(err))
        return PushReply(peek_seq(body), False, str(err), auth_required=isinstance(err, NoSession))

    def _count_refusal(self, peer: str, why: str) -> None:
        """Count a peer refused for its token; log it the first time and every `AUTH_LOG_EVERY`."""
        count = self._buffer.record_auth_refusal()
        if count % AUTH_LOG_EVERY == 1:
            logger.warning("PD receiver on %s: refused a peer at %s: %s (%d refused so far)",
                           self.address, peer, why, count)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        else:
            self._close_sockets()


def _peer_address(frames: list) -> str:
    """The sender's IP address as ZeroMQ saw it (for log lines)."""
    try:
        return frames[-1].get("Peer-Address")
    except (zmq.ZMQError, AttributeError):
        return "an unknown address"
