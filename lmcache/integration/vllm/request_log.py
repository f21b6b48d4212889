"""The doors' per-request and per-step log lines: written here, and read back here.

Tests, the serving demo and the serving benchmark read what the doors did from these lines, so
the format and its parser live side by side (change one, the other follows). Nothing here
imports vLLM or torch: the benchmark's report reads logs without them.

- v1: one line per finished request, `format_request_line` / `parse_request_lines`:
  `LMCache request <id>: prompt_tokens=N vllm_cached_tokens=N lmcache_hit_tokens=N
  loaded_tokens=N stored_tokens=N [(not loaded: <reason>)] [(not stored: <reason>)]`; "not loaded"
  names why a request did not even look up (it computes its whole prompt: prompt logprobs).
- v0: one line per prompt step the door serves, `format_v0_step_line` / `parse_v0_step_lines`:
  `LMCache v0 door: prompt of Q tokens: L hit tokens loaded, computing C` for a step from
  position 0, `LMCache v0 door: prompt chunk of Q tokens after X: L hit tokens loaded,
  computing C` for a later chunk of a chunked prefill (X tokens already in vLLM's cache); either
  ends in ` (not loaded: <reason>)` when the prompt must be computed whole.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import List


@dataclass
class RequestStats:
    """What the scheduler side learnt about one request, for its log line."""

    prompt_tokens: int
    vllm_cached_tokens: int  # vLLM's own prefix-cache hit
    lmcache_hit_tokens: int = 0  # LMCache's cached prefix at lookup


@dataclass
class RequestCounters:
    """What the worker actually did for one request (for the per-request log line)."""

    loaded_tokens: int = 0  # tokens written into vLLM's cache from LMCache
    stored_tokens: int = 0  # tokens handed to LMCache's store


@dataclass(frozen=True)
class RequestLine:
    """One parsed per-request line."""

    req_id: str
    stats: RequestStats
    counters: RequestCounters
    reason: str  # why the request was not stored ("" when it may be)
    load_reason: str = ""  # why it did not look up or load ("" when it may)


_REQUEST_LINE = re.compile(
    r"LMCache request (?P<req_id>\S+): prompt_tokens=(?P<prompt>\d+) vllm_cached_tokens=(?P<vllm>\d+) "
    r"lmcache_hit_tokens=(?P<hit>\d+) loaded_tokens=(?P<loaded>\d+) stored_tokens=(?P<stored>\d+)"
    r"(?: \(not loaded: (?P<load_reason>[^)]*)\))?(?: \(not stored: (?P<reason>[^)]*)\))?"
)


def format_request_line(
    req_id: str, stats: RequestStats, counters: RequestCounters, reason: str, load_reason: str = ""
) -> str:
    """The per-request log line (`parse_request_lines` reads it back)."""
    line = (
        f"LMCache request {req_id}: prompt_tokens={stats.prompt_tokens} "
        f"vllm_cached_tokens={stats.vllm_cached_tokens} lmcache_hit_tokens={stats.lmcache_hit_tokens} "
        f"loaded_tokens={counters.loaded_tokens} stored_tokens={counters.stored_tokens}"
    )
    if load_reason:
        line = f"{line} (not loaded: {load_reason})"
    return f"{line} (not stored: {reason})" if reason else line


def parse_request_lines(log: str) -> List[RequestLine]:
    """Every per-request line in `log`, in order."""
    return [
        RequestLine(
            m["req_id"],
            RequestStats(int(m["prompt"]), int(m["vllm"]), int(m["hit"])),
            RequestCounters(int(m["loaded"]), int(m["stored"])),
            m["reason"] or "",
            m["load_reason"] or "",
        )
        for m in _REQUEST_LINE.finditer(log)
    ]


@dataclass(frozen=True)
class V0StepLine:
    """One prompt step the v0 door served."""

    query_tokens: int  # tokens the step was scheduled to compute
    context_tokens: int  # tokens already in vLLM's cache before it (0 for a step from position 0)
    loaded_tokens: int  # of the query, loaded from LMCache
    computed_tokens: int  # of the query, computed by the model
    load_reason: str = ""  # why nothing was loaded ("" when it could be)


_V0_STEP_LINE = re.compile(
    r"LMCache v0 door: prompt (?:of (?P<q0>\d+) tokens|chunk of (?P<q>\d+) tokens after (?P<context>\d+)): "
    r"(?P<loaded>\d+) hit tokens loaded, computing (?P<computed>\d+)(?: \(not loaded: (?P<load_reason>[^)]*)\))?"
)


def format_v0_step_line(
    query_tokens: int, context_tokens: int, loaded_tokens: int, computed_tokens: int, load_reason: str = ""
) -> str:
    """The v0 door's line for one served prompt step (`parse_v0_step_lines` reads it back)."""
    if context_tokens == 0:
        head = f"LMCache v0 door: prompt of {query_tokens} tokens"
    else:
        head = f"LMCache v0 door: prompt chunk of {query_tokens} tokens after {context_tokens}"
    line = f"{head}: {loaded_tokens} hit tokens loaded, computing {computed_tokens}"
    return f"{line} (not loaded: {load_reason})" if load_reason else line


def parse_v0_step_lines(log: str) -> List[V0StepLine]:
    """Every v0 step line in `log`, in order."""
    return [
        V0StepLine(
            int(m["q0"] or m["q"]), int(m["context"] or 0), int(m["loaded"]), int(m["computed"]), m["load_reason"] or ""
        )
        for m in _V0_STEP_LINE.finditer(log)
    ]
