"""The v0 door: LMCache around one step of vLLM's v0 model runner.

vLLM 0.9.2's own v0 `LMCacheConnector` imports these names with these signatures, and the
`lmcache_vllm` wrapper calls them around `ModelRunner.execute_model` /
`CPUModelRunner.execute_model` (`execute_with_cache`):

- `init_lmcache_engine(model_config, parallel_config, cache_config)`: build this worker's engine
  (config from `LMCACHE_*` / `LMCACHE_CONFIG_FILE` / `lmcache.` extra config); `None` if it
  already exists or the door cannot serve this setup. `close_lmcache_engine()` closes it
  (pending disk writes are flushed); it also runs when the process exits.
- `lmcache_should_retrieve(model_input) -> [RetrieveStatus]`, one per sequence of the step.
- `lmcache_retrieve_kv(model_executable, model_input, cache_config, kv_caches, statuses)
  -> (model_input, bypass_model_exec, hidden_states)`: load each prompt's cached prefix into its
  slots and return the input rebuilt to compute only the rest (`v0_model_input`). A fully
  cached prompt still computes its last token, so the model is never bypassed.
- `lmcache_should_store(model_input) -> [StoreStatus]` and `lmcache_store_kv(model_config,
  parallel_config, cache_config, model_executable, model_input, kv_caches, statuses)`: store
  the prompt tokens computed by the step (chunks already cached are skipped).

Keys: a sequence served by a LoRA adapter is keyed with the adapter's name and path as the
cache salt; steps carrying prompt embeddings, multimodal inputs, token types, prompt adapters or
M-RoPE positions bypass the cache. Only prompt steps that start at position 0 are looked up and
stored: a later chunk of a chunked prompt no longer has its earlier tokens in the input.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Sequence, TypeVar

import torch

from lmcache.experimental.cache_engine import LMCacheEngine, LMCacheEngineBuilder
from lmcache.integration.vllm.request_identity import cache_identity
from lmcache.integration.vllm.utils import ENGINE_NAME, extra_config_of, force_skip_save, lmcache_get_config
from lmcache.integration.vllm.v0_model_input import StepLayout, read_step, rebuild_model_input
from lmcache.integration.vllm.vllm_compat import current_vllm_config
from lmcache.integration.vllm.worker_engine import close_worker_engine, open_worker_engine
from lmcache.logging import init_logger

if TYPE_CHECKING:
    from vllm.config import CacheConfig, ModelConfig, ParallelConfig

logger = init_logger(__name__)

# How this door names itself in the engine's log lines.
DOOR = "v0 door"
# Attribute of a rebuilt model input that carries the plan of its step (see `StepPlan`).
PLAN_ATTR = "_lmcache_step_plan"

T = TypeVar("T")


class RetrieveStatus(Enum):
    """What the door does for one sequence before the forward pass."""

    PREFILL = "prefill"  # a prompt step from position 0: load its cached prefix
    NONE = "none"  # decode, a later prompt chunk, or a bypassed sequence


class StoreStatus(Enum):
    """What the door does for one sequence after the forward pass."""

    PREFILL = "prefill"  # a prompt step from position 0: store what it computed
    NONE = "none"


@dataclass
class StepPlan:
    """One step as it came from vLLM, kept with the rebuilt input so the store can key whole prompts."""

    # Sequence spans of the input as vLLM built it.
    step: StepLayout
    # The input's token ids (CPU) and slot mapping (KV cache device), before any rebuild.
    tokens: torch.Tensor
    slot_mapping: torch.Tensor
    # Per prefill: the cache salt of its keys, or None when the sequence bypasses the cache.
    salts: List[Optional[str]]
    # Per prefill: whether a cached prefix may replace computation (False when the request
    # wants prompt logprobs, which need every prompt token computed).
    may_skip: List[bool]
    # Per prefill: tokens whose KV was loaded from LMCache this step.
    loaded: List[int]


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    logger.warning(message)


@dataclass(frozen=True)
class _ConfigView:
    """The parts of a `VllmConfig` the engine setup reads, for callers that hold them separately."""

    model_config: Any
    parallel_config: Any
    cache_config: Any
    kv_transfer_config: Any = None


def _vllm_config_for(model_config: Any, parallel_config: Any, cache_config: Any) -> Any:
    """vLLM's current config when it belongs to this model, else a view of the three parts."""
    current = current_vllm_config()
    if current is not None and current.model_config is model_config:
        return current
    return _ConfigView(model_config, parallel_config, cache_config)


