"""The one place that touches vLLM's private names (and, later, differences between vLLM versions).

Everything else in `lmcache` and `lmcache_vllm` asks this module. Each entry says what it is for
and the vLLM version it was checked against; a vLLM release that renames one of them breaks here,
in one place, and a version difference becomes a branch in one function here rather than
`hasattr` checks across the doors.

Two vLLM lines are supported: 0.9.2 (v0 and v1 engines) and 0.32 (v1 only; `vllm_release()`
tells them apart). Where they differ, the function below has one branch per line.

Operations:
- `vllm_release()` / `is_legacy_vllm()`: the running vLLM's release; whether it is the 0.9 line.
- `current_vllm_config()`: the `VllmConfig` vLLM set as current in this process, or None.
- `ipex_paged_attention_in_use()`: whether vLLM's CPU attention keeps K/V in IPEX's layout.
- `cpu_kv_layout(vllm_config)`: the paged layout of vLLM's CPU attention cache.
- `torch_dtype_of(cache_dtype)`: vLLM's KV cache dtype name -> torch dtype (None if unknown).
- `kv_caches_in_layer_order(kv_caches)`: the per-layer dict `register_kv_caches` gets, in order.
- `cached_request_step(cached, i)`: (resumed, new block ids) of one scheduled running request.
- `load_failure_policy(vllm_config)`: what vLLM does with blocks whose load failed.
- `FLASH_METADATA_VIEW_RESETS`: the flash-attention metadata's memoized views, to drop on rebuild.
- `connector_impl_of(shell)` / `step_connector_metadata(shell)`: what vLLM's own
  `LMCacheConnectorV1` shell holds and hands over each step.
- `attention_kv_caches(forward_context)`: each decoder attention layer's KV cache tensor.
- `multimodal_placeholders(request)`: a v1 request's multimodal content hashes and positions.
- `full_prompt_reason(request)`: why a v1 request must compute every prompt position (None if not).
- `WRAPPER_PATCH_POINTS` / `KV_SPEC_GUARD_POINTS` / `PLUGIN_PATCH_POINTS`: the vLLM functions LMCache wraps (`PatchPoint`:
  module, name, role, the vLLM lines it applies to).
- `wrapper_kv_transfer_config()`: the KV transfer config the wrapper turns on for the user.
- `kv_cache_block_ids(blocks)`: the block ids of a `KVCacheBlocks`, per KV cache group.
- `finish_short_remote_load(scheduler, request, loaded)`: vLLM 0.9.2's "remote KV arrived" step
  for a background load that left fewer tokens than the blocks vLLM allocated.
- `layers_without_paged_kv(kv_cache_specs)`: the layers whose KV cache spec is not a paged
  attention KV cache LMCache can save (Mamba / linear-attention state, unknown kinds).
- `route_mp_connector(module, class_name)`: make vLLM 0.32's `LMCacheMPConnector` name build our
  class (vLLM's own module for it cannot be imported without upstream's multiprocess package).
- `v0_attention_window(runner)` / `v0_state_beyond_kv(model_config)`: the sliding window a v0
  runner's attention applies (plain or interleaved), and whether a model keeps non-KV state.
- `kv_event_types()`: vLLM's own KV event classes, which LMCache's KV events are built from;
  `KV_EVENTS_POINTS` / `shell_kv_events(events)`: vLLM 0.32's connector hook that hands a worker's
  events to the scheduler, and the container it expects there.

Nothing here imports vLLM at module import time: `lmcache_vllm` imports it in every vLLM process.
"""

from __future__ import annotations

import functools
import importlib
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, List, Mapping, Optional, Sequence, Tuple

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext

    from lmcache.experimental.kv_layout import KVLayout

# The vLLM releases every name below was read from and tested against: the legacy line (v0 and
# v1 engines) and the current one (v1 only).
CHECKED_VLLM_VERSION = "0.9.2"
CHECKED_LATEST_VLLM_VERSION = "0.32.0"

# vLLM >= 0.11 CPU attention ISAs whose cache blocks have the CPU_ATTN layout (measured against
# vLLM 0.32's `cpu_attn_reshape_and_cache`, tests/latest/test_kernels_cpu_attn.py); `amx` packs
# K for its tiles and the others were not measured.
CPU_ATTN_ISAS = ("vec", "vec16")


