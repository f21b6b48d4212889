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
  slots and return the input rebuilt to compute only the rest (`model_input`). A fully
  cached prompt still computes its last token, so the model is never bypassed.
- `lmcache_should_store(model_input) -> [StoreStatus]` and `lmcache_store_kv(model_config,
  parallel_config, cache_config, model_executable, model_input, kv_caches, statuses)`: store
  the prompt tokens computed by the step (chunks already cached are skipped).

Every prompt step is served, its first chunk or a later one of a chunked prefill: the keys hash
the whole prompt so far (`step_plan`), a step loads the cached chunks beyond what vLLM already
has and stores each chunk once its KV is computed. A step is planned once; vLLM's connector
hands the rebuilt input back to the store, and `StepPlans` finds the plan again from it.

`execute_with_cache` stores off the step (`off_step_saver.py`): the step's store runs on a thread
after the forward pass and is waited for at the start of the next step, before vLLM writes into
its KV cache again (blocks of finished or preempted sequences may be reused then).

Keys: a sequence served by a LoRA adapter is keyed with the adapter's name and path as the
cache salt; steps carrying prompt embeddings, multimodal inputs, token types, prompt adapters or
M-RoPE positions bypass the cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Sequence, Tuple, TypeVar

import multiprocessing.util
import threading

import torch

from lmcache.experimental.cache_engine import LMCacheEngine, LMCacheEngineBuilder
from lmcache.experimental.token_database import skip_prefix_mask
from lmcache.integration.vllm.off_step_saver import OffStepSaver
from lmcache.integration.vllm.request_log import format_v0_step_line
from lmcache.integration.vllm.utils import ENGINE_NAME, extra_config_of, force_skip_save, lmcache_get_config
from lmcache.integration.vllm.v0.model_input import rebuild_model_input
from lmcache.integration.vllm.v0.step_plan import PrefillPlan, StepPlan, StepPlans, plan_step, warn_once
from lmcache.integration.vllm.vllm_compat import current_vllm_config, v0_attention_window, v0_state_beyond_kv
from lmcache.integration.vllm.worker_engine import ENGINE_EXIT_PRIORITY, close_worker_engine, open_worker_engine
from lmcache.logging import init_logger

if TYPE_CHECKING:
    from vllm.config import CacheConfig, ModelConfig, ParallelConfig

logger = init_logger(__name__)

# How this door names itself in the engine's log lines.
DOOR = "v0 door"

T = TypeVar("T")


class RetrieveStatus(Enum):
    """What the door does for one sequence before the forward pass."""

    PREFILL = "prefill"  # a prompt step (first or later chunk): load its cached chunks
    NONE = "none"  # decode, or a bypassed sequence


class StoreStatus(Enum):
    """What the door does for one sequence after the forward pass."""

    PREFILL = "prefill"  # a prompt step (first or later chunk): store the chunks it completed
    NONE = "none"


# The plan of the step in flight in this worker (vLLM runs one step at a time per worker).
_PLANS = StepPlans()
_SAVER: Optional[OffStepSaver] = None
_SAVER_LOCK = threading.Lock()


def _saver() -> OffStepSaver:
    """This process's off-step saver (made on first use; drained at exit before the engine closes)."""
    global _SAVER
    with _SAVER_LOCK:
        if _SAVER is None:
            _SAVER = OffStepSaver("v0")
            multiprocessing.util.Finalize(None, _SAVER.close, exitpriority=ENGINE_EXIT_PRIORITY + 1)
        return _SAVER


def step_plan_of(model_input: Any) -> Optional[StepPlan]:
    """The plan the door made for this step's input (original or rebuilt), planning it if new."""
    return _PLANS.get(model_input)


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


@dataclass(frozen=True)
class RunnerView:
    """What the door reads from vLLM's v0 model runner, read once per step."""

    vllm_config: Any
    block_size: int
    pipeline_parallel_size: int
    sliding_window: Optional[int]  # plain or interleaved (Gemma 2 / 3): `v0_attention_window`
    state_beyond_kv: Optional[str]  # Mamba / recurrent state: `v0_state_beyond_kv`

    @classmethod
    def of(cls, runner: Any) -> "RunnerView":
        return cls(
            vllm_config=runner.vllm_config,
            block_size=runner.cache_config.block_size,
            pipeline_parallel_size=runner.parallel_config.pipeline_parallel_size,
            sliding_window=v0_attention_window(runner),
            state_beyond_kv=v0_state_beyond_kv(getattr(runner, "model_config", None)),
        )

    def reason_to_step_aside(self) -> Optional[str]:
        """Why the door leaves this runner's steps alone (None: it serves them).

        A user's own KV transfer config means vLLM's connector is in charge. Pipeline stages
        run different micro-batches at once, so they could not agree on what to skip. vLLM's CPU
        prefix-aware attention cannot mask a sliding window (its `assert not self.need_mask`),
        and a windowed prompt's early tokens have no slots to store from or load into; models
        that interleave windowed layers (Gemma 2 / 3) are windowed too. State outside the KV
        caches (Mamba) would not be restored by a hit."""
        if self.vllm_config.kv_transfer_config is not None:
            return "kv_transfer_config"
        if self.pipeline_parallel_size > 1:
            return "pipeline parallelism is not supported"
        if self.sliding_window is not None:
            return f"sliding-window attention (window {self.sliding_window}) is not supported"
        if self.state_beyond_kv is not None:
            return f"LMCache does not support {self.state_beyond_kv}"
        return None


