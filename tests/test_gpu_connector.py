"""GPU connectors on CPU tensors, checked against the plain-torch oracle in kv_reference.py."""

import pytest
import torch

from kv_reference import Geometry, gather, make_kvcaches, random_tensor, scatter
from lmcache.experimental.gpu_connector import (
    VLLMNestedTupleGPUConnector,
    VLLMPagedMemGPUConnector,
    VLLMPagedMemGPUConnectorV2,
)
from lmcache.experimental.kv_layout import KVLayout
from lmcache.experimental.memory_management import HostMemoryAllocator, MemoryFormat
from lmcache.experimental.storage_backend import chunk_format

LAYOUTS = [KVLayout.FLASH, KVLayout.CPU_IPEX, KVLayout.CPU_PACKED, KVLayout.MLA]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn]


def geometry(layout: KVLayout, dtype: torch.dtype) -> Geometry:
    heads = 1 if layout == KVLayout.MLA else 2
    return Geometry(layout, num_layers=3, num_blocks=6, block_size=4, num_heads=heads, head_size=16, dtype=dtype)


def connector_for(geo: Geometry, **extra) -> VLLMPagedMemGPUConnectorV2:
    hidden = geo.head_size if geo.layout == KVLayout.MLA else geo.hidden
    return VLLMPagedMemGPUConnectorV2(
        hidden, geo.num_layers, layout=geo.layout, num_kv_heads=geo.num_heads, use_mla=geo.layout == KVLayout.MLA, **extra
    )


@pytest.fixture
def allocator() -> HostMemoryAllocator:
    return HostMemoryAllocator(1 << 22)


def shuffled_slots(geo: Geometry, n: int, seed: int = 1) -> torch.Tensor:
    return torch.randperm(geo.num_slots, generator=torch.Generator().manual_seed(seed))[:n].to(torch.long)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


# MLA has one latent cache per layer: no (K, V) pair form.
CASES = [(l, d, s) for l in LAYOUTS for d in DTYPES for s in (True, False) if s or l != KVLayout.MLA]


@pytest.mark.parametrize(
    "layout,dtype,stacked", CASES, ids=[f"{l.name}-{d}-{'stacked' if s else 'pairs'}" for l, d, s in CASES]
)
def test_v2_store_and_retrieve_match_the_oracle(layout, dtype, stacked, allocator):
    geo = geometry(layout, dtype)
    caches = make_kvcaches(geo, seed=3, stacked=stacked)
    conn = connector_for(geo)
    slots = shuffled_slots(geo, 10)
    start, end = 4, 10  # a partial chunk in the middle of the sequence
    obj = allocator.allocate(conn.get_shape(end - start), dtype, MemoryFormat.KV_BLOB)
    conn.from_gpu(obj, start, end, kvcaches=caches, slot_mapping=slots)
    assert same_bits(obj.tensor, gather(geo, caches, slots[start:end].tolist()))

    # Retrieve into fresh caches: exactly the chunk's slots change, to the stored values.
    target = make_kvcaches(geo, seed=9, stacked=stacked)
    expected = make_kvcaches(geo, seed=9, stacked=stacked)
    scatter(geo, expected, slots[start:end].tolist(), obj.tensor)
    conn.to_gpu(obj, start, end, kvcaches=target, slot_mapping=slots)
    for got, want in zip(target, expected):
        got_t = [got] if isinstance(got, torch.Tensor) else list(got)
        want_t = [want] if isinstance(want, torch.Tensor) else list(want)
        assert all(same_bits(g, w) for g, w in zip(got_t, want_t))


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.name)
def test_a_batched_store_returns_each_chunks_payload_checksum(layout, allocator):
    """What the kernel summed while it wrote each object is that object's payload checksum, so a
    tier can write it into the chunk's header without reading the payload again."""
    geo = geometry(layout, torch.bfloat16)
    caches = make_kvcaches(geo, seed=4)
    conn = connector_for(geo)
    slots = shuffled_slots(geo, 12)
    bounds = [(0, 4), (4, 8), (8, 12)]
    objs = [allocator.allocate(conn.get_shape(e - s), geo.dtype, MemoryFormat.KV_BLOB) for s, e in bounds]
    starts, ends = [s for s, _ in bounds], [e for _, e in bounds]
    assert conn.batched_from_gpu(objs, starts, ends, kvcaches=caches, slot_mapping=slots) is None  # not asked
    sums = conn.batched_from_gpu(objs, starts, ends, checksums=True, kvcaches=caches, slot_mapping=slots)
    assert sums == [chunk_format.payload_checksum(chunk_format.memory_obj_payload(obj)) for obj in objs]
    assert conn.batched_to_gpu(objs, [s for s, _ in bounds], [e for _, e in bounds], kvcaches=caches, slot_mapping=slots) is None
    staged = VLLMPagedMemGPUConnectorV2(geo.hidden if layout != KVLayout.MLA else geo.head_size, geo.num_layers,
                                        use_gpu=True, layout=layout, use_mla=layout == KVLayout.MLA,
                                        num_kv_heads=geo.num_heads, chunk_size=4, dtype=geo.dtype, device="cpu")
    assert staged.batched_from_gpu(objs, starts, ends, checksums=True, kvcaches=caches,
                                   slot_mapping=slots) is None  # staged chunk by chunk: not summed


