"""What the worker hands the engine for one request's load or store, from the step's `ReqMeta`
(shared by the synchronous and the layer-wise paths)."""

from __future__ import annotations

import torch

from lmcache.experimental.token_database import skip_prefix_mask
from lmcache.integration.vllm.v1.request_state import ReqMeta


def load_arguments(req: ReqMeta, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens, mask, slots) of a request's load: the chunks beyond vLLM's own prefix, with slots
    -1 over that prefix (vLLM's cached blocks may be shared with running requests: never written)."""
    spec = req.load_spec
    assert spec is not None
    num_tokens, vllm_cached = spec.lmcache_cached_tokens, spec.vllm_cached_tokens
    slots = req.slot_mapping[:num_tokens].clone()
    slots[:vllm_cached] = -1
    return req.token_ids[:num_tokens], skip_prefix_mask(num_tokens, vllm_cached, chunk_size), slots


def store_arguments(req: ReqMeta, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens, mask, slots) of a request's planned store."""
    spec = req.save_spec
    assert spec is not None
    mask = skip_prefix_mask(spec.num_tokens, spec.skip_leading_tokens, chunk_size)
    return req.token_ids[: spec.num_tokens], mask, req.slot_mapping[: spec.num_tokens]
