"""CacheBlend on the worker: blend a request's prompt into vLLM's KV cache, store its segments.

`Blender.blend` computes the KV of every prompt token but the last (vLLM computes that one and
samples from it), layer by layer with the model's own modules:

```
  layer < check:   every token computed fresh (attends causally over the fresh KV)
  layer == check:  fresh K/V of every token compared with the reused (RoPE-moved) K/V, then
                   written for every token (computed anyway, and exact: the layers below were
                   computed in full); kept: tokens no cached segment covers + the
                   blend_recompute_ratio share of reused tokens that deviate most
  layer > check:   only kept tokens are computed, attending over reused + recomputed KV
```
The check layer is the second one: a first layer's KV depends on the token and its position
only, so it cannot show what the context changed. With ratio 1.0 every token is kept, which is a
full prefill. Ratio 0 is naive reuse: no check layer, the reused tokens keep their cached KV at
every layer and only the tokens no segment covers are computed. Tokens vLLM already had (its own
prefix cache) are read, never written.
"""

from __future__ import annotations

import time
from typing import Any, Optional, Sequence

import torch

from lmcache.experimental.blend.segments import segment_salt
from lmcache.experimental.blend.selection import kv_deviation, select_recompute
from lmcache.experimental.cache_engine import LMCacheEngine
from lmcache.experimental.kv_layout import KVLayout
from lmcache.integration.vllm.blend.kv import BlendKV
from lmcache.integration.vllm.blend.model import LlamaBlendModel
from lmcache.integration.vllm.v1.request_state import ReqMeta
from lmcache.integration.vllm.vllm_compat import find_causal_lm
from lmcache.logging import init_logger

logger = init_logger(__name__)


class Blender:
    """One worker's CacheBlend: the model is found on first use (vLLM loads it after the connector)."""

    def __init__(self, engine: LMCacheEngine, layout: KVLayout, block_size: int, ratio: float) -> None:
        self.engine = engine
        self.layout = layout
        self.block_size = block_size
        self.ratio = ratio
        self._model: Optional[LlamaBlendModel] = None
        self._kv: Optional[BlendKV] = None

    def _ready(self, forward_context: Any) -> tuple[LlamaBlendModel, BlendKV]:
        if self._model is None or self._kv is None:
            model = LlamaBlendModel(find_causal_lm(forward_context))
            self._kv = BlendKV(self.engine, self.layout, self.block_size, model.inv_freq, model.is_neox_style)
            self._model = model
        return self._model, self._kv

    @torch.inference_mode()
    def blend(self, req: ReqMeta, kv_caches: Sequence[torch.Tensor], forward_context: Any) -> int:
        """Write the blended KV of the promised tokens into vLLM's cache; returns the tokens reused."""
        assert req.load_spec is not None and req.blend is not None
        started = time.perf_counter()
        model, io = self._ready(forward_context)
        n, first = req.load_spec.lmcache_cached_tokens, req.load_spec.vllm_cached_tokens
        tokens, slots = req.token_ids[:n], req.slot_mapping[:n]
        if first >= n:
            return 0
        salt = segment_salt(req.cache_salt)
        kv = torch.zeros(2, model.num_layers, n, model.shape.kv_hidden, dtype=io.dtype)
        if first:
            kv[:, :, :first] = io.gather(kv_caches, slots[:first])
        reused = torch.zeros(n, dtype=torch.bool)
        found = 0
        for seg in req.blend.segments:
            if seg.end <= first or seg.end > n:
                continue
            seg_kv = io.fetch_segment(tokens[seg.start : seg.end], salt)
            if seg_kv is None:  # gone since the lookup: recomputed like an uncovered token
                continue
            found += 1
            lo = max(seg.start, first)
            kv[:, :, lo : seg.end] = io.move(seg_kv, seg.start)[:, :, lo - seg.start :]
            reused[lo : seg.end] = True
        fetched = time.perf_counter()
        kept = self._run_layers(model, tokens, first, kv, reused)
        io.scatter(kv[:, :, first:], kv_caches, slots[first:])
        num_reused = int(reused.sum())
        logger.info(
            "request %s: CacheBlend reused %d of %d segments (%d tokens), recomputed %d of %d tokens "
            "(blend_recompute_ratio=%.2f) in %.3f s (segments loaded in %.3f s)",
            req.req_id, found, len(req.blend.segments), num_reused, kept, n - first, self.ratio,
            time.perf_counter() - started, fetched - started,
        )
        return num_reused

    def _run_layers(
        self, model: LlamaBlendModel, tokens: torch.Tensor, first: int, kv: torch.Tensor, reused: torch.Tensor
    ) -> int:
        """Fill `kv` layer by layer (see the module docstring); returns how many tokens were kept."""
        active = torch.arange(first, len(tokens))
        check = min(1, model.num_layers - 1)
        if self.ratio == 0.0:  # naive reuse: nothing of the reused tokens is computed
            active, check = active[~reused[active]], -1
        if not len(active):
            return 0
        hidden = model.embed(tokens[active])
        residual: Optional[torch.Tensor] = None
        for index in range(model.num_layers):
            q, k, v, residual = model.project(index, hidden, residual, active)
            if index == check:
                deviation = kv_deviation(k, v, kv[0, index, active], kv[1, index, active])
                keep = select_recompute(deviation, reused[active], self.ratio)
            kv[0, index, active] = k
            kv[1, index, active] = v
            if index == check:
                q, residual, active = q[keep], residual[keep], active[keep]
            out = model.attend(q, active, kv[0, index], kv[1, index])
            hidden, residual = model.finish(index, out, residual)
        return len(active)

    @torch.inference_mode()
    def store_segments(self, req: ReqMeta, kv_caches: Sequence[torch.Tensor], forward_context: Any) -> int:
        """Store the KV of the step's `blend.store` segments from vLLM's cache; returns tokens stored."""
        assert req.blend is not None
        _, io = self._ready(forward_context)
        salt = segment_salt(req.cache_salt)
        stored = 0
        for seg in req.blend.store:
            kv = io.gather(kv_caches, req.slot_mapping[seg.start : seg.end])
            io.store_segment(req.token_ids[seg.start : seg.end], io.move(kv, -seg.start), salt)
            stored += seg.length
        return stored
