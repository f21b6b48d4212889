"""Client of our `lm://` server (`lmcache.server`): pooled TCP connections, pipelined batches.

Each call borrows one connection from a small pool, sends its request frames and reads the
answers in order. Batches are pipelined in windows of `PIPELINE_WINDOW` requests: every
request of a window is sent before the first answer is read, which hides the round trip
while keeping what both sides buffer small (so neither can block the other).

A connection that fails is closed, never returned to the pool. A failure on a connection that
had been idle in the pool (typically: the server restarted since) empties the pool and the
request is retried once on a fresh connection - every operation here is idempotent - so a
server restart costs no error at all when the server is back by the time of the next request.
Timeouts are not retried: they already cost their full wait.

A put the server cannot take is a refusal, never an error: the client learns the server's frame
limit (from `INFO` before its first put, and from every `REFUSED` reply, which names it) and
refuses what is larger itself, without sending it; a put the server refuses anyway (over its
store, or its budget for unfinished frames is full) comes back False on a connection that stays
usable.

With a token, every new connection first passes `lmcache.server.security`'s handshake; with a
TLS context (`lms://`) it is TLS first, certificate and host name checked. A server that refuses
the token (or cannot prove it knows it, or wants one we do not have) is `RemoteAuthError`: logged
as an error (rate-limited), never retried at once, and to the remote tier a down store - every
lookup a miss, probed again with backoff - never data.

The node pool's client (`pool_connector.py`) is this connector on a unix socket, with its own
dial (which maps the server's arena) and its own puts and gets (in place, in the arena).
"""

from __future__ import annotations

import json
import socket
import ssl
import threading
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Tuple, TypeVar

from lmcache.experimental.config import RemoteUrl
from lmcache.experimental.remote.connector import (
    Buffer,
    Receive,
    RemoteAuthError,
    RemoteConnector,
    RemoteUnavailableError,
    Value,
    value_buffers,
    value_nbytes,
)
from lmcache.experimental.remote.value_reader import SocketReader
from lmcache.logging import init_logger
from lmcache.server.protocol import (
    DEFAULT_MAX_PAYLOAD_BYTES,
    HARD_MAX_PAYLOAD_BYTES,
    HEADER_SIZE,
    MAX_KEY_BYTES,
    Op,
    ProtocolError,
    Status,
    frame_limit_of,
    pack_header,
    parse_header,
    recv_exact,
    refusal_limit,
)
from lmcache.server.security import AUTH_REQUIRED, AuthRefused, client_handshake

logger = init_logger(__name__)

PIPELINE_WINDOW = 32
# Log one "too large" line per this many puts refused before sending.
_TOO_LARGE_LOG_EVERY = 100
# Payloads at least this large are sent on their own instead of being joined to the header.
_ZERO_COPY_BYTES = 64 * 1024
# Log one "refused our credentials" error per this many refusals.
_AUTH_LOG_EVERY = 100


@dataclass(frozen=True)
class Request:
    op: Op
    key: bytes = b""
    payload: Optional[Value] = None


@dataclass(frozen=True)
class Reply:
    status: Status
    payload: Optional[memoryview]


T = TypeVar("T")


def open_session(
    sock: socket.socket, where: str, token: Optional[bytes], tls: Optional[ssl.SSLContext] = None, host: str = ""
) -> socket.socket:
    """`sock`, just connected to `where`, after TLS (to `host`) and the token handshake, as the
    server asks; closed and turned into `RemoteAuthError` / `RemoteUnavailableError` on failure."""
    try:
        if tls is not None:
            sock = tls.wrap_socket(sock, server_hostname=host)
        if token is not None:
            client_handshake(sock, token)
    except AuthRefused as err:
        sock.close()
        raise RemoteAuthError(str(err)) from err
    except ssl.SSLError as err:
        sock.close()
        raise RemoteAuthError(f"TLS handshake failed: {err.reason or err}") from err
    except (OSError, ProtocolError) as err:
        sock.close()
        raise RemoteUnavailableError(f"handshake with {where} failed: {err}") from err
    return sock


