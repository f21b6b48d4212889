"""lmcache.c_ops transfers against a plain torch indexing oracle.

Every layout x dtype x direction, with random non-contiguous blocks, a chunk that starts
mid-block, odd token counts, a -1 prefix, and the object as a view inside a bigger buffer.
Bytes are compared (not values), so NaN bit patterns in random fp data are checked too.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import List, Tuple

import pytest
import torch
from helpers import Case, bits, make_case, make_slots, random_bytes, run_multi

from lmcache import c_ops
from lmcache.experimental.kv_layout import KVLayout, layout_shape

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.uint8, torch.float8_e4m3fn, torch.float64]
LAYOUTS = list(KVLayout)


# ---- the oracle: plain torch advanced indexing on each layout's own shape ----

def _indexable(t: torch.Tensor) -> torch.Tensor:
    """torch has no CPU indexing kernels for fp8: index its bytes instead (same shape)."""
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


def _cpu_attn_half(cache: torch.Tensor, is_value: bool) -> torch.Tensor:
    """CPU_ATTN's K half as [blocks, H, D, B] (tokens as columns) or V half as [blocks, H, B, D]."""
    nb, heads, bs, two_d = cache.shape
    halves = cache.view(nb, heads, 2, bs * two_d // 2)
    if is_value:
        return halves[:, :, 1].view(nb, heads, bs, two_d // 2)
    return halves[:, :, 0].view(nb, heads, two_d // 2, bs)


def _gather(cache: torch.Tensor, layout: KVLayout, is_value: bool, slots: torch.Tensor,
            block_size: int) -> torch.Tensor:
    """Rows [n, hidden] of the given (non-negative) slots."""
    cache = _indexable(cache)
    block, off = slots // block_size, slots % block_size
    if layout == KVLayout.CPU_ATTN:
        half = _cpu_attn_half(cache, is_value)
        rows = half[block, :, off, :] if is_value else half[block, :, :, off]  # [n, H, D]
    elif layout == KVLayout.FLASH:
        rows = cache[block, off]                      # [n, H, D]
    elif layout == KVLayout.CPU_IPEX:
        rows = cache[block, :, off, :]                # [n, H, D]
    elif layout == KVLayout.CPU_PACKED and not is_value:
        rows = cache[block, :, :, off, :]             # [n, H, D/x, x]
    elif layout == KVLayout.CPU_PACKED:
        rows = cache[block, :, :, off]                # [n, H, D]
    else:
        rows = cache[block, off]                      # [n, D]
    return rows.reshape(slots.numel(), -1)


def _scatter(cache: torch.Tensor, layout: KVLayout, is_value: bool, slots: torch.Tensor,
             block_size: int, rows: torch.Tensor) -> None:
    cache, rows = _indexable(cache), _indexable(rows)
    block, off = slots // block_size, slots % block_size
    if layout == KVLayout.CPU_ATTN:
        half = _cpu_attn_half(cache, is_value)
        if is_value:
            half[block, :, off, :] = rows.view(half[block, :, off, :].shape)
        else:
            half[block, :, :, off] = rows.view(half[block, :, :, off].shape)
    elif layout == KVLayout.FLASH:
        cache[block, off] = rows.view(cache[block, off].shape)
    elif layout == KVLayout.CPU_IPEX:
        cache[block, :, off, :] = rows.view(cache[block, :, off, :].shape)
    elif layout == KVLayout.CPU_PACKED and not is_value:
        cache[block, :, :, off, :] = rows.view(cache[block, :, :, off, :].shape)
    elif layout == KVLayout.CPU_PACKED:
        cache[block, :, :, off] = rows.view(cache[block, :, :, off].shape)
    else:
        cache[block, off] = rows.view(cache[block, off].shape)


def reference_store(c: Case, obj: torch.Tensor) -> None:
    obj = _indexable(obj)
    valid = c.slots >= 0
    if not bool(valid.any()):
        return
    for kv, caches in enumerate([c.keys, c.values][:c.num_kv]):
        for layer, cache in enumerate(caches):
            obj[kv, layer, valid] = _gather(cache, c.layout, kv == 1, c.slots[valid], c.block_size)


def reference_retrieve(c: Case, keys: List[torch.Tensor], values: List[torch.Tensor]) -> None:
    obj = _indexable(c.obj)
    valid = c.slots >= 0
    if not bool(valid.any()):
        return
    for kv, caches in enumerate([keys, values][:c.num_kv]):
        for layer, cache in enumerate(caches):
            _scatter(cache, c.layout, kv == 1, c.slots[valid], c.block_size, obj[kv, layer, valid])


def clone_caches(c: Case) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """Copies of the K and V caches, still one tensor per layer where the layout shares it."""
    keys = [t.clone() for t in c.keys]
    if c.layout == KVLayout.CPU_ATTN:
        return keys, list(keys)
    return keys, [t.clone() for t in c.values]


def assert_same_bytes(got: torch.Tensor, want: torch.Tensor) -> None:
    assert torch.equal(bits(got), bits(want))


# ---- correctness ----

@pytest.mark.parametrize("block_size", [5, 16])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.name)
def test_store_matches_reference(layout: KVLayout, dtype: torch.dtype, block_size: int) -> None:
    c = make_case(layout, dtype, block_size=block_size)
    before = c.buffer.clone()
    want = c.obj.clone()
    reference_store(c, want)
    run_multi(c, to_cache=False)
    assert_same_bytes(c.obj, want)
    # The -1 prefix rows were not written, nor anything around the object.
    assert_same_bytes(c.obj[:, :, :5], before[c.offset:c.offset + c.obj.numel()].view(c.obj.shape)[:, :, :5])
    assert_same_bytes(c.buffer[:c.offset], before[:c.offset])
    assert_same_bytes(c.buffer[c.offset + c.obj.numel():], before[c.offset + c.obj.numel():])


@pytest.mark.parametrize("block_size", [5, 16])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.name)
def test_retrieve_matches_reference(layout: KVLayout, dtype: torch.dtype, block_size: int) -> None:
    c = make_case(layout, dtype, block_size=block_size)
    want_k, want_v = clone_caches(c)
    reference_retrieve(c, want_k, want_v)
    obj_before = c.buffer.clone()
    run_multi(c, to_cache=True)
    # Whole caches compared: every slot not named (prefix, other blocks) is untouched.
    for got, want in zip(c.keys + c.values, want_k + want_v):
        assert_same_bytes(got, want)
    assert_same_bytes(c.buffer, obj_before)


@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("block_size", [16, 48])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.uint8], ids=str)
@pytest.mark.parametrize("layout", [KVLayout.CPU_ATTN, KVLayout.CPU_PACKED], ids=lambda layout: layout.name)
def test_banded_store_transposes_match_reference(layout: KVLayout, dtype: torch.dtype, block_size: int,
                                                 aligned: bool) -> None:
    """Stores whose transposes go through L1 bands (cpu/transpose.h, `transpose_to_rows`):
    object rows longer than one band, runs longer than one band of tokens, and an object on a
    line boundary (streamed rows) or off it (plain copies)."""
    c = make_case(layout, dtype, num_heads=4, head_size=256, block_size=block_size, num_blocks=16, num_tokens=150)
    if aligned:  # a fresh allocation starts on a 64-byte boundary
        buffer = c.obj.clone().view(-1)
        assert buffer.data_ptr() % 64 == 0
        c = Case(c.layout, c.dtype, c.block_size, c.num_heads, c.head_size, c.keys, c.values, c.slots, buffer, 0,
                 buffer.view(c.obj.shape))
    want = c.obj.clone()
    reference_store(c, want)
    run_multi(c, to_cache=False)
    assert_same_bytes(c.obj, want)


