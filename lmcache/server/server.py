"""The `lm://` server: a threaded TCP server over `protocol` frames and an `LRUChunkStore`.

One thread accepts; each client connection gets its own thread that reads a frame, answers it
and loops, so one client's pipelined requests are answered in order while other clients are
served in parallel. Socket reads release the GIL, so large payloads from several clients move
concurrently. A put's payload is received on a thread of idle priority (`background_threads`),
the connection's thread waiting for it: no client waits for a put to land (the engine's put
thread does, in the background), while a get or lookup on the same host - the engine beside the
server, whose model threads share its cores - does.

What a hostile or broken peer can hold is bounded:
- a frame has `frame_timeout_s` from its first byte to its last (a peer feeding one byte at a
  time cannot stretch it), and a reply must keep draining within that long;
- a connection idle between frames for `idle_timeout_s` is closed;
- at `max_connections`, a new connection closes the one that has waited longest in its
  current state (idle since its last frame, or inside one frame): idle or drip-feeding sockets
  are always the oldest, so they can never lock a working client out;
- payload bytes received for unfinished frames, across all connections, stay under
  `max_pending_bytes`; a put that would go over is drained and refused.

Refusals keep the connection: a put over the frame limit, over the whole store, or over the
pending budget is read to its end (into a small scratch block), answered `REFUSED` with the
reason and the frame limit, and counted in `refused_puts`. A connection that breaks the
protocol (bad magic or version, unknown op, a key over its limit, a frame cut short or past its
deadline) is answered with `BAD_REQUEST` where possible and closed, with the reason logged.

With `unix_socket`, the server also (or only) listens on an owner-only unix socket (or one of
`socket_group`'s) for clients on the same machine, which share the store's arena in shared
memory (`pool.py`, the node pool).

With a token (`ServerConfig.token`) a connection must pass `security.py`'s handshake before
anything else is served; a peer that fails it, or asks for anything first, is answered and
closed, counted in `auth_refusals` and logged (rate-limited) with its address. With a TLS
certificate every connection starts with a TLS handshake, which must finish within
`frame_timeout_s` (failures counted in `tls_refusals`).
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import secrets
import selectors
import socket
import ssl
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional, Union

from lmcache.background_threads import thread_initializer
from lmcache.logging import init_logger
from lmcache.server.pool import PoolSession, bind_unix_listener, peer_pid
from lmcache.server.pool_address import socket_group_id
from lmcache.server.protocol import (
    ARENA_ID_BYTES,
    DEFAULT_MAX_PAYLOAD_BYTES,
    POOL_OPS,
    HARD_MAX_PAYLOAD_BYTES,
    HEADER_SIZE,
    FrameHeader,
    Op,
    ProtocolError,
    RefusalReason,
    Status,
    TruncatedFrameError,
    alloc_buffer,
    parse_header,
    refusal_payload,
    send_frame,
)
from lmcache.server.security import (
    AUTH_REQUIRED,
    SERVER_TOKEN_ENV,
    AuthRefused,
    ServerHandshake,
    is_loopback,
    server_tls_context,
)
from lmcache.server.store import LRUChunkStore, Reservation

logger = init_logger(__name__)

_DISCARD_BLOCK = 1 << 20
# Payload is received (and counted against the pending budget) in steps: the first is this
# small, each next one at most what the peer already sent, up to the last constant. A peer that
# announces a large payload and then drips holds a little budget, never its announcement.
_FIRST_RECV_STEP = 64 << 10
_MAX_RECV_STEP = 8 << 20
_HUGE_PAGES_FROM = 2 << 20
# Log one line per this many connections closed to make room, so an attack does not flood the log.
_REAP_LOG_EVERY = 100
# The longest a GET answer may be held (`ServerConfig.get_delay_s`): past every client timeout.
MAX_GET_DELAY_S = 60.0


# The counter of each reason a put (or a pool reservation) is refused for.
_REFUSAL_COUNTERS = {
    RefusalReason.TOO_LARGE: "refused_too_large",
    RefusalReason.OVER_STORE: "refused_over_store",
    RefusalReason.BUSY: "refused_busy",
}


class FrameDeadline(Exception):
    """A frame (or a reply) did not finish within `frame_timeout_s`."""


@dataclass(frozen=True)
class ServerConfig:
    """How the server listens and how much it holds."""

    host: str = "127.0.0.1"
    # None: no TCP listener (the unix socket only).
    port: Optional[int] = 65432
    # Listen on this unix socket too (owner-only): the node pool's door (`pool.py`).
    unix_socket: Optional[str] = None
    # Give the unix socket to this group (name or gid) as 0660: its members' clients may connect.
    socket_group: Optional[str] = None
    max_size_bytes: int = 4 << 30
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
    max_connections: int = 256
    # A frame must arrive whole within this many seconds of its first byte.
    frame_timeout_s: float = 30.0
    # A connection with no frame started for this long is closed (clients reconnect on demand).
    idle_timeout_s: float = 120.0
    # Payload bytes of unfinished frames, all connections together; None = 2 x max_payload_bytes.
    max_pending_bytes: Optional[int] = None
    # The shared secret clients must prove (security.py); None = no authentication.
    token: Optional[bytes] = field(default=None, repr=False)
    # PEM certificate chain and key: serve TLS (`lms://`) instead of plaintext.
    tls_cert: Optional[str] = None
    tls_key: Optional[str] = None
    # Listen beyond loopback without a token anyway (protected mode off).
    no_auth: bool = False
    # Serve the counters on http://127.0.0.1:<port>/metrics (`metrics.py`); None = off.
    metrics_port: Optional[int] = None
    # Hold every GET answer (and the node pool's every LEASE) this long: a slow remote tier for
    # tests and benchmarks (`--delay-ms`).
    get_delay_s: float = 0.0
    # Fault the whole store's memory in at start, on an idle-priority thread (`--prefault`), so no
    # put pays for fresh pages: for a server sharing its cores with an engine (`arena.py`).
    prefault: bool = False

    def __post_init__(self) -> None:
        if self.port is None and self.unix_socket is None:
            raise ValueError("nothing to listen on: give a TCP port, a unix socket, or both")
        if self.port is not None and not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.unix_socket is not None and not self.unix_socket:
            raise ValueError("unix_socket is an empty path")
        if self.socket_group is not None:
            if self.unix_socket is None:
                raise ValueError(f"socket_group={self.socket_group!r} needs a unix socket to give to the group")
            socket_group_id(self.socket_group)  # an unknown group fails at start, by name
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
        if self.idle_timeout_s <= 0:
            raise ValueError(f"idle_timeout_s must be positive, got {self.idle_timeout_s}")
        if self.max_pending_bytes is None:
            object.__setattr__(self, "max_pending_bytes", 2 * self.max_payload_bytes)
        if self.max_pending_bytes < self.max_payload_bytes:
            raise ValueError(
                f"max_pending_bytes ({self.max_pending_bytes}) must be at least max_payload_bytes "
                f"({self.max_payload_bytes}), or a frame at the limit could never be received"
            )
        if self.metrics_port is not None and not 0 < self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in 1..65535, got {self.metrics_port}")
        if not 0 <= self.get_delay_s <= MAX_GET_DELAY_S:
            raise ValueError(f"get_delay_s must be in 0..{MAX_GET_DELAY_S:g} s, got {self.get_delay_s}")
        self._check_security()

    def _check_security(self) -> None:
        """Protected mode: no token on a non-loopback address is refused unless `no_auth`."""
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("TLS needs both a certificate (--tls-cert) and its key (--tls-key)")
        if self.token is not None and not self.token:
            raise ValueError("the token is empty")
        if self.token is None and not self.no_auth and self.port is not None and not is_loopback(self.host):
            raise ValueError(
                f"refusing to listen on {self.host} without authentication: anyone who reaches "
                f"the port could read and overwrite every cached chunk. Set a token with "
                f"{SERVER_TOKEN_ENV}=... or --token-file PATH (clients then use "
                f"lm://:TOKEN@host:port or LMCACHE_REMOTE_TOKEN), or pass --no-auth to insist"
            )


class _PendingBudget:
    """Bytes held by unfinished frames, shared by every connection."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._held = 0
        self._lock = threading.Lock()

    @property
    def held(self) -> int:
        return self._held

    def try_reserve(self, nbytes: int) -> bool:
        with self._lock:
            if self._held + nbytes > self._limit:
                return False
            self._held += nbytes
            return True

    def release(self, nbytes: int) -> None:
        with self._lock:
            self._held -= nbytes


