"""The self-describing byte format of one stored chunk: a bounded binary header, then the payload.

Used on disk (one file per chunk) and on the wire (remote tiers), so that a reader can reject a
chunk that is truncated, corrupted, written by something else, or not the chunk it asked for
- a cache may lose entries but must never hand back wrong ones. Nothing here is pickle.

Header layout (little-endian)::

    +------+---------+------------+-----+------+-----------+-----------+-------------+----------+
    |magic | version | header_len | fmt | ndim | dtype_len | key_len   | payload_len | checksum |
    | 4s   | u16     | u32        | u8  | u8   | u8        | u16       | u64         | 8s       |
    +------+---------+------------+-----+------+-----------+-----------+-------------+----------+
    | dims: ndim x i64 | dtype name (ascii) | key string (utf-8) | zeros  | header_checksum 8s|
    +------------------+--------------------+--------------------+--------+-------------------+
    then payload_len bytes

`checksum` (version 5) is the payload checksum of `csrc/checksum.h`: two sums over the payload's
64-bit words (one keyed by each word's place) folded into 64 bits. Sums of pieces add up, so the
copy kernel sums a chunk while it writes it, each piece still in cache, and a store needs no
second pass over the payload (XXH3-64, versions 2-4, could only be fed in order; BLAKE2b, version
1, held the disk tier to ~0.3 GB/s). Its job is catching corruption, not forgery.
`header_checksum` (version 3) is XXH3-64 over every header byte before it, so a flipped header
bit (a memory format, a shape, a length) is caught before anything is allocated from it; chunks
of older versions are misses. The zeros (version 4) round the header up to a multiple of
`HEADER_ALIGN` bytes, so a chunk that starts on a cache line has its payload on one too: the
node pool's copy kernel writes and reads payloads in place (`pool_in_place.py`), and its
streaming stores need an aligned target. Decoding never raises for bad input: it logs why and
returns None, which every caller treats as a miss.
"""

import math
import struct
from abc import ABCMeta, abstractmethod
from dataclasses import dataclass
from types import MappingProxyType
from typing import BinaryIO, Callable, Iterator, Mapping, Optional, Protocol, Sequence, Tuple, Union

import torch
import xxhash

from lmcache import c_ops
from lmcache.experimental.memory_management import MemoryFormat, MemoryObj
from lmcache.logging import init_logger
from lmcache.utils import CacheEngineKey

logger = init_logger(__name__)

MAGIC = b"LMCK"
VERSION = 5  # 5: summed payload checksum; 4: aligned header; 3: header checksum; 2: XXH3-64 payload (1: BLAKE2b-64)
MAX_HEADER_BYTES = 4096
MAX_NDIM = 8
CHECKSUM_BYTES = 8
HEADER_ALIGN = 64

_PREFIX = struct.Struct("<4sHI")  # magic, version, header_len
_FIXED = struct.Struct("<BBBHQ8s")  # fmt, ndim, dtype_len, key_len, payload_len, checksum
_MIN_HEADER = _PREFIX.size + _FIXED.size + CHECKSUM_BYTES  # the trailing header checksum

# Only these dtypes can appear in a header; a name is looked up here, never evaluated.
_DTYPES: Mapping[str, torch.dtype] = MappingProxyType(
    {
        str(dt).removeprefix("torch."): dt
        for dt in (
            torch.float16,
            torch.bfloat16,
            torch.float32,
            torch.float64,
            torch.int8,
            torch.uint8,
            torch.int16,
            torch.int32,
            torch.int64,
            torch.bool,
            torch.float8_e4m3fn,
            torch.float8_e5m2,
        )
    }
)

Buffer = Union[bytes, bytearray, memoryview]


class ChunkReader(Protocol):
    """A chunk arriving in order (`remote.value_reader.ValueReader`): bytes left, exact reads,
    and how many bytes one read should ask for (the payload is hashed after each such read)."""

    @property
    def remaining(self) -> int: ...

    @property
    def fill_piece(self) -> int: ...

    def readinto(self, view: memoryview) -> None: ...