class ConnectionPool:
    """Idle connections to one server, made by `connect` (which raises
    `RemoteUnavailableError`); a connection is used by one thread at a time."""

    def __init__(self, connect: Callable[[], socket.socket], max_idle: int) -> None:
        self._connect = connect
        self._max_idle = max_idle
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False

    def acquire(self) -> Tuple[socket.socket, bool]:
        """A connection and whether it was reused from the pool."""
        with self._lock:
            if self._closed:
                raise RemoteUnavailableError("connector is closed")
            if self._idle:
                return self._idle.pop(), True
        return self._connect(), False

    def release(self, sock: socket.socket) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self._max_idle:
                self._idle.append(sock)
                return
        sock.close()

    def clear(self) -> None:
        """Close every idle connection (they are suspect after a failure)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for sock in idle:
            sock.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self.clear()


class LMServerConnector(RemoteConnector):
    """`lm://host:port`: puts are acknowledged one by one, gets and exists are pipelined."""

    def __init__(
        self,
        host: str,
        port: int,
        timeout: float = 10.0,
        lookup_timeout: float = 1.0,
        pool_size: int = 4,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        token: Optional[str] = None,
        tls: Optional[ssl.SSLContext] = None,
    ) -> None:
        """`token`: the server's shared secret (None = no handshake); `tls`: a client context
        (`security.client_tls_context`) for `lms://`."""
        if timeout <= 0 or lookup_timeout <= 0:
            raise ValueError(f"timeouts must be positive, got {timeout} and {lookup_timeout}")
        if not 0 < max_payload_bytes <= HARD_MAX_PAYLOAD_BYTES:
            raise ValueError(
                f"max_payload_bytes must be in 1..{HARD_MAX_PAYLOAD_BYTES}, got {max_payload_bytes}"
            )
        self._host = host
        self._port = port
        self._timeout = timeout
        self._lookup_timeout = lookup_timeout
        self._max_payload = max_payload_bytes
        # The server's frame limit once known (INFO, or a refusal naming it); None = ask.
        self._server_limit: Optional[int] = None
        self._too_large = 0
        self._auth_refusals = 0
        self._secret = None if token is None else token.encode("utf-8")
        self._tls = tls
        self._pool = ConnectionPool(self._dial, pool_size)
        scheme = "lm" if tls is None else "lms"
        self._url = RemoteUrl(scheme, ((host, port),), password=token).display()

    def _dial(self) -> socket.socket:
        try:
            sock = socket.create_connection((self._host, self._port), timeout=self._lookup_timeout)
        except OSError as err:
            raise RemoteUnavailableError(f"cannot connect to lm://{self._host}:{self._port}: {err}") from err
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return open_session(sock, f"{self._host}:{self._port}", self._secret, self._tls, self._host)

    @property
    def url(self) -> str:
        return self._url

    def delete(self, key: str) -> bool:
        reply = self._call([Request(Op.DELETE, key_bytes(key))], self._timeout)[0]
        return reply.status == Status.OK

    def batched_exists(self, keys: Sequence[str]) -> list[bool]:
        requests = [Request(Op.EXISTS, key_bytes(k)) for k in keys]
        return [r.status == Status.OK for r in self._call(requests, self._lookup_timeout)]

    def batched_get(self, keys: Sequence[str]) -> list[Optional[Buffer]]:
        requests = [Request(Op.GET, key_bytes(k)) for k in keys]
        replies = self._call(requests, self._timeout)
        return [r.payload if r.status == Status.OK else None for r in replies]

    def batched_get_into(self, keys: Sequence[str], receive: Receive) -> None:
        """Each found value is read off the socket by `receive` itself, in the pipeline's order."""
        requests = [Request(Op.GET, key_bytes(k)) for k in keys]
        self._call(requests, self._timeout, receive)

    @property
    def max_payload_bytes(self) -> int:
        """The largest value a put sends: this client's limit, or the server's when lower."""
        if self._server_limit is None:
            return self._max_payload
        return min(self._max_payload, self._server_limit)

    def _slots_within_limit(self, items: Sequence[Tuple[str, int]]) -> list[int]:
        """Indexes of the (key, size) items a put may send: within this client's limit and the
        server's (learned first, once)."""
        if self._server_limit is None:
            self._learn_limit()
        limit = self.max_payload_bytes
        return [i for i, (key, size) in enumerate(items) if not self._over_limit(key, size, limit)]

    def batched_put(self, items: Sequence[Tuple[str, Value]]) -> list[bool]:
        results: list[bool] = [False] * len(items)
        if not items:
            return results
        slots = self._slots_within_limit([(key, value_nbytes(value)) for key, value in items])
        requests = [Request(Op.PUT, key_bytes(items[i][0]), items[i][1]) for i in slots]
        for slot, reply in zip(slots, self._call(requests, self._timeout)):
            results[slot] = reply.status == Status.OK
            if reply.status == Status.REFUSED:
                self._note_refusal(reply.payload)
        return results

    def _over_limit(self, key: str, size: int, limit: int) -> bool:
        """Whether a value of `size` bytes is over `limit` (then counted and logged: a put
        refused unsent)."""
        if size > limit:
            self._refuse_too_large(key, size, limit)
            return True
        return False

    def _note_refusal(self, payload: Optional[Buffer]) -> None:
        """Learn the server's frame limit from a refusal that names it."""
        learned = refusal_limit(payload)
        if learned is not None:
            self._server_limit = learned

    def _learn_limit(self) -> None:
        """Ask the server for its frame limit (an older server without one: use our own)."""
        limit = frame_limit_of(self.info())
        self._server_limit = self._max_payload if limit is None else limit

    def _refuse_too_large(self, key: str, size: int, limit: int) -> None:
        self._too_large += 1
        if self._too_large % _TOO_LARGE_LOG_EVERY == 1:
            logger.warning(
                "not storing %s on %s: %d bytes exceed the %d-byte frame limit "
                "(%d puts refused for size so far; raise lmcache_server --max-frame-mb)",
                key,
                self.url,
                size,
                limit,
                self._too_large,
            )

    def ping(self) -> None:
        self._call([Request(Op.PING)], self._lookup_timeout)

    def info(self) -> dict[str, int]:
        """The server's counters (entries, bytes used, evictions, protocol errors, ...)."""
        reply = self._call([Request(Op.INFO)], self._timeout)[0]
        return json.loads(bytes(reply.payload or b"{}"))

    def close(self) -> None:
        self._pool.close()

    def _call(
        self, requests: Sequence[Request], timeout: float, receive: Optional[Receive] = None
    ) -> list[Reply]:
        """One pipelined exchange (`_on_connection`)."""
        if not requests:
            return []
        exchanges: list[Exchange] = []

        def work(sock: socket.socket) -> list[Reply]:
            exchanges.append(Exchange(sock, self.url, receive))
            return exchanges[-1].run(requests, timeout, self._max_payload)

        return self._on_connection(work, timeout, lambda: exchanges[-1].received > 0)

    def _on_connection(
        self, work: Callable[[socket.socket], T], timeout: float, handed: Callable[[], bool], keep: bool = False
    ) -> T:
        """`work` on a pooled connection. A pooled connection that broke (e.g. the server
        restarted) is retried once on a fresh one - unless `handed()` says a value was already
        handed over, which a second try would hand again; a timeout or a second failure means the
        server is down. With `keep`, a connection `work` succeeded on is not given back to the
        pool: `work` has handed it on (to whoever gives it back or closes it)."""
        may_retry = True
        while True:
            try:
                sock, reused = self._pool.acquire()
            except RemoteAuthError as err:
                self._log_auth_refusal(err)
                raise
            try:
                result = work(sock)
            except RemoteAuthError as err:
                sock.close()
                self._log_auth_refusal(err)
                raise
            except RemoteUnavailableError:  # cut off inside a value `receive` was reading
                sock.close()
                self._pool.clear()
                raise
            except socket.timeout as err:
                sock.close()
                raise RemoteUnavailableError(f"{self.url} did not answer within {timeout} s") from err
            except (OSError, ProtocolError) as err:
                sock.close()
                self._pool.clear()
                self._server_limit = None  # a restarted server may have another frame limit
                if not (reused and may_retry and not handed()):
                    raise RemoteUnavailableError(f"{self.url}: {err}") from err
                may_retry = False
                logger.debug("pooled connection to %s failed (%s); retrying on a new one", self.url, err)
                continue
            except BaseException:  # `receive` itself failed: the connection is inside a value
                sock.close()
                raise
            if not keep:
                self._pool.release(sock)
            return result

    def _log_auth_refusal(self, err: RemoteAuthError) -> None:
        self._auth_refusals += 1
        if self._auth_refusals % _AUTH_LOG_EVERY == 1:
            logger.error(
                "%s refused this client: %s (check the token and CA; every lookup is a miss "
                "meanwhile; %d refusals so far)",
                self.url,
                err,
                self._auth_refusals,
            )

