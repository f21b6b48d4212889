"""Scheduler side of the v1 door: lookups, load promises, trackers and store plans across steps."""

from __future__ import annotations

import logging

import pytest
import torch
from vllm.lora.request import LoRARequest

from lmcache.integration.vllm.request_log import RequestCounters
from lmcache.integration.vllm.v1.request_state import (
    LoadSpec,
    RequestTracker,
    SaveSpec,
    plan_save,
    slot_mapping_for,
)
from lmcache.integration.vllm.v1.scheduler_side import LMCacheSchedulerSide
from lmcache.integration.vllm.v1.worker_channel import ChannelError

from v1_helpers import RecordingChannel, StepDriver, make_request, make_settings, scheduler_output

PROMPT = list(range(10, 1010))  # 1000 tokens: 3 whole chunks of 256 and a partial one of 232


def make_side(hit=lambda tokens, salt: 0, **settings):
    channel = RecordingChannel(hit=hit)
    side = LMCacheSchedulerSide(make_settings(**settings), channel)
    return side, channel, StepDriver(side, side.settings.block_size)


def only(meta):
    assert len(meta.requests) == 1, meta.requests
    return meta.requests[0]


# ----- pure helpers ---------------------------------------------------------------------------


def test_slot_mapping_walks_blocks_in_order():
    slots = slot_mapping_for([7, 2, 9], block_size=4, num_tokens=10)
    assert slots.tolist() == [28, 29, 30, 31, 8, 9, 10, 11, 36, 37]
    assert slots.dtype == torch.long
    with pytest.raises(ValueError, match="need 3 blocks"):
        slot_mapping_for([7, 2], block_size=4, num_tokens=10)


@pytest.mark.parametrize(
    "total, saved, partial, decode_cache, expected",
    [
        (300, 0, True, False, SaveSpec(0, 256)),  # mid-prefill: whole chunks only
        (600, 256, True, False, SaveSpec(256, 512)),
        (200, 0, True, False, None),  # not a whole chunk yet
        (1000, 768, True, False, SaveSpec(768, 1000)),  # last prefill step: the partial chunk too
        (1000, 768, False, False, None),  # ... unless partial chunks are discarded
        (1010, 1000, True, False, None),  # decoding without save_decode_cache
        (1020, 1000, True, True, None),  # decoding, next chunk not complete
        (1024, 1000, True, True, SaveSpec(1000, 1024)),  # decoding completed chunk 4
    ],
)
def test_plan_save(total, saved, partial, decode_cache, expected):
    tokens = list(range(total))
    tracker = RequestTracker("r", 1000, tokens, [], saved, "", may_save=True)
    settings = make_settings(save_partial_chunks=partial, save_decode_cache=decode_cache)
    assert plan_save(tracker, settings) == expected


def test_plan_save_respects_may_save():
    tracker = RequestTracker("r", 1000, list(range(1000)), [], 0, "", may_save=False)
    assert plan_save(tracker, make_settings()) is None


# ----- lookups and load promises ----------------------------------------------------------------


def test_no_hit_stores_the_whole_prompt_with_its_slots():
    side, channel, driver = make_side()
    request = make_request("a", PROMPT)
    req = only(driver.admit(request, 1000))
    assert driver.returned["a"] == 0
    assert channel.lookups == [(PROMPT, "")]
    assert req.load_spec is None
    assert req.save_spec == SaveSpec(0, 1000)
    assert req.token_ids.tolist() == PROMPT
    assert req.slot_mapping.tolist() == driver.slots("a", 1000)


def test_partial_hit_loads_the_hit_and_stores_the_rest():
    side, channel, driver = make_side(hit=lambda tokens, salt: 512)
    req = only(driver.admit(make_request("a", PROMPT), 1000))
    assert driver.returned["a"] == 512
    assert req.load_spec == LoadSpec(vllm_cached_tokens=0, lmcache_cached_tokens=512, can_load=True)
    assert req.save_spec == SaveSpec(512, 1000)
    assert req.slot_mapping.tolist() == driver.slots("a", 1000)


def test_full_hit_claims_one_token_less_but_loads_everything():
    side, channel, driver = make_side(hit=lambda tokens, salt: len(tokens))
    req = only(driver.admit(make_request("a", PROMPT), 1000))
    assert driver.returned["a"] == 999
    assert req.load_spec == LoadSpec(0, 1000, can_load=True)
    assert req.save_spec is None  # everything is already stored
    assert len(req.token_ids) == 1000


def test_vllm_prefix_cache_hit_is_not_loaded_twice():
    side, channel, driver = make_side(hit=lambda tokens, salt: 768)
    req = only(driver.admit(make_request("a", PROMPT), 1000, vllm_cached=320))
    assert driver.returned["a"] == 768 - 320
    assert req.load_spec == LoadSpec(320, 768, can_load=True)
    # vLLM already has more than LMCache: nothing to load, nothing promised.
    side, channel, driver = make_side(hit=lambda tokens, salt: 256)
    req = only(driver.admit(make_request("b", PROMPT), 1000, vllm_cached=512))
    assert driver.returned["b"] == 0
    assert req.load_spec is None