@functools.lru_cache(maxsize=1)
def vllm_release() -> Tuple[int, ...]:
    """The running vLLM's release as numbers: (0, 9, 2), (0, 32, 0)."""
    from vllm.version import __version__

    match = re.match(r"\d+(\.\d+)*", __version__)
    return tuple(int(x) for x in match.group(0).split(".")[:3]) if match else (0,)


def is_legacy_vllm() -> bool:
    """True on the 0.9 line (v0 engine, IPEX/packed CPU layouts, `resumed_from_preemption`)."""
    return vllm_release() < (0, 10)


# vLLM 0.9.2 `vllm/distributed/kv_transfer/kv_connector/v1/lmcache_connector.py`: the shell keeps
# the object `lmcache.integration.vllm.vllm_v1_adapter.LMCacheConnectorV1Impl` builds here.
_SHELL_IMPL_ATTRIBUTE = "_lmcache_engine"

# vLLM 0.9.2 `FlashAttentionMetadata`: memoized prefill/decode views computed from the other
# fields on first use; a copy with changed fields must drop them or it serves stale views.
FLASH_METADATA_VIEW_RESETS: dict[str, None] = {"_cached_prefill_metadata": None, "_cached_decode_metadata": None}


def current_vllm_config() -> Optional["VllmConfig"]:
    """The config vLLM's `set_current_vllm_config` made current here (None outside one).

    For vLLM's own v0 `LMCacheConnector`, which hands `init_lmcache_engine` only the model,
    parallel and cache configs: the whole config holds the KV transfer settings too.
    vLLM 0.9.2: module global `vllm.config._current_vllm_config`."""
    from vllm import config as vllm_config_module

    return getattr(vllm_config_module, "_current_vllm_config", None)


def ipex_paged_attention_in_use() -> bool:
    """Whether vLLM's CPU attention runs through IPEX (K/V head-major) rather than its own kernels
    (K packed by 16 bytes). vLLM 0.9.2: `vllm.attention.ops.ipex_attn._use_ipex`."""
    from vllm.attention.ops import ipex_attn

    return bool(ipex_attn._use_ipex)


def cpu_kv_layout(vllm_config: "VllmConfig") -> "KVLayout":
    """The layout of vLLM's CPU attention cache for this config.

    vLLM 0.9.2: `CPU_IPEX` when its CPU attention runs through IPEX, else `CPU_PACKED`.
    vLLM 0.32: `CPU_ATTN` (one tensor per layer), for the ISAs `CPU_ATTN_ISAS`; the ISA is what
    `vllm.v1.attention.backends.cpu_attn._get_attn_isa` picks for the dtype and block size."""
    from lmcache.experimental.kv_layout import KVLayout

    if is_legacy_vllm():
        return KVLayout.CPU_IPEX if ipex_paged_attention_in_use() else KVLayout.CPU_PACKED
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    cache = vllm_config.cache_config
    model = vllm_config.model_config
    isa = _get_attn_isa(model.dtype, cache.block_size, model.get_head_size(), cache.cache_dtype)
    if isa not in CPU_ATTN_ISAS:
        raise ValueError(
            f"vLLM {'.'.join(map(str, vllm_release()))} CPU attention uses ISA {isa!r} for dtype "
            f"{model.dtype} and block_size {cache.block_size}; LMCache reads its cache only for "
            f"ISAs {', '.join(CPU_ATTN_ISAS)} (e.g. use float32, or float16 without AMX)"
        )
    return KVLayout.CPU_ATTN


def torch_dtype_of(cache_dtype: str) -> Optional["torch.dtype"]:
    """vLLM's name for a KV cache dtype (`fp8`, `half`, ...) as a torch dtype; None if unknown.
    vLLM 0.9.2: `vllm.utils.STR_DTYPE_TO_TORCH_DTYPE`; 0.32: `vllm.utils.torch_utils`."""
    if is_legacy_vllm():
        from vllm.utils import STR_DTYPE_TO_TORCH_DTYPE
    else:
        from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
    return STR_DTYPE_TO_TORCH_DTYPE.get(cache_dtype)


