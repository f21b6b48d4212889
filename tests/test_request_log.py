"""The doors' log lines read back by the parser beside their formatter (tests, demo and bench use it)."""

from __future__ import annotations

from lmcache.integration.vllm.request_log import (
    RequestCounters,
    RequestLine,
    RequestStats,
    V0StepLine,
    format_request_line,
    format_v0_step_line,
    parse_request_lines,
    parse_v0_step_lines,
)


def test_request_lines_round_trip_with_and_without_a_reason() -> None:
    stored = format_request_line("cmpl-1", RequestStats(1000, 128, 512), RequestCounters(384, 488), "")
    skipped = format_request_line("r-2", RequestStats(10, 0, 0), RequestCounters(), "lmcache.skip_save is set")
    computed = format_request_line("r-3", RequestStats(10, 0, 0), RequestCounters(0, 10), "", "prompt logprobs")
    neither = format_request_line("r-4", RequestStats(10, 0, 0), RequestCounters(), "kv_role is kv_consumer", "prompt logprobs")
    log = f"INFO noise\n[ts] {stored} (scheduler_side.py:1)\nother line\n{skipped}\n{computed}\n{neither}\n"
    assert parse_request_lines(log) == [
        RequestLine("cmpl-1", RequestStats(1000, 128, 512), RequestCounters(384, 488), ""),
        RequestLine("r-2", RequestStats(10, 0, 0), RequestCounters(0, 0), "lmcache.skip_save is set"),
        RequestLine("r-3", RequestStats(10, 0, 0), RequestCounters(0, 10), "", "prompt logprobs"),
        RequestLine("r-4", RequestStats(10, 0, 0), RequestCounters(0, 0), "kv_role is kv_consumer", "prompt logprobs"),
    ]


def test_v0_step_lines_round_trip_for_first_and_later_chunks() -> None:
    steps = [V0StepLine(700, 0, 256, 444), V0StepLine(512, 512, 512, 1), V0StepLine(300, 0, 0, 300, "prompt logprobs")]
    log = "\n".join(f"[ts] LMCache INFO: {format_v0_step_line(*vars(s).values())} (vllm_adapter.py:9)" for s in steps)
    assert parse_v0_step_lines(log) == steps
    assert parse_request_lines(log) == [] and parse_v0_step_lines("LMCache request x: nothing") == []