@dataclass
class _ConnState:
    """Since when a connection has been in its current state (idle, or inside one frame)."""

    peer: tuple
    since: float


class LMCacheServer:
    """Serves one `LRUChunkStore` to many clients. `start()` binds, `serve_forever()` accepts."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        shared = config.unix_socket is not None
        self.store = LRUChunkStore(config.max_size_bytes, max_unfinished_bytes=self.pending_limit, shared=shared)
        # Names this arena to pool clients: a restarted server's is another (they map anew).
        self._arena_id = secrets.token_bytes(ARENA_ID_BYTES)
        self._listener: Optional[socket.socket] = None
        self._unix_listener: Optional[socket.socket] = None
        self._unix_inode = 0  # of the socket file we bound, so we only ever remove our own
        self._sessions: set[PoolSession] = set()
        self._started = False
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._connections: dict[socket.socket, _ConnState] = {}
        self._budget = _PendingBudget(self.pending_limit)
        # Where every refused payload is drained; shared, since nobody reads what lands there.
        self._scratch = memoryview(bytearray(_DISCARD_BLOCK))
        self._counts = {
            "protocol_errors": 0,
            "frame_timeouts": 0,
            "idle_timeouts": 0,
            "reaped_connections": 0,
            "refused_too_large": 0,
            "refused_over_store": 0,
            "refused_busy": 0,
            "auth_refusals": 0,
            "tls_refusals": 0,
        }
        self._tls: Optional[ssl.SSLContext] = None
        if config.tls_cert is not None and config.tls_key is not None:
            self._tls = server_tls_context(config.tls_cert, config.tls_key)
        self._accept_thread: Optional[threading.Thread] = None
        # One receiving thread per connection at most, so a slow put never holds up another's.
        self._put_pool = ThreadPoolExecutor(
            max_workers=config.max_connections, thread_name_prefix="lmcache-server-put",
            initializer=thread_initializer("lmc-server-put", background=True),
        )

    @property
    def pending_limit(self) -> int:
        """`max_pending_bytes` as configured or defaulted."""
        assert self.config.max_pending_bytes is not None  # set by ServerConfig.__post_init__
        return self.config.max_pending_bytes

    @property
    def address(self) -> tuple[str, int]:
        """The bound TCP (host, port); the port is the real one when configured as 0."""
        if self._listener is None:
            raise RuntimeError("server not started, or not listening on TCP")
        host, port = self._listener.getsockname()[:2]
        return host, port

    def start(self) -> Optional[tuple[str, int]]:
        """Bind and listen; returns the bound TCP address (None when only on a unix socket)."""
        if self._started:
            raise RuntimeError("server already started")
        if self.config.unix_socket is not None:
            self._unix_listener = bind_unix_listener(self.config.unix_socket, self.config.socket_group)
            self._unix_inode = os.stat(self.config.unix_socket).st_ino
            logger.info("node pool on unix socket %s (%s, %s; arena of %.2f GiB in shared memory)",
                        self.config.unix_socket,
                        "owner-only" if self.config.socket_group is None else f"group {self.config.socket_group}",
                        "token required" if self.config.token is not None else "no token",
                        self.store.arena.capacity / 1024**3)
        if self.config.port is not None:
            try:
                self._bind_tcp()
            except OSError:
                self._close_unix_listener()
                raise
        self._started = True
        if self.config.get_delay_s:
            logger.warning("every GET and pool LEASE is answered %.0f ms late (--delay-ms)", self.config.get_delay_s * 1000)
        if self.config.prefault:
            self.store.arena.prefault_in_background()
        return self.address if self._listener is not None else None

    def _bind_tcp(self) -> None:
        assert self.config.port is not None
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
        self._listener = listener
        host, port = self.address
        cfg = self.config
        logger.info(
            "lm:// server listening on %s:%d (max size %.2f GiB, frame limit %d bytes, "
            "frame timeout %.1f s, idle timeout %.1f s, %d connections, pending budget %d bytes, "
            "%s, %s)",
            host,
            port,
            cfg.max_size_bytes / 1024**3,
            cfg.max_payload_bytes,
            cfg.frame_timeout_s,
            cfg.idle_timeout_s,
            cfg.max_connections,
            self.pending_limit,
            "token required" if cfg.token is not None else "no authentication",
            "TLS" if self._tls is not None else "plaintext",
        )

    def serve_forever(self) -> None:
        """Accept connections (TCP and unix) until `shutdown()`."""
        if not self._started:
            self.start()
        with selectors.DefaultSelector() as selector:
            for listener in (self._listener, self._unix_listener):
                if listener is not None:
                    selector.register(listener, selectors.EVENT_READ)
            while not self._stop.is_set():
                for ready, _ in selector.select(timeout=0.2):
                    listener = ready.fileobj
                    assert isinstance(listener, socket.socket)
                    try:
                        conn, peer = listener.accept()
                    except (BlockingIOError, InterruptedError):
                        continue
                    except OSError:
                        if self._stop.is_set():
                            break
                        raise
                    pool = listener is self._unix_listener
                    self._admit(conn, ("unix", peer_pid(conn)) if pool else peer, pool)
        logger.info("lm:// server stopped")

    def start_in_thread(self) -> Optional[tuple[str, int]]:
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
        self._close_unix_listener()
        with self._lock:
            conns = list(self._connections)
        for conn in conns:
            _hang_up(conn)
        self._put_pool.shutdown(wait=False)
        self.store.arena.close()  # the memfd; clients' mappings of it stay valid

    def _close_unix_listener(self) -> None:
        """Close the unix socket and remove its file (if it is still ours: a successor may have
        replaced it)."""
        listener, self._unix_listener = self._unix_listener, None
        if listener is None or self.config.unix_socket is None:
            return
        try:
            ours = os.stat(self.config.unix_socket).st_ino == self._unix_inode
        except OSError:
            ours = False
        listener.close()
        if ours:
            os.unlink(self.config.unix_socket)

    def info(self) -> dict[str, int]:
        """Store counters plus connection counters (what `INFO` returns)."""
        data = self.store.stats().to_dict()
        with self._lock:
            data.update(self._counts)
            data["connections"] = len(self._connections)
        # Every refusal, whoever made it: the store's own plus the server's before storing.
        data["refused_puts"] += (
            data["refused_too_large"] + data["refused_over_store"] + data["refused_busy"]
        )
        data["pending_bytes"] = self._budget.held
        with self._lock:
            holds = [session.holds for session in self._sessions]
        data["pool_clients"] = len(holds)
        data["pool_reservations"] = sum(h[0] for h in holds)
        data["pool_leases"] = sum(h[1] for h in holds)
        data["max_payload_bytes"] = self.config.max_payload_bytes
        data["max_pending_bytes"] = self.pending_limit
        data["max_connections"] = self.config.max_connections
        return data

    def _count(self, name: str) -> int:
        with self._lock:
            self._counts[name] += 1
            return self._counts[name]

    # ---- connections ----------------------------------------------------------------------

    def _admit(self, conn: socket.socket, peer: tuple, pool: bool = False) -> None:
        victim: Optional[tuple[socket.socket, _ConnState]] = None
        with self._lock:
            if len(self._connections) >= self.config.max_connections:
                victim = min(self._connections.items(), key=lambda item: item[1].since)
                del self._connections[victim[0]]
                self._counts["reaped_connections"] += 1
                reaped = self._counts["reaped_connections"]
            self._connections[conn] = _ConnState(peer, time.monotonic())
        if victim is not None:
            # Its thread wakes up on the hang-up, finds itself gone and exits.
            _hang_up(victim[0])
            if reaped % _REAP_LOG_EVERY == 1:
                logger.warning(
                    "%d connections open (max_connections): closed the one from %s, unchanged "
                    "for %.1f s, to admit %s (%d closed this way so far)",
                    self.config.max_connections,
                    victim[1].peer,
                    time.monotonic() - victim[1].since,
                    peer,
                    reaped,
                )
        if not pool:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        thread = threading.Thread(
            target=self._serve_connection, args=(conn, peer, pool), name="lmcache-server-conn", daemon=True
        )
        thread.start()

    def _mark(self, conn: socket.socket) -> bool:
        """Record that `conn` entered a new state now; False once it was closed to make room."""
        with self._lock:
            state = self._connections.get(conn)
            if state is None:
                return False
            state.since = time.monotonic()
            return True

    def _serve_connection(self, conn: socket.socket, peer: tuple, pool: bool) -> None:
        handshake = ServerHandshake(self.config.token)
        session: Optional[PoolSession] = None
        if pool:
            session = PoolSession(self.store, self._arena_id, self.config.max_payload_bytes)
            with self._lock:
                self._sessions.add(session)
        try:
            if self._tls is not None and not pool:  # a unix socket is local: the token suffices
                tls = self._tls_accept(conn, peer)
                if tls is None:
                    return
                conn = tls
            while not self._stop.is_set():
                header = self._read_header(conn, peer)
                if header is None:
                    if handshake.started and not handshake.done:
                        self._refuse_auth(peer, "left during the handshake (a different token?)")
                    return
                if header[0].op == Op.AUTH or not handshake.done:
                    if not self._authenticate(conn, peer, header[0], header[1], handshake):
                        return
                else:
                    self._handle(conn, header[0], header[1], session)
                if not self._mark(conn):
                    return
        except ProtocolError as err:
            self._count("protocol_errors")
            logger.warning("closing connection from %s: %s", peer, err)
            if not isinstance(err, TruncatedFrameError):
                try:
                    conn.settimeout(self.config.frame_timeout_s)
                    send_frame(conn, Op.ERROR, Status.BAD_REQUEST, payload=str(err).encode())
                except OSError:
                    pass
        except FrameDeadline as err:
            self._count("protocol_errors")
            self._count("frame_timeouts")
            logger.warning("closing connection from %s: %s", peer, err)
        except OSError as err:
            if not self._stop.is_set():
                logger.info("connection from %s dropped: %s", peer, err)
        finally:
            with self._lock:
                self._connections.pop(conn, None)
                if session is not None:
                    self._sessions.discard(session)
            if session is not None:
                session.close()
            conn.close()

    def _tls_accept(self, conn: socket.socket, peer: tuple) -> Optional[ssl.SSLSocket]:
        """The TLS handshake, whole within `frame_timeout_s` (CPython bounds one `do_handshake`
        by the socket timeout as a deadline); None when it failed or the connection was reaped."""
        assert self._tls is not None
        tls = self._tls.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
        with self._lock:  # `conn` gave its descriptor to `tls`: track (and reap) that instead
            state = self._connections.pop(conn, None)
            if state is not None:
                self._connections[tls] = state
        if state is None:
            tls.close()
            return None
        tls.settimeout(self.config.frame_timeout_s)
        try:
            tls.do_handshake()
        except socket.timeout:
            self._forget(tls)
            raise FrameDeadline(f"TLS handshake not complete within {self.config.frame_timeout_s:.1f} s") from None
        except ssl.SSLError as err:
            count = self._count("tls_refusals")
            # A peer that closes before saying anything is a port probe (health check): quiet.
            level = logging.DEBUG if isinstance(err, ssl.SSLEOFError) else logging.WARNING
            if count % _REAP_LOG_EVERY == 1 or level == logging.DEBUG:
                logger.log(level, "TLS handshake with %s failed: %s (%d failed so far)", peer, err.reason or err, count)
            self._forget(tls)
            return None
        except OSError:
            self._forget(tls)
            raise
        return tls

    def _forget(self, conn: socket.socket) -> None:
        """Close `conn` and stop tracking it (the TLS socket the connection thread never got)."""
        with self._lock:
            self._connections.pop(conn, None)
        conn.close()

    def _authenticate(
        self, conn: socket.socket, peer: tuple, header: FrameHeader, deadline: float, handshake: ServerHandshake
    ) -> bool:
        """Answer one handshake frame; False (after a refusal) when the connection must close."""
        conn.settimeout(self.config.frame_timeout_s)
        if header.op != Op.AUTH:
            self._refuse_auth(peer, f"{header.op.name} before authenticating")
            # The key (bounded) is read so the answer is not lost to a reset; a payload is not.
            self._recv_exact(conn, header.key_len, deadline, "the key")
            send_frame(conn, Op.ERROR, Status.BAD_REQUEST, payload=AUTH_REQUIRED.encode())
            return False
        payload = bytes(self._recv_exact(conn, header.payload_len, deadline, "an AUTH payload"))
        try:
            status, reply = handshake.step(payload)
        except AuthRefused as err:
            self._refuse_auth(peer, str(err))
            send_frame(conn, Op.AUTH, Status.REFUSED, payload=self._refusal(RefusalReason.AUTH_FAILED))
            return False
        send_frame(conn, Op.AUTH, status, payload=reply or None)
        return True

    def _refuse_auth(self, peer: tuple, why: str) -> None:
        count = self._count("auth_refusals")
        if count % _REAP_LOG_EVERY == 1:
            logger.warning("refused a connection from %s: %s (%d refused so far)", peer, why, count)

    def _read_header(self, conn: socket.socket, peer: tuple) -> Optional[tuple[FrameHeader, float]]:
        """Wait up to `idle_timeout_s` for a frame to start; then (its header, its deadline)."""
        raw = bytearray(HEADER_SIZE)
        view = memoryview(raw)
        conn.settimeout(self.config.idle_timeout_s)
        try:
            first = conn.recv_into(view, HEADER_SIZE)
        except socket.timeout:
            self._count("idle_timeouts")
            logger.debug("closing connection from %s: idle for %.1f s", peer, self.config.idle_timeout_s)
            return None
        if first == 0 or not self._mark(conn):
            return None
        deadline = time.monotonic() + self.config.frame_timeout_s
        got = self._recv_into(conn, view, deadline, "a frame header", start=first)
        if got != HEADER_SIZE:
            raise TruncatedFrameError(
                f"connection closed after {got} of {HEADER_SIZE} bytes of a frame header"
            )
        # The configured frame limit is a refusal (below), not a protocol error: only the hard
        # ceiling breaks the protocol.
        return parse_header(raw, HARD_MAX_PAYLOAD_BYTES, is_request=True), deadline

    def _recv_into(
        self, conn: socket.socket, view: memoryview, deadline: float, what: str, start: int = 0
    ) -> int:
        """Fill `view[start:]` before `deadline`; returns the bytes in `view` (fewer only at EOF)."""
        got = start
        total = len(view)
        while got < total:
            left = deadline - time.monotonic()
            if left <= 0:
                raise FrameDeadline(
                    f"frame stalled: not complete within {self.config.frame_timeout_s:.1f} s of "
                    f"its first byte ({got} of {total} bytes of {what})"
                )
            conn.settimeout(left)
            try:
                n = conn.recv_into(view[got:], total - got)
            except socket.timeout:
                continue  # the loop raises with the byte count
            if n == 0:
                return got
            got += n
        return got

    def _recv_exact(self, conn: socket.socket, size: int, deadline: float, what: str) -> memoryview:
        buf = alloc_buffer(size)
        got = self._recv_into(conn, buf, deadline, what)
        if got != size:
            raise TruncatedFrameError(f"connection closed after {got} of {size} bytes of {what}")
        return buf

    # ---- requests -------------------------------------------------------------------------

    def _handle(
        self, conn: socket.socket, header: FrameHeader, deadline: float, session: Optional[PoolSession] = None
    ) -> None:
        key = bytes(self._recv_exact(conn, header.key_len, deadline, "the key"))
        op = header.op
        if op in POOL_OPS:
            if session is None:
                raise ProtocolError(f"{op.name} is served on the node pool's unix socket only")
            payload = bytes(self._recv_exact(conn, header.payload_len, deadline, f"a {op.name} payload"))
            conn.settimeout(self.config.frame_timeout_s)
            if op == Op.LEASE and self.config.get_delay_s:
                time.sleep(self.config.get_delay_s)  # the pool's read, as slow as a GET
            refused = session.handle(conn, op, key, payload)
            if refused is not None:
                self._count(_REFUSAL_COUNTERS[refused])
            return
        # A reply has as long as a request to drain into a client that stopped reading.
        conn.settimeout(self.config.frame_timeout_s)
        if op == Op.PUT:
            try:
                receiving = self._put_pool.submit(self._put, conn, key, header.payload_len, deadline)
            except RuntimeError:  # shut down after this frame's header arrived: the server is stopping
                raise OSError("the server is shutting down") from None
            receiving.result()
        elif op == Op.GET:
            if self.config.get_delay_s:
                time.sleep(self.config.get_delay_s)  # this connection only; others are served meanwhile
            lease = self.store.get(key)
            if lease is None:
                send_frame(conn, op, Status.NOT_FOUND)
            else:
                with lease as value:
                    send_frame(conn, op, Status.OK, payload=value)
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

    def _put(self, conn: socket.socket, key: bytes, size: int, deadline: float) -> None:
        if size > self.config.max_payload_bytes:
            self._refuse(conn, RefusalReason.TOO_LARGE, size, deadline, "refused_too_large")
            return
        if not self.store.fits(len(key), size):
            self._refuse(conn, RefusalReason.OVER_STORE, size, deadline, "refused_over_store")
            return
        value = self._recv_payload(conn, size, deadline)
        if value is None:
            return  # over the pending budget: refused and answered
        # It fits the store (checked above): a refusal now means the arena has no room left
        # that is not being read or received (the store counts it and gives a reservation back).
        ok = self.store.put(key, value)
        conn.settimeout(self.config.frame_timeout_s)
        if ok:
            send_frame(conn, Op.PUT, Status.OK)
        else:
            self._count("refused_busy")
            send_frame(conn, Op.PUT, Status.REFUSED, payload=self._refusal(RefusalReason.BUSY))

    def _recv_payload(
        self, conn: socket.socket, size: int, deadline: float
    ) -> Optional[Union[Reservation, memoryview]]:
        """Receive a put's payload into the store's arena (or, where the arena cannot take it now,
        a buffer of its own), each step reserved from the pending budget before it arrives (so the budget
        bounds what all unfinished frames hold: at most twice what they sent, plus one first step
        each).

        Over the budget, what arrived is dropped, the rest drained and the put refused (None)."""
        if size == 0:
            return alloc_buffer(0)
        reservation: Optional[Reservation] = None
        buf: Optional[_PayloadBuffer] = None
        view: Optional[memoryview] = None
        held = 0
        received = False
        try:
            while held < size:
                step = min(_MAX_RECV_STEP, size - held, max(_FIRST_RECV_STEP, held))
                if not self._budget.try_reserve(step):
                    break
                if view is None:
                    reservation = self.store.reserve(size)
                    if reservation is not None:
                        view = reservation.view
                    else:
                        buf = _PayloadBuffer(size)
                        view = buf.view
                if buf is not None:
                    buf.grown_to(held)
                held += step
                n = self._recv_into(conn, view[held - step : held], deadline, "the payload")
                if n != step:
                    raise TruncatedFrameError(
                        f"connection closed after {held - step + n} of {size} bytes of the payload"
                    )
            else:
                received = True
                return reservation if reservation is not None else view
        finally:
            self._budget.release(held)
            if reservation is not None and not received:
                self.store.cancel(reservation)
        del buf, view
        self._refuse(conn, RefusalReason.BUSY, size - held, deadline, "refused_busy")
        return None

    def _refusal(self, reason: RefusalReason) -> bytes:
        return refusal_payload(reason, self.config.max_payload_bytes)

    def _refuse(
        self, conn: socket.socket, reason: RefusalReason, unread: int, deadline: float, counter: str
    ) -> None:
        """Drain the rest of a refused put's payload (keeping the connection in step) and answer."""
        count = self._count(counter)
        if count % _REAP_LOG_EVERY == 1:
            logger.warning(
                "refusing a put (%s): frame limit %d bytes, pending budget %d of %d bytes "
                "(%d refused for this reason so far)",
                reason.value,
                self.config.max_payload_bytes,
                self._budget.held,
                self.pending_limit,
                count,
            )
        left = unread
        while left:
            scratch = self._scratch[: min(left, _DISCARD_BLOCK)]
            n = self._recv_into(conn, scratch, deadline, "a refused payload")
            if n == 0:
                raise TruncatedFrameError(f"connection closed with {left} payload bytes unread")
            left -= n
        conn.settimeout(self.config.frame_timeout_s)
        send_frame(conn, Op.PUT, Status.REFUSED, payload=self._refusal(reason))


