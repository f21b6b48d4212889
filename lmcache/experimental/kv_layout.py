"""Which paged layout a KV cache tensor has, and how to hand a layer's cache to the kernels.

vLLM stores each layer's KV cache in blocks of `block_size` token slots
(`slot = block_id * block_size + offset_in_block`), but the order of the
dimensions inside a block depends on the attention backend. The kernels in
`lmcache.c_ops` take the layout as an explicit code; `KVLayout` mirrors those
codes (`csrc/kv_layout.h` holds the matching address arithmetic).

`mla_latent_view` drops the head axis of 1 vLLM 0.32's CPU MLA cache carries.
`layout_shape` / `layout_dims` build and read each layout's K (V) shape from one table of
dimension names (the Python side's one definition; `csrc/kv_layout.h` keeps the C++ one), and
`vllm_layer_cache_shape` gives the tensor vLLM hands out per layer.
`split_layer_cache` / `split_kv_caches` turn what vLLM hands out per layer
(one tensor with K and V stacked, a (K, V) pair, or MLA's single latent cache)
into the per-layer K and V tensors the kernels want.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

LayerCache = Union[torch.Tensor, Sequence[torch.Tensor]]


class KVLayout(IntEnum):
    """Per-block element order of one layer's K (or V) cache; values match `c_ops.LAYOUT_*`.

    ```
    FLASH       GPU flash-attention: token rows, heads inside a row
                K, V: [num_blocks, block_size, heads, head_size]
                block: | tok0: h0 d0..dD | h1 ... | tok1: h0 ... |

    CPU_IPEX    vLLM CPU backend with IPEX: head-major inside a block
                K, V: [num_blocks, heads, block_size, head_size]
                block: | h0: tok0 d0..dD | tok1 ... | h1: tok0 ... |

    CPU_PACKED  vLLM CPU backend without IPEX (x = 16 // element_size)
                K: [num_blocks, heads, head_size // x, block_size, x]
                   block: | h0: d0..dx-1 of tok0, tok1, ... | dx..d2x-1 of tok0 ... |
                V: [num_blocks, heads, head_size, block_size]
                   block: | h0: d0 of tok0..tokB | d1 of tok0..tokB | ... |  (transposed)

    MLA         one latent vector per token, K only
                [num_blocks, block_size, head_size]
                (vLLM 0.32's CPU MLA hands [num_blocks, 1, block_size, head_size]: a head
                axis of 1 adds no stride, so it is the same layout; `mla_latent_view`)

    CPU_ATTN    vLLM >= 0.11 CPU attention (ISAs vec, vec16): K and V in one tensor
                [num_blocks, heads, block_size, 2 * head_size]
                block: | h0: K d0 of tok0..tokB | d1 ... | V tok0 d0..dD | tok1 ... | h1: ... |
                (per head the K half is transposed, the V half is token rows)
    ```
    """

    FLASH = 0
    CPU_IPEX = 1
    CPU_PACKED = 2
    MLA = 3
    CPU_ATTN = 4


def packed_x(dtype: torch.dtype) -> int:
    """Elements per 16-byte group of a CPU_PACKED key cache (vLLM's `x`)."""
    return 16 // torch.empty((), dtype=dtype).element_size()


# The one definition of each layout's K (V) shape, as dimension names in order; `layout_shape`
# builds shapes from it and `layout_dims` reads shapes back. "groups" * "x" is the head size
# of a CPU_PACKED key (x = 16 bytes of elements); "kv_head_size" is CPU_ATTN's 2 * head_size
# (its K and V share one tensor, so both have that shape).
_DIMS: dict = {
    (KVLayout.FLASH, False): ("blocks", "block_size", "heads", "head_size"),
    (KVLayout.FLASH, True): ("blocks", "block_size", "heads", "head_size"),
    (KVLayout.CPU_IPEX, False): ("blocks", "heads", "block_size", "head_size"),
    (KVLayout.CPU_IPEX, True): ("blocks", "heads", "block_size", "head_size"),
    (KVLayout.CPU_PACKED, False): ("blocks", "heads", "groups", "block_size", "x"),
    (KVLayout.CPU_PACKED, True): ("blocks", "heads", "head_size", "block_size"),
    (KVLayout.MLA, False): ("blocks", "block_size", "head_size"),
    (KVLayout.CPU_ATTN, False): ("blocks", "heads", "block_size", "kv_head_size"),
    (KVLayout.CPU_ATTN, True): ("blocks", "heads", "block_size", "kv_head_size"),
}


def _dim_names(layout: KVLayout, is_value: bool) -> Tuple[str, ...]:
    names = _DIMS.get((KVLayout(layout), is_value))
    if names is None:
        raise ValueError(f"layout {KVLayout(layout).name} has no value cache")
    return names


def layout_shape(
    layout: KVLayout,
    num_blocks: int,
    block_size: int,
    num_heads: int,
    head_size: int,
    dtype: torch.dtype,
    is_value: bool = False,
) -> Tuple[int, ...]:
    """The shape of one layer's K (or V, `is_value=True`) cache in `layout`."""
    names = _dim_names(layout, is_value)
    dims = {"blocks": num_blocks, "block_size": block_size, "heads": num_heads, "head_size": head_size,
            "kv_head_size": 2 * head_size}
    if "x" in names:
        x = packed_x(dtype)
        if head_size % x:
            raise ValueError(f"CPU_PACKED needs head_size ({head_size}) to be a multiple of x = {x}")
        dims.update(groups=head_size // x, x=x)
    return tuple(dims[name] for name in names)


def layout_dims(
    layout: KVLayout, shape: Sequence[int], dtype: torch.dtype, is_value: bool = False
) -> Optional[Dict[str, int]]:
    """`blocks`, `block_size`, `heads`, `head_size` of a K (V) cache of `shape` read as `layout`;
    None when the shape cannot be one (wrong rank, or a packed key whose last dim is not x)."""
    names = _dim_names(layout, is_value)
    if len(shape) != len(names):
        return None
    dims = dict(zip(names, (int(d) for d in shape)))
    if "x" in dims:
        if dims["x"] != packed_x(dtype):
            return None
        dims["head_size"] = dims.pop("groups") * dims.pop("x")
    if "kv_head_size" in dims:
        if dims["kv_head_size"] % 2:
            return None
        dims["head_size"] = dims.pop("kv_head_size") // 2
    dims.setdefault("heads", 1)  # MLA: one latent vector per token
    return dims


def vllm_layer_cache_shape(
    layout: KVLayout, num_blocks: int, block_size: int, num_heads: int, head_size: int
) -> Tuple[int, ...]:
    """The shape of the one tensor vLLM hands out per layer for `layout`.

    FLASH: K and V stacked, `(2, *layout_shape)`; vLLM 0.9's CPU layouts: K and V stacked with
    each block flattened, `(2, num_blocks, block_size * heads * head_size)` (the layout is how
    the backend views a block); MLA: the latent cache itself; CPU_ATTN (vLLM 0.32): its one
    tensor, `layout_shape` itself."""
    layout = KVLayout(layout)
    if layout == KVLayout.CPU_ATTN:
        return layout_shape(layout, num_blocks, block_size, num_heads, head_size, torch.float32)
    if layout == KVLayout.MLA:
        return layout_shape(layout, num_blocks, block_size, 1, head_size, torch.float32)
    if layout == KVLayout.FLASH:
        return (2,) + layout_shape(layout, num_blocks, block_size, num_heads, head_size, torch.float32)
    return (2, num_blocks, block_size * num_heads * head_size)


def mla_latent_view(kv_cache: LayerCache) -> LayerCache:
    """An MLA cache as `(num_blocks, block_size, head_size)`, without a copy: vLLM 0.32's CPU MLA
    backend hands `(num_blocks, 1, block_size, head_size)`, whose head axis of 1 changes no
    element's place (vLLM writes it as `view(-1, head_size)[slot]`). Anything else is returned
    as it is, for the caller's shape check to judge."""
    if isinstance(kv_cache, torch.Tensor) and kv_cache.dim() == 4 and kv_cache.shape[1] == 1:
        return kv_cache.squeeze(1)
    return kv_cache


def split_layer_cache(kv_cache: LayerCache, layout: KVLayout) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """View one layer's cache as (K, V) tensors for the kernels; V is None for MLA.

    Accepted: a (K, V) pair; one tensor with K and V stacked on dim 0 (the CPU
    backend's `(2, num_blocks, block_size * heads * head_size)`, flash's
    `(2, num_blocks, block_size, heads, head_size)`); for MLA the latent cache
    `(num_blocks, block_size, head_size)` (or vLLM 0.32's `(num_blocks, 1, block_size, head_size)`,
    viewed without its head axis: `mla_latent_view`); for CPU_ATTN the one
    `(num_blocks, heads, block_size, 2 * head_size)` tensor, returned as both K and V
    (the kernels find each half in it). No data is copied.
    """
    layout = KVLayout(layout)
    if layout == KVLayout.CPU_ATTN:
        if not isinstance(kv_cache, torch.Tensor) or kv_cache.dim() != 4 or kv_cache.shape[-1] % 2:
            raise ValueError(
                "a CPU_ATTN layer cache must be one (num_blocks, heads, block_size, 2 * head_size) "
                f"tensor, got {_describe(kv_cache)}"
            )
        return kv_cache, kv_cache
    if layout == KVLayout.MLA:
        kv_cache = mla_latent_view(kv_cache)
        if not isinstance(kv_cache, torch.Tensor) or kv_cache.dim() != 3:
            raise ValueError(
                "an MLA layer cache must be one (num_blocks, [1,] block_size, head_size) tensor, got "
                f"{_describe(kv_cache)}"
            )
        return kv_cache, None
    if isinstance(kv_cache, torch.Tensor):
        if kv_cache.dim() < 2 or kv_cache.shape[0] != 2:
            raise ValueError(
                f"a {layout.name} layer cache tensor must stack K and V on dim 0, got shape {tuple(kv_cache.shape)}"
            )
        return kv_cache[0], kv_cache[1]
    if len(kv_cache) != 2:
        raise ValueError(f"a {layout.name} layer cache pair must be (K, V), got {len(kv_cache)} tensors")
    key, value = kv_cache
    return key, value


def split_kv_caches(
    kv_caches: Sequence[LayerCache], layout: KVLayout
) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
    """Per-layer K and V lists for `c_ops.multi_layer_kv_transfer` (V list empty for MLA)."""
    keys: List[torch.Tensor] = []
    values: List[torch.Tensor] = []
    for layer_cache in kv_caches:
        key, value = split_layer_cache(layer_cache, layout)
        keys.append(key)
        if value is not None:
            values.append(value)
    return keys, values


def _describe(obj: object) -> str:
    if isinstance(obj, torch.Tensor):
        return f"tensor of shape {tuple(obj.shape)}"
    return type(obj).__name__