def kv_caches_in_layer_order(kv_caches: Mapping[str, "torch.Tensor"]) -> List["torch.Tensor"]:
    """The tensors of `register_kv_caches`' `{layer name: cache}` in model layer order (the
    order the engine stores layers in), by the layer index vLLM's own
    `vllm.model_executor.models.utils.extract_layer_index` reads from each name."""
    from vllm.model_executor.models.utils import extract_layer_index

    return [kv_caches[name] for name in sorted(kv_caches, key=extract_layer_index)]


def cached_request_step(cached: Any, index: int) -> Tuple[bool, Optional[Sequence[Sequence[int]]]]:
    """(resumed after preemption, new block ids per KV cache group or None for none) of the
    `index`-th request of the scheduler output's `scheduled_cached_reqs`.
    vLLM 0.9.2: `resumed_from_preemption[i]`, `new_block_ids[i]` always a tuple; vLLM 0.32:
    `req_id in resumed_req_ids`, `new_block_ids[i]` None when no block was added."""
    if is_legacy_vllm():
        return bool(cached.resumed_from_preemption[index]), cached.new_block_ids[index]
    return cached.req_ids[index] in cached.resumed_req_ids, cached.new_block_ids[index]


def load_failure_policy(vllm_config: "VllmConfig") -> Optional[str]:
    """What vLLM does with blocks a connector reports it failed to load: `recompute` or `fail`
    (vLLM 0.32: `kv_transfer_config.kv_load_failure_policy`, default `fail`); None on vLLM 0.9.2,
    which never asks."""
    kv_transfer = vllm_config.kv_transfer_config
    if is_legacy_vllm() or kv_transfer is None:
        return None
    return kv_transfer.kv_load_failure_policy


def connector_impl_of(shell: Any) -> Any:
    """The object vLLM's `LMCacheConnectorV1` shell delegates to (None for other connectors).
    vLLM 0.9.2: attribute `_lmcache_engine` of the shell."""
    return getattr(shell, _SHELL_IMPL_ATTRIBUTE, None)


def step_connector_metadata(shell: Any) -> Any:
    """The connector metadata the scheduler side built for this step, as the worker received it.
    vLLM 0.9.2: `KVConnectorBase_V1._get_connector_metadata()` (asserts it was bound)."""
    return shell._get_connector_metadata()


def attention_kv_caches(forward_context: "ForwardContext") -> List["torch.Tensor"]:
    """Each decoder attention layer's KV cache tensor for this virtual engine, in model order.
    vLLM 0.9.2: `ForwardContext.no_compile_layers` holds the `Attention` modules, each with
    `kv_cache[virtual_engine]` bound by the model runner. vLLM 0.32: the module moved to
    `vllm.model_executor.layers.attention` and `kv_cache` is the tensor itself."""
    if is_legacy_vllm():
        from vllm.attention import Attention, AttentionType

        def cache_of(layer: Any) -> "torch.Tensor":
            return layer.kv_cache[forward_context.virtual_engine]
    else:
        from vllm.model_executor.layers.attention.attention import Attention
        from vllm.v1.attention.backend import AttentionType

        def cache_of(layer: Any) -> "torch.Tensor":
            return layer.kv_cache

    caches = []
    for layer in forward_context.no_compile_layers.values():
        if isinstance(layer, Attention) and layer.attn_type == AttentionType.DECODER:
            caches.append(cache_of(layer))
    return caches


def multimodal_placeholders(request: Any) -> Optional[List[Tuple[Optional[str], int, int]]]:
    """`(content hash or None, offset, length)` per multimodal input of a v1 request (None without
    any). vLLM 0.9.2: `Request.mm_positions` (`PlaceholderRange`s) beside `Request.mm_hashes`;
    a hash list of another length counts as unhashed. vLLM 0.32: `Request.mm_features`, each with
    its content hash `identifier` and its `mm_position`."""
    if not is_legacy_vllm():
        features = list(getattr(request, "mm_features", None) or [])
        if not features:
            return None
        return [
            (f.identifier or None, int(f.mm_position.offset), int(f.mm_position.length)) for f in features
        ]
    positions = list(getattr(request, "mm_positions", None) or [])
    if not positions:
        return None
    hashes = list(getattr(request, "mm_hashes", None) or [])
    if len(hashes) != len(positions):
        hashes = [None] * len(positions)
    return [(h or None, int(p.offset), int(p.length)) for h, p in zip(hashes, positions)]


