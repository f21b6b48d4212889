"""Layer-by-layer copies of a request's chunks between vLLM's paged KV cache and chunk objects.

`LMCacheEngine.store_layer` / `retrieve_layer` keep the chunks exactly as the whole-chunk
`store` / `retrieve` do (`KV_BLOB` objects `[2, L, T, hidden]` under the same keys), so each path
reads what the other wrote; only the copy is split by layer. A `LayerCopier` moves one layer of
every chunk of a request with ONE `c_ops.single_layer_kv_transfer` call through a contiguous
staging buffer `[2, tokens, hidden]` (`[1, ...]` for MLA): a layer of a chunk object is a strided
view, which the kernel does not take.

```
  chunk objects   [2, L, T0, H]  [2, L, T1, H]  ...       (one per chunk of the request)
  layer l views    [:, l]         [:, l]
  staging         [2, T0 + T1 + ..., H]  <-- one kernel call per layer --> vLLM's layer-l cache
```
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

import torch

import lmcache.c_ops as c_ops
from lmcache.experimental.gpu_connector import GPUConnectorInterface, VLLMPagedMemGPUConnector
from lmcache.experimental.kv_layout import split_kv_caches
from lmcache.experimental.memory_management import MemoryObj


@dataclass(frozen=True)
class ChunkSpan:
    """One chunk of the request: tokens `[start, end)` and the object holding (or receiving) them."""

    start: int
    end: int
    obj: MemoryObj


def paged_connector(connector: GPUConnectorInterface) -> VLLMPagedMemGPUConnector:
    """The connector, if it can address one layer of a paged cache; ValueError otherwise."""
    if not isinstance(connector, VLLMPagedMemGPUConnector):
        raise ValueError(
            f"layer-wise transfer needs a paged connector (VLLMPagedMemGPUConnector[V2]), got {type(connector).__name__}"
        )
    return connector


def request_slots(slot_mapping: Any, offset: int, spans: Sequence[ChunkSpan], storing: bool) -> torch.Tensor:
    """The slots of every span's tokens, concatenated; `slot_mapping[i]` is token `offset + i`'s."""
    if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dim() != 1:
        raise ValueError(f"'slot_mapping' must be a 1-D tensor, got {type(slot_mapping).__name__}")
    if offset < 0:
        raise ValueError(f"offset={offset} must be >= 0")
    parts = []
    for span in spans:
        if span.start < offset or span.end - offset > slot_mapping.numel():
            raise ValueError(
                f"'slot_mapping' covers tokens [{offset}, {offset + slot_mapping.numel()}); "
                f"tokens [{span.start}, {span.end}) are outside it"
            )
        parts.append(slot_mapping[span.start - offset : span.end - offset])
    slots = torch.cat(parts).to(torch.long) if parts else torch.empty(0, dtype=torch.long)
    if storing and bool((slots < 0).any()):
        raise ValueError("'slot_mapping' has -1 for tokens to store: tokens vLLM did not compute cannot be stored")
    return slots


class LayerCopier:
    """Copies one layer at a time of a request's chunks: vLLM's cache -> objects (`storing`) or
    objects -> vLLM's cache. Shapes and layout are checked once, at construction."""

    def __init__(
        self,
        connector: GPUConnectorInterface,
        kvcaches: Sequence[Any],
        slots: torch.Tensor,
        spans: Sequence[ChunkSpan],
        *,
        storing: bool,
    ) -> None:
        paged = paged_connector(connector)
        if len(kvcaches) != paged.num_layers:
            raise ValueError(f"'kvcaches' has {len(kvcaches)} layers, the connector was made for {paged.num_layers}")
        self.geometry = paged.geometry(kvcaches)
        self.keys, self.values = split_kv_caches(kvcaches, self.geometry.layout)
        self.spans = list(spans)
        self.storing = storing
        device = self.keys[0].device
        self.slots = slots.to(device)
        kinds, hidden = (1 if paged.use_mla else 2), paged.hidden_dim_size
        dtype = self.spans[0].obj.metadata.dtype if self.spans else self.keys[0].dtype
        self.staging = torch.empty((kinds, int(self.slots.numel()), hidden), dtype=dtype, device=device)
        for span in self.spans:
            expected = paged.get_shape(span.end - span.start)
            if span.obj.tensor is None or span.obj.tensor.shape != expected:
                raise ValueError(f"chunk [{span.start}, {span.end}) object is not a {list(expected)} tensor")

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    def _views(self, layer: int) -> List[tuple]:
        views, offset = [], 0
        for span in self.spans:
            n = span.end - span.start
            assert span.obj.tensor is not None
            views.append((span.obj.tensor[:, layer], self.staging[:, offset : offset + n]))
            offset += n
        return views

    def copy_layer(self, layer: int) -> None:
        """Move layer `layer` of every span (in the direction given at construction)."""
        if not self.spans:
            return
        value: Optional[torch.Tensor] = self.values[layer] if self.values else None
        geo = self.geometry
        views = self._views(layer)
        if not self.storing:
            for obj_layer, staged in views:
                staged.copy_(obj_layer)
        c_ops.single_layer_kv_transfer(
            self.staging, self.keys[layer], value, self.slots, int(geo.layout), geo.block_size, geo.num_heads,
            not self.storing,
        )
        if self.storing:
            for obj_layer, staged in views:
                obj_layer.copy_(staged)
