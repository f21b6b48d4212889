"""Our CPU layouts are vLLM's: K/V written by vLLM's own cache writers read back exactly.

vLLM's CPU backend allocates `(2, num_blocks, block_size * heads * head_size)` per layer and
views it through `PagedAttention.split_kv_cache` (IPEX or the packed fallback). Here vLLM's
writers fill the cache, and `c_ops` (fed by `split_layer_cache`) must store the same rows.
"""

from __future__ import annotations

import pytest
import torch

from lmcache import c_ops
from lmcache.experimental.kv_layout import KVLayout, layout_shape, split_layer_cache

ipex_attn = pytest.importorskip("vllm.attention.ops.ipex_attn")

NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE, TOKENS = 9, 16, 4, 64, 45


def _tokens(dtype: torch.dtype):
    gen = torch.Generator().manual_seed(3)
    key = torch.randn(TOKENS, HEADS, HEAD_SIZE, generator=gen).to(dtype)
    value = torch.randn(TOKENS, HEADS, HEAD_SIZE, generator=gen).to(dtype)
    blocks = torch.randperm(NUM_BLOCKS, generator=gen)[:3]
    pos = torch.arange(TOKENS) + 2
    slots = (blocks[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE).to(torch.int64)
    return key, value, slots


def _store_and_compare(kv_cache: torch.Tensor, layout: KVLayout, key, value, slots) -> None:
    k_cache, v_cache = split_layer_cache(kv_cache, layout)
    obj = torch.zeros(2, 1, TOKENS, HEADS * HEAD_SIZE, dtype=kv_cache.dtype)
    c_ops.multi_layer_kv_transfer(obj, [k_cache], [v_cache], slots, int(layout), BLOCK_SIZE, HEADS, False)
    assert torch.equal(obj[0, 0], key.reshape(TOKENS, -1))
    assert torch.equal(obj[1, 0], value.reshape(TOKENS, -1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_packed_layout_matches_vllm_reshape_and_cache(dtype: torch.dtype) -> None:
    backend = ipex_attn._PagedAttention
    kv_cache = torch.zeros(backend.get_kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE), dtype=dtype)
    k_view, v_view = backend.split_kv_cache(kv_cache, HEADS, HEAD_SIZE)
    assert tuple(k_view.shape) == layout_shape(KVLayout.CPU_PACKED, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE, dtype)
    assert tuple(v_view.shape) == layout_shape(
        KVLayout.CPU_PACKED, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE, dtype, is_value=True
    )
    key, value, slots = _tokens(dtype)
    one = torch.tensor(1.0)
    backend.write_to_paged_cache(key, value, k_view, v_view, slots, "auto", one, one)
    _store_and_compare(kv_cache, KVLayout.CPU_PACKED, key, value, slots)
    # vLLM's own 5-D / 4-D views are accepted as they are.
    obj = torch.zeros(2, 1, TOKENS, HEADS * HEAD_SIZE, dtype=dtype)
    c_ops.multi_layer_kv_transfer(obj, [k_view], [v_view], slots, int(KVLayout.CPU_PACKED), BLOCK_SIZE, HEADS, False)
    assert torch.equal(obj[1, 0], value.reshape(TOKENS, -1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_ipex_layout_matches_ipex_reshape_and_cache(dtype: torch.dtype) -> None:
    if not ipex_attn._use_ipex:
        pytest.skip("IPEX is not importable here, so vLLM does not use the IPEX layout")
    backend = ipex_attn._IPEXPagedAttention
    kv_cache = torch.zeros(backend.get_kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE), dtype=dtype)
    k_view, v_view = backend.split_kv_cache(kv_cache, HEADS, HEAD_SIZE)
    assert tuple(k_view.shape) == layout_shape(KVLayout.CPU_IPEX, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE, dtype)
    key, value, slots = _tokens(dtype)
    backend.write_to_paged_cache(key, value, k_view, v_view, slots, "auto", None, None)
    _store_and_compare(kv_cache, KVLayout.CPU_IPEX, key, value, slots)


def test_retrieved_kv_is_what_vllm_reads() -> None:
    """Retrieve into an empty cache with c_ops, then vLLM's IPEX writer overwrites the same
    slots with the same K/V: nothing changes, so c_ops wrote exactly where vLLM looks."""
    if not ipex_attn._use_ipex:
        pytest.skip("IPEX is not importable here")
    backend = ipex_attn._IPEXPagedAttention
    dtype = torch.float32
    key, value, slots = _tokens(dtype)
    kv_cache = torch.zeros(backend.get_kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE), dtype=dtype)
    obj = torch.stack([key.reshape(TOKENS, -1), value.reshape(TOKENS, -1)]).unsqueeze(1).contiguous()
    k_cache, v_cache = split_layer_cache(kv_cache, KVLayout.CPU_IPEX)
    c_ops.multi_layer_kv_transfer(obj, [k_cache], [v_cache], slots, int(KVLayout.CPU_IPEX), BLOCK_SIZE, HEADS, True)
    ours = kv_cache.clone()
    k_view, v_view = backend.split_kv_cache(kv_cache, HEADS, HEAD_SIZE)
    backend.write_to_paged_cache(key, value, k_view, v_view, slots, "auto", None, None)
    assert torch.equal(kv_cache, ours)
    assert bool(ours.any())