def full_prompt_reason(request: Any) -> Optional[str]:
    """Why a v1 request must compute every prompt position itself, so that no cached prefix may
    replace any of it (None when one may). Prompt logprobs need the logits of every prompt token;
    a pooling request over all tokens needs their hidden states. vLLM 0.32 decides this itself:
    `Request.skip_reading_prefix_cache` (from `SamplingParams` / `PoolingParams`, which set it for
    prompt logprobs and for the `token_embed` / `token_classify` tasks, or as the user asked), and
    it zeroes a connector's hit for such a request after asking for it. vLLM 0.9.2 only skips its
    own prefix cache for `prompt_logprobs` and asks the connector anyway; its v1 pooling runs
    without a prefix cache, so every pooling request computes its prompt here too."""
    sampling = getattr(request, "sampling_params", None)
    pooling = getattr(request, "pooling_params", None)
    prompt_logprobs = sampling is not None and sampling.prompt_logprobs is not None
    if not is_legacy_vllm():
        if not getattr(request, "skip_reading_prefix_cache", False):
            return None
        if prompt_logprobs:
            return "prompt logprobs"
        if pooling is not None:
            return f"pooling task {pooling.task!r} reads every prompt token"
        return "the request skips reading the prefix cache"
    if prompt_logprobs:
        return "prompt logprobs"
    if pooling is not None:
        return "pooling reads every prompt token"
    return None


def wrapper_kv_transfer_config() -> Any:
    """The `KVTransferConfig` the wrapper gives users who gave none: vLLM's `LMCacheConnectorV1`,
    storing and loading; on vLLM 0.32 also `kv_load_failure_policy="recompute"`, so a load that
    comes back short is recomputed rather than failing the request."""
    from vllm.config import KVTransferConfig

    if is_legacy_vllm():
        return KVTransferConfig(kv_connector="LMCacheConnectorV1", kv_role="kv_both")
    return KVTransferConfig(kv_connector="LMCacheConnectorV1", kv_role="kv_both", kv_load_failure_policy="recompute")


def kv_cache_block_ids(blocks: Any) -> List[List[int]]:
    """The block ids of the `KVCacheBlocks` vLLM hands `update_state_after_alloc`, one list per KV
    cache group. vLLM 0.9.2 and 0.32: `KVCacheBlocks.get_block_ids()`, a tuple of lists."""
    return [list(group) for group in blocks.get_block_ids()]


def finish_short_remote_load(scheduler: Any, request: Any, loaded: int) -> bool:
    """vLLM 0.9.2's `Scheduler._update_waiting_for_remote_kv` counts every block allocated for a
    WAITING_FOR_REMOTE_KVS request as loaded. When the background load left only `loaded` leading
    tokens, do its work with that count instead (cache only the loaded blocks; free them all when
    none was, so the request is looked up and computed afresh) and return True (the request is
    ready); return False when nothing fell short (vLLM's own method then runs).
    vLLM 0.9.2: `scheduler.kv_cache_manager.{get_block_ids,cache_blocks,free}`,
    `scheduler.finished_recving_kv_req_ids`, `scheduler.block_size`."""
    (block_ids,) = scheduler.kv_cache_manager.get_block_ids(request.request_id)
    assumed = min(len(block_ids) * scheduler.block_size, request.num_tokens)
    if assumed == request.num_tokens:
        assumed -= 1
    if loaded >= assumed:
        return False
    loaded -= loaded % scheduler.block_size
    if loaded:
        scheduler.kv_cache_manager.cache_blocks(request, loaded)
    else:
        scheduler.kv_cache_manager.free(request)
    request.num_computed_tokens = loaded
    scheduler.finished_recving_kv_req_ids.remove(request.request_id)
    return True


def holds_delayed_frees(scheduler: Any) -> bool:
    """Whether vLLM 0.9.2's scheduler keeps a finished request whose blocks a connector holds
    (`request_finished` returned True; freed when `finished_sending` names it). Its engine loop
    steps only while requests run, wait or just finished, so after an abort during a background
    load it went idle with the blocks held until the next request; vLLM 0.32 counts these
    requests as finished ones and steps on. vLLM 0.9.2: `scheduler.{requests,running,waiting}`."""
    return len(scheduler.requests) > len(scheduler.running) + len(scheduler.waiting)


