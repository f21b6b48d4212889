"""lmcache.experimental.kv_layout: layout shapes and turning vLLM layer caches into (K, V)."""

from __future__ import annotations

import pytest
import torch

from lmcache.experimental.kv_layout import (
    KVLayout,
    layout_shape,
    packed_x,
    split_kv_caches,
    split_layer_cache,
    vllm_layer_cache_shape,
)


def test_packed_x_per_dtype() -> None:
    assert packed_x(torch.float32) == 4
    assert packed_x(torch.bfloat16) == 8
    assert packed_x(torch.float16) == 8
    assert packed_x(torch.float8_e4m3fn) == 16


@pytest.mark.parametrize(
    "layout,is_value,want",
    [
        (KVLayout.FLASH, False, (10, 16, 8, 128)),
        (KVLayout.FLASH, True, (10, 16, 8, 128)),
        (KVLayout.CPU_IPEX, True, (10, 8, 16, 128)),
        (KVLayout.CPU_PACKED, False, (10, 8, 16, 16, 8)),
        (KVLayout.CPU_PACKED, True, (10, 8, 128, 16)),
        (KVLayout.MLA, False, (10, 16, 128)),
        (KVLayout.CPU_ATTN, False, (10, 8, 16, 256)),
        (KVLayout.CPU_ATTN, True, (10, 8, 16, 256)),
    ],
)
def test_layout_shape(layout: KVLayout, is_value: bool, want: tuple) -> None:
    assert layout_shape(layout, 10, 16, 8, 128, torch.bfloat16, is_value) == want


def test_layout_shape_errors() -> None:
    with pytest.raises(ValueError, match="MLA has no value cache"):
        layout_shape(KVLayout.MLA, 10, 16, 1, 128, torch.float16, is_value=True)
    with pytest.raises(ValueError, match="head_size \\(12\\) to be a multiple of x = 8"):
        layout_shape(KVLayout.CPU_PACKED, 10, 16, 1, 12, torch.float16)


def test_split_cpu_backend_cache_is_a_view() -> None:
    kv = torch.zeros(2, 5, 16 * 2 * 8)
    k, v = split_layer_cache(kv, KVLayout.CPU_IPEX)
    assert k.shape == (5, 256) and v.shape == (5, 256)
    assert k.data_ptr() == kv.data_ptr()
    assert v.data_ptr() == kv[1].data_ptr()
    v.fill_(1.0)
    assert bool((kv[1] == 1).all()) and bool((kv[0] == 0).all())


def test_split_flash_cache_and_pairs() -> None:
    kv = torch.zeros(2, 5, 16, 2, 8)
    k, v = split_layer_cache(kv, KVLayout.FLASH)
    assert k.shape == (5, 16, 2, 8) and v.data_ptr() == kv[1].data_ptr()
    pair = (torch.zeros(5, 16, 2, 8), torch.ones(5, 16, 2, 8))
    k2, v2 = split_layer_cache(pair, KVLayout.FLASH)
    assert k2 is pair[0] and v2 is pair[1]


def test_split_mla_cache() -> None:
    latent = torch.zeros(2, 16, 64)  # num_blocks == 2 must not be mistaken for a K/V stack
    k, v = split_layer_cache(latent, KVLayout.MLA)
    assert k is latent and v is None
    with pytest.raises(ValueError, match="MLA layer cache must be one"):
        split_layer_cache((latent, latent), KVLayout.MLA)


def test_split_mla_cache_with_a_head_axis_of_one() -> None:
    """vLLM 0.32's CPU MLA cache `(num_blocks, 1, block_size, head_size)`: viewed without the axis."""
    cache = torch.arange(2 * 16 * 64, dtype=torch.float32).reshape(2, 1, 16, 64)
    k, v = split_layer_cache(cache, KVLayout.MLA)
    assert k.shape == (2, 16, 64) and v is None and k.data_ptr() == cache.data_ptr()
    assert torch.equal(k[1, 3], cache.view(-1, 64)[16 + 3])  # slot 19 is row 19, as vLLM writes it
    with pytest.raises(ValueError, match=r"MLA layer cache must be one \(num_blocks, \[1,\] block_size"):
        split_layer_cache(torch.zeros(2, 2, 16, 64), KVLayout.MLA)  # two heads: not an MLA cache


def test_split_cpu_attn_cache_is_both_halves() -> None:
    """vLLM 0.32's one tensor per layer is handed to the kernels as K and as V."""
    kv = torch.zeros(5, 2, 32, 2 * 64)
    k, v = split_layer_cache(kv, KVLayout.CPU_ATTN)
    assert k is kv and v is kv
    with pytest.raises(ValueError, match="CPU_ATTN layer cache must be one"):
        split_layer_cache((kv, kv), KVLayout.CPU_ATTN)
    with pytest.raises(ValueError, match="CPU_ATTN layer cache must be one"):
        split_layer_cache(torch.zeros(2, 5, 32 * 128), KVLayout.CPU_ATTN)


def test_split_errors_name_the_layout() -> None:
    with pytest.raises(ValueError, match="CPU_PACKED layer cache tensor must stack K and V on dim 0"):
        split_layer_cache(torch.zeros(3, 5, 16), KVLayout.CPU_PACKED)
    with pytest.raises(ValueError, match="FLASH layer cache pair must be \\(K, V\\), got 3"):
        split_layer_cache([torch.zeros(1)] * 3, KVLayout.FLASH)


def test_split_kv_caches_all_layers() -> None:
    layers = [torch.full((2, 4, 32), float(i)) for i in range(3)]
    keys, values = split_kv_caches(layers, KVLayout.CPU_IPEX)
    assert [int(k[0, 0]) for k in keys] == [0, 1, 2]
    assert len(values) == 3
    mla_keys, mla_values = split_kv_caches([torch.zeros(4, 16, 8)] * 2, KVLayout.MLA)
    assert len(mla_keys) == 2 and mla_values == []


@pytest.mark.parametrize("layout,want", [
    (KVLayout.FLASH, (2, 10, 16, 8, 128)),
    (KVLayout.CPU_IPEX, (2, 10, 16 * 8 * 128)),
    (KVLayout.CPU_PACKED, (2, 10, 16 * 8 * 128)),
    (KVLayout.MLA, (10, 16, 128)),
])
def test_vllm_layer_cache_shape(layout: KVLayout, want: tuple) -> None:
    assert vllm_layer_cache_shape(layout, 10, 16, 8, 128) == want
