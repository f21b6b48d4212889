"""The `lm://` server: a threaded TCP server over `protocol` frames and an `LRUChunkStore`.

One thread accepts; each client connection gets its own thread (bounded by
`max_connections`) that reads a frame, answers it and loops, so one client's pipelined
requests are answered in order while other clients are served in parallel. Socket reads
release the GIL, so large payloads from several clients move concurrently.

A connection that breaks the protocol (bad magic or version, unknown op, a key or payload
over the limits, a frame cut short or stalled for `frame_timeout_s`) is answered with
`BAD_REQUEST` where possible and closed, with the reason logged; every other connection
keeps being served.
"""

from __future__ import annotations

import json
import socket
import threading
from dataclasses import dataclass
from typing import Optional

from lmcache.logging import init_logger
from lmcache.server.protocol import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    HARD_MAX_PAYLOAD_BYTES,
    HEADER_SIZE,
    FrameHeader,
    Op,
    ProtocolError,
    Status,
    TruncatedFrameError,
    parse_header,
    recv_exact,
    recv_exact_into,
    send_frame,
)
from lmcache.server.store import LRUChunkStore

logger = init_logger(__name__)

_DISCARD_BLOCK = 1 << 20


@dataclass(frozen=True)
class ServerConfig:
    """How the server listens and how much it holds."""

    host: str = "127.0.0.1"
    port: int = 65432
    max_size_bytes: int = 4 << 30
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
    max_connections: int = 256
    # A frame that has started must keep arriving: no byte for this long closes the connection.
    frame_timeout_s: float = 30.0
    # Serve the counters on http://127.0.0.1:<port>/metrics (`metrics.py`); None = off.
    metrics_port: Optional[int] = None

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.max_size_bytes <= 0:
            raise ValueError(f"max_size_bytes must be positive, got {self.max_size_bytes}")
        if not 0 < self.max_payload_bytes <= HARD_MAX_PAYLOAD_BYTES:
            raise ValueError(
                f"max_payload_bytes must be in 1..{HARD_MAX_PAYLOAD_BYTES}, "
                f"got {self.max_payload_bytes}"
            )
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")
        if self.frame_timeout_s <= 0:
            raise ValueError(f"frame_timeout_s must be positive, got {self.frame_timeout_s}")
        if self.metrics_port is not None and not 0 < self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in 1..65535, got {self.metrics_port}")


