"""HTTP side of the serving benchmark: streamed completions timed to the first token, and vLLM's counters.

- `stream_completion`: POST `/v1/completions` with token ids and `stream: true`; the time to the
  first streamed chunk that carries a choice is the TTFT (vLLM sends a chunk for every new token,
  even one whose text is still empty, so that chunk is the first token). The request id is set
  through `X-Request-Id`, which vLLM turns into its engine request id `cmpl-<id>-0`; our log lines
  name that id, so hits are matched to requests exactly.
- `stream_chat`: the same through `/v1/chat/completions` with a list of messages (vLLM's engine
  request id is then `chatcmpl-<id>`).
- `reset_prefix_cache`: POST `/reset_prefix_cache` (a dev endpoint): drops vLLM's own prefix cache,
  so the next identical prompt has to come from our tier or be recomputed.
- `prefix_cache_counters`: vLLM's own prefix-cache counters from `/metrics` (queried and hit tokens).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import aiohttp

SERVED_BY_HEADER = "X-Served-By"  # set by `round_robin_proxy.py` on every answer it passes on
_METRIC_RE = re.compile(r"^(vllm:prefix_cache_(?:queries|hits)_total)\{[^}]*\}\s+([0-9.eE+-]+)\s*$", re.M)


class RequestFailed(RuntimeError):
    """A completion request failed; the message has the status and the server's answer."""


@dataclass(frozen=True)
class Completion:
    """What one streamed request measured. Times are seconds; `start_s` counts from the run's clock."""

    request_id: str  # vLLM's engine request id (`cmpl-<X-Request-Id>-0`)
    prompt_tokens: int
    output_tokens: int
    ttft_s: float  # request sent -> first token chunk received
    latency_s: float  # request sent -> stream finished
    start_s: float
    # (arrival from the run's clock, tokens generated so far) for every chunk that carried tokens
    token_times: tuple[tuple[float, int], ...] = ()
    served_by: str = ""  # the backend a proxy in front named (`X-Served-By`), else ""


@dataclass(frozen=True)
class PrefixCounters:
    """vLLM's own prefix-cache counters: tokens looked up and tokens found, since the server started."""

    queries: float
    hits: float

    def minus(self, earlier: "PrefixCounters") -> "PrefixCounters":
        return PrefixCounters(self.queries - earlier.queries, self.hits - earlier.hits)


def engine_request_id(header_id: str) -> str:
    """The id vLLM's completions endpoint gives the (single) engine request made for `header_id`."""
    return f"cmpl-{header_id}-0"


async def stream_completion(
    session: aiohttp.ClientSession,
    base_url: str,
    model: str,
    prompt: Sequence[int],
    max_tokens: int,
    header_id: str,
    clock_zero: float,
    progress: Optional[Callable[[int], None]] = None,
) -> Completion:
    """Send one greedy streamed completion and time it; `progress(n)` hears each chunk's token count
    so far. vLLM may merge tokens into one chunk when its output loop falls behind, so the count
    comes from the usage vLLM sends with every chunk (`continuous_usage_stats`)."""
    body = {"model": model, "prompt": list(prompt), **_stream_fields(max_tokens)}
    return await _stream(session, f"{base_url}/v1/completions", body, header_id, engine_request_id(header_id),
                         clock_zero, progress, len(prompt))


async def stream_chat(
    session: aiohttp.ClientSession,
    base_url: str,
    model: str,
    messages: Sequence[dict],
    max_tokens: int,
    header_id: str,
    clock_zero: float,
) -> Completion:
    """Send one greedy streamed chat completion and time it, as `stream_completion` does. vLLM
    sends the chunk that names the assistant's role with the first token, so it counts as one."""
    body = {"model": model, "messages": list(messages), **_stream_fields(max_tokens)}
    return await _stream(session, f"{base_url}/v1/chat/completions", body, header_id, f"chatcmpl-{header_id}",
                         clock_zero, None, 0)


def _stream_fields(max_tokens: int) -> dict:
    """Greedy, exactly `max_tokens` tokens, streamed with the usage in every chunk."""
    return {
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }


async def _stream(
    session: aiohttp.ClientSession,
    url: str,
    body: dict,
    header_id: str,
    request_id: str,
    clock_zero: float,
    progress: Optional[Callable[[int], None]],
    prompt_tokens: int,  # if the server sends no usage
) -> Completion:
    start = time.perf_counter()
    ttft = None
    usage: dict = {}
    token_times: list[tuple[float, int]] = []
    async with session.post(url, json=body, headers={"X-Request-Id": header_id}) as resp:
        if resp.status != 200:
            raise RequestFailed(f"{header_id}: HTTP {resp.status}: {(await resp.text())[:2000]}")
        served_by = resp.headers.get(SERVED_BY_HEADER, "")
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[len(b"data:") :].strip()
            if payload == b"[DONE]":
                break
            chunk = json.loads(payload)
            if "error" in chunk:
                raise RequestFailed(f"{header_id}: error in stream: {chunk['error']}")
            now = time.perf_counter()
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk.get("choices"):
                ttft = now - start if ttft is None else ttft
                generated = int(usage.get("completion_tokens", len(token_times) + 1))
                token_times.append((now - clock_zero, generated))
                if progress is not None:
                    progress(generated)
    latency = time.perf_counter() - start
    if ttft is None:
        raise RequestFailed(f"{header_id}: the stream ended without a token")
    return Completion(
        request_id=request_id,
        prompt_tokens=int(usage.get("prompt_tokens", prompt_tokens)),
        output_tokens=int(usage.get("completion_tokens", 0)),
        ttft_s=ttft,
        latency_s=latency,
        start_s=start - clock_zero,
        token_times=tuple(token_times),
        served_by=served_by,
    )


async def reset_prefix_cache(session: aiohttp.ClientSession, base_url: str) -> None:
    """Drop vLLM's own prefix cache (only succeeds while no request runs, which is when we call it)."""
    async with session.post(f"{base_url}/reset_prefix_cache") as resp:
        if resp.status != 200:
            raise RequestFailed(f"reset_prefix_cache: HTTP {resp.status}: {(await resp.text())[:500]}")


def parse_prefix_counters(metrics_text: str) -> PrefixCounters:
    """Sum `vllm:prefix_cache_{queries,hits}_total` over all label sets of a Prometheus page."""
    sums = {"vllm:prefix_cache_queries_total": 0.0, "vllm:prefix_cache_hits_total": 0.0}
    found = set()
    for name, value in _METRIC_RE.findall(metrics_text):
        sums[name] += float(value)
        found.add(name)
    if len(found) != 2:
        raise RequestFailed(f"/metrics has no {' or '.join(sorted(set(sums) - found))}")
    return PrefixCounters(sums["vllm:prefix_cache_queries_total"], sums["vllm:prefix_cache_hits_total"])


async def prefix_cache_counters(session: aiohttp.ClientSession, base_url: str) -> PrefixCounters:
    async with session.get(f"{base_url}/metrics") as resp:
        if resp.status != 200:
            raise RequestFailed(f"/metrics: HTTP {resp.status}")
        return parse_prefix_counters(await resp.text())