class FillAbandoned(Exception, metaclass=ABCMeta):
    """A read into an object gave up while something may still write into it (a transfer that
    outlived its timeout): the object must not be freed, so reused, before the writer stopped."""

    @abstractmethod
    def after(self, release: Callable[[], None]) -> None:
        """Call `release` once nothing writes into the target any more."""


@dataclass(frozen=True)
class ChunkHeader:
    """What a chunk says about itself; `size` is the header's own length in bytes."""

    key: str
    shape: Tuple[int, ...]
    dtype: Optional[torch.dtype]
    fmt: MemoryFormat
    payload_len: int
    checksum: bytes
    size: int


def dtype_name(dtype: Optional[torch.dtype]) -> str:
    """The header name of `dtype` ("" for untyped byte objects)."""
    if dtype is None:
        return ""
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"dtype {dtype} cannot be stored in a chunk header")
    return name


_U64 = struct.Struct("<Q")
_MASK64 = (1 << 64) - 1


def checksum_bytes(digest: int) -> bytes:
    """The header's 8 bytes of a payload checksum (`c_ops.checksum_finish`'s u64)."""
    return _U64.pack(digest)


def payload_checksum(payload: Buffer) -> bytes:
    """The payload checksum of `payload`'s bytes (csrc/checksum.h)."""
    view = memoryview(payload).cast("B")
    return checksum_bytes(c_ops.checksum_finish(*c_ops.checksum_sums(view, 0), view.nbytes))


# Bytes copied (or read) and then hashed at a time: a piece just written is still in L2 when the
# checksum reads it, so checking costs no second trip to memory (docs/design.md, "Storage
# tiers").
HASH_PIECE = 1 << 20


def hashed_pieces(total: int, piece: int = HASH_PIECE) -> Iterator[Tuple[int, int]]:
    """`(start, end)` of the pieces a payload of `total` bytes is moved and hashed in."""
    for start in range(0, total, piece):
        yield start, min(total, start + piece)


class PayloadHasher:
    """A running payload checksum: fed a payload's pieces in order (of any sizes), its digest is
    `payload_checksum`'s."""

    def __init__(self) -> None:
        self._mixed = self._plain = 0
        self._nbytes = 0
        self._carry = b""  # bytes of a word a piece ended inside

    def update(self, piece: Buffer) -> None:
        view = memoryview(piece).cast("B")
        if self._carry:
            take = min(8 - len(self._carry), view.nbytes)
            self._carry += bytes(view[:take])
            view = view[take:]
            if len(self._carry) < 8:
                return
            self._add(self._carry, self._nbytes)
            self._nbytes += 8
            self._carry = b""
        whole = view.nbytes - view.nbytes % 8
        if whole:
            self._add(view[:whole], self._nbytes)
            self._nbytes += whole
        self._carry = bytes(view[whole:])

    def digest(self) -> bytes:
        mixed, plain = self._mixed, self._plain
        if self._carry:  # the payload's last, partial word
            tail_mixed, tail_plain = c_ops.checksum_sums(self._carry, self._nbytes)
            mixed, plain = (mixed + tail_mixed) & _MASK64, (plain + tail_plain) & _MASK64
        return checksum_bytes(c_ops.checksum_finish(mixed, plain, self._nbytes + len(self._carry)))

    def _add(self, words: Buffer, first_byte: int) -> None:
        mixed, plain = c_ops.checksum_sums(words, first_byte)
        self._mixed = (self._mixed + mixed) & _MASK64
        self._plain = (self._plain + plain) & _MASK64


def payload_hasher() -> PayloadHasher:
    """A running payload checksum: fed a payload's pieces in order, its digest is
    `payload_checksum`'s."""
    return PayloadHasher()


def _key_str(key: Union[CacheEngineKey, str]) -> str:
    return key if isinstance(key, str) else key.to_string()


