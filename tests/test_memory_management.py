"""Memory objects and allocators: layout of the free list, views, ref counting, threads."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache.experimental.memory_management import (
    BufferAllocator,
    BytesBufferMemoryObj,
    FreeBlock,
    GPUMemoryAllocator,
    HostMemoryAllocator,
    MemoryAllocatorInterface,
    MemoryFormat,
    MemoryObjMetadata,
    MixedMemoryAllocator,
    PinMemoryAllocator,
    TensorMemoryAllocator,
    TensorMemoryObj,
)

ALIGN = TensorMemoryAllocator.ALIGN_BYTES


def _alloc(pool: TensorMemoryAllocator, nbytes: int) -> TensorMemoryObj:
    obj = pool.allocate((nbytes,), torch.uint8)
    assert obj is not None
    return obj


def test_memory_format_values() -> None:
    assert [(f.name, f.value) for f in MemoryFormat] == [
        ("UNDEFINED", 0),
        ("KV_BLOB", 1),
        ("BINARY", 2),
        ("BINARY_BUFFER", 3),
    ]
    meta = MemoryObjMetadata(torch.Size([2]), torch.float16, 0, 512, 1)
    assert meta.fmt == MemoryFormat.UNDEFINED and meta.get_size() == 4


def test_allocate_split_and_alignment() -> None:
    pool = TensorMemoryAllocator(torch.empty(8 * ALIGN, dtype=torch.uint8))
    a = _alloc(pool, 1)
    b = _alloc(pool, ALIGN + 1)
    c = pool.allocate((3, 5), torch.float32, MemoryFormat.KV_BLOB)
    assert c is not None
    assert [o.metadata.address for o in (a, b, c)] == [0, ALIGN, 3 * ALIGN]
    assert [o.metadata.phy_size for o in (a, b, c)] == [ALIGN, 2 * ALIGN, ALIGN]
    assert [o.get_size() for o in (a, b, c)] == [1, ALIGN + 1, 60]
    assert all(o.tensor.data_ptr() % ALIGN == pool.buffer.data_ptr() % ALIGN for o in (a, b, c))
    assert pool.free_blocks() == [FreeBlock(4 * ALIGN, 4 * ALIGN)]
    assert (pool.total_bytes, pool.used_bytes) == (8 * ALIGN, 4 * ALIGN)
    assert c.get_memory_format() == MemoryFormat.KV_BLOB
    assert (c.get_shape(), c.get_dtype()) == (torch.Size([3, 5]), torch.float32)


def test_unaligned_tail_of_buffer_is_not_used() -> None:
    pool = TensorMemoryAllocator(torch.empty(3 * ALIGN + 100, dtype=torch.uint8))
    assert pool.total_bytes == 3 * ALIGN
    with pytest.raises(ValueError, match="ALIGN_BYTES"):
        TensorMemoryAllocator(torch.empty(ALIGN - 1, dtype=torch.uint8))


def test_free_coalesces_both_neighbours() -> None:
    pool = TensorMemoryAllocator(torch.empty(6 * ALIGN, dtype=torch.uint8))
    objs = [_alloc(pool, ALIGN) for _ in range(5)]
    objs[1].ref_count_down()
    objs[3].ref_count_down()
    assert pool.free_blocks() == [
        FreeBlock(ALIGN, ALIGN),
        FreeBlock(3 * ALIGN, ALIGN),
        FreeBlock(5 * ALIGN, ALIGN),
    ]
    objs[2].ref_count_down()  # merges with the blocks on both sides
    assert pool.free_blocks() == [FreeBlock(ALIGN, 3 * ALIGN), FreeBlock(5 * ALIGN, ALIGN)]
    objs[4].ref_count_down()  # merges left and right
    assert pool.free_blocks() == [FreeBlock(ALIGN, 5 * ALIGN)]
    objs[0].ref_count_down()
    assert pool.free_blocks() == [FreeBlock(0, 6 * ALIGN)]
    assert pool.used_bytes == 0 and pool.num_live_objects() == 0


def test_first_fit_reuses_hole() -> None:
    pool = TensorMemoryAllocator(torch.empty(4 * ALIGN, dtype=torch.uint8))
    a, _b = _alloc(pool, 2 * ALIGN), _alloc(pool, ALIGN)
    a.ref_count_down()
    c = _alloc(pool, ALIGN)
    assert c.metadata.address == 0
    assert pool.free_blocks() == [FreeBlock(ALIGN, ALIGN), FreeBlock(3 * ALIGN, ALIGN)]


def test_full_returns_none_and_recovers() -> None:
    pool = TensorMemoryAllocator(torch.empty(2 * ALIGN, dtype=torch.uint8))
    a = _alloc(pool, 2 * ALIGN)
    assert pool.allocate((1,), torch.uint8) is None
    assert pool.allocate((4 * ALIGN,), torch.uint8) is None
    a.ref_count_down()
    assert pool.allocate((2 * ALIGN,), torch.uint8) is not None


@pytest.mark.parametrize("shape", [(0,), (4, 0, 2), (-1, 3)])
def test_empty_or_negative_shape_rejected(shape: tuple) -> None:
    pool = HostMemoryAllocator(4 * ALIGN)
    with pytest.raises(ValueError, match="positive"):
        pool.allocate(shape, torch.float16)
    with pytest.raises(ValueError, match="positive"):
        BufferAllocator().allocate(shape, None)


def test_views_see_the_right_bytes() -> None:
    pool = HostMemoryAllocator(8 * ALIGN)
    a = pool.allocate((2, 3, 4, 8), torch.bfloat16)
    b = pool.allocate((2, 3, 4, 8), torch.bfloat16)
    assert a is not None and b is not None
    src_a = torch.randn(2, 3, 4, 8).to(torch.bfloat16)
    src_b = torch.randn(2, 3, 4, 8).to(torch.bfloat16)
    a.tensor.copy_(src_a)
    b.tensor.copy_(src_b)
    assert torch.equal(a.tensor, src_a) and torch.equal(b.tensor, src_b)
    assert a.tensor.shape == (2, 3, 4, 8) and a.tensor.dtype == torch.bfloat16
    # byte_array is the same memory as tensor, both ways
    assert bytes(a.byte_array) == src_a.view(torch.uint8).numpy().tobytes()
    assert len(a.byte_array) == a.get_size() == 2 * 3 * 4 * 8 * 2
    b.byte_array[:] = bytes(src_a.view(torch.uint8).reshape(-1).tolist())
    assert torch.equal(b.tensor, src_a)
    # the views sit where the metadata says in the pool's buffer
    off = b.metadata.address
    assert torch.equal(pool.pool.buffer[off : off + b.get_size()], src_a.view(torch.uint8).reshape(-1))


def test_refcount_frees_at_zero_and_guards_misuse() -> None:
    pool = HostMemoryAllocator(2 * ALIGN)
    obj = pool.allocate((10,), torch.int32)
    assert obj is not None
    assert obj.get_ref_count() == pool.get_ref_count(obj) == 1
    obj.ref_count_up()
    obj.ref_count_down()
    assert obj.is_valid() and pool.used_bytes == ALIGN
    obj.ref_count_down()
    assert not obj.is_valid() and pool.used_bytes == 0 and obj.get_ref_count() == 0
    with pytest.raises(RuntimeError, match="below zero"):
        obj.ref_count_down()
    with pytest.raises(RuntimeError, match="released"):
        obj.ref_count_up()
    with pytest.raises(RuntimeError, match="freed"):
        _ = obj.tensor
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free(obj)
    assert pool.pool.free_blocks() == [FreeBlock(0, 2 * ALIGN)]


def test_double_free_after_reuse_does_not_free_new_owner() -> None:
    pool = TensorMemoryAllocator(torch.empty(ALIGN, dtype=torch.uint8))
    old = _alloc(pool, ALIGN)
    pool.free(old)
    new = _alloc(pool, ALIGN)
    assert new.metadata.address == old.metadata.address
    with pytest.raises(RuntimeError, match="freed twice or foreign"):
        pool.free(old)
    assert new.is_valid() and pool.used_bytes == ALIGN
    other = TensorMemoryAllocator(torch.empty(ALIGN, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="foreign"):
        other.free(new)


def test_tensor_allocator_argument_errors() -> None:
    pool = TensorMemoryAllocator(torch.empty(2 * ALIGN, dtype=torch.uint8))
    with pytest.raises(ValueError, match="dtype"):
        pool.allocate((4,), None)
    with pytest.raises(ValueError, match="BufferAllocator"):
        pool.allocate((4,), torch.uint8, MemoryFormat.BINARY_BUFFER)
    with pytest.raises(ValueError, match="contiguous"):
        TensorMemoryAllocator(torch.empty(4, 2 * ALIGN, dtype=torch.uint8).t())
    for cls in (HostMemoryAllocator, PinMemoryAllocator, MixedMemoryAllocator):
        with pytest.raises(ValueError, match="size"):
            cls(0)


def test_allocators_work_without_cuda() -> None:
    pin = PinMemoryAllocator(4 * ALIGN)
    assert pin.pinned == torch.cuda.is_available()
    obj = pin.allocate((2, 2, 16, 8), torch.float16)
    assert obj is not None and obj.tensor.device.type == "cpu"
    dev = GPUMemoryAllocator(4 * ALIGN, device="cpu")  # same code path, any device
    assert dev.allocate((4,), torch.float32) is not None
    for a in (pin, dev, HostMemoryAllocator(ALIGN), MixedMemoryAllocator(ALIGN), BufferAllocator()):
        assert isinstance(a, MemoryAllocatorInterface)


def test_byte_buffers() -> None:
    obj = BytesBufferMemoryObj(b"hello")
    assert obj.tensor is None and bytes(obj.byte_array) == b"hello" and obj.get_size() == 5
    assert obj.get_memory_format() == MemoryFormat.BINARY_BUFFER
    obj.ref_count_down()
    assert not obj.is_valid()
    buffers = BufferAllocator()
    b = buffers.allocate((3, 4), torch.float16)
    assert b.get_size() == 24 and buffers.used_bytes == 24 and buffers.total_bytes is None
    b.byte_array[:3] = b"abc"
    assert bytes(b.byte_array[:3]) == b"abc"
    b.ref_count_down()
    assert buffers.used_bytes == 0
    with pytest.raises(RuntimeError, match="freed twice"):
        buffers.free(b)
    with pytest.raises(ValueError, match="BINARY_BUFFER"):
        buffers.allocate((3,), None, MemoryFormat.KV_BLOB)
    with pytest.raises(ValueError, match="host memory"):
        BufferAllocator(device="meta")


def test_mixed_allocator_routes_by_format() -> None:
    mixed = MixedMemoryAllocator(4 * ALIGN)
    kv = mixed.allocate((2, 1, 4, 8), torch.float32)
    binary = mixed.allocate((100,), torch.uint8, MemoryFormat.BINARY)
    buf = mixed.allocate((700,), None, MemoryFormat.BINARY_BUFFER)
    assert isinstance(kv, TensorMemoryObj) and isinstance(binary, TensorMemoryObj)
    assert isinstance(buf, BytesBufferMemoryObj)
    assert (mixed.used_bytes, mixed.buffer_bytes, mixed.total_bytes) == (2 * ALIGN, 700, 4 * ALIGN)
    for o in (kv, binary, buf):
        mixed.free(o)
    assert (mixed.used_bytes, mixed.buffer_bytes) == (0, 0)
    with pytest.raises(ValueError, match="UNDEFINED"):
        mixed.allocate((4,), torch.uint8, MemoryFormat.UNDEFINED)


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("alloc"), st.integers(min_value=1, max_value=5 * ALIGN)),
            st.tuples(st.just("free"), st.integers(min_value=0, max_value=1000)),
        ),
        max_size=80,
    )
)
def test_property_random_allocate_free_never_overlaps(ops: list[tuple[str, int]]) -> None:
    total = 32 * ALIGN
    pool = TensorMemoryAllocator(torch.empty(total, dtype=torch.uint8))
    live: list[TensorMemoryObj] = []
    for op, n in ops:
        if op == "alloc":
            obj = pool.allocate((n,), torch.uint8)
            if obj is None:
                biggest = max((b.size for b in pool.free_blocks()), default=0)
                assert biggest < -(-n // ALIGN) * ALIGN
                continue
            live.append(obj)
        elif live:
            live.pop(n % len(live)).ref_count_down()
        spans = sorted((o.metadata.address, o.metadata.phy_size) for o in live)
        spans += [(b.start, b.size) for b in pool.free_blocks()]
        spans.sort()
        # live blocks and free blocks tile the buffer exactly: no overlap, no leak
        pos = 0
        for start, size in spans:
            assert start == pos and start % ALIGN == 0 and size % ALIGN == 0
            pos += size
        assert pos == total
        assert pool.used_bytes == sum(o.metadata.phy_size for o in live)
        free = pool.free_blocks()
        assert all(a.start + a.size < b.start for a, b in zip(free, free[1:])), "not coalesced"
    for obj in live:
        obj.ref_count_down()
    assert pool.free_blocks() == [FreeBlock(0, total)]


def test_concurrent_allocate_free_keeps_data_private() -> None:
    pool = TensorMemoryAllocator(torch.empty(64 * ALIGN, dtype=torch.uint8))
    errors: list[str] = []

    def worker(tag: int) -> None:
        for i in range(300):
            obj = pool.allocate((ALIGN * (1 + (i + tag) % 3),), torch.uint8)
            if obj is None:
                continue
            obj.tensor.fill_(tag)
            shared = obj.metadata.ref_count
            obj.ref_count_up()
            if not bool((obj.tensor == tag).all()) or shared != 1:
                errors.append(f"thread {tag} saw foreign bytes at {obj.metadata.address}")
            obj.ref_count_down()
            obj.ref_count_down()

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(1, 7)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert pool.used_bytes == 0 and pool.free_blocks() == [FreeBlock(0, 64 * ALIGN)]