class _PayloadBuffer:
    """One put's payload buffer, resident only as bytes arrive and returned to the system as
    soon as the value is dropped: a private anonymous mapping. (A block recycled by malloc is
    resident in full, so peers announcing sizes they never send could pin that much memory
    whatever the pending budget says.) Once a frame has sent `_HUGE_PAGES_FROM` bytes, the
    mapping asks for transparent huge pages, as numpy does for its large arrays: far fewer page
    faults for the rest, at most one huge page beyond what the budget reserved."""

    def __init__(self, size: int) -> None:
        self._region: Optional[mmap.mmap] = None
        if size < _FIRST_RECV_STEP:
            self.view = alloc_buffer(size)
        else:
            self._region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self.view = memoryview(self._region)
        self._huge = False

    def grown_to(self, received: int) -> None:
        """Note that `received` bytes arrived; large enough, ask for huge pages."""
        if self._region is not None and not self._huge and received >= _HUGE_PAGES_FROM:
            self._huge = True
            if hasattr(mmap, "MADV_HUGEPAGE"):
                self._region.madvise(mmap.MADV_HUGEPAGE)


def _hang_up(conn: socket.socket) -> None:
    """Wake whatever thread is blocked on `conn`; that thread closes it. (The plain socket's
    shutdown also for a TLS socket: `SSLSocket.shutdown` would drop its TLS state under the
    thread still reading it.)"""
    try:
        socket.socket.shutdown(conn, socket.SHUT_RDWR)
    except OSError:
        pass