class Exchange:
    """One pipelined run of requests on one connection; found values go to `receive` (when
    given) as they arrive, read straight off the socket."""

    def __init__(self, sock: socket.socket, url: str, receive: Optional[Receive]) -> None:
        self._sock = sock
        self._url = url
        self._receive = receive
        self.received = 0  # values handed to `receive`

    def run(self, requests: Sequence[Request], timeout: float, max_payload: int) -> list[Reply]:
        self._sock.settimeout(timeout)
        replies: list[Reply] = []
        for start in range(0, len(requests), PIPELINE_WINDOW):
            window = requests[start : start + PIPELINE_WINDOW]
            self._send_window(window)
            for i, request in enumerate(window, start):
                replies.append(self._read_reply(i, request.op, max_payload))
        return replies

    def _send_window(self, window: Sequence[Request]) -> None:
        pending: list[bytes] = []
        for request in window:
            size = 0 if request.payload is None else value_nbytes(request.payload)
            pending.append(pack_header(request.op, Status.OK, len(request.key), size))
            pending.append(request.key)
            for part in () if request.payload is None else value_buffers(request.payload):
                if memoryview(part).nbytes >= _ZERO_COPY_BYTES:
                    self._sock.sendall(b"".join(pending))
                    pending.clear()
                    self._sock.sendall(part)
                else:
                    pending.append(bytes(part))
        if pending:
            self._sock.sendall(b"".join(pending))

    def _read_reply(self, index: int, op: Op, max_payload: int) -> Reply:
        sock = self._sock
        header = parse_header(recv_exact(sock, HEADER_SIZE, "a reply header"), max_payload, is_request=False)
        recv_exact(sock, header.key_len, "a reply key")
        if self._receive is not None and header.op == op == Op.GET and header.status == Status.OK:
            reader = SocketReader(sock, header.payload_len, self._url)
            self.received += 1
            self._receive(index, reader)
            reader.drain()
            return Reply(header.status, None)
        payload = recv_exact(sock, header.payload_len, "a reply payload") if header.payload_len else None
        if header.op == Op.ERROR:
            reason = bytes(payload or b"").decode("utf-8", "replace")
            if reason == AUTH_REQUIRED:
                raise RemoteAuthError(reason)
            raise ProtocolError(f"server rejected the request: {reason}")
        if header.op != op:
            raise ProtocolError(f"reply to {op.name} came back as {header.op.name}")
        return Reply(header.status, payload)


def key_bytes(key: str) -> bytes:
    raw = key.encode("utf-8")
    if not raw or len(raw) > MAX_KEY_BYTES:
        raise ValueError(f"remote key must be 1..{MAX_KEY_BYTES} UTF-8 bytes, got {len(raw)}: {key[:80]!r}")
    return raw
