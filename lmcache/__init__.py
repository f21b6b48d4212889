"""LMCache: KV-cache tiers (CPU, disk, remote) for vLLM. The engine API lives in `lmcache.experimental`."""

__version__ = "0.1.0"
