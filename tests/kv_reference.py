"""Plain-torch oracle for paged KV caches: build caches in every layout and read/write tokens by
slot with indexing only, so the connector and engine tests can check the kernels against it."""

from dataclasses import dataclass
from typing import List, Sequence, Tuple

import torch

from lmcache.experimental.kv_layout import KVLayout, packed_x


@dataclass(frozen=True)
class Geometry:
    layout: KVLayout
    num_layers: int
    num_blocks: int
    block_size: int
    num_heads: int
    head_size: int
    dtype: torch.dtype

    @property
    def hidden(self) -> int:
        return self.num_heads * self.head_size

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def num_kv(self) -> int:
        return 1 if self.layout == KVLayout.MLA else 2


def random_tensor(shape: Sequence[int], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random values whose bytes are all distinct enough to catch a misplaced element."""
    if dtype.is_floating_point:
        return torch.randn(*shape, generator=gen).to(dtype)
    return torch.randint(-100, 100, tuple(shape), generator=gen).to(dtype)


def make_layer(geo: Geometry, gen: torch.Generator, stacked: bool):
    """One layer's cache as vLLM hands it over: stacked tensor (vLLM's own form) or a (K, V) pair."""
    nb, bs, h, d = geo.num_blocks, geo.block_size, geo.num_heads, geo.head_size
    if geo.layout == KVLayout.MLA:
        return random_tensor((nb, bs, d), geo.dtype, gen)
    if geo.layout == KVLayout.FLASH:
        both = random_tensor((2, nb, bs, h, d), geo.dtype, gen)
        return both if stacked else (both[0].clone(), both[1].clone())
    both = random_tensor((2, nb, bs * h * d), geo.dtype, gen)  # the vLLM CPU backend's shape
    if stacked:
        return both
    if geo.layout == KVLayout.CPU_IPEX:
        return (both[0].clone().view(nb, h, bs, d), both[1].clone().view(nb, h, bs, d))
    x = packed_x(geo.dtype)
    return (both[0].clone().view(nb, h, d // x, bs, x), both[1].clone().view(nb, h, d, bs))


def make_kvcaches(geo: Geometry, seed: int = 0, stacked: bool = True) -> List:
    gen = torch.Generator().manual_seed(seed)
    return [make_layer(geo, gen, stacked) for _ in range(geo.num_layers)]


def _kv_views(geo: Geometry, layer) -> List[torch.Tensor]:
    """K (and V) of one layer viewed in the layout's own shape."""
    nb, bs, h, d = geo.num_blocks, geo.block_size, geo.num_heads, geo.head_size
    if geo.layout == KVLayout.MLA:
        return [layer]
    k, v = (layer[0], layer[1]) if isinstance(layer, torch.Tensor) else layer
    if geo.layout == KVLayout.FLASH:
        return [k.view(nb, bs, h, d), v.view(nb, bs, h, d)]
    if geo.layout == KVLayout.CPU_IPEX:
        return [k.view(nb, h, bs, d), v.view(nb, h, bs, d)]
    x = packed_x(geo.dtype)
    return [k.view(nb, h, d // x, bs, x), v.view(nb, h, d, bs)]


def _token_index(geo: Geometry, kind: int, block: int, off: int) -> Tuple:
    """Index of one token's elements inside a layer view; the result is reshaped to [hidden]."""
    if geo.layout in (KVLayout.FLASH, KVLayout.MLA):
        return (block, off)
    if geo.layout == KVLayout.CPU_IPEX:
        return (block, slice(None), off)
    # packed K [nb, h, d/x, bs, x] -> [h, d/x, x]; packed V [nb, h, d, bs] -> [h, d]
    return (block, slice(None), slice(None), off)


def gather(geo: Geometry, kvcaches: Sequence, slots: Sequence[int]) -> torch.Tensor:
    """The KV_BLOB `[num_kv, L, T, hidden]` for tokens at `slots`, by plain indexing."""
    hidden = geo.head_size if geo.layout == KVLayout.MLA else geo.hidden
    out = torch.empty((geo.num_kv, geo.num_layers, len(slots), hidden), dtype=geo.dtype)
    for layer_id, layer in enumerate(kvcaches):
        for kind, view in enumerate(_kv_views(geo, layer)):
            for t, slot in enumerate(slots):
                block, off = divmod(int(slot), geo.block_size)
                out[kind, layer_id, t] = view[_token_index(geo, kind, block, off)].reshape(hidden)
    return out


def scatter(geo: Geometry, kvcaches: Sequence, slots: Sequence[int], blob: torch.Tensor) -> None:
    """Write `blob` into the caches at `slots` (slots < 0 skipped), by plain indexing."""
    for layer_id, layer in enumerate(kvcaches):
        for kind, view in enumerate(_kv_views(geo, layer)):
            for t, slot in enumerate(slots):
                if slot < 0:
                    continue
                block, off = divmod(int(slot), geo.block_size)
                idx = _token_index(geo, kind, block, off)
                view[idx] = blob[kind, layer_id, t].reshape(view[idx].shape)
