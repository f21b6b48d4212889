"""`LMCacheMPConnector`: upstream LMCache's multiprocess-mode connector by its name, served by the
v1 door on the node pool of this machine's `lmcache server`.

vLLM 0.32 builds this class for `"kv_connector": "LMCacheMPConnector"` (its factory entry points
here, see `vllm_compat.route_mp_connector`). It is vLLM's own `LMCacheConnectorV1` shell, which
builds `vllm_v1_adapter.LMCacheConnectorV1Impl`; only the configuration differs, and
`utils.extra_config_of` reads it for this connector name through `mp_keys.pool_extra_config`:
`lmcache.mp.host` / `lmcache.mp.port` become the pool's `lm+shm://` URL, with no private CPU tier.
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import LMCacheConnectorV1


class LMCacheMPConnector(LMCacheConnectorV1):
    """The v1 door on the node pool, under upstream's multiprocess-mode name (vLLM 0.32)."""