def test_no_allocation_for_external_tokens_means_no_load():
    side, channel, driver = make_side(hit=lambda tokens, salt: 512)
    request = make_request("a", PROMPT)
    assert side.get_num_new_matched_tokens(request, 0) == 512
    side.update_state_after_alloc(request, 0)
    request.num_computed_tokens = 0
    from vllm.v1.core.sched.output import NewRequestData

    data = NewRequestData.from_request(request, (list(range(63)),))
    meta = side.build_connector_meta(scheduler_output([data], num_scheduled={"a": 1000}))
    assert only(meta).load_spec is None


def test_allocation_that_contradicts_the_promise_is_an_error():
    side, channel, driver = make_side(hit=lambda tokens, salt: 512)
    request = make_request("a", PROMPT)
    side.get_num_new_matched_tokens(request, 0)
    with pytest.raises(RuntimeError, match="promised 512"):
        side.update_state_after_alloc(request, 256)


def test_skip_last_n_tokens_shortens_the_lookup():
    side, channel, driver = make_side(skip_last_n_tokens=100)
    driver.admit(make_request("a", PROMPT), 1000)
    assert channel.lookups == [(PROMPT[:900], "")]
    side, channel, driver = make_side(skip_last_n_tokens=5000)
    driver.admit(make_request("b", PROMPT), 1000)
    assert channel.lookups == []


def test_lookup_failure_means_no_hit():
    def broken(tokens, salt):
        raise ChannelError("worker gone")

    side, channel, driver = make_side(hit=broken)
    req = only(driver.admit(make_request("a", PROMPT), 1000))
    assert driver.returned["a"] == 0 and req.load_spec is None


# ----- steps: chunked prefill, decode, preemption ------------------------------------------------


def test_chunked_prefill_saves_whole_chunks_then_the_partial_one():
    side, channel, driver = make_side()
    request = make_request("a", PROMPT)
    specs = [only(driver.admit(request, 300)).save_spec]
    for _ in range(3):
        meta = driver.run(request, min(300, 1000 - request.num_computed_tokens))
        specs.append(only(meta).save_spec)
    assert specs == [SaveSpec(0, 256), SaveSpec(256, 512), SaveSpec(512, 768), SaveSpec(768, 1000)]
    # The last step's slots follow the blocks allocated across all steps.
    assert only(meta).slot_mapping.tolist() == driver.slots("a", 1000)


def test_chunked_prefill_with_a_step_below_a_chunk_emits_nothing():
    side, channel, driver = make_side()
    request = make_request("a", PROMPT)
    assert driver.admit(request, 100).requests == []
    assert only(driver.run(request, 200)).save_spec == SaveSpec(0, 256)


def test_decode_saves_only_with_save_decode_cache():
    side, channel, driver = make_side()
    request = make_request("a", PROMPT)
    driver.admit(request, 1000)
    for token in range(30):
        assert driver.decode(request, 5 + token).requests == []

    side, channel, driver = make_side(save_decode_cache=True)
    request = make_request("b", PROMPT)
    driver.admit(request, 1000)
    metas = [driver.decode(request, 5 + token) for token in range(30)]
    saving = [(i, only(m)) for i, m in enumerate(metas) if m.requests]
    assert len(saving) == 1
    step, req = saving[0]
    assert step == 23  # the step that computes token 1023 completes chunk 3
    assert req.save_spec == SaveSpec(1000, 1024)
    assert req.token_ids.tolist() == PROMPT + list(range(5, 29))
    assert req.slot_mapping.tolist() == driver.slots("b", 1024)


def test_resumed_request_uses_its_new_blocks_and_load():
    side, channel, driver = make_side(hit=lambda tokens, salt: 0)
    request = make_request("a", PROMPT)
    driver.admit(request, 300)
    # Preempted: vLLM frees the blocks, looks the request up again, reallocates everything.
    channel.hit = lambda tokens, salt: 256
    driver.blocks["a"] = []
    request.num_computed_tokens = 0
    assert side.get_num_new_matched_tokens(request, 0) == 256
    driver._alloc("a", 1000)
    side.update_state_after_alloc(request, 256)
    request.num_computed_tokens = 256
    req = only(driver.run(request, 744, resumed=True))
    assert req.load_spec == LoadSpec(0, 256, can_load=True)
    assert req.save_spec == SaveSpec(256, 1000)
    assert req.slot_mapping.tolist() == driver.slots("a", 1000)