def init_lmcache_engine(
    model_config: "ModelConfig",
    parallel_config: "ParallelConfig",
    cache_config: "CacheConfig",
    vllm_config: Any = None,
) -> Optional[LMCacheEngine]:
    """Create this worker's engine; None when it exists already or the setup is not served.

    Pipeline parallelism is not served: v0 runs different micro-batches on different stages at
    once, so the stages could not agree on how many tokens to skip.
    """
    if LMCacheEngineBuilder.get(ENGINE_NAME) is not None:
        return None
    if parallel_config.pipeline_parallel_size > 1:
        _warn_once("LMCache v0 door: pipeline parallelism is not supported; the cache stays off")
        return None
    if vllm_config is None:
        vllm_config = _vllm_config_for(model_config, parallel_config, cache_config)
    config = lmcache_get_config(extra_config_of(vllm_config))
    if config.save_decode_cache:
        _warn_once("LMCache v0 door: save_decode_cache is not supported by the v0 engine; only prompts are stored")
    return open_worker_engine(vllm_config, config, DOOR).engine


def close_lmcache_engine() -> None:
    """Close this process's engine, waiting for its pending writes (no-op without one)."""
    close_worker_engine(DOOR)


def _step_bypass_reason(model_input: Any) -> Optional[str]:
    """Why a whole step cannot use the cache, or None."""
    if getattr(model_input, "inputs_embeds", None) is not None:
        return "prompt embeddings"
    if getattr(model_input, "multi_modal_kwargs", None):
        return "multimodal inputs"
    if getattr(model_input, "token_types", None) is not None or getattr(model_input, "token_type_ids", None) is not None:
        return "token types"
    if getattr(model_input, "prompt_adapter_requests", None):
        return "prompt adapters"
    if getattr(model_input, "previous_hidden_states", None) is not None:
        return "speculative hidden states"
    positions = model_input.input_positions
    if positions is None or positions.dim() != 1:
        return "M-RoPE positions"
    return None


def _lora_salt(model_input: Any, token_index: int) -> Optional[str]:
    """The empty salt without LoRA, the adapter's identity for a LoRA sequence, None if unnamed."""
    mapping = getattr(model_input, "lora_mapping", None)
    if mapping is None or not mapping.index_mapping:
        return ""
    lora_id = mapping.index_mapping[token_index]
    if lora_id <= 0:
        return ""
    for request in getattr(model_input, "lora_requests", None) or ():
        if request.lora_int_id == lora_id:
            return cache_identity(lora_request=request).cache_salt
    return None


def plan_step(model_input: Any) -> Optional[StepPlan]:
    """The plan of a step as vLLM built it; None for unknown attention backends or no prefills."""
    step = read_step(model_input)
    if step is None:
        _warn_once(
            f"LMCache v0 door: attention metadata {type(model_input.attn_metadata).__name__} is not "
            "supported (TorchSDPAMetadata, FlashAttentionMetadata are); the cache is bypassed"
        )
        return None
    if step.num_prefills == 0:
        return None
    reason = _step_bypass_reason(model_input)
    if reason is not None:
        _warn_once(f"LMCache v0 door: steps with {reason} bypass the cache")
    slot_mapping = model_input.attn_metadata.slot_mapping
    selected = model_input.sampling_metadata.selected_token_indices.cpu() if model_input.sampling_metadata else None
    salts: List[Optional[str]] = []
    may_skip: List[bool] = []
    for seq in step.prefills:
        salt = None if reason is not None else _lora_salt(model_input, seq.start)
        if salt is not None and bool((slot_mapping[seq.start : seq.end] < 0).any()):
            salt = None  # tokens without a slot (sliding window, profiling) cannot be stored or loaded
        salts.append(salt)
        sampled = 0 if selected is None else int(((selected >= seq.start) & (selected < seq.end)).sum())
        may_skip.append(sampled <= 1)
    return StepPlan(
        step=step,
        tokens=model_input.input_tokens.cpu(),
        slot_mapping=slot_mapping,
        salts=salts,
        may_skip=may_skip,
        loaded=[0] * step.num_prefills,
    )


