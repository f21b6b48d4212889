"""Our CPU_ATTN layout is vLLM 0.32's CPU attention cache: what vLLM's own cache writer puts in a
block, `c_ops` reads back exactly, and what `c_ops` writes is where vLLM's writer would put it.

vLLM keeps each layer as one `[num_blocks, kv_heads, block_size, 2 * head_size]` tensor and
writes it through `cpu_attn_reshape_and_cache` with the ISA its backend picked for the dtype
and block size (`vec` or `vec16` on x86 without AMX).
"""

from __future__ import annotations

import pytest
import torch

from lmcache import c_ops
from lmcache.experimental.kv_layout import KVLayout, layout_shape, split_layer_cache

NUM_BLOCKS, HEADS, HEAD_SIZE, TOKENS = 5, 2, 64, 45


def _new_cache(dtype: torch.dtype, block_size: int) -> torch.Tensor:
    """An empty layer cache of the layout the CPU backend says it reads (head-major blocks)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    assert [layout.name for layout in CPUAttentionBackend.supported_kv_cache_layouts()] == ["LBHNC"]
    return torch.zeros(layout_shape(KVLayout.CPU_ATTN, NUM_BLOCKS, block_size, HEADS, HEAD_SIZE, dtype), dtype=dtype)


def _tokens(dtype: torch.dtype, block_size: int):
    gen = torch.Generator().manual_seed(3)
    key = torch.randn(TOKENS, HEADS, HEAD_SIZE, generator=gen).to(dtype)
    value = torch.randn(TOKENS, HEADS, HEAD_SIZE, generator=gen).to(dtype)
    blocks = torch.randperm(NUM_BLOCKS, generator=gen)
    pos = torch.arange(TOKENS) + 2  # starts mid-block
    slots = (blocks[pos // block_size] * block_size + pos % block_size).to(torch.int64)
    return key, value, slots


def _vllm_write(kv_cache: torch.Tensor, key, value, slots, isa: str) -> None:
    from vllm import _custom_ops as ops

    nb, heads, bs, _ = kv_cache.shape
    k_cache, v_cache = kv_cache.view(nb, heads, 2 * bs, -1).chunk(2, dim=2)  # as cpu_attn.py does
    ops.cpu_attn_reshape_and_cache(key, value, k_cache, v_cache, slots, isa)


@pytest.mark.parametrize("isa,block_size", [("vec", 32), ("vec16", 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_store_reads_what_vllm_wrote(dtype: torch.dtype, isa: str, block_size: int) -> None:
    kv_cache = _new_cache(dtype, block_size)
    key, value, slots = _tokens(dtype, block_size)
    _vllm_write(kv_cache, key, value, slots, isa)
    k, v = split_layer_cache(kv_cache, KVLayout.CPU_ATTN)
    obj = torch.zeros(2, 1, TOKENS, HEADS * HEAD_SIZE, dtype=dtype)
    c_ops.multi_layer_kv_transfer(obj, [k], [v], slots, int(KVLayout.CPU_ATTN), block_size, HEADS, False)
    assert torch.equal(obj[0, 0], key.reshape(TOKENS, -1))
    assert torch.equal(obj[1, 0], value.reshape(TOKENS, -1))


@pytest.mark.parametrize("isa,block_size", [("vec", 32), ("vec16", 16)])
def test_retrieve_writes_where_vllm_reads(isa: str, block_size: int) -> None:
    """Retrieve into an empty cache, then vLLM's writer stores the same K/V over it: nothing
    changes, so every element landed where vLLM keeps it."""
    dtype = torch.float32
    kv_cache = _new_cache(dtype, block_size)
    key, value, slots = _tokens(dtype, block_size)
    obj = torch.stack([key.reshape(TOKENS, -1), value.reshape(TOKENS, -1)]).unsqueeze(1).contiguous()
    k, v = split_layer_cache(kv_cache, KVLayout.CPU_ATTN)
    c_ops.multi_layer_kv_transfer(obj, [k], [v], slots, int(KVLayout.CPU_ATTN), block_size, HEADS, True)
    ours = kv_cache.clone()
    _vllm_write(kv_cache, key, value, slots, isa)
    assert torch.equal(kv_cache, ours)
    assert bool(ours.any())
