"""How the scheduler side asks the worker-side engine things: lookups and per-request counters.

In vLLM 0.9.2 v1 with one worker (the `uni` executor) the scheduler and the worker live in the
engine-core process, so `InProcessChannel` calls the worker side directly. With separate worker
processes (`mp` executor) worker rank 0 serves the same two calls over a Unix-domain socket on
this host (`WorkerChannelServer`), and the scheduler side connects to it (`SocketChannel`).

Wire format (little-endian, no pickle), one request and one reply per exchange:

```
request: magic "LMCW" | version u8 | op u8 | body_len u32 | body
   op 1 LOOKUP:  salt_len u32 | salt utf-8 | token ids int32 ...
   op 2 COUNTERS: request id utf-8
reply:   magic "LMCW" | version u8 | status u8 | body_len u32 | body
   status 0 OK:  LOOKUP -> hit i64;  COUNTERS -> loaded i64 | stored i64
   status 1 ERR: message utf-8
```
"""

from __future__ import annotations

import os
import socket
import struct
import tempfile
import threading
import time
from typing import TYPE_CHECKING, Optional, Protocol, Sequence

import numpy as np

from lmcache.integration.vllm.v1.request_state import RequestCounters
from lmcache.logging import init_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)

MAGIC = b"LMCW"
VERSION = 1
OP_LOOKUP = 1
OP_COUNTERS = 2
STATUS_OK = 0
STATUS_ERROR = 1
_HEADER = struct.Struct("<4sBBI")
_LOOKUP_PREFIX = struct.Struct("<I")
_HIT = struct.Struct("<q")
_COUNTERS = struct.Struct("<qq")
# A prompt of 16M tokens is far beyond any model; anything bigger is a broken peer.
MAX_BODY_BYTES = 64 << 20
MAX_SALT_BYTES = 1 << 20
# UNIX socket paths are limited to 108 bytes including the terminating NUL.
_MAX_SOCKET_PATH = 107


class ChannelError(RuntimeError):
    """The scheduler side cannot reach or understand the worker side."""


class WorkerEndpoint(Protocol):
    """What the worker side answers (implemented by `LMCacheWorkerSide`)."""

    def lookup(self, token_ids: Sequence[int], cache_salt: str) -> int: ...

    def pop_request_counters(self, req_id: str) -> RequestCounters: ...


class WorkerChannel(Protocol):
    """What the scheduler side calls."""

    def lookup(self, token_ids: Sequence[int], cache_salt: str) -> int: ...

    def pop_request_counters(self, req_id: str) -> RequestCounters: ...

    def close(self) -> None: ...


class InProcessChannel:
    """Scheduler and worker in one process: plain calls."""

    def __init__(self, endpoint: WorkerEndpoint) -> None:
        self._endpoint = endpoint

    def lookup(self, token_ids: Sequence[int], cache_salt: str) -> int:
        return self._endpoint.lookup(token_ids, cache_salt)

    def pop_request_counters(self, req_id: str) -> RequestCounters:
        return self._endpoint.pop_request_counters(req_id)

    def close(self) -> None:
        return None


def channel_socket_path(vllm_config: "VllmConfig") -> str:
    """The socket of this vLLM instance's worker channel: named by the KV transfer engine id
    (a UUID vLLM makes once and hands to every process) and the data-parallel rank."""
    kv_transfer = vllm_config.kv_transfer_config
    engine_id = kv_transfer.engine_id if kv_transfer is not None else None
    if not engine_id:
        raise ChannelError("kv_transfer_config.engine_id is not set: cannot name the LMCache worker channel")
    dp_rank = vllm_config.parallel_config.data_parallel_rank
    path = os.path.join(tempfile.gettempdir(), f"lmcache-{engine_id}-dp{dp_rank}.sock")
    if len(path.encode()) > _MAX_SOCKET_PATH:
        raise ChannelError(f"LMCache worker channel path {path!r} is longer than {_MAX_SOCKET_PATH} bytes; set a shorter TMPDIR")
    return path


# ----- framing ---------------------------------------------------------------------------------


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise ConnectionError(f"peer closed the connection after {len(buf)} of {n} bytes")
        buf.extend(part)
    return bytes(buf)


def _send_frame(sock: socket.socket, code: int, body: bytes) -> None:
    sock.sendall(_HEADER.pack(MAGIC, VERSION, code, len(body)) + body)