def _plan_of(model_input: Any) -> Optional[StepPlan]:
    plan = getattr(model_input, PLAN_ATTR, None)
    return plan if plan is not None else plan_step(model_input)


def _is_profile_run(kv_caches: Optional[Sequence[torch.Tensor]]) -> bool:
    return not kv_caches or kv_caches[0].numel() == 0


def lmcache_should_retrieve(model_input: Any, kv_caches: Optional[Sequence[torch.Tensor]] = None) -> List[RetrieveStatus]:
    """One status per sequence: PREFILL for prompt steps from position 0 that may use a cached prefix."""
    step = read_step(model_input)
    statuses = [RetrieveStatus.NONE] * (len(step.seqs) if step is not None else 0)
    if step is None or (kv_caches is not None and _is_profile_run(kv_caches)):
        return statuses
    plan = plan_step(model_input)
    if plan is None:
        return statuses
    for seq, salt, may_skip in zip(step.prefills, plan.salts, plan.may_skip):
        if seq.context_len == 0 and salt is not None and may_skip:
            statuses[seq.index] = RetrieveStatus.PREFILL
    return statuses


def _agree_across_tensor_parallel(loaded: List[int]) -> List[int]:
    """The smallest loaded count per sequence over the tensor-parallel group.

    Every rank must rebuild the same input (the model's collectives need equal shapes), and
    ranks may hold different chunks (each stores its own shard)."""
    from vllm.distributed import parallel_state

    if not loaded or not parallel_state.model_parallel_is_initialized():
        return loaded
    group = parallel_state.get_tp_group()
    if group.world_size == 1:
        return loaded
    counts = torch.tensor(loaded, dtype=torch.int64)
    torch.distributed.all_reduce(counts, op=torch.distributed.ReduceOp.MIN, group=group.cpu_group)
    return [int(n) for n in counts.tolist()]


def lmcache_retrieve_kv(
    model_executable: torch.nn.Module,
    model_input: Any,
    cache_config: "CacheConfig",
    kv_caches: List[torch.Tensor],
    retrieve_status: Sequence[RetrieveStatus],
) -> tuple[Any, bool, Optional[torch.Tensor]]:
    """Load cached prefixes into their slots; return (rebuilt input, False, None)."""
    engine = LMCacheEngineBuilder.get(ENGINE_NAME)
    if engine is None or _is_profile_run(kv_caches) or RetrieveStatus.PREFILL not in retrieve_status:
        return model_input, False, None
    plan = plan_step(model_input)
    if plan is None:
        return model_input, False, None
    for seq, salt in zip(plan.step.prefills, plan.salts):
        if retrieve_status[seq.index] != RetrieveStatus.PREFILL or salt is None:
            continue
        mask = engine.retrieve(
            plan.tokens[seq.start : seq.end],
            cache_salt=salt,
            kvcaches=kv_caches,
            slot_mapping=plan.slot_mapping[seq.start : seq.end],
        )
        misses = torch.nonzero(~mask, as_tuple=False)
        plan.loaded[seq.index] = int(misses[0]) if misses.numel() else int(mask.shape[0])
    plan.loaded = _agree_across_tensor_parallel(plan.loaded)
    # A step computes at least each prompt's last token: its logits give the next token.
    skips = [min(n, seq.query_len - 1) for n, seq in zip(plan.loaded, plan.step.prefills)]
    rebuilt = rebuild_model_input(model_input, plan.step, skips, cache_config.block_size)
    if rebuilt is not model_input:
        # The rebuilt input lacks the loaded tokens that the store needs to key whole prompts,
        # so the plan rides along as a private attribute vLLM never reads (frozen dataclass).
        object.__setattr__(rebuilt, PLAN_ATTR, plan)
    for seq, n, skip in zip(plan.step.prefills, plan.loaded, skips):
        if retrieve_status[seq.index] == RetrieveStatus.PREFILL:
            logger.info(
                "LMCache v0 door: prompt of %d tokens: %d hit tokens loaded, computing %d",
                seq.query_len, n, seq.query_len - skip,
            )
    return rebuilt, False, None