@pytest.mark.parametrize("block_size,head_size", [(16, 256), (48, 256), (1040, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.uint8], ids=str)
@pytest.mark.parametrize("layout", [KVLayout.CPU_ATTN, KVLayout.CPU_PACKED], ids=lambda layout: layout.name)
def test_banded_retrieve_transposes_match_reference(layout: KVLayout, dtype: torch.dtype, block_size: int,
                                                    head_size: int) -> None:
    """Retrieves into whole blocks, whose transposes go through an L1 tile streamed out as one span
    (cpu/transpose.h, `transpose_into_block`): several bands per head with a short last one, and
    blocks whose token rows exceed the tile (1040 x 8 bytes), which take the plain transpose."""
    c = make_case(layout, dtype, num_heads=2, head_size=head_size, block_size=block_size, num_blocks=6,
                  num_tokens=3 * block_size, start=0, prefix=0)
    want_k, want_v = clone_caches(c)
    reference_retrieve(c, want_k, want_v)
    run_multi(c, to_cache=True)
    for got, want in zip(c.keys + c.values, want_k + want_v):
        assert_same_bytes(got, want)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.name)
def test_round_trip_through_other_blocks(layout: KVLayout) -> None:
    """Store from one set of slots, retrieve into another: the tokens' K/V follow them."""
    c = make_case(layout, torch.bfloat16, num_tokens=33, prefix=0, start=0)
    run_multi(c, to_cache=False)
    first = c.obj.clone()
    gen = torch.Generator().manual_seed(1)
    c.slots = make_slots(33, c.block_size, 12, 0, 0, gen)
    run_multi(c, to_cache=True)
    c.obj.zero_()
    run_multi(c, to_cache=False)
    assert_same_bytes(c.obj, first)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.name)
