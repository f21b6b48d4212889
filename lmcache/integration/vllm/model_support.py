"""Models whose per-layer state LMCache cannot save exactly: refused at engine start, in our words.

LMCache saves and restores paged attention KV caches. A layer with any other state (Mamba's
convolution and SSM state, linear attention, a KV cache spec of a kind we do not know) would stay
unrestored while the connector reports a hit for its tokens: garbled output (upstream LMCache
2845). vLLM itself stops such a model when a connector without hybrid support is configured, with
"Failed to promote local KV cache specs to one unified type", which names neither the cause nor
the way out; `check_kv_cache_specs` stops it first and names both.

Operations:
- `runs_lmcache(vllm_config)`: whether this engine's KV transfer config runs LMCache's connector.
- `check_kv_cache_specs(vllm_config, kv_cache_specs)`: raise when a layer is not paged attention KV.

`lmcache_vllm.plugin` wraps vLLM's engine-core function at `vllm_compat.KV_SPEC_GUARD_POINTS` to
call `check_kv_cache_specs` first (`vllm_injection.check_kv_specs_first`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lmcache.integration.vllm.mp_keys import MP_CONNECTOR
from lmcache.integration.vllm.utils import extra_config_of
from lmcache.integration.vllm.vllm_compat import layers_without_paged_kv

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# vLLM's name for its shell around `lmcache.integration.vllm.vllm_v1_adapter`.
LMCACHE_CONNECTOR = "LMCacheConnectorV1"
# vLLM's names that build that door here: the shell, and upstream's multiprocess-mode connector
# (`lmcache_mp_connector.LMCacheMPConnector`, the same door on the node pool).
LMCACHE_CONNECTORS = (LMCACHE_CONNECTOR, MP_CONNECTOR)
# Layers named in the error before "and N more".
NAMED_LAYERS = 3


def runs_lmcache(vllm_config: "VllmConfig") -> bool:
    """True when vLLM builds `LMCacheConnectorV1` (or `LMCacheMPConnector`) on this package (not its
    `use_native` copy)."""
    kv_transfer = vllm_config.kv_transfer_config
    if kv_transfer is None or kv_transfer.kv_connector not in LMCACHE_CONNECTORS:
        return False
    return not extra_config_of(vllm_config).get("use_native", False)


def check_kv_cache_specs(vllm_config: "VllmConfig", kv_cache_specs: Any) -> None:
    """Raise ValueError naming the layer kinds LMCache cannot save, when LMCache runs here.
    `kv_cache_specs`: one worker's `{layer name: KV cache spec}` or a list of them."""
    if not runs_lmcache(vllm_config):
        return
    unsupported = layers_without_paged_kv(kv_cache_specs)
    if not unsupported:
        return
    kinds = sorted({kind for _, kind in unsupported})
    names = ", ".join(name for name, _ in unsupported[:NAMED_LAYERS])
    if len(unsupported) > NAMED_LAYERS:
        names += f" and {len(unsupported) - NAMED_LAYERS} more"
    raise ValueError(
        f"LMCache does not support layers of kind {', '.join(kinds)} (model {vllm_config.model_config.model}: "
        f"{names}): it saves and restores paged attention KV caches only, and a cache hit would skip "
        f"state it never restored. Serve this model without the {vllm_config.kv_transfer_config.kv_connector} "
        "KV connector (plain `vllm`, no kv_transfer_config); vLLM's own prefix cache still works without it."
    )
