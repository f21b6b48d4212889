"""What a request may do with the cache, decided once when it first reaches the connector.

Operations:
- `DoorSettings.from_vllm(vllm_config, config)`: the scheduler side's settings, from the engine
  config, the door's own (unprefixed) extra-config keys, `LMCACHE_FORCE_SKIP_SAVE` and `kv_role`.
- `request_identity(request)`: the `cache_salt` that names everything besides the tokens that
  shapes the request's KV (vLLM's own `cache_salt`, the LoRA adapter, multimodal input hashes and
  their positions), or the reason the request must bypass the cache.
- `request_config(kv_transfer_params)`: the request's `lmcache.`-prefixed settings.
- `request_policy(request, settings)`: the three above, and whether the request must compute its
  whole prompt (`vllm_compat.full_prompt_reason`), folded into one `RequestPolicy`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Optional

from lmcache.experimental.config import EXTRA_CONFIG_PREFIX, LMCacheEngineConfig, parse_bool
from lmcache.integration.vllm.request_identity import RequestIdentity, cache_identity
from lmcache.integration.vllm.utils import EXTRA_CONFIG_SOURCE, extra_config_of, force_skip_save
from lmcache.integration.vllm.vllm_compat import full_prompt_reason, multimodal_placeholders
from lmcache.logging import init_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request

logger = init_logger(__name__)

# Unprefixed extra-config keys the door itself reads (the `lmcache.` ones are engine fields).
SKIP_LAST_N_TOKENS_KEY = "skip_last_n_tokens"
DISCARD_PARTIAL_CHUNKS_KEY = "discard_partial_chunks"
# Per-request settings in `SamplingParams.extra_args["kv_transfer_params"]`.
REQUEST_SKIP_SAVE_KEY = EXTRA_CONFIG_PREFIX + "skip_save"
KNOWN_REQUEST_KEYS = (REQUEST_SKIP_SAVE_KEY,)
# With enable_pd, the vLLM role each pd_role runs under.
PD_KV_ROLES = {"sender": "kv_producer", "receiver": "kv_consumer"}



@dataclass(frozen=True)
class DoorSettings:
    """Everything the scheduler side decides with, besides the request itself."""

    chunk_size: int
    block_size: int  # vLLM's tokens per KV block (slot = block_id * block_size + offset)
    save_decode_cache: bool  # store chunks completed while decoding
    save_partial_chunks: bool  # store the trailing partial chunk at the end of prefill
    skip_last_n_tokens: int  # lookups ignore this many trailing prompt tokens
    priority_limit: Optional[int]  # requests with a priority above it are not stored
    force_skip_save: bool  # LMCACHE_FORCE_SKIP_SAVE
    kv_role: str  # kv_both / kv_producer / kv_consumer (a consumer never stores)
    model_name: str  # vLLM's model name (the metrics' `model_name` label)
    pd_sender_peer: Optional[str] = None  # PD prefiller: the receiver host it may push to
    async_loading: bool = False  # enable_async_loading: slow-tier hits load in the background
    kv_events: bool = False  # enable_kv_events: stores carry vLLM's block hashes for the events

    @classmethod
    def from_vllm(cls, vllm_config: "VllmConfig", config: LMCacheEngineConfig) -> "DoorSettings":
        extra = extra_config_of(vllm_config)
        skip_last = extra.get(SKIP_LAST_N_TOKENS_KEY, 0)
        if isinstance(skip_last, bool) or not isinstance(skip_last, int) or skip_last < 0:
            raise ValueError(f"{EXTRA_CONFIG_SOURCE}[{SKIP_LAST_N_TOKENS_KEY!r}]={skip_last!r}: expected an int >= 0")
        discard = extra.get(DISCARD_PARTIAL_CHUNKS_KEY, False)
        if not isinstance(discard, bool):
            raise ValueError(f"{EXTRA_CONFIG_SOURCE}[{DISCARD_PARTIAL_CHUNKS_KEY!r}]={discard!r}: expected a bool")
        kv_transfer = vllm_config.kv_transfer_config
        kv_role = (kv_transfer.kv_role if kv_transfer is not None else None) or "kv_both"
        if config.enable_pd and config.pd_role is not None and kv_role != PD_KV_ROLES[config.pd_role]:
            raise ValueError(
                f"pd_role={config.pd_role!r} needs kv_transfer_config.kv_role={PD_KV_ROLES[config.pd_role]!r}, "
                f"got {kv_role!r}"
            )
        return cls(
            chunk_size=config.chunk_size,
            block_size=vllm_config.cache_config.block_size,
            save_decode_cache=config.save_decode_cache,
            save_partial_chunks=config.save_unfull_chunk and not discard,
            skip_last_n_tokens=skip_last,
            priority_limit=config.priority_limit,
            force_skip_save=force_skip_save(),
            kv_role=kv_role,
            model_name=vllm_config.model_config.model,
            pd_sender_peer=config.pd_peer_host if config.enable_pd and config.pd_role == "sender" else None,
            async_loading=config.enable_async_loading,
            kv_events=config.enable_kv_events,
        )


@dataclass(frozen=True)
class RequestConfig:
    """The request's own `lmcache.` settings."""

    skip_save: bool = False