# KV cache spec classes (vLLM's `vllm.v1.kv_cache_interface`) whose layers are paged attention KV
# caches LMCache reads and writes. Exact classes: a subclass (vLLM 0.32's `SinkFullAttentionSpec`,
# `HiddenStateCacheSpec`, ...) may lay out or use its blocks differently. Sliding-window specs are
# promoted to full attention when the hybrid KV cache manager is off, which vLLM does for our
# connector (it does not declare `SupportsHMA`). vLLM 0.9.2's MLA is a `FullAttentionSpec`.
PAGED_KV_SPECS = ("FullAttentionSpec", "SlidingWindowSpec", "MLAAttentionSpec")


@dataclass(frozen=True)
class PatchPoint:
    """One vLLM function LMCache wraps, named rather than imported: it is wrapped when vLLM imports
    its module, on the vLLM lines listed (each line's module may lack the other's names)."""

    module: str  # the vLLM module that defines it
    path: str  # "Class.method", or a module-level function's name
    # What the wrapper puts around it: "v0_execute_model" (LMCache around a v0 step),
    # "v0_load_model" (start the engine once the model is loaded), "model_inspection" (vLLM's
    # model-class inspection, in-process on the CPU platform), "v1_default_args" (turn on the v1
    # connector when vLLM picks the v1 engine) or "v1_engine_config" (turn it on before the
    # engine config is built, vLLM 0.32), "v1_async_match" / "v1_async_alloc" (vLLM's
    # LMCacheConnectorV1 shell: the lookup's async flag, the allocated blocks), "v1_async_ready"
    # (vLLM 0.9.2's scheduler taking a finished background load), "v1_delayed_free_steps" (vLLM
    # 0.9.2's engine loop stepping until a released request's blocks are freed), "v0_startup_socket" (vLLM
    # 0.9.2's v0 server client waiting for its engine process on one socket) or "kv_spec_guard"
    # (the engine core checking the KV cache specs first).
    role: str
    lines: Tuple[str, ...]  # the vLLM releases it was read from (`CHECKED_*VLLM_VERSION`)

    def applies(self) -> bool:
        """Whether the running vLLM is one of `lines` (imports `vllm.version`)."""
        return running_vllm_line() in self.lines

    def __str__(self) -> str:
        return f"{self.module}.{self.path}"


LEGACY_LINE = (CHECKED_VLLM_VERSION,)
LATEST_LINE = (CHECKED_LATEST_VLLM_VERSION,)
BOTH_LINES = LEGACY_LINE + LATEST_LINE


def running_vllm_line() -> str:
    """The checked release of the running vLLM's line: `CHECKED_VLLM_VERSION` or the latest."""
    return CHECKED_VLLM_VERSION if is_legacy_vllm() else CHECKED_LATEST_VLLM_VERSION


_V0_RUNNERS = (("vllm.worker.model_runner", "ModelRunner"), ("vllm.worker.cpu_model_runner", "CPUModelRunner"))
_SHELL = "vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector"

# The methods `lmcache_vllm.vllm_injection` wraps. vLLM 0.9.2: the v0 GPU and CPU model runners'
# `execute_model` and `load_model`; `EngineArgs._set_default_args_v1`, which vLLM calls exactly when
# it chose the v1 engine (private: there is no public hook at that moment); the scheduler's
# `_update_waiting_for_remote_kv` (private), see `finish_short_remote_load`, and its
# `has_finished_requests`, see `holds_delayed_frees`; the v0 server's
# startup handshake socket, `MQLLMEngineClient.get_data_socket` (private). vLLM 0.32 (v1 only):
# `EngineArgs.create_engine_config`, before it reads the KV transfer config. Both: vLLM's
# `LMCacheConnectorV1` shell's `get_num_new_matched_tokens` (always answers "not async") and
# `update_state_after_alloc` (drops the blocks), for `enable_async_loading`.
WRAPPER_PATCH_POINTS = (
    PatchPoint("vllm.engine.arg_utils", "EngineArgs._set_default_args_v1", "v1_default_args", LEGACY_LINE),
    PatchPoint("vllm.engine.arg_utils", "EngineArgs.create_engine_config", "v1_engine_config", LATEST_LINE),
    PatchPoint(_SHELL, "LMCacheConnectorV1.get_num_new_matched_tokens", "v1_async_match", BOTH_LINES),
    PatchPoint(_SHELL, "LMCacheConnectorV1.update_state_after_alloc", "v1_async_alloc", BOTH_LINES),
    PatchPoint("vllm.v1.core.sched.scheduler", "Scheduler._update_waiting_for_remote_kv", "v1_async_ready", LEGACY_LINE),
    PatchPoint("vllm.v1.core.sched.scheduler", "Scheduler.has_finished_requests", "v1_delayed_free_steps", LEGACY_LINE),
    PatchPoint("vllm.engine.multiprocessing.client", "MQLLMEngineClient.get_data_socket", "v0_startup_socket", LEGACY_LINE),
    *(
        PatchPoint(module, f"{runner}.{method}", role, LEGACY_LINE)
        for module, runner in _V0_RUNNERS
        for method, role in (("execute_model", "v0_execute_model"), ("load_model", "v0_load_model"))
    ),
)