def test_hybrid_kv_cache_groups_are_refused():
    side, channel, driver = make_side()
    request = make_request("a", PROMPT)
    side.get_num_new_matched_tokens(request, 0)
    from vllm.v1.core.sched.output import NewRequestData

    data = NewRequestData.from_request(request, ([1, 2], [3, 4]))
    with pytest.raises(NotImplementedError, match="2 KV cache groups"):
        side.build_connector_meta(scheduler_output([data], num_scheduled={"a": 32}))


# ----- who may save, and what keys are salted with -----------------------------------------------


@pytest.mark.parametrize(
    "settings, request_kwargs, reason",
    [
        ({"force_skip_save": True}, {}, "LMCACHE_FORCE_SKIP_SAVE"),
        ({"kv_role": "kv_consumer"}, {}, "kv_consumer"),
        ({}, {"kv_transfer_params": {"lmcache.skip_save": True}}, "lmcache.skip_save"),
        ({}, {"kv_transfer_params": {"lmcache.skip_save": "maybe"}}, "lmcache.skip_save"),
        ({"priority_limit": 1}, {"priority": 2}, "priority 2 is above priority_limit 1"),
    ],
)
def test_requests_that_must_not_store(settings, request_kwargs, reason, caplog):
    side, channel, driver = make_side(hit=lambda tokens, salt: 256, **settings)
    request = make_request("a", PROMPT, **request_kwargs)
    req = only(driver.admit(request, 1000))
    assert req.save_spec is None and req.load_spec is not None  # still loads
    logging.getLogger("lmcache").addHandler(caplog.handler)
    try:
        side.request_finished(request, [])
    finally:
        logging.getLogger("lmcache").removeHandler(caplog.handler)
    assert "not stored: " in caplog.text and reason in caplog.text


def test_prompt_logprobs_never_look_up_or_load_but_store_and_say_why(caplog):
    """vLLM 0.9.2 asks the connector even for a request that wants prompt logprobs; a hit would
    leave those positions uncomputed (its output processor then fails and the engine dies)."""
    side, channel, driver = make_side(hit=lambda tokens, salt: len(tokens))
    request = make_request("a", PROMPT, prompt_logprobs=1)
    req = only(driver.admit(request, 1000))
    assert driver.returned["a"] == 0 and channel.lookups == [] and channel.unpinned == []
    assert req.load_spec is None and req.save_spec == SaveSpec(0, 1000)
    channel.counters["a"] = RequestCounters(stored_tokens=1000)
    logging.getLogger("lmcache").addHandler(caplog.handler)
    try:
        side.request_finished(request, [])
    finally:
        logging.getLogger("lmcache").removeHandler(caplog.handler)
    assert "lmcache_hit_tokens=0 loaded_tokens=0 stored_tokens=1000 (not loaded: prompt logprobs)" in caplog.text
    # The same prompt without prompt logprobs looks up as usual.
    assert only(driver.admit(make_request("b", PROMPT), 1000)).load_spec is not None


def test_priority_at_the_limit_and_skip_save_false_still_store():
    side, channel, driver = make_side(priority_limit=1)
    request = make_request("a", PROMPT, priority=1, kv_transfer_params={"lmcache.skip_save": False, "other": 1})
    assert only(driver.admit(request, 1000)).save_spec == SaveSpec(0, 1000)


def test_lora_and_vllm_cache_salt_reach_the_lookup_and_the_worker():
    side, channel, driver = make_side()
    plain = only(driver.admit(make_request("a", PROMPT), 1000))
    lora = LoRARequest("adapter-x", 1, "/adapters/x")
    with_lora = only(driver.admit(make_request("b", PROMPT, lora_request=lora), 1000))
    salted = only(driver.admit(make_request("c", PROMPT, cache_salt="tenant-1"), 1000))
    salts = [salt for _, salt in channel.lookups]
    assert salts[0] == "" and plain.cache_salt == ""
    assert "adapter-x" in salts[1] and with_lora.cache_salt == salts[1]
    assert "tenant-1" in salts[2] and salted.cache_salt == salts[2]
    assert len(set(salts)) == 3


# ----- the end of a request ----------------------------------------------------------------------


def test_request_finished_logs_one_line_and_forgets_the_request(caplog):
    side, channel, driver = make_side(hit=lambda tokens, salt: 512)
    request = make_request("req-7", PROMPT)
    driver.admit(request, 1000, vllm_cached=128)
    channel.counters["req-7"] = RequestCounters(loaded_tokens=384, stored_tokens=488)
    logging.getLogger("lmcache").addHandler(caplog.handler)
    try:
        assert side.request_finished(request, [1, 2]) == (False, None)
    finally:
        logging.getLogger("lmcache").removeHandler(caplog.handler)
    assert (
        "LMCache request req-7: prompt_tokens=1000 vllm_cached_tokens=128 lmcache_hit_tokens=512 "
        "loaded_tokens=384 stored_tokens=488"
    ) in caplog.text
    assert "not stored" not in caplog.text
    assert channel.popped == ["req-7"]
    assert side.num_tracked_requests() == 0
    # A later step for a finished request id changes nothing.
    assert side.build_connector_meta(scheduler_output(finished={"req-7"})).requests == []


