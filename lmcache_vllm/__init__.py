"""lmcache_vllm: vLLM with LMCache injected (`import lmcache_vllm.vllm as vllm`, `lmcache_vllm serve`).

Importing this package only installs the import hook for `lmcache_vllm.vllm.*` names (cheap, no
vLLM import): vLLM's plugin loading imports it in every vLLM process.
"""

from lmcache_vllm import import_hook as _import_hook

__version__ = "0.1.0"

_import_hook.install()