# vLLM 0.32's `LMCacheConnectorV1` shell hands a worker's KV events to the scheduler from
# `get_kv_connector_kv_cache_events`, which turns what our `get_kv_events()` answers into
# `BlockStored` only; this patch has it return our events (removals too) as they are, in the
# container its scheduler side aggregates (`shell_kv_events`). One of `PLUGIN_PATCH_POINTS`.
KV_EVENTS_POINTS = (
    PatchPoint(_SHELL, "LMCacheConnectorV1.get_kv_connector_kv_cache_events", "v1_kv_events", LATEST_LINE),
)


# vLLM's engine-core function that first sees every worker's KV cache specs, before vLLM unifies
# them (and, for a hybrid model with a non-HMA connector, fails with "Failed to promote local KV
# cache specs to one unified type"); the connector itself is built only after it. Both are bound by
# name in `vllm.v1.engine.core` and called by `EngineCore._initialize_kv_caches`.
# vLLM 0.9.2: `get_kv_cache_config(vllm_config, specs of one worker, memory)`;
# vLLM 0.32: `get_kv_cache_configs(vllm_config, [specs per worker], memory)`.
KV_SPEC_GUARD_POINTS = (
    PatchPoint("vllm.v1.engine.core", "get_kv_cache_config", "kv_spec_guard", LEGACY_LINE),
    PatchPoint("vllm.v1.engine.core", "get_kv_cache_configs", "kv_spec_guard", LATEST_LINE),
)

# What `lmcache_vllm.plugin` wraps in every vLLM process with LMCache installed, wrapper or not:
# the KV spec guard, `registry._run_in_subprocess` (private), which runs vLLM's model-class
# inspection in a fresh interpreter (on the CPU platform it runs in-process instead), and the
# KV events hook.
PLUGIN_PATCH_POINTS = KV_SPEC_GUARD_POINTS + KV_EVENTS_POINTS + (
    PatchPoint("vllm.model_executor.models.registry", "_run_in_subprocess", "model_inspection", BOTH_LINES),
)


def layers_without_paged_kv(kv_cache_specs: Any) -> List[Tuple[str, str]]:
    """`(layer name, kind)` of each layer whose KV cache spec is not one of `PAGED_KV_SPECS`, from
    one worker's `{layer name: spec}` or a list of them. The kind is the spec class, with vLLM
    0.32's `mamba_type` for Mamba-style state (`MambaSpec(mamba2)`, `MambaSpec(linear_attention)`)."""
    per_worker = [kv_cache_specs] if isinstance(kv_cache_specs, Mapping) else list(kv_cache_specs)
    found: dict[str, str] = {}
    for specs in per_worker:
        for name, spec in specs.items():
            kind = type(spec).__name__
            if kind in PAGED_KV_SPECS:
                continue
            mamba_type = getattr(spec, "mamba_type", None)
            if mamba_type is not None:
                kind += f"({str(getattr(mamba_type, 'name', mamba_type)).lower()})"
            found.setdefault(name, kind)
    return list(found.items())


# The environment variable with which vLLM 0.32's `_resolve_lmcache_mp_connector` forces its own
# built-in `LMCacheMPConnectorUpstream` (which needs upstream LMCache's `lmcache.v1.multiprocess`).
FORCE_UPSTREAM_MP_ENV = "LMCACHE_USE_UPSTREAM_MP"