def test_v2_detects_layout_from_unambiguous_shapes(allocator):
    # flash stacked: everything is in the shape
    geo = geometry(KVLayout.FLASH, torch.float32)
    caches = make_kvcaches(geo, stacked=True)
    conn = VLLMPagedMemGPUConnectorV2(geo.hidden, geo.num_layers)
    assert conn.geometry(caches).layout == KVLayout.FLASH
    # IPEX pair with block_size != heads: only one reading fits
    geo = geometry(KVLayout.CPU_IPEX, torch.float32)
    caches = make_kvcaches(geo, stacked=False)
    detected = VLLMPagedMemGPUConnectorV2(geo.hidden, geo.num_layers).geometry(caches)
    assert (detected.layout, detected.block_size, detected.num_heads) == (KVLayout.CPU_IPEX, 4, 2)
    # packed pair: 5-dim key cache
    geo = geometry(KVLayout.CPU_PACKED, torch.bfloat16)
    caches = make_kvcaches(geo, stacked=False)
    assert VLLMPagedMemGPUConnectorV2(geo.hidden, geo.num_layers).geometry(caches).layout == KVLayout.CPU_PACKED


def test_v2_refuses_ambiguous_shapes():
    # CPU backend tensor (2, blocks, block_size*hidden): IPEX or packed cannot be told apart
    geo = geometry(KVLayout.CPU_IPEX, torch.float32)
    with pytest.raises(ValueError, match="layout"):
        VLLMPagedMemGPUConnectorV2(geo.hidden, geo.num_layers).geometry(make_kvcaches(geo))
    # a pair with block_size == heads fits flash and IPEX
    square = Geometry(KVLayout.FLASH, 2, 3, block_size=2, num_heads=2, head_size=16, dtype=torch.float32)
    with pytest.raises(ValueError, match="layout"):
        VLLMPagedMemGPUConnectorV2(square.hidden, 2).geometry(make_kvcaches(square, stacked=False))


def test_v2_full_slot_mapping_with_leading_minus_ones(allocator):
    """vLLM already has the first chunk: slot_mapping starts with -1s, the chunk after it loads."""
    geo = geometry(KVLayout.CPU_IPEX, torch.bfloat16)
    conn = connector_for(geo)
    source = make_kvcaches(geo, seed=1)
    slots = shuffled_slots(geo, 8)
    obj = allocator.allocate(conn.get_shape(4), geo.dtype)
    conn.from_gpu(obj, 4, 8, kvcaches=source, slot_mapping=slots)

    target = make_kvcaches(geo, seed=2)
    expected = make_kvcaches(geo, seed=2)
    full = slots.clone()
    full[:4] = -1
    scatter(geo, expected, full[4:8].tolist(), obj.tensor)
    conn.to_gpu(obj, 4, 8, kvcaches=target, slot_mapping=full)
    assert all(same_bits(t, e) for t, e in zip(target, expected))
    assert same_bits(gather(geo, target, slots[4:8].tolist()), obj.tensor)


def test_v2_refuses_to_store_uncomputed_slots(allocator):
    geo = geometry(KVLayout.FLASH, torch.float32)
    conn = connector_for(geo)
    slots = shuffled_slots(geo, 8)
    slots[5] = -1
    obj = allocator.allocate(conn.get_shape(4), geo.dtype)
    with pytest.raises(ValueError, match="-1"):
        conn.from_gpu(obj, 4, 8, kvcaches=make_kvcaches(geo), slot_mapping=slots)


