"""Wire protocol of the `lm://` server: versioned, typed, length-prefixed, size-checked frames.

Every message in either direction is one frame::

    +-------+---------+----+--------+---------+-------------+-----------+---------------+
    | magic | version | op | status | key_len | payload_len | key bytes | payload bytes |
    |  4 B  |   1 B   | 1B |  2 B   |   4 B   |     8 B     |  key_len  |  payload_len  |
    +-------+---------+----+--------+---------+-------------+-----------+---------------+

all integers big-endian. A request carries `status == 0`; the reply to it echoes the op and
sets the status. Requests on one connection are answered in order, so a client may pipeline.

Operations:
- `PING`: no key, no payload -> `OK`.
- `PUT key payload` -> `OK` (stored) or `REFUSED`: larger than the server's frame limit, larger
  than its whole store, or more than its budget for unfinished frames holds right now. A
  refused payload is still read to its end, so the connection stays usable; the `REFUSED` reply
  carries a JSON object `{"reason": ..., "max_payload_bytes": N}` (see `RefusalReason`), so a
  client learns the limit and stops sending what cannot fit. Every put is answered, so a client
  knows which writes landed.
- `GET key` -> `OK` + payload, or `NOT_FOUND`.
- `EXISTS key` -> `OK` or `NOT_FOUND`.
- `DELETE key` -> `OK` (was there) or `NOT_FOUND`.
- `INFO` -> `OK` + a JSON object of server statistics and limits (`max_payload_bytes`, ...).
- `AUTH payload` (at most `MAX_AUTH_PAYLOAD_BYTES`) -> `OK` + payload or `REFUSED`: the token
  handshake of `security.py`. A server with a token serves nothing else before it succeeded.

The node pool's ops (`pool.py`), served on the unix socket only (a TCP peer asking is a
protocol error); every payload is a few integers (`POOL_WORD`, big-endian u64s):
- `MAP [arena id]` -> `OK` + arena id (16 B) + arena size (u64); the arena's memfd rides along
  (SCM_RIGHTS) unless the request named this arena already (the client has it mapped).
- `RESERVE key size` -> `OK` + offset, or `REFUSED` + the JSON of a refused put: a block of the
  arena for a value of `size` bytes, which the client fills in place.
- `COMMIT key offset` -> `OK` (stored under `key`) or `REFUSED` (busy): publish a reserved block.
  A block never committed goes back when its connection closes: nobody sees half a value.
- `LEASE key` -> `OK` + lease id + offset + length, or `NOT_FOUND`: the block is not reused
  while leased; leases are released by `RELEASE`, or all at once when the connection closes.
- `RELEASE lease ids...` -> `OK`.

Version 1 since the start: the refusal payload and the INFO limits were added without a bump
because both sides ignore what they do not read (a reply's payload on `REFUSED`, unknown INFO
keys), so older clients and servers still interoperate. `AUTH` was added without a bump too: a
client without a token never sends it, so old and new clients work with a server without a
token; an old server answers a new client's `AUTH` with `BAD_REQUEST` "unknown op code 7", and
a server with a token answers an old client's first request with `BAD_REQUEST`
"authentication required" - each a clear refusal, and a bump would only break the pairs that
work.

Anything else (bad magic, unknown version or op, a key over its limit or a payload over
`HARD_MAX_PAYLOAD_BYTES`, a payload on an op that takes none) is a `ProtocolError`: the server answers an `ERROR` frame with status
`BAD_REQUEST` and the reason as UTF-8 payload (best effort) and closes that connection. There is no pickle: values are opaque bytes.
"""

from __future__ import annotations

import enum
import json
import socket
import struct
from dataclasses import dataclass
from typing import Optional, Union

import numpy

MAGIC = b"LMCS"
PROTOCOL_VERSION = 1
HEADER = struct.Struct("!4sBBHIQ")
HEADER_SIZE = HEADER.size

