"""What names a request's KV besides its tokens: the cache salt both doors key chunks with.

`cache_identity(...)` is the one function that turns a request's inputs into the salt (or the
reason it must bypass the cache); the v1 door reads them from vLLM's `Request`
(`v1/request_policy.request_identity`), the v0 door from a step's LoRA mapping
(`v0/connector.py`). Because both call this, a prompt stored through one door hits through the other.

NOTE: the salt is JSON with sorted keys, so it is the same string in every process and after a
restart (keys must never depend on `hash()` of Python objects or on random seeds).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Tuple

# `(content hash or None, offset, length)` of one multimodal input in the prompt.
Placeholder = Tuple[Optional[str], int, int]


@dataclass(frozen=True)
class RequestIdentity:
    """What names the request's KV besides its tokens."""

    cache_salt: str  # "" for plain text
    bypass_reason: Optional[str] = None  # set when the KV cannot be named: no lookup, no store


def cache_identity(
    *,
    user_salt: Optional[str] = None,
    lora_request: Any = None,
    mm_placeholders: Optional[Sequence[Placeholder]] = None,
    prompt_embeds: bool = False,
) -> RequestIdentity:
    """The salt for a request's keys, or why it must bypass the cache.

    Two requests with the same tokens but a different LoRA adapter (`lora_name`, `lora_path`;
    not the per-process int id), different images, or a different vLLM `cache_salt` compute
    different KV, so each of those goes into the salt. Inputs that cannot be named stably
    (prompt embeddings, multimodal inputs without content hashes) bypass the cache instead of
    risking another request's KV.
    """
    if prompt_embeds:
        return RequestIdentity("", "prompt embeddings cannot be named by a cache key")
    parts: dict[str, Any] = {}
    if user_salt:
        parts["salt"] = str(user_salt)
    if lora_request is not None:
        parts["lora"] = [str(lora_request.lora_name), str(lora_request.lora_path or "")]
    if mm_placeholders:
        if not all(h for h, _, _ in mm_placeholders):
            return RequestIdentity("", "multimodal inputs without content hashes cannot be named by a cache key")
        parts["mm"] = [[str(h), int(offset), int(length)] for h, offset, length in mm_placeholders]
    if not parts:
        return RequestIdentity("")
    return RequestIdentity(json.dumps(parts, sort_keys=True, separators=(",", ":")))