def test_accepts_flat_and_cpu_backend_views(layout: KVLayout) -> None:
    """A (2, num_blocks, X) CPU cache hands over kv[0] / kv[1]; flat caches work too."""
    c = make_case(layout, torch.float16)
    want = c.obj.clone()
    reference_store(c, want)
    two_d = [t.view(t.shape[0], -1) for t in c.keys]
    flat_v = [t.view(-1) for t in c.values]
    run_multi(c, to_cache=False, keys=two_d, values=flat_v)
    assert_same_bytes(c.obj, want)


@pytest.mark.parametrize("num_tokens,prefix", [(1, 0), (1, 1), (16, 16), (17, 0), (64, 0)])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.name)
def test_token_counts_and_all_skipped(layout: KVLayout, num_tokens: int, prefix: int) -> None:
    c = make_case(layout, torch.float32, num_tokens=num_tokens, prefix=prefix, start=0,
                  num_blocks=8)
    want = c.obj.clone()
    reference_store(c, want)
    run_multi(c, to_cache=False)
    assert_same_bytes(c.obj, want)


def test_consecutive_blocks_merge_into_long_runs() -> None:
    """Slots running straight across block boundaries (blocks 2, 3, 4 in order)."""
    c = make_case(KVLayout.FLASH, torch.float32, num_tokens=40, prefix=0, start=0)
    c.slots = torch.arange(32, 72, dtype=torch.int64)
    want = c.obj.clone()
    reference_store(c, want)
    run_multi(c, to_cache=False)
    assert_same_bytes(c.obj, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8], ids=str)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.name)
def test_single_layer_matches_multi_layer(layout: KVLayout, dtype: torch.dtype) -> None:
    c = make_case(layout, dtype)
    want = c.obj.clone()
    reference_store(c, want)
    for layer in range(len(c.keys)):
        value = c.values[layer] if c.values else None
        obj_layer = c.obj[:, layer].contiguous()
        c_ops.single_layer_kv_transfer(obj_layer, c.keys[layer], value, c.slots, int(layout),
                                       c.block_size, c.num_heads, False)
        assert_same_bytes(obj_layer[:, c.slots >= 0], want[:, layer][:, c.slots >= 0])
        # Retrieve the layer into fresh caches and compare with the oracle.
        new_k = torch.zeros_like(c.keys[layer])
        new_v = torch.zeros_like(value) if value is not None else None
        if layout == KVLayout.CPU_ATTN:
            new_v = new_k
        c_ops.single_layer_kv_transfer(obj_layer, new_k, new_v, c.slots, int(layout),
                                       c.block_size, c.num_heads, True)
        ref_k = torch.zeros_like(c.keys[layer])
        ref_v = [torch.zeros_like(value)] if value is not None else []
        if layout == KVLayout.CPU_ATTN:
            ref_v = [ref_k]
        sub = Case(layout, dtype, c.block_size, c.num_heads, c.head_size, [], [], c.slots,
                   obj_layer.view(-1), 0, obj_layer.unsqueeze(1))
        reference_retrieve(sub, [ref_k], ref_v)
        assert_same_bytes(new_k, ref_k)
        if new_v is not None:
            assert_same_bytes(new_v, ref_v[0])


def test_layout_constants_match_python_enum() -> None:
    assert c_ops.LAYOUT_FLASH == KVLayout.FLASH == 0
    assert c_ops.LAYOUT_CPU_IPEX == KVLayout.CPU_IPEX == 1
    assert c_ops.LAYOUT_CPU_PACKED == KVLayout.CPU_PACKED == 2
    assert c_ops.LAYOUT_MLA == KVLayout.MLA == 3
    assert c_ops.LAYOUT_CPU_ATTN == KVLayout.CPU_ATTN == 4