# Keys are `CacheEngineKey` strings (format, model name, sizes, a 32-hex-digit hash).
MAX_KEY_BYTES = 4096
# The hard ceiling no configuration can raise: one frame never carries more than this.
HARD_MAX_PAYLOAD_BYTES = 4 << 30
# What server and client accept by default; a 256-token chunk of a 70B model is ~80 MB.
DEFAULT_MAX_PAYLOAD_BYTES = 1 << 30
# An AUTH frame carries a nonce and an HMAC-SHA256 proof at most: a peer that has not
# authenticated yet can make the server hold no more than this.
MAX_AUTH_PAYLOAD_BYTES = 64

Buffer = Union[bytes, bytearray, memoryview]

_UNINITIALISED_FROM = 64 * 1024


class Op(enum.IntEnum):
    """Frame types; `ERROR` only appears in the server's reply to a broken request."""

    ERROR = 0
    PING = 1
    PUT = 2
    GET = 3
    EXISTS = 4
    DELETE = 5
    INFO = 6
    AUTH = 7
    MAP = 8
    RESERVE = 9
    COMMIT = 10
    LEASE = 11
    RELEASE = 12


class Status(enum.IntEnum):
    """Reply codes (a request carries `OK`, i.e. 0)."""

    OK = 0
    NOT_FOUND = 1
    REFUSED = 2
    BAD_REQUEST = 3


# The node pool's ops (unix socket only), their words (u64, big-endian), leases per RELEASE.
POOL_OPS = frozenset({Op.MAP, Op.RESERVE, Op.COMMIT, Op.LEASE, Op.RELEASE})
POOL_WORD = struct.Struct("!Q")
ARENA_ID_BYTES = 16
MAX_RELEASE_LEASES = 1024

# Ops that name a key; ops whose request carries a payload, and how large it may be (PUT's is
# bounded by the frame limit).
_KEYED_OPS = frozenset({Op.PUT, Op.GET, Op.EXISTS, Op.DELETE, Op.RESERVE, Op.COMMIT, Op.LEASE})
_PAYLOAD_REQUEST_LIMITS = {
    Op.AUTH: MAX_AUTH_PAYLOAD_BYTES,
    Op.MAP: ARENA_ID_BYTES,
    Op.RESERVE: POOL_WORD.size,
    Op.COMMIT: POOL_WORD.size,
    Op.RELEASE: MAX_RELEASE_LEASES * POOL_WORD.size,
}


class RefusalReason(str, enum.Enum):
    """Why a put (or a handshake) was refused (the `reason` of a `REFUSED` reply's JSON payload)."""

    TOO_LARGE = "too_large"  # over the server's frame limit (`max_payload_bytes`)
    OVER_STORE = "over_store"  # larger than the server's whole store
    BUSY = "busy"  # unfinished frames already hold the server's pending budget
    AUTH_FAILED = "auth_failed"  # the handshake's proof was wrong (security.py)


def refusal_payload(reason: RefusalReason, max_payload_bytes: int) -> bytes:
    """The JSON payload of a `REFUSED` put reply."""
    return json.dumps({"reason": reason.value, "max_payload_bytes": max_payload_bytes}).encode()


def frame_limit_of(fields: object) -> Optional[int]:
    """`max_payload_bytes` of a decoded INFO or refusal object, or None if absent or not valid."""
    limit = fields.get("max_payload_bytes") if isinstance(fields, dict) else None
    return limit if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else None


def refusal_limit(payload: Optional[Buffer]) -> Optional[int]:
    """The frame limit a `REFUSED` reply names, or None when it names none (or is not JSON)."""
    if not payload:
        return None
    try:
        return frame_limit_of(json.loads(bytes(payload)))
    except (ValueError, RecursionError):  # not JSON (or nested past the parser's depth)
        return None


class ProtocolError(Exception):
    """A frame that breaks the protocol; the connection it came on cannot be trusted any more."""


class TruncatedFrameError(ProtocolError):
    """The peer closed the connection in the middle of a frame."""


@dataclass(frozen=True)
class FrameHeader:
    """The fixed-size part of a frame, already checked against the limits."""

    op: Op
    status: Status
    key_len: int
    payload_len: int


def pack_header(op: Op, status: Status, key_len: int, payload_len: int) -> bytes:
    """Encode a frame header; refuses values the receiver would reject anyway."""
    if key_len > MAX_KEY_BYTES:
        raise ProtocolError(f"key of {key_len} bytes exceeds the {MAX_KEY_BYTES}-byte key limit")
    if payload_len > HARD_MAX_PAYLOAD_BYTES:
        raise ProtocolError(
            f"payload of {payload_len} bytes exceeds the hard frame limit of "
            f"{HARD_MAX_PAYLOAD_BYTES} bytes"
        )
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, int(op), int(status), key_len, payload_len)


