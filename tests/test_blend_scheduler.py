"""CacheBlend on the v1 scheduler side: which prompts blend, the segment lookups, the promise to
vLLM, and the worker's instructions (load once, store the missing segments once)."""

from __future__ import annotations

import pytest

from v1_helpers import RecordingChannel, StepDriver, make_request, make_settings

from lmcache.experimental.blend.segments import Segment, segment_salt
from lmcache.integration.vllm.blend.plan import BlendScheduler
from lmcache.integration.vllm.v1.scheduler_side import LMCacheSchedulerSide
from lmcache.integration.vllm.vllm_compat import blend_unsupported_reason

SEP = [7, 8]
DOC_A = list(range(100, 140))
DOC_B = list(range(200, 230))
PROMPT = [1, 2, 3] + SEP + DOC_A + SEP + DOC_B + SEP + [50, 51]  # 81 tokens
SEG_A, SEG_B = Segment(5, 45), Segment(47, 77)


def side_with(cached_docs: list[list[int]], min_tokens: int = 32) -> tuple[LMCacheSchedulerSide, RecordingChannel]:
    channel = RecordingChannel(hit=lambda tokens, salt: len(tokens) if tokens in cached_docs else 0)
    side = LMCacheSchedulerSide(make_settings(block_size=16), channel, BlendScheduler(SEP, min_tokens))
    return side, channel


def test_cached_segments_promise_the_prompt_but_its_last_token_and_blend_once() -> None:
    side, channel = side_with([DOC_B])
    driver = StepDriver(side, 16)
    meta = driver.admit(make_request("r", PROMPT), num_scheduled=512)
    # One lookup per segment, under the segment salt, no pins; no prefix lookup.
    assert channel.lookups == [(DOC_A, segment_salt("")), (DOC_B, segment_salt(""))]
    assert channel.lookup_ids == ["", ""]
    assert driver.returned["r"] == len(PROMPT) - 1
    (req,) = meta.requests
    assert req.blend is not None and req.blend.load
    assert req.blend.segments == (SEG_A, SEG_B) and req.blend.cached == (False, True)
    assert req.blend.store == (SEG_A,)  # the one that missed, stored once the prompt is computed
    assert req.save_spec is None  # no prefix chunks for a blending request
    assert req.load_spec is not None and req.load_spec.lmcache_cached_tokens == len(PROMPT) - 1
    assert len(req.token_ids) == len(PROMPT) - 1
    assert driver.decode(driver.requests["r"], 9).requests == []  # nothing more to do


def test_no_cached_segment_computes_it_all_and_stores_every_segment_at_the_end() -> None:
    side, channel = side_with([])
    driver = StepDriver(side, 16)
    first = driver.admit(make_request("r", PROMPT), num_scheduled=48)  # chunked prefill
    assert driver.returned["r"] == 0 and first.requests == []
    (req,) = driver.run(driver.requests["r"], 33).requests
    assert req.blend is not None and not req.blend.load and req.blend.store == (SEG_A, SEG_B)
    assert len(req.token_ids) == SEG_B.end and req.save_spec is None


def test_short_prompts_and_prompts_without_segments_take_the_prefix_path(caplog) -> None:
    side, channel = side_with([DOC_A], min_tokens=100)
    driver = StepDriver(side, 16)
    driver.admit(make_request("short", PROMPT), num_scheduled=512)
    assert channel.lookups == [(PROMPT, "")]  # the ordinary, pinned prefix lookup
    assert channel.lookup_ids == ["short"]
    side2, channel2 = side_with([DOC_A])
    StepDriver(side2, 16).admit(make_request("plain", list(range(300, 400))), num_scheduled=512)
    assert channel2.lookups == [(list(range(300, 400)), "")]


def test_skip_save_blends_but_stores_no_segment() -> None:
    side, _ = side_with([DOC_B])
    driver = StepDriver(side, 16)
    meta = driver.admit(make_request("r", PROMPT, kv_transfer_params={"lmcache.skip_save": True}), num_scheduled=512)
    (req,) = meta.requests
    assert req.blend is not None and req.blend.load and req.blend.store == ()


def test_finished_requests_leave_no_blend_state() -> None:
    side, _ = side_with([DOC_B])
    driver = StepDriver(side, 16)
    driver.admit(make_request("r", PROMPT), num_scheduled=512)
    side.request_finished(driver.requests["r"], [])
    assert side.num_tracked_requests() == 0 and not side._blend.blends("r")


@pytest.mark.parametrize(
    "architectures, reason",
    [(["LlamaForCausalLM"], None), (["Qwen2ForCausalLM"], "this model is Qwen2ForCausalLM"), ([], "unknown")],
)
def test_other_architectures_are_refused_by_name(architectures, reason) -> None:
    got = blend_unsupported_reason(architectures)
    assert got is None if reason is None else reason in got and "Llama" in got


def test_rope_that_scales_positions_is_refused_by_name() -> None:
    assert blend_unsupported_reason(["LlamaForCausalLM"], {"rope_type": "llama3", "factor": 8.0}) is None
    got = blend_unsupported_reason(["LlamaForCausalLM"], {"type": "linear", "factor": 2.0})
    assert got is not None and "'linear'" in got
