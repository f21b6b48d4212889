"""Layer-by-layer copies of a request's chunks between vLLM's paged KV cache and chunk objects.

`LMCacheEngine.store_layer` / `retrieve_layer` keep the chunks exactly as the whole-chunk
`store` / `retrieve` do (`KV_BLOB` objects `[2, L, T, hidden]` under the same keys), so each path
reads what the other wrote; only the copy is split by layer. A `LayerCopier` moves one layer of
every chunk of a request with ONE `c_ops.layer_kv_transfer_batch` call, straight between the
whole chunk objects (`[1, L, T, H]` for MLA) and that layer's cache: no staging copy, so each
layer's bytes move once, as in the whole-chunk path.

```
  chunk objects   [2, L, T0, H]  [2, L, T1, H]  ...       (one per chunk of the request)
  layer l          [:, l]         [:, l]
                   <-- one layer_kv_transfer_batch(objs, l, ...) per layer --> vLLM's layer-l cache
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
        lengths = [span.end - span.start for span in self.spans]
        if sum(lengths) != self.slots.numel():
            raise ValueError(f"'slots' has {self.slots.numel()} entries, the spans cover {sum(lengths)} tokens")
        self.slot_parts = list(torch.split(self.slots, lengths)) if self.spans else []
        self.objs: List[torch.Tensor] = []
        for span in self.spans:
            expected = paged.get_shape(span.end - span.start)
            if span.obj.tensor is None or span.obj.tensor.shape != expected:
                raise ValueError(f"chunk [{span.start}, {span.end}) object is not a {list(expected)} tensor")
            self.objs.append(span.obj.tensor)

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    def copy_layer(self, layer: int) -> None:
        """Move layer `layer` of every span (in the direction given at construction)."""
        if not self.spans:
            return
        value: Optional[torch.Tensor] = self.values[layer] if self.values else None
        geo = self.geometry
        c_ops.layer_kv_transfer_batch(
            self.objs, layer, self.keys[layer], value, self.slot_parts, int(geo.layout), geo.block_size,
            geo.num_heads, not self.storing,
        )
