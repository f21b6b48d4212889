"""vLLM general plugin (entry point group `vllm.general_plugins`): the wrapper's injection in
every process vLLM starts.

vLLM calls `load_general_plugins()` in the engine-args setup, the v0 multiprocessing engine, the
v1 engine core and each worker. In each it installs the KV cache spec guard
(`vllm_injection.install_kv_spec_guard`: a model LMCache cannot save stops at engine start in our
words, when the engine runs LMCache's connector); the wrapper's injection follows only when the
wrapper marked the environment (`vllm_injection.INJECT_ENV`).
"""

from __future__ import annotations

from lmcache_vllm.vllm_injection import apply_injection, injection_requested, install_kv_spec_guard


def general_plugin() -> None:
    """Entry point: the KV cache spec guard, and the injection when the wrapper asked for it."""
    install_kv_spec_guard()
    if injection_requested():
        apply_injection()