def _open_engine(vllm_config: Any) -> LMCacheEngine:
    config = lmcache_get_config(extra_config_of(vllm_config))
    if config.save_decode_cache:
        warn_once("LMCache v0 door: save_decode_cache is not supported by the v0 engine; only prompts are stored")
    if config.enable_pd:
        raise ValueError("enable_pd=True: prefill/decode disaggregation runs on the v1 connector "
                         "(LMCacheConnectorV1, kv_producer/kv_consumer), not on the v0 engine")
    for switch in ("use_layerwise", "enable_async_loading"):
        if getattr(config, switch):
            warn_once(f"LMCache v0 door: {switch} applies to the v1 door; the v0 door loads whole chunks in the step")
    if config.enable_blending:
        raise ValueError("enable_blending=True: CacheBlend runs on vLLM's v1 engine (VLLM_USE_V1=1), not on v0")
    return open_worker_engine(vllm_config, config, DOOR).engine


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
        warn_once("LMCache v0 door: pipeline parallelism is not supported; the cache stays off")
        return None
    if vllm_config is None:
        vllm_config = _vllm_config_for(model_config, parallel_config, cache_config)
    return _open_engine(vllm_config)


def flush_stores() -> None:
    """Wait for the last step's off-step store (for readers of the cache right after a step)."""
    if _SAVER is not None:
        _SAVER.flush()


def close_lmcache_engine() -> None:
    """Close this process's engine, waiting for its pending writes (no-op without one)."""
    flush_stores()
    close_worker_engine(DOOR)


def _is_profile_run(kv_caches: Optional[Sequence[torch.Tensor]]) -> bool:
    return not kv_caches or kv_caches[0].numel() == 0


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


def _load_prefill(engine: LMCacheEngine, prefill: PrefillPlan, kv_caches: List[torch.Tensor], block_size: int) -> int:
    """Retrieve the cached chunks of one prefill into its slots; the step's tokens now loaded.

    The context (tokens vLLM has already) gets slot -1, so vLLM's blocks are never written; the
    chunk that straddles it is read whole and only its tail lands."""
    assert prefill.tokens is not None
    context = prefill.seq.context_len
    slots = prefill.slots(block_size)
    if context:
        slots = slots.clone()
        slots[:context] = -1
    got = engine.retrieve(
        prefill.tokens,
        skip_prefix_mask(prefill.seq.seq_len, context, engine.config.chunk_size),
        cache_salt=prefill.salt,
        kvcaches=kv_caches,
        slot_mapping=slots,
    )
    fresh = got[context:]
    misses = torch.nonzero(~fresh, as_tuple=False)
    return int(misses[0]) if misses.numel() else int(fresh.shape[0])


def retrieve_step(
    engine: LMCacheEngine,
    model_input: Any,
    plan: StepPlan,
    kv_caches: List[torch.Tensor],
    block_size: int,
    wanted: Optional[Sequence[bool]] = None,
) -> Tuple[Any, StepPlan]:
    """Load what LMCache has for the plan's prefills (`wanted[i]` False leaves prefill i alone);
    return the input rebuilt to compute only the rest, and the plan with what was loaded."""
    for prefill in plan.prefills:
        prefill.loaded = 0
        if prefill.served and prefill.may_skip and (wanted is None or wanted[prefill.seq.index]):
            prefill.loaded = _load_prefill(engine, prefill, kv_caches, block_size)
    for prefill, agreed in zip(plan.prefills, _agree_across_tensor_parallel(plan.loaded)):
        prefill.loaded = agreed
    # A step computes at least one token of each prompt: vLLM's attention needs a query, and the
    # last chunk's last token gives the next token's logits.
    skips = [min(p.loaded, p.seq.query_len - 1) for p in plan.prefills]
    rebuilt = rebuild_model_input(model_input, plan.step, skips, block_size)
    for prefill, skip in zip(plan.prefills, skips):
        if prefill.served:
            seq = prefill.seq
            reason = "" if prefill.may_skip else "prompt logprobs"
            logger.info(
                "%s", format_v0_step_line(seq.query_len, seq.context_len, prefill.loaded, seq.query_len - skip, reason)
            )
    return rebuilt, plan