def encode_header(
    key: Union[CacheEngineKey, str],
    shape: Sequence[int],
    dtype: Optional[torch.dtype],
    fmt: MemoryFormat,
    payload: Buffer,
    checksum: Optional[bytes] = None,
) -> bytes:
    """Build the header for `payload` (its checksum is computed here unless given; the header's
    length does not depend on it).

    Raises ValueError when the key, shape or dtype cannot be represented - a programming error,
    not bad input from a file.
    """
    key_bytes = _key_str(key).encode("utf-8")
    dtype_bytes = dtype_name(dtype).encode("ascii")
    dims = tuple(int(d) for d in shape)
    payload_len = memoryview(payload).nbytes
    header_len = header_size(key, dims, dtype)
    body = b"".join(
        (
            _PREFIX.pack(MAGIC, VERSION, header_len),
            _FIXED.pack(
                int(fmt.value),
                len(dims),
                len(dtype_bytes),
                len(key_bytes),
                payload_len,
                payload_checksum(payload) if checksum is None else checksum,
            ),
            struct.pack(f"<{len(dims)}q", *dims),
            dtype_bytes,
            key_bytes,
        )
    )
    body += bytes(header_len - CHECKSUM_BYTES - len(body))
    return body + xxhash.xxh3_64_digest(body)


def header_size(key: Union[CacheEngineKey, str], shape: Sequence[int], dtype: Optional[torch.dtype]) -> int:
    """The length of the header `encode_header` writes for this key, shape and dtype (whatever
    the payload): where a chunk's payload starts when it is written in place.

    Raises ValueError when the key, shape or dtype cannot be represented."""
    if len(shape) > MAX_NDIM:
        raise ValueError(f"shape {tuple(shape)} has more than {MAX_NDIM} dimensions")
    size = _aligned(_MIN_HEADER + 8 * len(shape) + len(dtype_name(dtype).encode("ascii")) + len(_key_str(key).encode("utf-8")))
    if size > MAX_HEADER_BYTES:
        raise ValueError(f"chunk header for key {_key_str(key)!r} would exceed {MAX_HEADER_BYTES} bytes")
    return size