def test_v2_staging_buffer_path_is_bit_exact(allocator):
    geo = geometry(KVLayout.FLASH, torch.bfloat16)
    caches = make_kvcaches(geo, seed=5)
    slots = shuffled_slots(geo, 12)
    direct = connector_for(geo)
    staged = VLLMPagedMemGPUConnectorV2(
        geo.hidden, geo.num_layers, use_gpu=True, layout=geo.layout, chunk_size=4, dtype=geo.dtype, device="cpu"
    )
    assert staged._buffer is not None and staged._buffer.numel() == staged.get_shape(4).numel()  # reserved up front
    a = allocator.allocate(direct.get_shape(6), geo.dtype)
    b = allocator.allocate(direct.get_shape(6), geo.dtype)
    direct.from_gpu(a, 6, 12, kvcaches=caches, slot_mapping=slots)
    staged.from_gpu(b, 6, 12, kvcaches=caches, slot_mapping=slots)
    assert same_bits(a.tensor, b.tensor)
    target = make_kvcaches(geo, seed=6)
    staged.to_gpu(b, 6, 12, kvcaches=target, slot_mapping=slots)
    assert same_bits(gather(geo, target, slots[6:12].tolist()), a.tensor)


def test_missing_kwargs_and_wrong_objects_raise(allocator):
    geo = geometry(KVLayout.FLASH, torch.float32)
    conn = connector_for(geo)
    caches = make_kvcaches(geo)
    slots = shuffled_slots(geo, 4)
    obj = allocator.allocate(conn.get_shape(4), geo.dtype)
    with pytest.raises(ValueError, match="kvcaches"):
        conn.from_gpu(obj, 0, 4, slot_mapping=slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        conn.to_gpu(obj, 0, 4, kvcaches=caches)
    with pytest.raises(ValueError, match="shape"):
        conn.from_gpu(obj, 0, 3, kvcaches=caches, slot_mapping=slots)
    binary = allocator.allocate((4,), torch.uint8, MemoryFormat.BINARY)
    with pytest.raises(ValueError, match="KV_BLOB"):
        conn.from_gpu(binary, 0, 4, kvcaches=caches, slot_mapping=slots)
    with pytest.raises(ValueError, match="unknown arguments"):
        VLLMPagedMemGPUConnectorV2(geo.hidden, 3, layuot=KVLayout.FLASH)


def test_v1_paged_connector_with_flash_pairs(allocator):
    geo = geometry(KVLayout.FLASH, torch.float16)
    caches = make_kvcaches(geo, seed=4, stacked=False)
    conn = VLLMPagedMemGPUConnector(geo.hidden, geo.num_layers)
    slots = shuffled_slots(geo, 8)
    obj = allocator.allocate(conn.get_shape(8), geo.dtype)
    conn.from_gpu(obj, 0, 8, kvcaches=caches, slot_mapping=slots)
    assert same_bits(obj.tensor, gather(geo, caches, slots.tolist()))
    # a chunk-length slot mapping is taken as the chunk's own
    obj2 = allocator.allocate(conn.get_shape(4), geo.dtype)
    conn.from_gpu(obj2, 4, 8, kvcaches=caches, slot_mapping=slots[4:8])
    assert same_bits(obj2.tensor, obj.tensor[:, :, 4:8])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_nested_tuple_connector_round_trip(dtype, allocator):
    gen = torch.Generator().manual_seed(0)
    layers, tokens, heads, head = 2, 10, 2, 8
    caches = tuple((random_tensor((tokens, heads, head), dtype, gen), random_tensor((tokens, heads, head), dtype, gen)) for _ in range(layers))
    conn = VLLMNestedTupleGPUConnector(heads * head, layers)
    obj = allocator.allocate(conn.get_shape(4), dtype)
    conn.from_gpu(obj, 3, 7, kvcaches=caches)
    for layer, (k, v) in enumerate(caches):
        assert same_bits(obj.tensor[0, layer], k[3:7].reshape(4, -1))
        assert same_bits(obj.tensor[1, layer], v[3:7].reshape(4, -1))
    empty = tuple((torch.zeros_like(k), torch.zeros_like(v)) for k, v in caches)
    conn.to_gpu(obj, 3, 7, kvcaches=empty)
    for (k, v), (ek, ev) in zip(caches, empty):
        assert same_bits(ek[3:7], k[3:7]) and same_bits(ev[3:7], v[3:7])
        assert not ek[:3].any() and not ek[7:].any()
    with pytest.raises(ValueError, match="beyond"):
        conn.from_gpu(allocator.allocate(conn.get_shape(4), dtype), 8, 12, kvcaches=caches)