def route_mp_connector(connector_name: str, module: str, class_name: str) -> bool:
    """Point vLLM's connector factory entry `connector_name` at `module.class_name`; False where
    vLLM has no such entry (vLLM 0.9.2) or the user forces vLLM's built-in copy.

    vLLM 0.32 registers `LMCacheMPConnector` as `...kv_connector.v1.lmcache_mp_connector`, whose
    `_resolve_lmcache_mp_connector` prefers `lmcache.integration.vllm.lmcache_mp_connector` - but
    only after that module's own top-level imports of upstream LMCache names
    (`lmcache.integration.vllm.utils.mla_enabled`, the multiprocess adapter
    `lmcache.integration.vllm.vllm_multi_process_adapter`, `lmcache.v1.multiprocess.*`), which this
    package does not have, so the import fails before the preference is asked. vLLM 0.32:
    `KVConnectorFactory._registry` (private), `{name: loader returning the class}`."""
    if is_legacy_vllm() or os.environ.get(FORCE_UPSTREAM_MP_ENV):
        return False
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    registry = getattr(KVConnectorFactory, "_registry", None)
    if registry is None or connector_name not in registry:
        return False

    def load_ours() -> Any:
        return getattr(importlib.import_module(module), class_name)

    registry[connector_name] = load_ours
    return True


def v0_attention_window(runner: Any) -> Optional[int]:
    """The sliding window a vLLM 0.9.2 v0 runner's attention applies (None: full attention).
    `runner.sliding_window` for a plain window; for models that interleave windowed and global
    layers (Gemma 2, Gemma 3) vLLM 0.9.2's `ModelConfig` moves the window to
    `hf_text_config.interleaved_sliding_window` and clears `sliding_window`."""
    window = getattr(runner, "sliding_window", None)
    if window is not None:
        return window
    model_config = getattr(runner, "model_config", None)
    text_config = getattr(model_config, "hf_text_config", None)
    return getattr(text_config, "interleaved_sliding_window", None)


def v0_state_beyond_kv(model_config: Any) -> Optional[str]:
    """What a vLLM 0.9.2 model keeps besides paged attention KV (None: nothing). vLLM 0.9.2
    `ModelConfig.is_attention_free`, `.is_hybrid` (attention and Mamba layers), `.has_inner_state`
    (Mamba / recurrent state the v0 runner keeps outside the KV caches)."""
    if model_config is None:
        return None
    if getattr(model_config, "is_attention_free", False):
        return "an attention-free model (recurrent state only)"
    if getattr(model_config, "is_hybrid", False) or getattr(model_config, "has_inner_state", False):
        return "Mamba / recurrent state beside its attention layers"
    return None


# ----- CacheBlend: the model it runs layer by layer ----------------------------------------------

# Model classes whose modules `blend/model.py` knows how to call one layer at a time.
BLEND_ARCHITECTURES = ("LlamaForCausalLM",)


# RoPE variants whose angle is `position * inv_freq` (see `rotary_inv_freq`).
BLEND_ROPE_TYPES = ("default", "llama3")


def blend_unsupported_reason(architectures: Sequence[str], rope_scaling: Optional[Mapping[str, Any]] = None) -> Optional[str]:
    """Why CacheBlend cannot run here (None when it can): vLLM 0.9.2's v1 engine, Llama models
    whose rotary embedding it can move (no position-scaling rope)."""
    if not is_legacy_vllm():
        from vllm.version import __version__

        return f"CacheBlend runs on vLLM 0.9.2's v1 engine; this is vLLM {__version__}"
    if not any(arch in BLEND_ARCHITECTURES for arch in architectures):
        return (
            f"CacheBlend supports the Llama family ({', '.join(BLEND_ARCHITECTURES)}); "
            f"this model is {', '.join(architectures) or 'of unknown architecture'}"
        )
    rope_type = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
    if rope_type not in BLEND_ROPE_TYPES:
        return f"CacheBlend cannot move keys under rope_scaling type {rope_type!r} (supported: {BLEND_ROPE_TYPES})"
    return None