# ----- pins: every lookup names its request; a dropped promise is released at once ---------------


def test_lookups_pin_for_their_request_and_a_kept_promise_is_left_to_the_worker():
    side, channel, driver = make_side(hit=lambda tokens, salt: 512)
    req = only(driver.admit(make_request("a", PROMPT), 1000))
    assert channel.lookup_ids == ["a"]
    assert req.load_spec is not None and req.load_spec.can_load
    assert channel.unpinned == []  # the worker releases them after its load


def test_a_promise_vllm_does_not_need_is_released_at_once():
    # vLLM's own prefix cache already covers LMCache's hit.
    side, channel, driver = make_side(hit=lambda tokens, salt: 256)
    driver.admit(make_request("b", PROMPT), 1000, vllm_cached=512)
    assert channel.unpinned == ["b"]
    assert channel.lookup_computed == [512]  # the worker pins nothing vLLM holds
    # No hit: nothing was pinned, nothing to release.
    side, channel, driver = make_side(hit=lambda tokens, salt: 0)
    driver.admit(make_request("c", PROMPT), 1000)
    assert channel.lookup_ids == ["c"] and channel.unpinned == []


def test_no_allocation_for_external_tokens_releases_the_pins():
    side, channel, driver = make_side(hit=lambda tokens, salt: 512)
    request = make_request("a", PROMPT)
    assert side.get_num_new_matched_tokens(request, 0) == 512
    assert channel.unpinned == []
    side.update_state_after_alloc(request, 0)
    assert channel.unpinned == ["a"]


def test_a_request_that_waits_again_is_looked_up_again_under_the_same_id():
    # vLLM could not allocate blocks: no update_state_after_alloc, the next step asks again and
    # the worker's engine replaces the request's pins.
    side, channel, driver = make_side(hit=lambda tokens, salt: 512)
    request = make_request("a", PROMPT)
    side.get_num_new_matched_tokens(request, 0)
    assert only(driver.admit(request, 1000)).load_spec == LoadSpec(0, 512, can_load=True)
    assert channel.lookup_ids == ["a", "a"] and channel.unpinned == []


def test_a_resumed_request_without_a_tracker_drops_its_promise():
    side, channel, driver = make_side(hit=lambda tokens, salt: 256)
    request = make_request("a", PROMPT)
    side.get_num_new_matched_tokens(request, 0)
    side.update_state_after_alloc(request, 256)
    from vllm.v1.core.sched.output import CachedRequestData

    cached = CachedRequestData(
        req_ids=["a"], resumed_from_preemption=[True], new_token_ids=[], new_block_ids=[([1, 2],)],
        num_computed_tokens=[256],
    )
    assert side.build_connector_meta(scheduler_output(cached=cached, num_scheduled={"a": 16})).requests == []
    assert channel.unpinned == ["a"]


def test_an_unpin_that_cannot_reach_the_worker_is_logged_not_raised(caplog):
    side, channel, driver = make_side(hit=lambda tokens, salt: 512)

    def broken(request_ids):
        raise ChannelError("worker gone")

    channel.unpin = broken
    request = make_request("a", PROMPT)
    side.get_num_new_matched_tokens(request, 0)
    logging.getLogger("lmcache").addHandler(caplog.handler)
    try:
        side.update_state_after_alloc(request, 0)
    finally:
        logging.getLogger("lmcache").removeHandler(caplog.handler)
    assert "cannot release LMCache pins now: worker gone" in caplog.text


@pytest.mark.parametrize("hit_after", [256, 768])
def test_a_resumed_request_stores_from_what_its_new_lookup_found(hit_after):
    # Before its preemption the request stored 512 tokens; by its resume LMCache holds 256 of them
    # (a chunk evicted: it must be stored again) or 768 (another request stored more: not again).
    side, channel, driver = make_side(hit=lambda tokens, salt: 0)
    request = make_request("a", PROMPT)
    assert only(driver.admit(request, 600)).save_spec == SaveSpec(0, 512)
    channel.hit = lambda tokens, salt: hit_after
    driver.blocks["a"] = []
    request.num_computed_tokens = 0
    assert side.get_num_new_matched_tokens(request, 0) == hit_after
    driver._alloc("a", 1000)
    side.update_state_after_alloc(request, hit_after)
    request.num_computed_tokens = hit_after
    req = only(driver.run(request, 1000 - hit_after, resumed=True))
    assert req.load_spec == LoadSpec(0, hit_after, can_load=True)
    assert req.save_spec == SaveSpec(hit_after, 1000)