def _aligned(fields_len: int) -> int:
    """The header length for fields of `fields_len` bytes: rounded up to `HEADER_ALIGN`."""
    return -(-fields_len // HEADER_ALIGN) * HEADER_ALIGN


def header_length(prefix: Buffer) -> Optional[int]:
    """Total header length announced by the first `_PREFIX.size` bytes, or None if foreign."""
    prefix = memoryview(prefix)
    if prefix.nbytes < _PREFIX.size:
        logger.warning("chunk header truncated: %d bytes", prefix.nbytes)
        return None
    magic, version, header_len = _PREFIX.unpack_from(prefix, 0)
    if magic != MAGIC:
        logger.warning("not a chunk: magic %r", bytes(magic))
        return None
    if version != VERSION:
        logger.warning("chunk format version %d is not %d", version, VERSION)
        return None
    if not _MIN_HEADER <= header_len <= MAX_HEADER_BYTES:
        logger.warning("chunk header length %d out of bounds", header_len)
        return None
    return header_len


def decode_header(buf: Buffer) -> Optional[ChunkHeader]:
    """Parse the header at the start of `buf` (which may continue with the payload)."""
    view = memoryview(buf).cast("B")
    header_len = header_length(view[: _PREFIX.size])
    if header_len is None:
        return None
    if view.nbytes < header_len:
        logger.warning("chunk header truncated: %d of %d bytes", view.nbytes, header_len)
        return None
    body_len = header_len - CHECKSUM_BYTES
    if xxhash.xxh3_64_digest(view[:body_len]) != view[body_len:header_len]:
        logger.warning("chunk header checksum mismatch")
        return None
    fmt_value, ndim, dtype_len, key_len, payload_len, checksum = _FIXED.unpack_from(view, _PREFIX.size)
    if ndim > MAX_NDIM or _aligned(_MIN_HEADER + 8 * ndim + dtype_len + key_len) != header_len:
        logger.warning("chunk header fields do not add up to its length %d", header_len)
        return None
    try:
        fmt = MemoryFormat(fmt_value)
    except ValueError:
        logger.warning("chunk header names unknown memory format %d", fmt_value)
        return None
    pos = _PREFIX.size + _FIXED.size
    shape = struct.unpack_from(f"<{ndim}q", view, pos)
    pos += 8 * ndim
    try:
        name = bytes(view[pos : pos + dtype_len]).decode("ascii")
        key = bytes(view[pos + dtype_len : pos + dtype_len + key_len]).decode("utf-8")
    except UnicodeDecodeError:
        logger.warning("chunk header has undecodable dtype or key text")
        return None
    if name and name not in _DTYPES:
        logger.warning("chunk header names unknown dtype %r", name)
        return None
    dtype = _DTYPES[name] if name else None
    if any(d < 0 for d in shape):
        logger.warning("chunk header has a negative dimension: %s", shape)
        return None
    if dtype is not None and math.prod(shape) * dtype.itemsize != payload_len:
        logger.warning("chunk header: shape %s of %s does not match payload %d bytes", shape, dtype, payload_len)
        return None
    return ChunkHeader(key, tuple(shape), dtype, fmt, payload_len, bytes(checksum), header_len)


def read_header(f: BinaryIO) -> Optional[ChunkHeader]:
    """Read exactly one header from the current position of `f` (never more than the bound)."""
    raw = read_header_bytes(f)
    return None if raw is None else decode_header(raw)


def read_header_bytes(f: BinaryIO) -> Optional[Buffer]:
    """The raw bytes of the header at the current position of `f` (not checked beyond its
    announced length), or None when they do not start a chunk."""
    prefix = f.read(_PREFIX.size)
    header_len = header_length(prefix)
    if header_len is None:
        return None
    return prefix + f.read(header_len - _PREFIX.size)


def header_matches(
    header: ChunkHeader,
    key: Optional[Union[CacheEngineKey, str]] = None,
    shape: Optional[Sequence[int]] = None,
    dtype: Optional[torch.dtype] = None,
    fmt: Optional[MemoryFormat] = None,
) -> bool:
    """True when the header describes what the caller asked for (None = don't care)."""
    wanted = {
        "key": None if key is None else _key_str(key),
        "shape": None if shape is None else tuple(int(d) for d in shape),
        "dtype": dtype,
        "fmt": fmt,
    }
    for field, want in wanted.items():
        if want is not None and getattr(header, field) != want:
            logger.warning(
                "chunk %s: header %s is %s, expected %s", header.key, field, getattr(header, field), want
            )
            return False
    return True


def verify_payload(header: ChunkHeader, payload: Buffer) -> bool:
    """True when `payload` has the header's length and checksum."""
    view = memoryview(payload)
    if view.nbytes != header.payload_len:
        logger.warning("chunk %s: payload is %d bytes, header says %d", header.key, view.nbytes, header.payload_len)
        return False
    if payload_checksum(view) != header.checksum:
        logger.warning("chunk %s: payload checksum mismatch", header.key)
        return False
    return True


def memory_obj_payload(obj: MemoryObj) -> memoryview:
    """The object's payload bytes (exactly `get_size()` of them)."""
    return memoryview(obj.byte_array).cast("B")[: obj.get_size()]


def encode_memory_obj(key: Union[CacheEngineKey, str], obj: MemoryObj) -> bytes:
    """Header + payload of `obj` as one bytes object (for the wire)."""
    header, payload = encode_memory_obj_parts(key, obj)
    return header + payload


def encode_memory_obj_parts(key: Union[CacheEngineKey, str], obj: MemoryObj) -> Tuple[bytes, memoryview]:
    """`encode_memory_obj` as its header and a view of the object's payload, not copied."""
    payload = memory_obj_payload(obj)
    meta = obj.metadata
    return encode_header(key, meta.shape, meta.dtype, meta.fmt, payload, obj.payload_checksum), payload


def decode_into(
    buf: Buffer,
    allocate: Callable[[torch.Size, Optional[torch.dtype], MemoryFormat], Optional[MemoryObj]],
    key: Optional[Union[CacheEngineKey, str]] = None,
    shape: Optional[Sequence[int]] = None,
    dtype: Optional[torch.dtype] = None,
    fmt: Optional[MemoryFormat] = None,
) -> Optional[MemoryObj]:
    """Check a whole encoded chunk and copy its payload into a freshly allocated object.

    Returns None (after logging) when the chunk is bad, is not what was asked for, or memory is
    full. The caller owns the one reference of the returned object.
    """
    view = memoryview(buf).cast("B")
    header = decode_header(view)
    if header is None or not header_matches(header, key, shape, dtype, fmt):
        return None
    if view.nbytes != header.size + header.payload_len:
        logger.warning(
            "chunk %s: %d bytes, header announces %d", header.key, view.nbytes, header.size + header.payload_len
        )
        return None
    return copy_into_new(
        header.key, view[header.size :], allocate, torch.Size(header.shape), header.dtype, header.fmt, header.checksum
    )


def receive_into(
    reader: ChunkReader,
    header: ChunkHeader,
    allocate: Callable[[torch.Size, Optional[torch.dtype], MemoryFormat], Optional[MemoryObj]],
    key: Optional[Union[CacheEngineKey, str]] = None,
    dtype: Optional[torch.dtype] = None,
) -> Optional[MemoryObj]:
    """The payload after `header` (already read from `reader`), read straight into a freshly
    allocated object: no buffer in between, each piece hashed right after it arrived.

    None (logged) when the chunk is not what was asked for, its length or checksum is wrong, or
    memory is full; what is left unread is the caller's to skip. An error of the reader itself
    frees the object and propagates."""
    if not header_matches(header, key, None, dtype, None):
        return None
    if reader.remaining != header.payload_len:
        logger.warning(
            "chunk %s: %d payload bytes, header announces %d", header.key, reader.remaining, header.payload_len
        )
        return None
    return _new_object(
        header.key, header.payload_len, allocate, torch.Size(header.shape), header.dtype, header.fmt,
        header.checksum, lambda start, piece: reader.readinto(piece), reader.fill_piece,
    )


def copy_into_new(
    key: str,
    payload: memoryview,
    allocate: Callable[[torch.Size, Optional[torch.dtype], MemoryFormat], Optional[MemoryObj]],
    shape: torch.Size,
    dtype: Optional[torch.dtype],
    fmt: MemoryFormat,
    checksum: Optional[bytes] = None,
) -> Optional[MemoryObj]:
    """A freshly allocated object holding `payload` (None, logged, when memory is full or the
    allocation's size disagrees with the payload's). The caller owns its one reference.

    With `checksum`, this is also `verify_payload` in the same pass: each piece is hashed right
    after it is copied, while it is in cache; a mismatch frees the object (None, logged)."""

    def copy(start: int, piece: memoryview) -> None:
        piece[:] = payload[start : start + piece.nbytes]

    return _new_object(key, payload.nbytes, allocate, shape, dtype, fmt, checksum, copy)


def _new_object(
    key: str,
    nbytes: int,
    allocate: Callable[[torch.Size, Optional[torch.dtype], MemoryFormat], Optional[MemoryObj]],
    shape: torch.Size,
    dtype: Optional[torch.dtype],
    fmt: MemoryFormat,
    checksum: Optional[bytes],
    fill: Callable[[int, memoryview], None],
    piece_bytes: int = HASH_PIECE,
) -> Optional[MemoryObj]:
    """Allocate, `fill(start, piece)` the payload piece by piece (hashing each right after it,
    with `checksum`), and hand the object over only if the checksum matches."""
    obj = allocate(shape, dtype, fmt)
    if obj is None:
        logger.warning("chunk %s: no memory to load %d bytes", key, nbytes)
        return None
    target = memory_obj_payload(obj)
    if target.nbytes != nbytes:
        logger.warning("chunk %s: allocated %d bytes for a %d-byte payload", key, target.nbytes, nbytes)
        obj.ref_count_down()
        return None
    try:
        if checksum is None:
            fill(0, target)
            return obj
        hasher = payload_hasher()
        for start, end in hashed_pieces(nbytes, piece_bytes):
            fill(start, target[start:end])
            hasher.update(target[start:end])
    except FillAbandoned as err:
        err.after(obj.ref_count_down)
        raise
    except BaseException:
        obj.ref_count_down()
        raise
    if hasher.digest() != checksum:
        logger.warning("chunk %s: payload checksum mismatch", key)
        obj.ref_count_down()
        return None
    return obj
