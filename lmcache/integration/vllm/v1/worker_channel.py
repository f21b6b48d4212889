"""How the scheduler side asks the worker-side engine things: lookups, unpins, per-request counters.

In vLLM 0.9.2 v1 with one worker (the `uni` executor) the scheduler and the worker live in the
engine-core process, so `InProcessChannel` calls the worker side directly. With separate worker
processes (`mp` executor) worker rank 0 serves the same calls over a Unix-domain socket on
this host (`WorkerChannelServer`), and the scheduler side connects to it (`SocketChannel`).

A lookup that names a request id pins the prefix it reports in the worker's engine until the
worker loads it, the request finishes, or the scheduler side drops the promise (`unpin`).

Wire format (little-endian, no pickle), one request and one reply per exchange:

```
request: magic "LMCW" | version u8 | op u8 | body_len u32 | body
   op 1 LOOKUP:   id_len u32 | request id utf-8 (empty: no pin) | salt_len u32 | salt utf-8
                  | computed u32 (vLLM's own prefix: not pinned) | token ids int32 ...
   op 2 COUNTERS: request id utf-8
   op 3 UNPIN:    count u32 | count x (id_len u32 | request id utf-8)
   op 4 LOOKUP_ASYNC: as LOOKUP (`enable_async_loading`: pins only a prefix already in memory)
   op 5 ASYNC_LOADED: request id utf-8
reply:   magic "LMCW" | version u8 | status u8 | body_len u32 | body
   status 0 OK:  LOOKUP -> hit i64;  COUNTERS -> loaded i64 | stored i64;  UNPIN -> empty;
                 LOOKUP_ASYNC -> hit i64 | needs a slow tier u8;  ASYNC_LOADED -> tokens i64 (-1: none)
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
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol, Sequence

import numpy as np

from lmcache.integration.vllm.request_log import RequestCounters
from lmcache.logging import init_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)

MAGIC = b"LMCW"
VERSION = 3
OP_LOOKUP = 1
OP_COUNTERS = 2
OP_UNPIN = 3
OP_LOOKUP_ASYNC = 4
OP_ASYNC_LOADED = 5
STATUS_OK = 0
STATUS_ERROR = 1
_HEADER = struct.Struct("<4sBBI")
_LEN = struct.Struct("<I")
_HIT = struct.Struct("<q")
_COUNTERS = struct.Struct("<qq")
_ASYNC_HIT = struct.Struct("<q?")
# A prompt of 16M tokens is far beyond any model; anything bigger is a broken peer.
MAX_BODY_BYTES = 64 << 20
MAX_SALT_BYTES = 1 << 20
MAX_REQUEST_ID_BYTES = 4096
# UNIX socket paths are limited to 108 bytes including the terminating NUL.
_MAX_SOCKET_PATH = 107


class ChannelError(RuntimeError):
    """The scheduler side cannot reach or understand the worker side."""


class WorkerEndpoint(Protocol):
    """What the worker side answers (implemented by `LMCacheWorkerSide`)."""

    def lookup(self, token_ids: Sequence[int], cache_salt: str, request_id: str = "", computed: int = 0) -> int: ...

    def unpin(self, request_ids: Sequence[str]) -> None: ...

    def pop_request_counters(self, req_id: str) -> RequestCounters: ...

    def lookup_async(
        self, token_ids: Sequence[int], cache_salt: str, request_id: str, computed: int = 0
    ) -> tuple[int, bool]: ...

    def pop_async_loaded(self, req_id: str) -> Optional[int]: ...


class WorkerChannel(Protocol):
    """What the scheduler side calls."""

    def lookup(self, token_ids: Sequence[int], cache_salt: str, request_id: str = "", computed: int = 0) -> int:
        """Cached prefix length; with a `request_id`, that prefix stays pinned for the request,
        except chunks within the first `computed` tokens (vLLM's own prefix cache has them)."""

    def unpin(self, request_ids: Sequence[str]) -> None:
        """Release the pins of these requests' lookups."""

    def pop_request_counters(self, req_id: str) -> RequestCounters: ...

    def lookup_async(
        self, token_ids: Sequence[int], cache_salt: str, request_id: str, computed: int = 0
    ) -> tuple[int, bool]:
        """(cached prefix, whether part of it is only in a slow tier): a prefix all in memory is
        pinned as `lookup` does; one that needs a slow tier is loaded later, in the background."""

    def pop_async_loaded(self, req_id: str) -> Optional[int]:
        """Leading tokens a finished background load left in vLLM's blocks (None: no such load)."""

    def close(self) -> None: ...


class InProcessChannel:
    """Scheduler and worker in one process: plain calls."""

    def __init__(self, endpoint: WorkerEndpoint) -> None:
        self._endpoint = endpoint

    def lookup(self, token_ids: Sequence[int], cache_salt: str, request_id: str = "", computed: int = 0) -> int:
        return self._endpoint.lookup(token_ids, cache_salt, request_id, computed)

    def unpin(self, request_ids: Sequence[str]) -> None:
        self._endpoint.unpin(list(request_ids))

    def pop_request_counters(self, req_id: str) -> RequestCounters:
        return self._endpoint.pop_request_counters(req_id)

    def lookup_async(
        self, token_ids: Sequence[int], cache_salt: str, request_id: str, computed: int = 0
    ) -> tuple[int, bool]:
        return self._endpoint.lookup_async(token_ids, cache_salt, request_id, computed)

    def pop_async_loaded(self, req_id: str) -> Optional[int]:
        return self._endpoint.pop_async_loaded(req_id)

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


def _encode_text(text: str, limit: int, what: str) -> bytes:
    raw = text.encode("utf-8")
    if len(raw) > limit:
        raise ValueError(f"{what} of {len(raw)} bytes exceeds the {limit}-byte limit")
    return _LEN.pack(len(raw)) + raw


def _decode_text(body: bytes, offset: int, limit: int, what: str) -> tuple[str, int]:
    """The length-prefixed string at `offset` and the offset after it."""
    if offset + _LEN.size > len(body):
        raise ValueError(f"{what}: body of {len(body)} bytes ends before its length field")
    (length,) = _LEN.unpack_from(body, offset)
    start = offset + _LEN.size
    if length > limit or start + length > len(body):
        raise ValueError(f"{what} length {length} does not fit the {len(body)}-byte body (limit {limit})")
    return body[start : start + length].decode("utf-8"), start + length


def encode_lookup(token_ids: Sequence[int], cache_salt: str, request_id: str = "", computed: int = 0) -> bytes:
    head = _encode_text(request_id, MAX_REQUEST_ID_BYTES, "request id")
    salt = _encode_text(cache_salt, MAX_SALT_BYTES, "cache_salt")
    if not 0 <= computed < 1 << 32:
        raise ValueError(f"computed tokens must fit a u32, got {computed}")
    return head + salt + _LEN.pack(computed) + np.asarray(token_ids, dtype="<i4").tobytes()


def decode_lookup(body: bytes) -> tuple[list[int], str, str, int]:
    """(token ids, cache salt, request id, computed tokens) of a LOOKUP body."""
    request_id, offset = _decode_text(body, 0, MAX_REQUEST_ID_BYTES, "lookup request id")
    salt, offset = _decode_text(body, offset, MAX_SALT_BYTES, "lookup salt")
    if len(body) < offset + _LEN.size:
        raise ValueError(f"lookup body of {len(body)} bytes ends before its computed-tokens field")
    (computed,) = _LEN.unpack_from(body, offset)
    tokens = body[offset + _LEN.size :]
    if len(tokens) % 4:
        raise ValueError(f"lookup token bytes ({len(tokens)}) are not whole int32 values")
    return np.frombuffer(tokens, dtype="<i4").tolist(), salt, request_id, computed


def encode_unpin(request_ids: Sequence[str]) -> bytes:
    parts = [_LEN.pack(len(request_ids))]
    parts.extend(_encode_text(request_id, MAX_REQUEST_ID_BYTES, "request id") for request_id in request_ids)
    return b"".join(parts)


def decode_unpin(body: bytes) -> list[str]:
    if len(body) < _LEN.size:
        raise ValueError("unpin body shorter than its count field")
    (count,) = _LEN.unpack_from(body)
    # Each id takes at least its length field: a count the body cannot hold is a broken peer.
    if count * _LEN.size > len(body) - _LEN.size:
        raise ValueError(f"unpin count {count} does not fit the {len(body)}-byte body")
    request_ids, offset = [], _LEN.size
    for _ in range(count):
        request_id, offset = _decode_text(body, offset, MAX_REQUEST_ID_BYTES, "unpin request id")
        request_ids.append(request_id)
    if offset != len(body):
        raise ValueError(f"unpin body has {len(body) - offset} bytes after its {count} request ids")
    return request_ids


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
            tokens, salt, request_id, computed = decode_lookup(body)
            return _HIT.pack(self._endpoint.lookup(tokens, salt, request_id, computed))
        if op == OP_UNPIN:
            self._endpoint.unpin(decode_unpin(body))
            return b""
        if op == OP_COUNTERS:
            counters = self._endpoint.pop_request_counters(body.decode("utf-8"))
            return _COUNTERS.pack(counters.loaded_tokens, counters.stored_tokens)
        if op == OP_LOOKUP_ASYNC:
            tokens, salt, request_id, computed = decode_lookup(body)
            return _ASYNC_HIT.pack(*self._endpoint.lookup_async(tokens, salt, request_id, computed))
        if op == OP_ASYNC_LOADED:
            loaded = self._endpoint.pop_async_loaded(body.decode("utf-8"))
            return _HIT.pack(-1 if loaded is None else loaded)
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

    def _encode(self, encoder: Callable[..., bytes], *args: Any) -> bytes:
        try:
            return encoder(*args)
        except ValueError as err:  # a call this channel cannot carry is a failed call, like a dead peer
            raise ChannelError(f"LMCache worker channel at {self.path!r}: cannot send the call: {err}") from err

    def lookup(self, token_ids: Sequence[int], cache_salt: str, request_id: str = "", computed: int = 0) -> int:
        reply = self._call(OP_LOOKUP, self._encode(encode_lookup, token_ids, cache_salt, request_id, computed))
        return self._unpack(_HIT, reply)[0]

    def unpin(self, request_ids: Sequence[str]) -> None:
        reply = self._call(OP_UNPIN, self._encode(encode_unpin, list(request_ids)))
        if reply:
            raise ChannelError(f"LMCache worker channel at {self.path!r}: unpin reply of {len(reply)} bytes, expected 0")

    def pop_request_counters(self, req_id: str) -> RequestCounters:
        loaded, stored = self._unpack(_COUNTERS, self._call(OP_COUNTERS, req_id.encode("utf-8")))
        return RequestCounters(loaded_tokens=loaded, stored_tokens=stored)

    def lookup_async(
        self, token_ids: Sequence[int], cache_salt: str, request_id: str, computed: int = 0
    ) -> tuple[int, bool]:
        reply = self._call(OP_LOOKUP_ASYNC, self._encode(encode_lookup, token_ids, cache_salt, request_id, computed))
        hit, slow = self._unpack(_ASYNC_HIT, reply)
        return hit, slow

    def pop_async_loaded(self, req_id: str) -> Optional[int]:
        (loaded,) = self._unpack(_HIT, self._call(OP_ASYNC_LOADED, req_id.encode("utf-8")))
        return None if loaded < 0 else loaded

    def close(self) -> None:
        with self._lock:
            self._sock.close()
