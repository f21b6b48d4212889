"""Property-based fuzzing of the chunk-file parser (`chunk_format`): random bytes and mutations of
valid chunks are misses (None), never an exception, and a decode that succeeds returns exactly
the bytes that were encoded - in memory, through `read_header` on a file-like object, read off
a connection by the naive serde's `receive`, and through the disk tier's own reader."""

from __future__ import annotations

import io

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmcache.experimental.memory_management import HostMemoryAllocator, MemoryFormat
from lmcache.experimental.remote.serde import NaiveSerde
from lmcache.experimental.remote.value_reader import BufferReader
from lmcache.experimental.storage_backend import chunk_format as cf
from lmcache.experimental.storage_backend.local_cpu_backend import LocalCPUBackend
from lmcache.experimental.storage_backend.local_disk_backend import LocalDiskBackend, file_name_for
from lmcache.utils import CacheEngineKey

KEY = CacheEngineKey("vllm", "org/model", 1, 0, "00ff00ff")
SHAPE = (2, 1, 3, 4)
ALLOCATOR = HostMemoryAllocator(1 << 20)
FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _chunk(seed: int) -> tuple[bytes, bytes]:
    """(a valid encoded chunk, its payload)."""
    obj = ALLOCATOR.allocate(torch.Size(SHAPE), torch.float16, MemoryFormat.KV_BLOB)
    assert obj is not None and obj.tensor is not None
    obj.tensor.copy_(torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed)).half())
    payload = bytes(cf.memory_obj_payload(obj))
    blob = cf.encode_memory_obj(KEY, obj)
    obj.ref_count_down()
    return blob, payload


VALID, PAYLOAD = _chunk(0)

# Edits of a valid chunk: (position, new byte) flips, truncation, appended bytes.
mutations = st.lists(
    st.tuples(st.integers(0, len(VALID) - 1), st.integers(0, 255)), min_size=1, max_size=6
)


def _mutate(edits, cut: int, tail: bytes) -> bytes:
    blob = bytearray(VALID)
    for pos, value in edits:
        blob[pos] = value
    return bytes(blob[: len(blob) - cut]) + tail


def _decode_checks(blob: bytes) -> None:
    header = cf.decode_header(blob)
    assert header is None or header.size <= cf.MAX_HEADER_BYTES
    assert cf.read_header(io.BytesIO(blob)) == header
    # In memory, and as a remote value read off its connection into the object (`receive`).
    for obj in (cf.decode_into(blob, ALLOCATOR.allocate), NaiveSerde().receive(KEY, BufferReader(blob), ALLOCATOR.allocate)):
        if obj is not None:  # only the untouched chunk may decode, and then to its own bytes
            try:
                assert blob == VALID and bytes(cf.memory_obj_payload(obj)) == PAYLOAD
            finally:
                obj.ref_count_down()
    assert ALLOCATOR.pool.num_live_objects() == 0


@FUZZ
@given(st.binary(max_size=512))
def test_random_bytes_are_misses(blob: bytes) -> None:
    _decode_checks(blob)
    _decode_checks(cf.MAGIC + blob)  # past the magic, into the fields


@FUZZ
@given(mutations, st.integers(0, 8), st.binary(max_size=8))
def test_mutated_chunks_are_misses_or_exactly_the_original(edits, cut: int, tail: bytes) -> None:
    _decode_checks(_mutate(edits, cut, tail))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutations, st.integers(0, 8))
def test_the_disk_tier_reads_mutated_files_as_misses(tmp_path_factory, edits, cut: int) -> None:
    """The same property through real files: the index scan and `get_blocking` never raise or
    return other bytes, and a rejected file is gone afterwards."""
    root = tmp_path_factory.mktemp("fuzz")
    blob = _mutate(edits, cut, b"")
    path = root / file_name_for(KEY)
    path.write_bytes(blob)
    cpu = LocalCPUBackend(ALLOCATOR)
    disk = LocalDiskBackend(str(root), 1 << 20, cpu)
    obj = disk.get_blocking(KEY)
    if obj is not None:
        assert blob == VALID and bytes(cf.memory_obj_payload(obj)) == PAYLOAD
        obj.ref_count_down()
    else:
        assert not path.exists() and len(disk) == 0
    disk.close()
    assert ALLOCATOR.pool.num_live_objects() == 0
