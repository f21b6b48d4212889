"""lmcache_vllm: vLLM with LMCache injected (`import lmcache_vllm.vllm as vllm`, `lmcache_vllm serve`).

Importing this package only installs the import hook for `lmcache_vllm.vllm.*` names (cheap, no
vLLM import): vLLM's plugin loading imports it in every vLLM process.
"""

from lmcache_vllm import import_hook as _import_hook

__version__ = "0.1.0"

_import_hook.install()


def close_lmcache_engine() -> None:
    """Close this process's LMCache engine, flushing its pending writes (the old wrapper's API;
    a no-op without an engine here, e.g. when the v1 engine keeps it in its own process)."""
    from lmcache.integration.vllm.vllm_adapter import close_lmcache_engine as close

    close()
