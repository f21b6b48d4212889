"""Per-request bookkeeping on the scheduler side and what it hands the worker each step.

Operations:
- `RequestTracker`: what one request has scheduled so far (tokens, blocks) and how much of it
  is already in LMCache; extended every step, reset when vLLM resumes a preempted request.
- `plan_save(tracker, settings)`: whether this step stores, and which tokens (`SaveSpec`).
- `slot_mapping_for(block_ids, block_size, num_tokens)`: token i -> its slot in vLLM's cache.
- `make_req_meta(...)`: the `ReqMeta` a worker needs to load and/or store one request.

```
  prompt:  |<---------------- prompt_len ---------------->|
  chunks:  |  chunk 0  |  chunk 1  |  chunk 2  |  chunk 3 |partial|
  saved:   |<-- num_saved_tokens -->|
  step:                             |<- scheduled ->|
  store:                            [  chunk 2  ]          (only whole chunks mid-prefill)
  last prefill step stores up to prompt_len when partial chunks are saved
```
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Sequence

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from lmcache.experimental.chunk_tokens import BlockNames
from lmcache.experimental.pd.disagg_spec import DisaggSpec
from lmcache.integration.vllm.v1.request_policy import DoorSettings

if TYPE_CHECKING:
    from lmcache.integration.vllm.blend.plan import BlendStep


@dataclass
class LoadSpec:
    """A load the scheduler promised vLLM for one request."""

    vllm_cached_tokens: int  # leading tokens vLLM already has in its own prefix cache
    lmcache_cached_tokens: int  # leading tokens LMCache has (the whole hit, even on a full hit)
    can_load: bool = False  # set once vLLM allocated blocks for the tokens
    # `enable_async_loading`: part of the prefix is in a slow tier; the worker loads it in the
    # background while vLLM holds the request in WAITING_FOR_REMOTE_KVS.
    is_async: bool = False


@dataclass(frozen=True)
class SaveSpec:
    """A store the worker performs for one request at the end of this step."""

    skip_leading_tokens: int  # already in LMCache; the worker rounds it down to a chunk boundary
    num_tokens: int  # store the KV of tokens [skip_leading_tokens, num_tokens)


@dataclass
class RequestTracker:
    """One running request as the scheduler side sees it across steps."""

    req_id: str
    prompt_len: int
    # Tokens whose KV exists once this step ran (prompt first, then generated tokens).
    token_ids: list[int]
    # vLLM block ids backing those tokens, in order.
    block_ids: list[int]
    # Leading tokens already in LMCache (hit at lookup, or stored by an earlier step).
    num_saved_tokens: int
    cache_salt: str
    may_save: bool

    def extend(self, new_token_ids: Sequence[int], new_block_ids: Sequence[int]) -> None:
        """Add this step's newly scheduled tokens and newly allocated blocks."""
        self.token_ids.extend(new_token_ids)
        self.block_ids.extend(new_block_ids)

    def resume(self, token_ids: Sequence[int], block_ids: Sequence[int]) -> None:
        """vLLM resumed the request after preemption: it has new blocks for all its tokens."""
        self.token_ids = list(token_ids)
        self.block_ids = list(block_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class ReqMeta:
    """What the worker needs to load and/or store one request this step."""

    req_id: str
    token_ids: torch.Tensor  # int64, the leading tokens the load and the store cover
    slot_mapping: torch.Tensor  # int64, slot of each of those tokens in vLLM's KV cache
    cache_salt: str
    load_spec: Optional[LoadSpec]
    save_spec: Optional[SaveSpec]
    disagg_spec: Optional[DisaggSpec] = None  # PD prefiller: push what the save stores, to here
    blend: Optional["BlendStep"] = None  # CacheBlend's load and/or segment stores (enable_blending)
    # vLLM 0.32: vLLM's hashes of the blocks the store covers (and the one before), for KV events
    block_names: Optional[BlockNames] = None


@dataclass
class LMCacheConnectorMetadata(KVConnectorMetadata):
    """The scheduler side's message to the workers for one step."""

    requests: list[ReqMeta] = field(default_factory=list)
    # Requests that ended while their background load ran: vLLM keeps their blocks until the
    # worker reports them in `finished_sending`, once the load stopped writing into them.
    release_after_load: list[str] = field(default_factory=list)
    # No token is computed this step (every request waits, e.g. for a background load): vLLM
    # would step again at once, so the worker may wait a moment for a load to end instead.
    nothing_scheduled: bool = False


def slot_mapping_for(block_ids: Sequence[int], block_size: int, num_tokens: int) -> torch.Tensor:
    """Slot of each of the first `num_tokens` tokens: `block_ids[i // B] * B + i % B`."""
    if num_tokens < 0:
        raise ValueError(f"num_tokens={num_tokens} must be >= 0")
    needed = -(-num_tokens // block_size)
    if len(block_ids) < needed:
        raise ValueError(f"{num_tokens} tokens need {needed} blocks of {block_size}, the request has {len(block_ids)}")
    blocks = torch.tensor(list(block_ids[:needed]), dtype=torch.long)
    offsets = torch.arange(block_size, dtype=torch.long)
    return (blocks[:, None] * block_size + offsets[None, :]).flatten()[:num_tokens]


def async_load_meta(req_id: str, token_ids: Sequence[int], block_ids: Sequence[int], block_size: int,
                    cache_salt: str, spec: LoadSpec) -> ReqMeta:
    """The worker's instructions for a background load, built when vLLM allocates its blocks (the
    request is not scheduled until the load is reported). Tokens beyond the allocated blocks (the
    prompt's last token, which vLLM computes) get slot -1 and are not written."""
    num_tokens = spec.lmcache_cached_tokens
    covered = min(num_tokens, len(block_ids) * block_size)
    slots = torch.full((num_tokens,), -1, dtype=torch.long)
    slots[:covered] = slot_mapping_for(block_ids, block_size, covered)
    return ReqMeta(
        req_id=req_id,
        token_ids=torch.tensor(list(token_ids[:num_tokens]), dtype=torch.long),
        slot_mapping=slots,
        cache_salt=cache_salt,
        load_spec=spec,
        save_spec=None,
    )


def plan_save(tracker: RequestTracker, settings: DoorSettings) -> Optional[SaveSpec]:
    """The store this step should do for `tracker` (after its tokens were extended), or None.

    Mid-prefill only whole chunks are stored; the step that completes the prompt may also store
    the trailing partial chunk; while decoding, chunks are stored as they complete, and only
    with `save_decode_cache`. Nothing is stored unless it goes past what is already saved.
    """
    if not tracker.may_save:
        return None
    total = tracker.num_tokens
    whole = total - total % settings.chunk_size
    if total > tracker.prompt_len:
        if not settings.save_decode_cache:
            return None
        end = whole
    elif total == tracker.prompt_len and settings.save_partial_chunks:
        end = total
    else:
        end = whole
    if end <= tracker.num_saved_tokens:
        return None
    return SaveSpec(skip_leading_tokens=tracker.num_saved_tokens, num_tokens=end)


def make_req_meta(
    tracker: RequestTracker,
    load_spec: Optional[LoadSpec],
    save_spec: Optional[SaveSpec],
    block_size: int,
    blend: Optional["BlendStep"] = None,
) -> Optional[ReqMeta]:
    """The worker's instructions for this request this step (None when it neither loads nor stores)."""
    if load_spec is not None and not load_spec.can_load:
        load_spec = None
    if blend is not None and blend.load and load_spec is None:
        blend = None if not blend.store else dataclasses.replace(blend, load=False)
    if load_spec is None and save_spec is None and blend is None:
        return None
    num_tokens = max(
        load_spec.lmcache_cached_tokens if load_spec is not None else 0,
        save_spec.num_tokens if save_spec is not None else 0,
        blend.num_tokens if blend is not None else 0,
    )
    if num_tokens > tracker.num_tokens:
        raise ValueError(
            f"request {tracker.req_id}: the step covers {num_tokens} tokens, only {tracker.num_tokens} are scheduled"
        )
    return ReqMeta(
        req_id=tracker.req_id,
        token_ids=torch.tensor(tracker.token_ids[:num_tokens], dtype=torch.long),
        slot_mapping=slot_mapping_for(tracker.block_ids, block_size, num_tokens),
        cache_salt=tracker.cache_salt,
        load_spec=load_spec,
        save_spec=save_spec,
        blend=blend,
    )
