"""Our MLA layout is vLLM 0.32's CPU MLA cache: what vLLM's own cache writer puts in a block,
`c_ops` reads back exactly, and what `c_ops` writes is where vLLM's writer would put it.

vLLM 0.32 hands each MLA layer as one `[num_blocks, 1, block_size, 576]` tensor (a head axis of 1;
its CPU MLA backend takes head size 576 = kv_lora_rank 512 + rope 64 and block size 16 only) and
writes it in `CPUMLAImpl.do_kv_cache_update` as `view(-1, 576)[slot]`. `split_layer_cache` views
it without the head axis (`mla_latent_view`), which the kernels read as MLA.
"""

from __future__ import annotations

import pytest
import torch

from lmcache import c_ops
from lmcache.experimental.kv_layout import KVLayout, split_layer_cache

NUM_BLOCKS, BLOCK, LORA, ROPE, TOKENS = 5, 16, 512, 64, 45


def _tokens(dtype: torch.dtype):
    gen = torch.Generator().manual_seed(4)
    kv_c = torch.randn(TOKENS, LORA, generator=gen).to(dtype)
    k_pe = torch.randn(TOKENS, 1, ROPE, generator=gen).to(dtype)  # one rope head, as vLLM passes it
    blocks = torch.randperm(NUM_BLOCKS, generator=gen)
    pos = torch.arange(TOKENS) + 3  # starts mid-block
    slots = (blocks[pos // BLOCK] * BLOCK + pos % BLOCK).to(torch.int64)
    return kv_c, k_pe, slots


def _vllm_write(kv_cache: torch.Tensor, kv_c, k_pe, slots) -> None:
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

    # The method reads nothing from its instance; vLLM's own code writes the cache.
    CPUMLAImpl.do_kv_cache_update(None, kv_c, k_pe, kv_cache, slots, "auto", None)


def _latent(kv_c, k_pe) -> torch.Tensor:
    return torch.cat([kv_c, k_pe.squeeze(1)], dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_store_reads_what_vllm_wrote(dtype: torch.dtype) -> None:
    kv_cache = torch.zeros(NUM_BLOCKS, 1, BLOCK, LORA + ROPE, dtype=dtype)
    kv_c, k_pe, slots = _tokens(dtype)
    _vllm_write(kv_cache, kv_c, k_pe, slots)
    k, v = split_layer_cache(kv_cache, KVLayout.MLA)
    assert v is None and k.data_ptr() == kv_cache.data_ptr()
    obj = torch.zeros(1, 1, TOKENS, LORA + ROPE, dtype=dtype)
    c_ops.multi_layer_kv_transfer(obj, [k], [], slots, int(KVLayout.MLA), BLOCK, 1, False)
    assert torch.equal(obj[0, 0], _latent(kv_c, k_pe))


def test_retrieve_writes_where_vllm_reads() -> None:
    """Retrieve into an empty cache, then vLLM's writer stores the same latents over it: nothing
    changes, so every element landed where vLLM keeps it."""
    kv_cache = torch.zeros(NUM_BLOCKS, 1, BLOCK, LORA + ROPE)
    kv_c, k_pe, slots = _tokens(torch.float32)
    obj = _latent(kv_c, k_pe)[None, None].contiguous()
    k, _ = split_layer_cache(kv_cache, KVLayout.MLA)
    c_ops.multi_layer_kv_transfer(obj, [k], [], slots, int(KVLayout.MLA), BLOCK, 1, True)
    ours = kv_cache.clone()
    _vllm_write(kv_cache, kv_c, k_pe, slots)
    assert torch.equal(kv_cache, ours)
    assert bool(ours.any())
