"""Pipelined Redis reads whose values go straight from the socket into the receiver's memory.

redis-py (hiredis or not) reads a reply into its own growing buffer and builds one `bytes` per
value: two copies past the socket for a 32 MiB chunk, into memory new to the process each time
(issue 18: Redis get ran at 0.16x of raw loopback). Here the replies are parsed by us and each
value handed to the receiver as a `ValueReader`, which reads it where it will live.

A value is not fetched with one `GET`: Redis copies a reply into an output buffer of its own
before writing it, and a 32 MiB buffer, after puts had churned its memory, was fresh memory to
fault in every time (0.40-0.58 GB/s where 1 MiB pieces ran at 0.87-1.30 on the same machine).
So one pipelined `STRLEN` per key says which values exist and how long they are, and each value
is read as `GETRANGE` pieces of `PIECE` bytes, `WINDOW` of them in flight. A value that shrinks
or disappears between its `STRLEN` and its last piece is a `ValueChanged` (a miss); a value
replaced by one of the same length reads as a mix, which its checksum turns into a miss too.

Only reads go this way, on a connection borrowed from redis-py's own pool: redis-py has already
connected it (TLS, `AUTH`, `SELECT`, the master found through the Sentinels) and gets it back
afterwards. Those pools speak RESP2 (`RESP_PROTOCOL`): RESP3 may interleave push messages this
reader would have to parse. A connection that fails or answers out of step is disconnected,
never returned half-read.
"""

from __future__ import annotations

import socket
from collections import deque
from typing import Any, Deque, Optional, Sequence, Set, Tuple

from lmcache.experimental.remote.connector import Receive, RemoteUnavailableError
from lmcache.experimental.remote.value_reader import SocketReader, ValueReader
from lmcache.logging import init_logger

logger = init_logger(__name__)

# What the connections whose replies we read speak (redis-py's `protocol=`).
RESP_PROTOCOL = 2
# Bytes per GETRANGE, and GETRANGEs in flight: Redis buffers at most WINDOW x PIECE for us.
PIECE = 1 << 20
WINDOW = 4
# A reply line ("$1048576", ":33554432", "-ERR ...") is never longer than this.
_MAX_LINE = 4096


class ValueChanged(Exception):
    """The value shrank or went away while its pieces were read: a miss, not an outage."""


def pipelined_get_into(pool: Any, keys: Sequence[str], receive: Receive, where: str) -> None:
    """Read every key's value on a connection of redis-py's `pool`; each found value goes to
    `receive(index, reader)` in order. A failing connection raises what failed (redis-py's
    errors, `OSError`, `RemoteUnavailableError`); values handed over before stay handed over."""
    conn = pool.get_connection()
    try:
        conn.send_packed_command([b"".join(_pack(b"STRLEN", key) for key in keys)], check_health=False)
        # redis-py keeps its socket private; reading it ourselves is the point of this module.
        sock: socket.socket = conn._sock
        sizes = [_read_length(sock, key, where) for key in keys]
        pieces = _Pieces(conn, sock, keys, sizes, where)
        for i, size in enumerate(sizes):
            if size:
                reader = _PieceReader(pieces, i, size)
                receive(i, reader)
                reader.drain()
    except BaseException:
        conn.disconnect()
        pool.release(conn)
        raise
    pool.release(conn)


def _pack(command: bytes, key: str, *numbers: int) -> bytes:
    parts = [command, key.encode("utf-8"), *(b"%d" % n for n in numbers)]
    return b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts)


def _read_length(sock: socket.socket, key: str, where: str) -> int:
    """A STRLEN reply: the value's length, 0 when there is none (or it is not a string)."""
    line = _read_line(sock, where)
    if line[:1] == b"-":
        logger.warning("STRLEN %s on %s failed: %s", key, where, bytes(line[1:]).decode("utf-8", "replace"))
        return 0
    if line[:1] != b":":
        raise RemoteUnavailableError(f"{where}: unexpected reply to STRLEN: {bytes(line[:40])!r}")
    size = _number(line, where)
    if size < 0:  # never from Redis; a peer out of step must not become a reader of negative length
        raise RemoteUnavailableError(f"{where}: negative length in reply to STRLEN: {bytes(line[:40])!r}")
    return size