def parse_header(raw: Buffer, max_payload_bytes: int, is_request: bool) -> FrameHeader:
    """Decode and validate a header; raises `ProtocolError` naming what is wrong."""
    if len(raw) != HEADER_SIZE:
        raise ProtocolError(f"header must be {HEADER_SIZE} bytes, got {len(raw)}")
    magic, version, op_code, status_code, key_len, payload_len = HEADER.unpack(raw)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {version} not supported (this side speaks {PROTOCOL_VERSION})"
        )
    try:
        op = Op(op_code)
    except ValueError:
        raise ProtocolError(f"unknown op code {op_code}") from None
    try:
        status = Status(status_code)
    except ValueError:
        raise ProtocolError(f"unknown status code {status_code}") from None
    if key_len > MAX_KEY_BYTES:
        raise ProtocolError(f"key length {key_len} exceeds the {MAX_KEY_BYTES}-byte limit")
    limit = min(max_payload_bytes, HARD_MAX_PAYLOAD_BYTES)
    if payload_len > limit:
        raise ProtocolError(f"payload length {payload_len} exceeds the frame limit of {limit} bytes")
    if is_request:
        if op == Op.ERROR:
            raise ProtocolError("ERROR is not a request op")
        if status != Status.OK:
            raise ProtocolError(f"request carries status {status.name}, expected OK")
        if op in _KEYED_OPS and key_len == 0:
            raise ProtocolError(f"{op.name} request without a key")
        if op not in _KEYED_OPS and key_len != 0:
            raise ProtocolError(f"{op.name} request must not carry a key")
        if op != Op.PUT and payload_len != 0:
            if op not in _PAYLOAD_REQUEST_LIMITS:
                raise ProtocolError(f"{op.name} request must not carry a payload")
            if payload_len > _PAYLOAD_REQUEST_LIMITS[op]:
                raise ProtocolError(f"{op.name} payload of {payload_len} bytes exceeds {_PAYLOAD_REQUEST_LIMITS[op]}")
    return FrameHeader(op=op, status=status, key_len=key_len, payload_len=payload_len)


def recv_exact_into(sock: socket.socket, view: memoryview) -> int:
    """Fill `view` from `sock`; returns the byte count read before EOF (== len(view) if complete)."""
    got = 0
    total = len(view)
    while got < total:
        n = sock.recv_into(view[got:], total - got)
        if n == 0:
            return got
        got += n
    return got


def alloc_buffer(size: int) -> memoryview:
    """A writable byte buffer of `size` bytes.

    Large buffers come from `numpy.empty`: a `bytearray` is zero-filled first, which costs as
    much as the socket copy that overwrites it.
    """
    if size < _UNINITIALISED_FROM:
        return memoryview(bytearray(size))
    return memoryview(numpy.empty(size, dtype=numpy.uint8))


def recv_exact(sock: socket.socket, size: int, what: str) -> memoryview:
    """Read exactly `size` bytes or raise `TruncatedFrameError` naming the part that was cut."""
    buf = alloc_buffer(size)
    if size:
        got = recv_exact_into(sock, buf)
        if got != size:
            raise TruncatedFrameError(f"connection closed after {got} of {size} bytes of {what}")
    return buf


def send_frame(
    sock: socket.socket,
    op: Op,
    status: Status = Status.OK,
    key: bytes = b"",
    payload: Optional[Buffer] = None,
) -> None:
    """Send one frame; large payloads go out without being copied into the header buffer."""
    payload_len = 0 if payload is None else memoryview(payload).nbytes
    header = pack_header(op, status, len(key), payload_len)
    if payload_len and payload_len > 64 * 1024:
        sock.sendall(header + key)
        sock.sendall(payload)  # type: ignore[arg-type]
    elif payload_len:
        sock.sendall(header + key + bytes(payload))  # type: ignore[arg-type]
    else:
        sock.sendall(header + key)