@dataclass(frozen=True)
class RequestPolicy:
    """The decisions for one request, made when it first reaches the connector."""

    cache_salt: str
    use_cache: bool  # False: neither look up, load nor store
    may_save: bool
    reason: str  # why not stored (empty when it may be), for the per-request log line
    # False when the request computes every prompt position (prompt logprobs, pooling over all
    # tokens): no lookup and no load, though it may store what it computed.
    may_load: bool = True
    load_reason: str = ""  # why not loaded (empty when it may be), for the per-request log line


def request_identity(request: "Request") -> RequestIdentity:
    """The salt for a v1 request's keys, or why it must bypass the cache (`cache_identity`)."""
    return cache_identity(
        user_salt=getattr(request, "cache_salt", None),
        lora_request=getattr(request, "lora_request", None),
        mm_placeholders=multimodal_placeholders(request),
        prompt_embeds=getattr(request, "prompt_embeds", None) is not None,
    )


def request_config(kv_transfer_params: Optional[Mapping[str, Any]], req_id: str = "?") -> RequestConfig:
    """The request's `lmcache.` keys of `kv_transfer_params`.

    A request cannot fail the engine, so an unknown `lmcache.` key is logged (naming it) and
    ignored, and a `skip_save` value that is not a bool is logged and taken as "skip" (not
    storing is always safe). Keys without the prefix belong to other connectors.
    """
    if not kv_transfer_params:
        return RequestConfig()
    skip_save = False
    for key, value in kv_transfer_params.items():
        if not isinstance(key, str) or not key.startswith(EXTRA_CONFIG_PREFIX):
            continue
        if key == REQUEST_SKIP_SAVE_KEY:
            parsed = parse_bool(value)
            if parsed is None:
                logger.warning(
                    "request %s: kv_transfer_params[%r]=%r is not a bool; not storing this request",
                    req_id, key, value,
                )
                parsed = True
            skip_save = parsed
        else:
            logger.warning(
                "request %s: kv_transfer_params key %r is not an LMCache request setting (known: %s); ignored",
                req_id, key, ", ".join(KNOWN_REQUEST_KEYS),
            )
    return RequestConfig(skip_save=skip_save)


def request_policy(request: "Request", settings: DoorSettings) -> RequestPolicy:
    """Fold identity, the request's config and the instance settings into one decision."""
    identity = request_identity(request)
    if identity.bypass_reason is not None:
        return RequestPolicy("", use_cache=False, may_save=False, reason=identity.bypass_reason)
    req_config = request_config(getattr(request, "kv_transfer_params", None), request.request_id)
    reason = ""
    if settings.force_skip_save:
        reason = "LMCACHE_FORCE_SKIP_SAVE is set"
    elif settings.kv_role == "kv_consumer":
        reason = "kv_role is kv_consumer"
    elif req_config.skip_save:
        reason = f"{REQUEST_SKIP_SAVE_KEY} is set"
    elif settings.priority_limit is not None and request.priority > settings.priority_limit:
        reason = f"priority {request.priority} is above priority_limit {settings.priority_limit}"
    full_prompt = full_prompt_reason(request)
    return RequestPolicy(
        identity.cache_salt, use_cache=True, may_save=not reason, reason=reason,
        may_load=full_prompt is None, load_reason=full_prompt or "",
    )
