"""chunk_format: round trips, and every kind of bad input is a logged miss, never an exception."""

import random
import struct

import pytest
import torch

from lmcache.experimental.memory_management import HostMemoryAllocator, MemoryFormat
from lmcache.experimental.storage_backend import chunk_format as cf

KEY = "vllm@org/model@rev@2@1@00ff"


@pytest.fixture
def allocator() -> HostMemoryAllocator:
    return HostMemoryAllocator(1 << 20)


def make_obj(allocator, dtype=torch.bfloat16, shape=(2, 3, 5, 8)):
    obj = allocator.allocate(shape, dtype, MemoryFormat.KV_BLOB)
    obj.tensor.view(torch.uint8).copy_(torch.randint(0, 256, obj.tensor.view(torch.uint8).shape, dtype=torch.uint8))
    return obj


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.int8, torch.uint8], ids=str
)
def test_round_trip_is_bit_exact(allocator, dtype):
    obj = make_obj(allocator, dtype)
    blob = cf.encode_memory_obj(KEY, obj)
    header = cf.decode_header(blob)
    assert header is not None
    assert (header.key, header.shape, header.dtype, header.fmt) == (KEY, (2, 3, 5, 8), dtype, MemoryFormat.KV_BLOB)
    assert header.payload_len == obj.get_size() and len(blob) == header.size + header.payload_len
    # The payload starts on a cache line (the node pool's kernel writes it in place, aligned).
    assert header.size % cf.HEADER_ALIGN == 0 and header.size == cf.header_size(KEY, (2, 3, 5, 8), dtype)
    back = cf.decode_into(blob, allocator.allocate, key=KEY, shape=(2, 3, 5, 8), dtype=dtype, fmt=MemoryFormat.KV_BLOB)
    assert back is not None
    assert torch.equal(back.tensor.view(torch.uint8), obj.tensor.view(torch.uint8))


def test_every_truncation_is_a_miss(allocator):
    blob = cf.encode_memory_obj(KEY, make_obj(allocator, shape=(1, 1, 2, 4)))
    for n in range(len(blob)):
        assert cf.decode_into(blob[:n], allocator.allocate) is None
    assert cf.decode_into(blob + b"x", allocator.allocate) is None


def test_every_flipped_byte_is_a_miss(allocator):
    """Any single corrupted byte - header or payload - is rejected (checksum, bounds, fields)."""
    blob = cf.encode_memory_obj(KEY, make_obj(allocator, shape=(1, 1, 2, 4)))
    for i in range(len(blob)):
        bad = bytearray(blob)
        bad[i] ^= 0x5A
        out = cf.decode_into(bytes(bad), allocator.allocate, key=KEY)
        assert out is None, f"flip at byte {i} was accepted"
    assert allocator.pool.num_live_objects() == 1  # nothing leaked by the rejected loads


def test_mismatch_with_what_was_asked_is_a_miss(allocator):
    obj = make_obj(allocator)
    blob = cf.encode_memory_obj(KEY, obj)
    assert cf.decode_into(blob, allocator.allocate, key=KEY.replace("00ff", "00fe")) is None
    assert cf.decode_into(blob, allocator.allocate, shape=(2, 3, 4, 8)) is None
    assert cf.decode_into(blob, allocator.allocate, dtype=torch.float16) is None
    assert cf.decode_into(blob, allocator.allocate, fmt=MemoryFormat.BINARY) is None


def test_foreign_and_hostile_headers_are_misses(allocator):
    assert cf.decode_header(b"") is None
    assert cf.decode_header(b"PK\x03\x04" + b"\0" * 100) is None  # a zip file
    assert cf.decode_header(b"\x80\x04\x95" + b"\0" * 100) is None  # a pickle
    # right magic, absurd header length (must not be trusted to size a read)
    assert cf.header_length(struct.pack("<4sHI", cf.MAGIC, cf.VERSION, 2**31)) is None
    # right magic, future version
    assert cf.header_length(struct.pack("<4sHI", cf.MAGIC, cf.VERSION + 1, 64)) is None
    rng = random.Random(0)
    for _ in range(500):
        junk = cf.MAGIC + bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 120)))
        assert cf.decode_into(junk, allocator.allocate) is None


def test_memory_full_is_a_miss(allocator):
    blob = cf.encode_memory_obj(KEY, make_obj(allocator))
    assert cf.decode_into(blob, lambda shape, dtype, fmt: None) is None


def test_encode_refuses_what_it_cannot_represent():
    with pytest.raises(ValueError, match="exceed"):
        cf.encode_header("k" * cf.MAX_HEADER_BYTES, (1,), torch.uint8, MemoryFormat.KV_BLOB, b"x")
    with pytest.raises(ValueError, match="dtype"):
        cf.encode_header(KEY, (1,), torch.complex64, MemoryFormat.KV_BLOB, b"x" * 8)
    with pytest.raises(ValueError, match="dimensions"):
        cf.encode_header(KEY, (1,) * (cf.MAX_NDIM + 1), torch.uint8, MemoryFormat.KV_BLOB, b"x")