def _recv_frame(sock: socket.socket) -> tuple[int, bytes]:
    magic, version, code, length = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if magic != MAGIC:
        raise ValueError(f"bad magic {magic!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise ValueError(f"protocol version {version}, expected {VERSION}")
    if length > MAX_BODY_BYTES:
        raise ValueError(f"frame body of {length} bytes exceeds the {MAX_BODY_BYTES}-byte limit")
    return code, _recv_exact(sock, length)


def encode_lookup(token_ids: Sequence[int], cache_salt: str) -> bytes:
    salt = cache_salt.encode("utf-8")
    if len(salt) > MAX_SALT_BYTES:
        raise ValueError(f"cache_salt of {len(salt)} bytes exceeds the {MAX_SALT_BYTES}-byte limit")
    tokens = np.asarray(token_ids, dtype="<i4").tobytes()
    return _LOOKUP_PREFIX.pack(len(salt)) + salt + tokens


def decode_lookup(body: bytes) -> tuple[list[int], str]:
    if len(body) < _LOOKUP_PREFIX.size:
        raise ValueError("lookup body shorter than its salt length field")
    (salt_len,) = _LOOKUP_PREFIX.unpack_from(body)
    start = _LOOKUP_PREFIX.size
    if salt_len > MAX_SALT_BYTES or start + salt_len > len(body):
        raise ValueError(f"lookup salt length {salt_len} does not fit the {len(body)}-byte body")
    salt = body[start : start + salt_len].decode("utf-8")
    tokens = body[start + salt_len :]
    if len(tokens) % 4:
        raise ValueError(f"lookup token bytes ({len(tokens)}) are not whole int32 values")
    return np.frombuffer(tokens, dtype="<i4").tolist(), salt


# ----- server (worker side) ------------------------------------------------------------------


class WorkerChannelServer:
    """Serves `WorkerEndpoint` calls on a Unix-domain socket; one thread per connection."""

    def __init__(self, endpoint: WorkerEndpoint, path: str) -> None:
        self._endpoint = endpoint
        self.path = path
        self._listener: Optional[socket.socket] = None
        self._closed = threading.Event()

    def start(self) -> None:
        """Bind (replacing a stale socket file of a dead instance) and start accepting."""
        if os.path.exists(self.path):
            os.unlink(self.path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.path)
        os.chmod(self.path, 0o600)
        listener.listen(8)
        self._listener = listener
        threading.Thread(target=self._accept_loop, name="lmcache-worker-channel", daemon=True).start()
        logger.info("LMCache worker channel listening on %s", self.path)

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="lmcache-worker-channel-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            while not self._closed.is_set():
                try:
                    op, body = _recv_frame(conn)
                except ConnectionError:
                    return
                except (ValueError, OSError) as err:
                    logger.warning("LMCache worker channel: dropping a connection that sent a bad frame: %s", err)
                    return
                try:
                    reply = self._handle(op, body)
                    status = STATUS_OK
                except Exception as err:  # the scheduler side gets the message, the server lives on
                    reply, status = f"{type(err).__name__}: {err}".encode("utf-8"), STATUS_ERROR
                try:
                    _send_frame(conn, status, reply)
                except OSError:
                    return

    def _handle(self, op: int, body: bytes) -> bytes:
        if op == OP_LOOKUP:
            tokens, salt = decode_lookup(body)
            return _HIT.pack(self._endpoint.lookup(tokens, salt))
        if op == OP_COUNTERS:
            counters = self._endpoint.pop_request_counters(body.decode("utf-8"))
            return _COUNTERS.pack(counters.loaded_tokens, counters.stored_tokens)
        raise ValueError(f"unknown operation {op}")

    def close(self) -> None:
        """Stop accepting and remove the socket file."""
        self._closed.set()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


# ----- client (scheduler side) ---------------------------------------------------------------


class SocketChannel:
    """The scheduler side's end of `WorkerChannelServer` (calls are serialised by a lock)."""

    def __init__(self, path: str, connect_timeout: float = 30.0) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._sock = self._connect(path, connect_timeout)

    @staticmethod
    def _connect(path: str, timeout: float) -> socket.socket:
        deadline = time.monotonic() + timeout
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(path)
                return sock
            except OSError as err:
                sock.close()
                if time.monotonic() >= deadline:
                    raise ChannelError(
                        f"LMCache scheduler side cannot connect to the worker channel at {path!r} "
                        f"after {timeout:.0f} s: {err}. Worker rank 0 opens it when it creates the "
                        "LMCache engine; is the worker process alive on this host?"
                    ) from err
                time.sleep(0.1)

    def _call(self, op: int, body: bytes) -> bytes:
        with self._lock:
            try:
                _send_frame(self._sock, op, body)
                status, reply = _recv_frame(self._sock)
            except (OSError, ValueError) as err:
                raise ChannelError(f"LMCache worker channel at {self.path!r} failed: {err}") from err
        if status != STATUS_OK:
            raise ChannelError(f"LMCache worker refused the call: {reply.decode('utf-8', 'replace')}")
        return reply

    def _unpack(self, layout: struct.Struct, reply: bytes) -> tuple:
        if len(reply) != layout.size:
            raise ChannelError(f"LMCache worker channel at {self.path!r}: reply of {len(reply)} bytes, expected {layout.size}")
        return layout.unpack(reply)

    def lookup(self, token_ids: Sequence[int], cache_salt: str) -> int:
        reply = self._call(OP_LOOKUP, encode_lookup(token_ids, cache_salt))
        return self._unpack(_HIT, reply)[0]

    def pop_request_counters(self, req_id: str) -> RequestCounters:
        loaded, stored = self._unpack(_COUNTERS, self._call(OP_COUNTERS, req_id.encode("utf-8")))
        return RequestCounters(loaded_tokens=loaded, stored_tokens=stored)

    def close(self) -> None:
        with self._lock:
            self._sock.close()
