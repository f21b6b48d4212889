"""lmcache_vllm: vLLM with LMCache injected (`import lmcache_vllm.vllm as vllm`, `lmcache_vllm serve`)."""

__version__ = "0.1.0"
