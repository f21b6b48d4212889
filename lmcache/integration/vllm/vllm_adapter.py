"""vLLM 0.9.2's v0 entry: the names its own `LMCacheConnector` imports from this module path.

The door itself lives in `v0/` (`v0/connector.py`); this module keeps upstream's import path and
the wrapper's (`lmcache_vllm`) entry points, and nothing else.
"""

from lmcache.integration.vllm.v0.connector import (
    RetrieveStatus,
    StoreStatus,
    close_lmcache_engine,
    execute_with_cache,
    init_lmcache_engine,
    lmcache_retrieve_kv,
    lmcache_should_retrieve,
    lmcache_should_store,
    lmcache_store_kv,
    start_engine_for_runner,
)

__all__ = [
    "RetrieveStatus",
    "StoreStatus",
    "close_lmcache_engine",
    "execute_with_cache",
    "init_lmcache_engine",
    "lmcache_retrieve_kv",
    "lmcache_should_retrieve",
    "lmcache_should_store",
    "lmcache_store_kv",
    "start_engine_for_runner",
]
