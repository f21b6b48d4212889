"""CacheBlend's KV moves: token-major KV out of and into vLLM's paged cache, and segment entries
in LMCache.

Token-major KV is `[2, num_layers, num_tokens, kv_hidden]` (the `KV_BLOB` shape). A segment's
entry holds its KV as if the segment started at position 0; it goes through the engine's public
`store`/`retrieve` via a staging paged cache of our own (vLLM's layout, as many blocks as the
segment needs), so vLLM's blocks are never touched by a segment store or fetch.

```
  store:  vLLM cache --gather--> KV at p..p+n --rotate K by -p--> staging --engine.store--> LMCache
  fetch:  LMCache --engine.retrieve--> staging --gather--> KV at 0..n --rotate K by +q--> blender
```
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from lmcache import c_ops
from lmcache.experimental.blend.rope import rotate_keys
from lmcache.experimental.cache_engine import LMCacheEngine
from lmcache.experimental.kv_layout import KVLayout, split_kv_caches, vllm_layer_cache_shape


class BlendKV:
    """Moves token-major KV for one worker's engine and vLLM cache layout."""

    def __init__(
        self, engine: LMCacheEngine, layout: KVLayout, block_size: int, inv_freq: torch.Tensor, is_neox_style: bool
    ) -> None:
        self.engine = engine
        self.layout = KVLayout(layout)
        if self.layout in (KVLayout.MLA, KVLayout.CPU_ATTN):
            raise NotImplementedError(f"CacheBlend does not handle the {self.layout.name} KV layout")
        self.block_size = block_size
        self.num_layers, _, _, self.num_kv_heads, self.head_size = engine.metadata.kv_shape
        self.dtype = engine.metadata.kv_dtype
        self.inv_freq = inv_freq
        self.is_neox_style = is_neox_style

    # ----- vLLM's paged cache ---------------------------------------------------------------------

    def gather(self, kv_caches: Sequence[torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
        """The KV of these slots, token-major."""
        kv = torch.empty(2, self.num_layers, len(slots), self.num_kv_heads * self.head_size, dtype=self.dtype)
        self._transfer(kv, kv_caches, slots, to_cache=False)
        return kv

    def scatter(self, kv: torch.Tensor, kv_caches: Sequence[torch.Tensor], slots: torch.Tensor) -> None:
        """Write token-major KV into these slots (a slot < 0 is skipped)."""
        self._transfer(kv.contiguous(), kv_caches, slots, to_cache=True)

    def _transfer(self, kv: torch.Tensor, kv_caches: Sequence[torch.Tensor], slots: torch.Tensor, to_cache: bool) -> None:
        keys, values = split_kv_caches(kv_caches, self.layout)
        c_ops.multi_layer_kv_transfer(
            kv, keys, values, slots.to(torch.long), int(self.layout), self.block_size, self.num_kv_heads, to_cache
        )

    def move(self, kv: torch.Tensor, delta: int) -> torch.Tensor:
        """The same KV with its keys moved by `delta` positions (values do not depend on position)."""
        if delta == 0:
            return kv
        layers, tokens = kv.shape[1], kv.shape[2]
        keys = kv[0].transpose(0, 1).reshape(tokens, layers * self.num_kv_heads, self.head_size)
        moved = rotate_keys(keys, torch.tensor([delta]), self.inv_freq, self.is_neox_style)
        out = kv.clone()
        out[0] = moved.reshape(tokens, layers, -1).transpose(0, 1)
        return out

    # ----- segment entries in LMCache -----------------------------------------------------------

    def _staging(self, num_tokens: int) -> List[torch.Tensor]:
        blocks = -(-num_tokens // self.block_size)
        shape = vllm_layer_cache_shape(self.layout, blocks, self.block_size, self.num_kv_heads, self.head_size)
        return [torch.zeros(shape, dtype=self.dtype) for _ in range(self.num_layers)]

    def store_segment(self, tokens: torch.Tensor, kv_at_zero: torch.Tensor, salt: str) -> None:
        """Store a segment's KV (keys at positions 0..n-1) under its own tokens."""
        staging = self._staging(len(tokens))
        slots = torch.arange(len(tokens), dtype=torch.long)
        self.scatter(kv_at_zero, staging, slots)
        self.engine.store(tokens, kvcaches=staging, slot_mapping=slots, cache_salt=salt)

    def fetch_segment(self, tokens: torch.Tensor, salt: str) -> Optional[torch.Tensor]:
        """A segment's KV (keys at positions 0..n-1), or None unless every chunk of it was loaded."""
        staging = self._staging(len(tokens))
        slots = torch.arange(len(tokens), dtype=torch.long)
        got = self.engine.retrieve(tokens, kvcaches=staging, slot_mapping=slots, cache_salt=salt)
        if not bool(got.all()):
            return None
        return self.gather(staging, slots)