def find_causal_lm(forward_context: Optional["ForwardContext"]) -> Any:
    """vLLM's model object whose first attention layer is this forward context's (None: the
    current one) first one.

    vLLM 0.9.2 hands a KV connector no handle on the model; its `LlamaForCausalLM` is found once
    among the live objects (`gc`), checked by identity of the attention module it owns."""
    import gc

    from vllm.forward_context import get_forward_context
    from vllm.model_executor.models.llama import LlamaForCausalLM

    if forward_context is None:
        forward_context = get_forward_context()
    first_attention = next(iter(forward_context.no_compile_layers.values()), None)
    for obj in gc.get_objects():
        if isinstance(obj, LlamaForCausalLM):
            layers = obj.model.layers
            if len(layers) and getattr(layers[obj.model.start_layer].self_attn, "attn", None) is first_attention:
                return obj
    raise RuntimeError("CacheBlend: no LlamaForCausalLM in this process owns the attention layers vLLM runs")


def fused_forward(custom_op: Any) -> Callable[..., Any]:
    """The fused-kernel forward of one of vLLM 0.9.2's custom-op modules (RMSNorm, SiluAndMul,
    RotaryEmbedding), for calling it eagerly.

    Under torch.compile vLLM's CPU platform turns custom ops off (`custom_ops=["none"]`: each
    module runs its native form, several torch passes, and inductor fuses them). CacheBlend calls
    the modules one layer at a time outside the compiled graph, where the native forms stay
    unfused, so it takes `forward_cuda`: the `_C` kernels, which the CPU build implements.
    RMSNorm with a residual and RotaryEmbedding work in place, like in vLLM's own forward."""
    return custom_op.forward_cuda


def rotary_inv_freq(rotary_emb: Any) -> "torch.Tensor":
    """The per-pair frequencies of a rotary embedding whose angle is `position * inv_freq`.
    vLLM 0.9.2: `RotaryEmbedding._compute_inv_freq(base)` (Llama 3 scaling overrides it); the
    schemes that scale positions or the cache itself (linear, dynamic NTK, YaRN) are refused."""
    import torch
    from vllm.model_executor.layers.rotary_embedding import Llama3RotaryEmbedding, RotaryEmbedding

    if type(rotary_emb) not in (RotaryEmbedding, Llama3RotaryEmbedding):
        raise NotImplementedError(f"CacheBlend cannot move keys under {type(rotary_emb).__name__} (rope scaling)")
    inv_freq = rotary_emb._compute_inv_freq(rotary_emb.base).to(torch.float32)
    cos_at_one = rotary_emb.cos_sin_cache[1, : inv_freq.shape[0]].float().cpu()
    if not torch.allclose(cos_at_one, torch.cos(inv_freq), atol=1e-5):
        raise NotImplementedError(f"CacheBlend: {type(rotary_emb).__name__}'s cache is not cos(position * inv_freq)")
    return inv_freq


def kv_event_types() -> Tuple[type, type, type]:
    """vLLM's `BlockStored`, `BlockRemoved` and `KVEventBatch` (`vllm.distributed.kv_events`, both
    lines): built from them, our events are what the running line's decoder reads (0.9.2's are
    tagged arrays without `medium`; 0.32's are tagged maps with `medium` and `ownership`)."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

    return BlockStored, BlockRemoved, KVEventBatch


def request_block_hashes(request: Any, first: int, end: int) -> Optional[Tuple[Any, ...]]:
    """vLLM's hashes of the request's blocks `[first, end)` as its KV events carry them
    (`maybe_convert_block_hash`: 64-bit ints, or bytes with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0),
    the names its GPU blocks and its OffloadingConnector's CPU copies get. None on vLLM 0.9.2 (its
    requests hold no hashes) or when blocks in the range are not hashed yet. A single KV cache
    group (all LMCache serves) hashes at the block size, so `request.block_hashes[i]` is block i's."""
    if is_legacy_vllm():
        return None
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    hashes = request.block_hashes
    if end > len(hashes) or first >= end:
        return None
    return tuple(maybe_convert_block_hash(h) for h in hashes[first:end])


def shell_kv_events(events: Sequence[Any]) -> Any:
    """`events` in the container vLLM 0.32's shell hands its scheduler side (`LMCacheKVEvents`
    of one worker; vLLM counts workers as it merges them and publishes what all of them sent)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import LMCacheKVEvents

    container = LMCacheKVEvents(num_workers=1)
    container.add_events(list(events))
    return container
