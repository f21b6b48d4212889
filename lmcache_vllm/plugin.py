"""vLLM general plugin (entry point group `vllm.general_plugins`): the wrapper's injection in
every process vLLM starts.

vLLM calls `load_general_plugins()` in the engine-args setup, the v0 multiprocessing engine, the
v1 engine core and each worker. In each it installs the KV cache spec guard, the in-process
model inspection and the KV events hook (`vllm_injection.install_plugin_patches`: a model LMCache
cannot save stops at engine start in our words, when the engine runs LMCache's connector; on the
CPU platform vLLM inspects a model class without starting another interpreter; on vLLM 0.32
LMCache's KV events reach vLLM's publisher, removals included) and, on vLLM 0.32, points vLLM's
`LMCacheMPConnector` name at ours (`vllm_compat.route_mp_connector`: vLLM's own module for it
needs upstream's multiprocess package to import); the wrapper's injection follows only when the
wrapper marked the environment (`vllm_injection.INJECT_ENV`).
"""

from __future__ import annotations

from lmcache.integration.vllm.mp_keys import MP_CONNECTOR
from lmcache.integration.vllm.vllm_compat import route_mp_connector
from lmcache_vllm.vllm_injection import apply_injection, injection_requested, install_plugin_patches

# Where vLLM's `LMCacheMPConnector` name leads here.
MP_CONNECTOR_MODULE = "lmcache.integration.vllm.lmcache_mp_connector"


def general_plugin() -> None:
    """Entry point: the plugin's patches, our `LMCacheMPConnector`, and the injection when the
    wrapper asked for it."""
    install_plugin_patches()
    route_mp_connector(MP_CONNECTOR, MP_CONNECTOR_MODULE, MP_CONNECTOR)
    if injection_requested():
        apply_injection()
