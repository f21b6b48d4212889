"""The scheduler side of the v1 door: lookups, load promises, per-step store plans, the log line.

vLLM calls, per step:
- `get_num_new_matched_tokens(request, num_computed_tokens)` for each waiting request it tries
  to schedule: LMCache's cached prefix beyond vLLM's own hit (one token less when the whole
  prompt is cached: vLLM must compute at least one token to sample);
- `update_state_after_alloc(request, num_external_tokens)` once blocks are allocated;
- `build_connector_meta(scheduler_output)` once per step: trackers are created or extended and
  every request that loads or stores this step gets a `ReqMeta`;
- `request_finished(request, block_ids)`: one log line per request; blocks are freed at once
  because stores finish inside the step (`wait_for_save`).

A PD prefiller (`pd_role: sender`) never looks up; each request's `disagg_spec` rides on its
store plans to the worker, which pushes what it stores (`pd_requests.py`).

`enable_async_loading` (through the `lmcache_vllm` wrapper, whose patched shell calls
`match_tokens` and hands over the allocated blocks): a prefix that needs a slow tier is answered
`(n, True)`; vLLM parks the request in WAITING_FOR_REMOTE_KVS and this side sends the worker a
background load (`async_load_meta`) in the same step. `async_loaded_tokens` tells vLLM 0.9.2 how
much really arrived. A request gets at most one background load; a later lookup of it is
synchronous. Promises are rounded down to a block (vLLM 0.9.2 counts whole blocks as loaded).

No engine lives here: lookups and the worker's counters go through a `WorkerChannel`.

Each lookup names its request, so the worker's engine pins the prefix it reports until the load
(see `worker_side.py`). When a promise is not kept - vLLM already has at least as much, or it
allocated no blocks for LMCache's tokens - this side releases the pins at once (`unpin`); a
request that ends without loading is released by the worker's `get_finished`.

Preemption: vLLM frees a preempted request's blocks without telling the connector and later
looks it up again like a new request; its tracker stays, and on the resume (`resumed` in the
step's cached requests) takes the new blocks and stores on from what that lookup found.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Optional, Sequence

from lmcache.experimental.chunk_tokens import BlockNames
from lmcache.experimental.metrics import record_vllm_hit_tokens
from lmcache.integration.vllm.v1.pd_requests import PDRequests
from lmcache.integration.vllm.blend.plan import BlendScheduler
from lmcache.integration.vllm.request_log import RequestCounters, RequestStats, format_request_line
from lmcache.integration.vllm.v1.request_policy import DoorSettings, RequestPolicy, request_policy
from lmcache.integration.vllm.v1.request_state import (
    LMCacheConnectorMetadata,
    LoadSpec,
    ReqMeta,
    RequestTracker,
    SaveSpec,
    async_load_meta,
    make_req_meta,
    plan_save,
)
from lmcache.integration.vllm.v1.worker_channel import ChannelError, WorkerChannel
from lmcache.integration.vllm.vllm_compat import cached_request_step, request_block_hashes
from lmcache.logging import init_logger

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)


def _single_group(block_ids: Sequence[Sequence[int]], req_id: str) -> list[int]:
    """vLLM gives one block list per KV cache group; LMCache handles models with one group."""
    if len(block_ids) != 1:
        raise NotImplementedError(
            f"request {req_id}: {len(block_ids)} KV cache groups (hybrid attention); "
            "LMCache supports models with a single KV cache group"
        )
    return list(block_ids[0])


class LMCacheSchedulerSide:
    """Scheduler-side bookkeeping for every request between its first lookup and its end."""

    def __init__(self, settings: DoorSettings, channel: WorkerChannel, blend: Optional[BlendScheduler] = None) -> None:
        self.settings = settings
        self._channel = channel
        self._blend = blend  # CacheBlend (enable_blending): segment lookups instead of the prefix one
        # The live vLLM requests (their token lists grow as they decode).
        self._requests: dict[str, "Request"] = {}
        self._policies: dict[str, RequestPolicy] = {}
        self._stats: dict[str, RequestStats] = {}
        self._load_specs: dict[str, LoadSpec] = {}
        self._trackers: dict[str, RequestTracker] = {}
        # A PD prefiller's disagg specs (None unless pd_role is sender).
        self._pd = PDRequests(settings.pd_sender_peer) if settings.pd_sender_peer is not None else None
        self._async_tried: set[str] = set()  # requests that had their background load
        self._async_loads: list[ReqMeta] = []  # background loads for the next step's metadata
        self._async_pending: set[str] = set()  # background load sent, request not scheduled yet
        self._release_after_load: list[str] = []
        self._said_sync = False

    # ----- before scheduling -------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> int:
        """Tokens LMCache can load beyond vLLM's own `num_computed_tokens` (0 for none), loaded
        within the step (vLLM's own shell asks for this answer)."""
        if self.settings.async_loading and not self._said_sync:
            self._said_sync = True
            logger.warning(
                "enable_async_loading is on, but vLLM's LMCacheConnectorV1 answers every lookup as "
                "synchronous; run vLLM through lmcache_vllm for background loads. Loading synchronously."
            )
        return self._match(request, num_computed_tokens, allow_async=False)[0]

    def match_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        """`(tokens, load asynchronously)`: vLLM's full answer (the wrapper's patched shell)."""
        allow = self.settings.async_loading and request.request_id not in self._async_tried
        return self._match(request, num_computed_tokens, allow)

    def _match(self, request: "Request", num_computed_tokens: int, allow_async: bool) -> tuple[int, bool]:
        req_id = request.request_id
        self._requests[req_id] = request
        policy = self._policies.get(req_id)
        if policy is None:
            policy = self._policies[req_id] = request_policy(request, self.settings)
        prompt = request.prompt_token_ids
        stats = self._stats[req_id] = RequestStats(len(prompt), num_computed_tokens)
        self._load_specs.pop(req_id, None)
        if self._pd is not None:
            self._pd.admit(request)
            return 0, False  # a PD prefiller computes every prompt and pushes it; it never loads
        if not policy.use_cache or not policy.may_load:
            return 0, False
        if self._blend is not None:
            blended = self._blend.match(req_id, prompt, policy.cache_salt, policy.may_save, self._channel)
            if blended is not None:  # the worker blends all prompt tokens but the last
                stats.lmcache_hit_tokens = blended
                if blended == 0 or len(prompt) - 1 <= num_computed_tokens:
                    return 0, False
                self._load_specs[req_id] = LoadSpec(num_computed_tokens, lmcache_cached_tokens=len(prompt) - 1)
                return len(prompt) - 1 - num_computed_tokens, False
        num_lookup = len(prompt) - self.settings.skip_last_n_tokens
        if num_lookup <= 0:
            return 0, False
        slow = False
        try:
            if allow_async:
                hit, slow = self._channel.lookup_async(prompt[:num_lookup], policy.cache_salt, req_id, num_computed_tokens)
            else:
                hit = self._channel.lookup(prompt[:num_lookup], policy.cache_salt, req_id, num_computed_tokens)
        except ChannelError as err:
            logger.error("request %s: LMCache lookup failed, computing it all: %s", req_id, err)
            return 0, False
        stats.lmcache_hit_tokens = hit
        tracker = self._trackers.get(req_id)
        if tracker is not None:
            # A preempted request looked up again: what LMCache holds now, not what it stored
            # before (evicted since: stored again; stored since by another request: not again).
            tracker.num_saved_tokens = hit
        # vLLM must compute at least the last prompt token to sample from it.
        claimed = len(prompt) - 1 if hit >= len(prompt) else hit
        if slow and claimed < len(prompt) - 1:
            claimed -= claimed % self.settings.block_size
        if claimed <= num_computed_tokens:
            if hit > 0 and not slow:
                self._unpin(req_id)
            return 0, False
        self._load_specs[req_id] = LoadSpec(
            vllm_cached_tokens=num_computed_tokens, lmcache_cached_tokens=hit, is_async=slow
        )
        if slow:
            self._async_tried.add(req_id)
        return claimed - num_computed_tokens, slow

    def update_state_after_alloc(
        self, request: "Request", num_external_tokens: int, block_ids: Optional[Sequence[Sequence[int]]] = None
    ) -> None:
        """vLLM allocated blocks: the load goes ahead only if it allocated for LMCache's tokens.
        `block_ids` (every block of the request, per KV cache group) come with a background load."""
        spec = self._load_specs.get(request.request_id)
        if spec is None:
            return
        if num_external_tokens == 0:
            del self._load_specs[request.request_id]
            if not spec.is_async:
                self._unpin(request.request_id)
            return
        if spec.is_async:
            self._start_async_load(request, spec, block_ids)
            return
        promised = min(spec.lmcache_cached_tokens, len(request.prompt_token_ids) - 1) - spec.vllm_cached_tokens
        if num_external_tokens != promised:
            raise RuntimeError(
                f"request {request.request_id}: vLLM allocated {num_external_tokens} external tokens, "
                f"LMCache promised {promised}"
            )
        spec.can_load = True

    def _start_async_load(
        self, request: "Request", spec: LoadSpec, block_ids: Optional[Sequence[Sequence[int]]]
    ) -> None:
        req_id = request.request_id
        del self._load_specs[req_id]  # settled by the background load, not by a scheduled step
        if block_ids is None:
            raise RuntimeError(f"request {req_id}: a background load needs the allocated blocks (the wrapper's shell)")
        spec.can_load = True
        self._async_pending.add(req_id)
        policy = self._policies[req_id]
        blocks = _single_group(block_ids, req_id)
        self._async_loads.append(
            async_load_meta(req_id, request.prompt_token_ids, blocks, self.settings.block_size, policy.cache_salt, spec)
        )

    def async_loaded_tokens(self, req_id: str) -> Optional[int]:
        """Leading tokens the request's finished background load left in its blocks (None: unknown)."""
        try:
            return self._channel.pop_async_loaded(req_id)
        except ChannelError as err:
            logger.error("request %s: cannot read the LMCache background load's result: %s", req_id, err)
            return 0  # nothing is trusted: vLLM computes the prompt

    # ----- every step ----------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> LMCacheConnectorMetadata:
        """Track this step's tokens and blocks; plan each request's load and store."""
        meta = LMCacheConnectorMetadata(nothing_scheduled=scheduler_output.total_num_scheduled_tokens == 0)
        meta.requests.extend(self._async_loads)
        meta.release_after_load = self._release_after_load
        self._async_loads, self._release_after_load = [], []
        for req_id in scheduler_output.finished_req_ids:
            self._forget(req_id)
        for new_req in scheduler_output.scheduled_new_reqs:
            req_id = new_req.req_id
            self._async_pending.discard(req_id)  # its background load was reported done
            policy, stats = self._policies.get(req_id), self._stats.get(req_id)
            if policy is None or stats is None:
                logger.warning("request %s was scheduled without an LMCache lookup; not caching it", req_id)
                continue
            total = new_req.num_computed_tokens + scheduler_output.num_scheduled_tokens[req_id]
            tracker = RequestTracker(
                req_id=req_id,
                prompt_len=len(new_req.prompt_token_ids),
                token_ids=list(new_req.prompt_token_ids[:total]),
                block_ids=_single_group(new_req.block_ids, req_id),
                num_saved_tokens=stats.lmcache_hit_tokens,
                cache_salt=policy.cache_salt,
                may_save=policy.may_save and not (self._blend is not None and self._blend.blends(req_id)),
            )
            self._trackers[req_id] = tracker
            self._plan(meta, tracker, self._load_specs.pop(req_id, None))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracker, request = self._trackers.get(req_id), self._requests.get(req_id)
            if tracker is None or request is None:
                if self._load_specs.pop(req_id, None) is not None:
                    self._unpin(req_id)  # nothing to load it into: drop the promise
                continue
            # Speculative tokens are scheduled but not part of the request's tokens yet.
            total = min(cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens[req_id], request.num_tokens)
            resumed, new_block_ids = cached_request_step(cached, i)
            new_blocks = [] if new_block_ids is None else _single_group(new_block_ids, req_id)
            load_spec: Optional[LoadSpec] = None
            if resumed:
                tracker.resume(request.all_token_ids[:total], new_blocks)
                load_spec = self._load_specs.pop(req_id, None)
            else:
                tracker.extend(request.all_token_ids[tracker.num_tokens : total], new_blocks)
            self._plan(meta, tracker, load_spec)
        return meta

    def _plan(self, meta: LMCacheConnectorMetadata, tracker: RequestTracker, load_spec: Optional[LoadSpec]) -> None:
        save_spec = plan_save(tracker, self.settings)
        blend = None
        if self._blend is not None:
            blend = self._blend.step(tracker.req_id, tracker.num_tokens, tracker.prompt_len, load_spec is not None)
        req_meta = make_req_meta(tracker, load_spec, save_spec, self.settings.block_size, blend)
        if save_spec is not None:
            tracker.num_saved_tokens = save_spec.num_tokens
            if req_meta is not None and self.settings.kv_events:
                req_meta = dataclasses.replace(req_meta, block_names=self._block_names(tracker.req_id, save_spec))
            if req_meta is not None and self._pd is not None:
                req_meta = dataclasses.replace(req_meta, disagg_spec=self._pd.step_spec(tracker, save_spec))
        if req_meta is not None:
            meta.requests.append(req_meta)

    def _block_names(self, req_id: str, save_spec: SaveSpec) -> Optional[BlockNames]:
        """vLLM's hashes of the blocks this store's chunks cover and of the block before the first
        (the worker stores from `skip_leading_tokens` rounded down to a chunk); None where vLLM
        has none (0.9.2) or its blocks do not tile a chunk."""
        request = self._requests.get(req_id)
        block, chunk = self.settings.block_size, self.settings.chunk_size
        if request is None or chunk % block:
            return None
        start = save_spec.skip_leading_tokens - save_spec.skip_leading_tokens % chunk
        first = max(start // block - 1, 0)
        hashes = request_block_hashes(request, first, save_spec.num_tokens // block)
        return BlockNames(block, first, hashes) if hashes is not None else None

    # ----- at the end -----------------------------------------------------------------------------

    def request_finished(self, request: "Request", block_ids: Sequence[int]) -> tuple[bool, Optional[dict[str, Any]]]:
        """Log the request's line and forget it; its blocks can be freed now, unless its background
        load may still be writing into them (then `(True, None)`: the worker reports them free)."""
        req_id = request.request_id
        stats = self._stats.get(req_id)
        if stats is not None:
            try:
                counters = self._channel.pop_request_counters(req_id)
            except ChannelError as err:
                logger.error("request %s: cannot read the worker's LMCache counters: %s", req_id, err)
                counters = RequestCounters()
            policy = self._policies.get(req_id)
            reasons = ("", "") if policy is None else (policy.reason, policy.load_reason)
            logger.info("%s", format_request_line(req_id, stats, counters, *reasons))
            record_vllm_hit_tokens(self.settings.model_name, stats.vllm_cached_tokens)
        params = self._pd.finished(request) if self._pd is not None else None
        self._forget(req_id)
        if req_id in self._async_pending:
            self._async_pending.discard(req_id)
            self._release_after_load.append(req_id)
            return True, params
        return False, params

    def _unpin(self, req_id: str) -> None:
        """The worker need not hold this request's lookup any longer."""
        try:
            self._channel.unpin([req_id])
        except ChannelError as err:
            # The worker still releases them when the request ends (`get_finished`).
            logger.warning("request %s: cannot release LMCache pins now: %s", req_id, err)

    def _forget(self, req_id: str) -> None:
        if self._blend is not None:
            self._blend.forget(req_id)
        for table in (self._requests, self._policies, self._stats, self._load_specs, self._trackers):
            table.pop(req_id, None)
        if self._pd is not None:
            self._pd.forget(req_id)
        self._async_tried.discard(req_id)

    def num_tracked_requests(self) -> int:
        """Requests with scheduler-side state (tests check nothing leaks)."""
        pd = 0 if self._pd is None else len(self._pd)
        return len(set(self._requests) | set(self._trackers) | set(self._load_specs) | set(self._stats)) + pd

    def held(self) -> dict[str, int]:
        """What this side holds for requests now (the status API's `/held`; all 0 at idle)."""
        return {"tracked_requests": self.num_tracked_requests(),
                "awaiting_background_loads": len(self._async_pending),
                "background_loads_tried": len(self._async_tried),
                "unsent_loads_and_releases": len(self._async_loads) + len(self._release_after_load)}

    def close(self) -> None:
        self._channel.close()
