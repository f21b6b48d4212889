"""The one place that touches vLLM's private names (and, later, differences between vLLM versions).

Everything else in `lmcache` and `lmcache_vllm` asks this module. Each entry says what it is for
and the vLLM version it was checked against; a vLLM release that renames one of them breaks here,
in one place, and a version difference becomes a branch in one function here rather than
`hasattr` checks across the doors.

Operations:
- `current_vllm_config()`: the `VllmConfig` vLLM set as current in this process, or None.
- `ipex_paged_attention_in_use()`: whether vLLM's CPU attention keeps K/V in IPEX's layout.
- `FLASH_METADATA_VIEW_RESETS`: the flash-attention metadata's memoized views, to drop on rebuild.
- `connector_impl_of(shell)` / `step_connector_metadata(shell)`: what vLLM's own
  `LMCacheConnectorV1` shell holds and hands over each step.
- `attention_kv_caches(forward_context)`: each decoder attention layer's KV cache tensor.
- `multimodal_placeholders(request)`: a v1 request's multimodal content hashes and positions.
- `wrapper_patch_points()`: the vLLM methods the `lmcache_vllm` wrapper wraps.

Nothing here imports vLLM at module import time: `lmcache_vllm` imports it in every vLLM process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, List, Optional, Tuple

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext

# The vLLM release every name below was read from and tested against.
CHECKED_VLLM_VERSION = "0.9.2"

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
    `kv_cache[virtual_engine]` bound by the model runner."""
    from vllm.attention import Attention, AttentionType

    caches = []
    for layer in forward_context.no_compile_layers.values():
        if isinstance(layer, Attention) and layer.attn_type == AttentionType.DECODER:
            caches.append(layer.kv_cache[forward_context.virtual_engine])
    return caches


def multimodal_placeholders(request: Any) -> Optional[List[Tuple[Optional[str], int, int]]]:
    """`(content hash or None, offset, length)` per multimodal input of a v1 request (None without
    any). vLLM 0.9.2: `Request.mm_positions` (`PlaceholderRange`s) beside `Request.mm_hashes`;
    a hash list of another length counts as unhashed."""
    positions = list(getattr(request, "mm_positions", None) or [])
    if not positions:
        return None
    hashes = list(getattr(request, "mm_hashes", None) or [])
    if len(hashes) != len(positions):
        hashes = [None] * len(positions)
    return [(h or None, int(p.offset), int(p.length)) for h, p in zip(hashes, positions)]


@dataclass(frozen=True)
class PatchPoint:
    """One vLLM method the wrapper wraps."""

    owner: type
    name: str
    # What the wrapper puts around it: "v0_execute_model" (LMCache around a v0 step) or
    # "v1_default_args" (turn on the v1 connector when vLLM picks the v1 engine).
    role: str


def wrapper_patch_points() -> List[PatchPoint]:
    """The methods `lmcache_vllm.vllm_injection` wraps. vLLM 0.9.2: the v0 GPU and CPU model
    runners' `execute_model`, and `EngineArgs._set_default_args_v1`, which vLLM calls exactly
    when it chose the v1 engine (private: there is no public hook at that moment)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.worker.cpu_model_runner import CPUModelRunner
    from vllm.worker.model_runner import ModelRunner

    return [
        PatchPoint(ModelRunner, "execute_model", "v0_execute_model"),
        PatchPoint(CPUModelRunner, "execute_model", "v0_execute_model"),
        PatchPoint(EngineArgs, "_set_default_args_v1", "v1_default_args"),
    ]
