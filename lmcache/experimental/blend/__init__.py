"""CacheBlend's model-independent parts: finding a prompt's segments and their keys
(`segments.py`), moving cached keys to a new position (`rope.py`), and picking the tokens to
recompute (`selection.py`). The vLLM side (`lmcache/integration/vllm/blend/`) runs the model."""