def store_step(
    engine: LMCacheEngine,
    plan: StepPlan,
    kv_caches: List[torch.Tensor],
    block_size: int,
    wanted: Optional[Sequence[bool]] = None,
) -> None:
    """Store the chunks each served prefill completed this step, keyed by its whole prompt so far.

    Mid-prompt only whole chunks are stored; the step that computes the prompt's last token also
    stores the trailing partial chunk (unless `save_unfull_chunk` is off). Chunks below the
    context plus what this step loaded were stored when their KV was computed (an earlier chunk
    through this door, or the request that filled vLLM's prefix cache), so they are left out."""
    chunk_size = engine.config.chunk_size
    for prefill in plan.prefills:
        if not prefill.served or (wanted is not None and not wanted[prefill.seq.index]):
            continue
        assert prefill.tokens is not None
        seq_len = prefill.seq.seq_len
        end = seq_len
        if not (prefill.completes_prompt and engine.config.save_unfull_chunk):
            end -= seq_len % chunk_size
        cached = prefill.seq.context_len + prefill.loaded
        if end <= cached - cached % chunk_size:
            continue
        engine.store(
            prefill.tokens[:end],
            skip_prefix_mask(end, cached, chunk_size),
            cache_salt=prefill.salt,
            kvcaches=kv_caches,
            slot_mapping=prefill.slots(block_size)[:end],
        )


def lmcache_should_retrieve(model_input: Any, kv_caches: Optional[Sequence[torch.Tensor]] = None) -> List[RetrieveStatus]:
    """One status per sequence: PREFILL for prompt steps that may use cached chunks."""
    plan = _PLANS.get(model_input)
    if plan is None:
        return []
    statuses = [RetrieveStatus.NONE] * len(plan.step.seqs)
    if kv_caches is not None and _is_profile_run(kv_caches):
        return statuses
    for prefill in plan.prefills:
        if prefill.served and prefill.may_skip:
            statuses[prefill.seq.index] = RetrieveStatus.PREFILL
    return statuses


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
    plan = _PLANS.get(model_input)
    if plan is None:
        return model_input, False, None
    wanted = [status == RetrieveStatus.PREFILL for status in retrieve_status]
    rebuilt, plan = retrieve_step(engine, model_input, plan, kv_caches, cache_config.block_size, wanted)
    _PLANS.remember(rebuilt, plan, same_step=True)
    return rebuilt, False, None


def lmcache_should_store(model_input: Any, kv_caches: Optional[Sequence[torch.Tensor]] = None) -> List[StoreStatus]:
    """One status per sequence: PREFILL for prompt steps whose KV can be keyed."""
    plan = _PLANS.get(model_input)
    if plan is None:
        return []
    statuses = [StoreStatus.NONE] * len(plan.step.seqs)
    if force_skip_save() or (kv_caches is not None and _is_profile_run(kv_caches)):
        return statuses
    for prefill in plan.prefills:
        if prefill.served:
            statuses[prefill.seq.index] = StoreStatus.PREFILL
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
    plan = _PLANS.get(model_input)
    if plan is None:
        return
    wanted = [status == StoreStatus.PREFILL for status in store_status]
    store_step(engine, plan, kv_caches, cache_config.block_size, wanted)


def _say_cache_stays_off(reason: Optional[str]) -> None:
    """Warn once why the door serves nothing (not when the user's own connector is in charge)."""
    if reason not in (None, "kv_transfer_config"):
        warn_once(f"LMCache v0 door: {reason}; the cache stays off")


def start_engine_for_runner(runner: Any) -> None:
    """Create the engine for a v0 model runner whose model just loaded, so a bad LMCache config
    stops the `LLM`/engine build rather than its first request. Runners the door leaves alone
    (`RunnerView.reason_to_step_aside`) get none."""
    view = RunnerView.of(runner)
    reason = view.reason_to_step_aside()
    if reason is None and LMCacheEngineBuilder.get(ENGINE_NAME) is None:
        _open_engine(view.vllm_config)
    else:
        _say_cache_stays_off(reason)


def execute_with_cache(runner: Any, model_input: Any, kv_caches: List[torch.Tensor], forward: Callable[[Any], T]) -> T:
    """One v0 step with LMCache: plan, retrieve and rebuild, `forward(input)`, store.

    Starts the engine here if `start_engine_for_runner` did not (or it was closed since). Steps
    it does not serve (profiling, decode-only, and every step of a runner
    `RunnerView.reason_to_step_aside` names) go to `forward`
    untouched. A failure inside the cache is logged and the step computes everything, as it
    would without LMCache.
    """
    # The last step's store copies out of blocks this step may write (decodes included): wait for it.
    flush_stores()
    metadata = model_input.attn_metadata
    if metadata is None or metadata.num_prefills == 0 or _is_profile_run(kv_caches):
        return forward(model_input)
    view = RunnerView.of(runner)
    reason = view.reason_to_step_aside()
    if reason is not None:
        _say_cache_stays_off(reason)
        return forward(model_input)
    engine = LMCacheEngineBuilder.get(ENGINE_NAME) or _open_engine(view.vllm_config)
    step_input, plan = model_input, None
    try:
        plan = plan_step(model_input)
        if plan is not None:
            step_input, plan = retrieve_step(engine, model_input, plan, kv_caches, view.block_size)
    except Exception:
        logger.exception("LMCache v0 door: retrieve failed; computing the whole step")
        step_input = model_input
        if plan is not None:
            for prefill in plan.prefills:
                prefill.loaded = 0
    output = forward(step_input)
    if plan is not None and not force_skip_save():
        stored_plan = plan
        _saver().submit(lambda: store_step(engine, stored_plan, kv_caches, view.block_size), "v0 step")
    return output