def test_uses_several_threads_consistently() -> None:
    """Same bytes with 1 and 2 intra-op threads (work split differs)."""
    results = []
    old = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            c = make_case(KVLayout.CPU_PACKED, torch.bfloat16, num_layers=4, num_tokens=61)
            run_multi(c, to_cache=False)
            results.append(c.obj.clone())
    finally:
        torch.set_num_threads(old)
    assert_same_bytes(results[0], results[1])


ISA_ORDER = ["base", "avx2", "avx512"]


@pytest.mark.skipif("LMCACHE_CPU_ISA" in os.environ, reason="already running under an ISA cap")
@pytest.mark.parametrize("isa", ["base", "avx2"])
def test_fallback_tile_paths_match_reference(isa: str) -> None:
    """The CPU_PACKED transposes pick vector tiles at run time; capping the ISA runs the
    narrower tiles (and the scalar edges) against the oracle on this same machine."""
    env = {**os.environ, "LMCACHE_CPU_ISA": isa, "OMP_NUM_THREADS": "2"}
    native = c_ops.cpu_isa()
    want = ISA_ORDER[min(ISA_ORDER.index(isa), ISA_ORDER.index(native))]
    got = subprocess.run(
        [sys.executable, "-c", "import torch; from lmcache import c_ops; print(c_ops.cpu_isa())"],
        env=env, capture_output=True, text=True, check=True,
    ).stdout.strip()
    assert got == want
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__,
         "-k", "CPU_PACKED and (store_matches or retrieve_matches or token_counts or single_layer)"],
        env=env, capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8], ids=str)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.name)
def test_header_offsets_match_layout_shapes(layout: KVLayout, dtype: torch.dtype) -> None:
    """kv_layout.h's per-element arithmetic (what the CUDA kernel calls for every element)
    against the position of each element in a tensor of the layout's own shape."""
    heads = 1 if layout == KVLayout.MLA else 3
    head_size, block_size, num_blocks = 32, 5, 7
    es = torch.empty((), dtype=dtype).element_size()
    slots = torch.tensor([0, 4, 5, 17, 34, 12, 33], dtype=torch.int64)
    for kv in range(1 if layout == KVLayout.MLA else 2):
        shape = layout_shape(layout, num_blocks, block_size, heads, head_size, dtype, is_value=kv == 1)
        positions = torch.arange(torch.Size(shape).numel()).view(shape)
        want = _gather(positions, layout, kv == 1, slots, block_size)
        got = c_ops._cache_offsets(int(layout), kv, slots, block_size, heads, head_size, es)
        assert torch.equal(got, want)


def test_split_kv_caches_feed_the_kernel() -> None:
    """vLLM-shaped per-layer caches -> split_kv_caches -> kernel, against the oracle."""
    from lmcache.experimental.kv_layout import split_kv_caches

    for layout, vllm_shape in ((KVLayout.FLASH, lambda t: t), (KVLayout.CPU_IPEX, lambda t: t.reshape(t.shape[0], -1))):
        c = make_case(layout, torch.float16)
        want = c.obj.clone()
        reference_store(c, want)  # the oracle reads the caches in their layout's own shape
        # Flash hands (2, blocks, bs, H, D) per layer; the CPU backend (2, blocks, bs * H * D).
        stacked = [torch.stack([vllm_shape(k), vllm_shape(v)]) for k, v in zip(c.keys, c.values)]
        keys, values = split_kv_caches(stacked, layout)
        run_multi(c, to_cache=False, keys=keys, values=values)
        assert_same_bytes(c.obj, want)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.name)
def test_negative_slots_anywhere_are_skipped(layout: KVLayout) -> None:
    """Any slot < 0 (not only a -1 prefix) skips its token, both directions, and splits runs."""
    c = make_case(layout, torch.bfloat16, prefix=0)
    c.slots[[3, 10, 11, 36]] = torch.tensor([-1, -7, -1, -2])
    want = c.obj.clone()
    reference_store(c, want)
    run_multi(c, to_cache=False)
    assert_same_bytes(c.obj, want)
    want_k, want_v = clone_caches(c)
    c.obj.copy_(random_bytes(tuple(c.obj.shape), c.dtype, torch.Generator().manual_seed(5)))
    reference_retrieve(c, want_k, want_v)
    run_multi(c, to_cache=True)
    for got, exp in zip(c.keys + c.values, want_k + want_v):
        assert_same_bytes(got, exp)
