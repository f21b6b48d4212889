"""Checksums computed piece by piece while a payload is copied or read (`chunk_format.HASH_PIECE`)
still equal the one-shot XXH3-64, and still turn any corrupted byte into a miss: remote decode
(`decode_into`) and disk reads alike."""

import torch

from lmcache.experimental.memory_management import HostMemoryAllocator, MemoryFormat
from lmcache.experimental.storage_backend import chunk_format
from lmcache.experimental.storage_backend.local_cpu_backend import LocalCPUBackend
from lmcache.experimental.storage_backend.local_disk_backend import LocalDiskBackend
from lmcache.utils import CacheEngineKey

# 2.5 pieces: a last piece shorter than the others
SHAPE = (2, 5, 64, chunk_format.HASH_PIECE // 256)
KEY = CacheEngineKey("vllm", "m", 1, 0, "ab" * 16)


def _object(alloc: HostMemoryAllocator):
    obj = alloc.allocate(SHAPE, torch.float32, MemoryFormat.KV_BLOB)
    assert obj is not None
    obj.tensor.copy_(torch.randn(SHAPE, generator=torch.Generator().manual_seed(0)))
    return obj


def test_piecewise_checksum_is_the_one_shot_checksum() -> None:
    data = memoryview(bytearray(torch.randint(0, 256, (int(2.5 * chunk_format.HASH_PIECE),), dtype=torch.uint8).numpy()))
    hasher = chunk_format.payload_hasher()
    for start, end in chunk_format.hashed_pieces(data.nbytes):
        hasher.update(data[start:end])
    assert hasher.digest() == chunk_format.payload_checksum(data)


def test_decode_into_is_exact_and_rejects_a_flipped_byte_in_every_piece() -> None:
    alloc = HostMemoryAllocator(64 << 20)
    obj = _object(alloc)
    blob = bytearray(chunk_format.encode_memory_obj(KEY, obj))
    back = chunk_format.decode_into(blob, alloc.allocate, key=KEY)
    assert back is not None and torch.equal(back.tensor, obj.tensor)
    back.ref_count_down()
    header_len = len(blob) - obj.get_size()
    used = alloc.used_bytes
    for offset in (0, chunk_format.HASH_PIECE + 7, obj.get_size() - 1):  # first, middle, last piece
        bad = bytearray(blob)
        bad[header_len + offset] ^= 0x01
        assert chunk_format.decode_into(bad, alloc.allocate, key=KEY) is None
        assert alloc.used_bytes == used  # the rejected object went back to the allocator
    obj.ref_count_down()


def test_disk_read_is_exact_and_a_flipped_byte_is_a_miss(tmp_path) -> None:
    alloc = HostMemoryAllocator(64 << 20)
    cpu = LocalCPUBackend(alloc, keep_objects=False)
    disk = LocalDiskBackend(str(tmp_path), 1 << 30, cpu)
    obj = _object(alloc)
    disk.submit_put_task(KEY, obj)
    disk.flush()
    got = disk.get_blocking(KEY)
    assert got is not None and torch.equal(got.tensor, obj.tensor)
    got.ref_count_down()
    path = disk.key_to_path(KEY)
    raw = bytearray(open(path, "rb").read())
    raw[len(raw) - obj.get_size() + chunk_format.HASH_PIECE + 3] ^= 0x10
    open(path, "wb").write(raw)
    assert disk.get_blocking(KEY) is None
    assert not disk.contains(KEY)  # a bad file is dropped
    obj.ref_count_down()
    disk.close()
