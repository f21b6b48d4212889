"""The `lm://` server: a small KV-chunk store shared by LMCache instances over TCP.

`protocol` is the wire format both sides speak, `store` the server's LRU memory,
`server` the TCP server, `__main__` the `lmcache_server` command.
"""

from lmcache.server.server import LMCacheServer, ServerConfig

__all__ = ["LMCacheServer", "ServerConfig"]
