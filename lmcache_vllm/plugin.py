"""vLLM general plugin (entry point group `vllm.general_plugins`): the wrapper's injection in
every process vLLM starts.

vLLM calls `load_general_plugins()` in the engine-args setup, the v0 multiprocessing engine, the
v1 engine core and each worker. The plugin acts only when the wrapper marked the environment
(`vllm_injection.INJECT_ENV`); for everyone else it returns at once.
"""

from __future__ import annotations

from lmcache_vllm.vllm_injection import apply_injection, injection_requested


def general_plugin() -> None:
    """Entry point: apply the injection in this vLLM process when the wrapper asked for it."""
    if injection_requested():
        apply_injection()
