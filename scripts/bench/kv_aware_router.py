"""Routing by what each instance's cache holds, the way production-stack's `kvaware` router does.

For each request the proxy (`round_robin_proxy.py`) forwards, `KvAwareRouter.choose`:
1. tokenizes the prompt as vLLM does (a chat request through the model's chat template with the
   generation prompt; a completion's `prompt` as text),
2. asks the LMCache controller's `/lookup` which instances hold how long a prefix of it (the
   longest first),
3. sends it to that instance when the prefix leaves at most `threshold` tokens of the prompt to
   compute (production-stack's `kv_aware_threshold` rule: `matched >= len(tokens) - threshold`),
   and otherwise, or when nothing matches, when the holder is not one of the proxy's backends or
   when the controller does not answer in time, to the proxy's round robin.

`instance_ids[i]` is the `lmcache_instance_id` of backend i (production-stack asks the controller
which instance serves an address; here the benchmark started the instances and knows).
`stats` counts each decision, so a run shows how many requests the cache routed.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import aiohttp

# production-stack's default `--kv-aware-threshold`: tokens a holder may leave to compute.
DEFAULT_THRESHOLD = 2000
# How long a `/lookup` may take before the request goes round robin instead.
LOOKUP_TIMEOUT_S = 2.0


@dataclass
class RouteStats:
    """How the router decided, request by request."""

    by_cache: int = 0  # sent to the instance holding the longest prefix
    no_match: int = 0  # no instance held any of it: round robin
    short_match: int = 0  # a holder, but more than `threshold` tokens left to compute: round robin
    lookup_failed: int = 0  # the controller did not answer (or not in time): round robin
    unreadable: int = 0  # a body that is not a chat or completion request: round robin


class KvAwareRouter:
    """Chooses a backend index per request from the controller's `/lookup`."""

    def __init__(self, controller_url: str, instance_ids: Sequence[str], model_dir: str,
                 threshold: int = DEFAULT_THRESHOLD, timeout_s: float = LOOKUP_TIMEOUT_S) -> None:
        if threshold < 0:
            raise ValueError(f"kv-aware threshold must be >= 0 tokens, got {threshold}")
        from transformers import AutoTokenizer  # the router's one heavy import, only when used

        self.lookup_url = controller_url.rstrip("/") + "/lookup"
        self.backend_of = {instance: index for index, instance in enumerate(instance_ids)}
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.threshold = threshold
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.stats = RouteStats()

    def tokens(self, body: bytes) -> list[int]:
        """The prompt's token ids as vLLM's OpenAI server makes them."""
        request = json.loads(body)
        if "messages" in request:
            return list(self.tokenizer.apply_chat_template(request["messages"], add_generation_prompt=True,
                                                           tokenize=True))
        return self.tokenizer.encode(request.get("prompt", ""), add_special_tokens=False)

    async def choose(self, session: aiohttp.ClientSession, body: bytes, fallback: Callable[[], int]) -> int:
        """The backend for this request: the longest prefix's holder, or `fallback()`."""
        try:
            tokens = self.tokens(body)
        except (ValueError, TypeError, KeyError, AttributeError):
            self.stats.unreadable += 1
            return fallback()
        try:
            async with session.post(self.lookup_url, json={"tokens": tokens}, timeout=self.timeout) as resp:
                layout = (await resp.json())["layout_info"] if resp.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError):
            layout = None
        if layout is None:
            self.stats.lookup_failed += 1
            return fallback()
        holder: Optional[int] = None
        for instance, (_location, matched) in layout.items():  # the longest prefix first
            if instance in self.backend_of:
                holder = self.backend_of[instance]
                break
        if holder is None:
            self.stats.no_match += 1
            return fallback()
        if matched < len(tokens) - self.threshold:
            self.stats.short_match += 1
            return fallback()
        self.stats.by_cache += 1
        return holder