def lmcache_should_store(model_input: Any, kv_caches: Optional[Sequence[torch.Tensor]] = None) -> List[StoreStatus]:
    """One status per sequence: PREFILL for prompt steps from position 0 whose KV can be keyed."""
    plan = _plan_of(model_input)
    step = plan.step if plan is not None else read_step(model_input)
    statuses = [StoreStatus.NONE] * (len(step.seqs) if step is not None else 0)
    if plan is None or force_skip_save() or (kv_caches is not None and _is_profile_run(kv_caches)):
        return statuses
    for seq, salt in zip(plan.step.prefills, plan.salts):
        if seq.context_len == 0 and salt is not None:
            statuses[seq.index] = StoreStatus.PREFILL
    return statuses


def lmcache_store_kv(
    model_config: "ModelConfig",
    parallel_config: "ParallelConfig",
    cache_config: "CacheConfig",
    model_executable: torch.nn.Module,
    model_input: Any,
    kv_caches: List[torch.Tensor],
    store_status: Sequence[StoreStatus],
) -> None:
    """Store the KV the step computed for each PREFILL sequence, keyed by its whole prompt so far."""
    engine = LMCacheEngineBuilder.get(ENGINE_NAME)
    if engine is None or _is_profile_run(kv_caches) or StoreStatus.PREFILL not in store_status:
        return
    plan = _plan_of(model_input)
    if plan is None:
        return
    chunk_size = engine.config.chunk_size
    for seq, salt, loaded in zip(plan.step.prefills, plan.salts, plan.loaded):
        if store_status[seq.index] != StoreStatus.PREFILL or salt is None:
            continue
        end = seq.end
        if not engine.config.save_unfull_chunk:
            end = seq.start + (seq.query_len // chunk_size) * chunk_size
        if end <= seq.start:
            continue
        tokens = plan.tokens[seq.start : end]
        # Chunks loaded this step are cached already: leave them out of the store.
        cached = (loaded // chunk_size) * chunk_size
        mask = None
        if cached:
            mask = torch.ones(len(tokens), dtype=torch.bool)
            mask[:cached] = False
        engine.store(
            tokens,
            mask,
            cache_salt=salt,
            kvcaches=kv_caches,
            slot_mapping=plan.slot_mapping[seq.start : end],
        )


def execute_with_cache(runner: Any, model_input: Any, kv_caches: List[torch.Tensor], forward: Callable[[Any], T]) -> T:
    """One v0 step with LMCache: retrieve and rebuild, `forward(input)`, store.

    Starts the engine at the first real step. Steps it does not serve (profiling, a user's own
    KV transfer config, pipeline parallelism, sliding-window attention) go to `forward`
    untouched. A failure inside the cache is logged and the step computes everything, as it
    would without LMCache.
    """
    metadata = model_input.attn_metadata
    if (
        metadata is None
        or metadata.num_prefills == 0  # decode-only steps: nothing to load or store
        or runner.vllm_config.kv_transfer_config is not None
        or _is_profile_run(kv_caches)
        or runner.parallel_config.pipeline_parallel_size > 1
    ):
        return forward(model_input)
    if getattr(runner, "sliding_window", None) is not None:
        # vLLM's CPU prefix-aware attention cannot mask a window, and a windowed prompt's early
        # tokens have no slots to store from or load into.
        _warn_once("LMCache v0 door: sliding-window attention is not supported; the cache stays off")
        return forward(model_input)
    if LMCacheEngineBuilder.get(ENGINE_NAME) is None:
        init_lmcache_engine(runner.model_config, runner.parallel_config, runner.cache_config, vllm_config=runner.vllm_config)
    step_input = model_input
    try:
        statuses = lmcache_should_retrieve(model_input, kv_caches)
        if RetrieveStatus.PREFILL in statuses:
            step_input, _, _ = lmcache_retrieve_kv(runner.model, model_input, runner.cache_config, kv_caches, statuses)
    except Exception:
        logger.exception("LMCache v0 door: retrieve failed; computing the whole step")
        step_input = model_input
    output = forward(step_input)
    try:
        store_statuses = lmcache_should_store(step_input, kv_caches)
        if StoreStatus.PREFILL in store_statuses:
            lmcache_store_kv(
                runner.model_config, runner.parallel_config, runner.cache_config,
                runner.model, step_input, kv_caches, store_statuses,
            )
    except Exception:
        logger.exception("LMCache v0 door: store failed; the step's KV is not cached")
    return output
