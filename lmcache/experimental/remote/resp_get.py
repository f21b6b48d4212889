"""Pipelined Redis `GET`s whose values are read straight off the socket (RESP2 bulk strings).

redis-py (hiredis or not) reads a reply into its own growing buffer and builds one `bytes` per
value: two copies past the socket for a 32 MiB chunk, into memory new to the process each time
(issue 18: Redis get ran at 0.16x of raw loopback). Here the `$<len>` line of each reply is
parsed by us and the value handed to the receiver as a `SocketReader`, which reads it into the
memory object where it will live.

Only `GET` goes this way, on a connection borrowed from redis-py's own pool: redis-py has
already connected it (TLS, `AUTH`, `SELECT`, the master found through the Sentinels) and gets
it back afterwards. Those pools speak RESP2 (`RESP_PROTOCOL`): RESP3 may interleave push
messages this reader would have to parse. A connection that fails or answers out of step is disconnected, never
returned half-read.
"""

from __future__ import annotations

import socket
from typing import Any, Sequence

from lmcache.experimental.remote.connector import Receive, RemoteUnavailableError
from lmcache.experimental.remote.value_reader import SocketReader
from lmcache.logging import init_logger

logger = init_logger(__name__)

# What the connections whose replies we read speak (redis-py's `protocol=`).
RESP_PROTOCOL = 2
# GETs in flight on the connection: enough to hide the round trip. Redis copies every reply into
# its output buffer, so a whole batch in flight made it buffer (and first-touch) every value at
# once: 0.4-1.1 GB/s here, against a steady 1.0 with one at a time.
GET_WINDOW = 2
# A reply line ("$33554432", "-ERR ...") is never longer than this; a longer one is out of step.
_MAX_LINE = 4096


def pipelined_get_into(pool: Any, keys: Sequence[str], receive: Receive, where: str) -> None:
    """`GET` every key in one pipeline on a connection of redis-py's `pool`; each found value
    goes to `receive(index, reader)` in order. A failing connection raises what failed (redis-py's
    errors, `OSError`, `RemoteUnavailableError`); values handed over before stay handed over."""
    conn = pool.get_connection()
    try:
        conn.send_packed_command([b"".join(_pack_get(key) for key in keys[:GET_WINDOW])], check_health=False)
        # redis-py keeps its socket private; reading it ourselves is the point of this module.
        sock: socket.socket = conn._sock
        for i, key in enumerate(keys):
            if i + GET_WINDOW < len(keys):
                conn.send_packed_command([_pack_get(keys[i + GET_WINDOW])], check_health=False)
            _read_reply(sock, i, key, receive, where)
    except BaseException:
        conn.disconnect()
        pool.release(conn)
        raise
    pool.release(conn)


def _pack_get(key: str) -> bytes:
    raw = key.encode("utf-8")
    return b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(raw), raw)


def _read_reply(sock: socket.socket, index: int, key: str, receive: Receive, where: str) -> None:
    line = _read_line(sock, where)
    kind, rest = line[:1], line[1:]
    if kind == b"$":
        try:
            size = int(rest)
        except ValueError:
            raise RemoteUnavailableError(f"{where}: bad bulk length {bytes(line[:40])!r}") from None
        if size < 0:
            return  # RESP2's nil: not stored
        reader = SocketReader(sock, size, where)
        receive(index, reader)
        reader.drain()
        end = bytearray(2)
        SocketReader(sock, 2, where).readinto(memoryview(end))
        if end != b"\r\n":
            raise RemoteUnavailableError(f"{where}: a value of {size} bytes did not end its reply")
    elif kind == b"_" and not rest:
        return  # RESP3's null
    elif kind == b"-":
        logger.warning("GET %s on %s failed: %s", key, where, bytes(rest).decode("utf-8", "replace"))
    else:
        raise RemoteUnavailableError(f"{where}: unexpected reply to GET: {bytes(line[:40])!r}")


def _read_line(sock: socket.socket, where: str) -> bytearray:
    """One reply line without its CRLF; byte by byte (a few bytes per value; no peeking, which
    TLS sockets cannot do)."""
    line = bytearray()
    one = memoryview(bytearray(1))
    while not line.endswith(b"\r\n"):
        if len(line) > _MAX_LINE:
            raise RemoteUnavailableError(f"{where}: reply line longer than {_MAX_LINE} bytes")
        SocketReader(sock, 1, where).readinto(one)
        line += one
    return line[:-2]