class _Pieces:
    """The GETRANGE pieces of every found value, in order, `WINDOW` commands in flight; the
    body of the reply being read is `left` bytes on the socket."""

    def __init__(self, conn: Any, sock: socket.socket, keys: Sequence[str], sizes: Sequence[int], where: str) -> None:
        self._conn = conn
        self._sock = sock
        self._keys = keys
        self.where = where
        self._todo: Deque[Tuple[int, int, int]] = deque(
            (i, start, min(PIECE, size - start)) for i, size in enumerate(sizes) for start in range(0, size, PIECE)
        )
        self._flight: Deque[Tuple[int, int]] = deque()  # (value index, expected length)
        self._dropped: Set[int] = set()  # values whose pieces not sent yet are not wanted
        self._open_body: Optional[int] = None  # bytes of the current body still unread; None = none open
        self._send()

    def next_piece(self, index: int) -> int:
        """Open the next reply, a piece of value `index`: its length. A piece shorter than asked
        (the value changed) is skipped with the value's other pieces: `ValueChanged`."""
        self._close_body()
        owner, expected = self._flight.popleft()
        assert owner == index, "pieces are read in the order they were asked for"
        self._send()
        line = _read_line(self._sock, self.where)
        got = _number(line, self.where) if line[:1] == b"$" else -1
        if line[:1] not in (b"$", b"-"):
            raise RemoteUnavailableError(f"{self.where}: unexpected reply to GETRANGE: {bytes(line[:40])!r}")
        self._open_body = got if got >= 0 else None  # an error or a nil has no body
        if got != expected:
            self._drop(index)
            raise ValueChanged(f"value {self._keys[index]} changed while it was read ({got} of {expected} bytes)")
        return got

    def recv_into(self, view: memoryview) -> int:
        """Read at most what is left of the current body."""
        assert self._open_body is not None and view.nbytes <= self._open_body
        SocketReader(self._sock, view.nbytes, self.where).readinto(view)
        self._open_body -= view.nbytes
        return view.nbytes

    def _drop(self, index: int) -> None:
        """Skip the rest of value `index`: what is in flight is read and dropped, the rest never asked."""
        self._dropped.add(index)
        self._close_body()
        while self._flight and self._flight[0][0] == index:
            self._flight.popleft()
            line = _read_line(self._sock, self.where)
            body = _number(line, self.where) if line[:1] == b"$" else -1
            self._open_body = body if body >= 0 else None
            self._close_body()
        self._send()

    def _close_body(self) -> None:
        """Skip what is left of the current reply body, and its CRLF."""
        if self._open_body is None:
            return
        reader = SocketReader(self._sock, self._open_body + 2, self.where)
        reader.drain()
        self._open_body = None

    def _send(self) -> None:
        batch = []
        while self._todo and len(self._flight) + len(batch) < WINDOW:
            i, start, n = self._todo.popleft()
            if i in self._dropped:
                continue
            batch.append(_pack(b"GETRANGE", self._keys[i], start, start + n - 1))
            self._flight.append((i, n))
        if batch:
            self._conn.send_packed_command([b"".join(batch)], check_health=False)

    def finish(self) -> None:
        self._close_body()


class _PieceReader(ValueReader):
    """One value, read piece after piece off `_Pieces`."""

    def __init__(self, pieces: _Pieces, index: int, size: int) -> None:
        super().__init__(size)
        self._pieces = pieces
        self._index = index
        self._in_piece = 0

    def _fill(self, view: memoryview) -> int:
        if not self._in_piece:
            try:
                self._in_piece = self._pieces.next_piece(self._index)
            except ValueChanged:
                self._left = 0  # its other pieces are skipped already: nothing left to drain
                raise
        n = self._pieces.recv_into(view[: min(view.nbytes, self._in_piece)])
        self._in_piece -= n
        if not self._left - n:
            self._pieces.finish()  # the value's last byte: its CRLF too
        return n


def _number(line: bytearray, where: str) -> int:
    try:
        return int(line[1:])
    except ValueError:
        raise RemoteUnavailableError(f"{where}: bad number in reply {bytes(line[:40])!r}") from None


def _read_line(sock: socket.socket, where: str) -> bytearray:
    """One reply line without its CRLF; byte by byte (a few bytes per piece; no peeking, which
    TLS sockets cannot do)."""
    line = bytearray()
    one = memoryview(bytearray(1))
    while not line.endswith(b"\r\n"):
        if len(line) > _MAX_LINE:
            raise RemoteUnavailableError(f"{where}: reply line longer than {_MAX_LINE} bytes")
        SocketReader(sock, 1, where).readinto(one)
        line += one
    return line[:-2]
