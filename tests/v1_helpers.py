"""Small builders for the v1 door's unit tests: real vLLM `Request` / `SchedulerOutput` objects,
a recording worker channel, and `StepDriver`, which calls the scheduler side the way vLLM's
scheduler does (lookup, allocation, one `build_connector_meta` per step) without any engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from vllm import SamplingParams
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.request import Request

from lmcache.integration.vllm.request_log import RequestCounters
from lmcache.integration.vllm.v1.request_policy import DoorSettings
from lmcache.integration.vllm.v1.request_state import LMCacheConnectorMetadata
from lmcache.integration.vllm.v1.scheduler_side import LMCacheSchedulerSide


def make_settings(**overrides) -> DoorSettings:
    values = dict(
        chunk_size=256,
        block_size=16,
        save_decode_cache=False,
        save_partial_chunks=True,
        skip_last_n_tokens=0,
        priority_limit=None,
        force_skip_save=False,
        kv_role="kv_both",
        model_name="test/model",
    )
    values.update(overrides)
    return DoorSettings(**values)


def make_request(
    req_id: str,
    prompt: Sequence[int],
    *,
    kv_transfer_params: Optional[dict] = None,
    lora_request=None,
    cache_salt: Optional[str] = None,
    priority: int = 0,
    prompt_logprobs: Optional[int] = None,
) -> Request:
    extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params is not None else None
    return Request(
        request_id=req_id,
        prompt_token_ids=list(prompt),
        multi_modal_inputs=None,
        multi_modal_hashes=None,
        multi_modal_placeholders=None,
        sampling_params=SamplingParams(max_tokens=64, extra_args=extra, prompt_logprobs=prompt_logprobs),
        pooling_params=None,
        eos_token_id=2,
        lora_request=lora_request,
        cache_salt=cache_salt,
        priority=priority,
    )


def scheduler_output(
    new: Sequence[NewRequestData] = (),
    cached: Optional[CachedRequestData] = None,
    num_scheduled: Optional[dict[str, int]] = None,
    finished: Optional[set[str]] = None,
) -> SchedulerOutput:
    num_scheduled = num_scheduled or {}
    return SchedulerOutput(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=cached or CachedRequestData.make_empty(),
        num_scheduled_tokens=num_scheduled,
        total_num_scheduled_tokens=sum(num_scheduled.values()),
        scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={},
        num_common_prefix_blocks=[0],
        finished_req_ids=finished or set(),
        free_encoder_input_ids=[],
        structured_output_request_ids={},
        grammar_bitmask=None,
    )


@dataclass
class RecordingChannel:
    """A worker channel whose hit count comes from `hit(tokens, salt)`; records every call (lookups
    with the request id they pin for, unpins, counter reads)."""

    hit: Callable[[list[int], str], int] = lambda tokens, salt: 0
    lookups: list[tuple[list[int], str]] = field(default_factory=list)
    lookup_ids: list[str] = field(default_factory=list)  # the request id each lookup pinned for
    lookup_computed: list[int] = field(default_factory=list)  # vLLM's own prefix each lookup skipped
    unpinned: list[str] = field(default_factory=list)
    counters: dict[str, RequestCounters] = field(default_factory=dict)
    popped: list[str] = field(default_factory=list)

    def lookup(self, token_ids: Sequence[int], cache_salt: str, request_id: str = "", computed: int = 0) -> int:
        tokens = list(token_ids)
        self.lookups.append((tokens, cache_salt))
        self.lookup_ids.append(request_id)
        self.lookup_computed.append(computed)
        return self.hit(tokens, cache_salt)

    def unpin(self, request_ids: Sequence[str]) -> None:
        self.unpinned.extend(request_ids)

    def pop_request_counters(self, req_id: str) -> RequestCounters:
        self.popped.append(req_id)
        return self.counters.pop(req_id, RequestCounters())

    def close(self) -> None:
        return None


class StepDriver:
    """Drives `LMCacheSchedulerSide` like vLLM's scheduler: one call of `step` per engine step."""

    def __init__(self, side: LMCacheSchedulerSide, block_size: int) -> None:
        self.side = side
        self.block_size = block_size
        self.next_block = 100
        self.blocks: dict[str, list[int]] = {}
        self.requests: dict[str, Request] = {}
        self.returned: dict[str, int] = {}

    def _alloc(self, req_id: str, num_tokens: int) -> list[int]:
        have = self.blocks.setdefault(req_id, [])
        new = []
        while len(have) * self.block_size < num_tokens:
            have.append(self.next_block)
            new.append(self.next_block)
            self.next_block += 1
        return new

    def admit(self, request: Request, num_scheduled: int, vllm_cached: int = 0) -> LMCacheConnectorMetadata:
        """Schedule a waiting request: lookup, allocation, and this step's metadata."""
        external = self.side.get_num_new_matched_tokens(request, vllm_cached)
        self.returned[request.request_id] = external
        computed = vllm_cached + external
        num_scheduled = min(num_scheduled, request.num_tokens - computed)
        self._alloc(request.request_id, computed + num_scheduled)
        self.side.update_state_after_alloc(request, external)
        request.num_computed_tokens = computed
        self.requests[request.request_id] = request
        data = NewRequestData.from_request(request, (list(self.blocks[request.request_id]),))
        meta = self.side.build_connector_meta(scheduler_output([data], num_scheduled={request.request_id: num_scheduled}))
        request.num_computed_tokens += num_scheduled
        return meta

    def run(self, request: Request, num_scheduled: int, resumed: bool = False) -> LMCacheConnectorMetadata:
        """Schedule a running request for `num_scheduled` more tokens."""
        req_id = request.request_id
        new_blocks = self._alloc(req_id, request.num_computed_tokens + num_scheduled)
        cached = CachedRequestData(
            req_ids=[req_id],
            resumed_from_preemption=[resumed],
            new_token_ids=[],
            new_block_ids=[(list(self.blocks[req_id]) if resumed else new_blocks,)],
            num_computed_tokens=[request.num_computed_tokens],
        )
        meta = self.side.build_connector_meta(scheduler_output(cached=cached, num_scheduled={req_id: num_scheduled}))
        request.num_computed_tokens += num_scheduled
        return meta

    def decode(self, request: Request, token: int) -> LMCacheConnectorMetadata:
        """Sample one token (vLLM appends it) and schedule it in the next step."""
        request.append_output_token_ids(token)
        return self.run(request, 1)

    def slots(self, req_id: str, num_tokens: int) -> list[int]:
        blocks = self.blocks[req_id]
        return [blocks[i // self.block_size] * self.block_size + i % self.block_size for i in range(num_tokens)]