class LMCacheServer:
    """Serves one `LRUChunkStore` to many clients. `start()` binds, `serve_forever()` accepts."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.store = LRUChunkStore(config.max_size_bytes)
        self._listener: Optional[socket.socket] = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        self._protocol_errors = 0
        self._rejected_connections = 0
        self._accept_thread: Optional[threading.Thread] = None

    @property
    def address(self) -> tuple[str, int]:
        """The bound (host, port); the port is the real one when configured as 0."""
        if self._listener is None:
            raise RuntimeError("server not started")
        host, port = self._listener.getsockname()[:2]
        return host, port

    def start(self) -> tuple[str, int]:
        """Bind and listen; returns the bound address."""
        if self._listener is not None:
            raise RuntimeError("server already started")
        family = socket.AF_INET6 if ":" in self.config.host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((self.config.host, self.config.port))
        except OSError as err:
            listener.close()
            raise OSError(
                err.errno, f"cannot bind {self.config.host}:{self.config.port}: {err.strerror}"
            ) from err
        listener.listen(128)
        listener.settimeout(0.2)
        self._listener = listener
        host, port = self.address
        logger.info(
            "lm:// server listening on %s:%d (max size %.2f GiB, frame limit %d bytes)",
            host,
            port,
            self.config.max_size_bytes / 1024**3,
            self.config.max_payload_bytes,
        )
        return host, port

    def serve_forever(self) -> None:
        """Accept connections until `shutdown()`."""
        if self._listener is None:
            self.start()
        assert self._listener is not None
        while not self._stop.is_set():
            try:
                conn, peer = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                if self._stop.is_set():
                    break
                raise
            self._admit(conn, peer)
        logger.info("lm:// server stopped")

    def start_in_thread(self) -> tuple[str, int]:
        """Bind and serve from a background thread (for embedding and tests)."""
        address = self.start()
        self._accept_thread = threading.Thread(
            target=self.serve_forever, name="lmcache-server-accept", daemon=True
        )
        self._accept_thread.start()
        return address

    def shutdown(self) -> None:
        """Stop accepting, close every connection, and wait for the accept loop."""
        self._stop.set()
        if self._accept_thread is not None:
            self._accept_thread.join(timeout=5)
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            conns = list(self._connections)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def info(self) -> dict[str, int]:
        """Store counters plus connection counters (what `INFO` returns)."""
        data = self.store.stats().to_dict()
        with self._lock:
            data["connections"] = len(self._connections)
            data["protocol_errors"] = self._protocol_errors
            data["rejected_connections"] = self._rejected_connections
        return data

    def _admit(self, conn: socket.socket, peer: tuple) -> None:
        with self._lock:
            if len(self._connections) >= self.config.max_connections:
                self._rejected_connections += 1
                full = True
            else:
                self._connections.add(conn)
                full = False
        if full:
            logger.warning(
                "refusing connection from %s: %d connections open (max_connections)",
                peer,
                self.config.max_connections,
            )
            conn.close()
            return
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        thread = threading.Thread(
            target=self._serve_connection, args=(conn, peer), name="lmcache-server-conn", daemon=True
        )
        thread.start()

    def _serve_connection(self, conn: socket.socket, peer: tuple) -> None:
        try:
            while not self._stop.is_set():
                header = self._read_header(conn)
                if header is None:
                    return
                self._handle(conn, header)
        except ProtocolError as err:
            with self._lock:
                self._protocol_errors += 1
            logger.warning("closing connection from %s: %s", peer, err)
            if not isinstance(err, TruncatedFrameError):
                try:
                    send_frame(conn, Op.ERROR, Status.BAD_REQUEST, payload=str(err).encode())
                except OSError:
                    pass
        except socket.timeout:
            with self._lock:
                self._protocol_errors += 1
            logger.warning(
                "closing connection from %s: frame stalled for %.1f s",
                peer,
                self.config.frame_timeout_s,
            )
        except OSError as err:
            if not self._stop.is_set():
                logger.info("connection from %s dropped: %s", peer, err)
        finally:
            with self._lock:
                self._connections.discard(conn)
            conn.close()

    def _read_header(self, conn: socket.socket) -> Optional[FrameHeader]:
        """Wait (without limit) for a frame to start, then read its header under the timeout."""
        raw = bytearray(HEADER_SIZE)
        view = memoryview(raw)
        conn.settimeout(None)
        first = conn.recv_into(view, HEADER_SIZE)
        if first == 0:
            return None
        conn.settimeout(self.config.frame_timeout_s)
        got = first + recv_exact_into(conn, view[first:])
        if got != HEADER_SIZE:
            raise TruncatedFrameError(
                f"connection closed after {got} of {HEADER_SIZE} bytes of a frame header"
            )
        return parse_header(raw, self.config.max_payload_bytes, is_request=True)

    def _handle(self, conn: socket.socket, header: FrameHeader) -> None:
        key = bytes(recv_exact(conn, header.key_len, "the key"))
        op = header.op
        if op == Op.PUT:
            if not self.store.fits(len(key), header.payload_len):
                self._discard(conn, header.payload_len)
                send_frame(conn, op, Status.REFUSED)
                return
            value = recv_exact(conn, header.payload_len, "the payload")
            ok = self.store.put(key, value)
            send_frame(conn, op, Status.OK if ok else Status.REFUSED)
        elif op == Op.GET:
            found = self.store.get(key)
            if found is None:
                send_frame(conn, op, Status.NOT_FOUND)
            else:
                send_frame(conn, op, Status.OK, payload=found)
        elif op == Op.EXISTS:
            send_frame(conn, op, Status.OK if self.store.exists(key) else Status.NOT_FOUND)
        elif op == Op.DELETE:
            send_frame(conn, op, Status.OK if self.store.delete(key) else Status.NOT_FOUND)
        elif op == Op.PING:
            send_frame(conn, op, Status.OK)
        elif op == Op.INFO:
            send_frame(conn, op, Status.OK, payload=json.dumps(self.info()).encode())
        else:  # parse_header only lets known ops through
            raise ProtocolError(f"op {op.name} has no handler")

    def _discard(self, conn: socket.socket, size: int) -> None:
        """Read and drop a payload the store refuses, keeping the connection in step."""
        block = memoryview(bytearray(min(size, _DISCARD_BLOCK)))
        left = size
        while left:
            n = conn.recv_into(block, min(left, len(block)))
            if n == 0:
                raise TruncatedFrameError(f"connection closed with {left} payload bytes unread")
            left -= n
