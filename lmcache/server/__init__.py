"""The `lm://` server: a small KV-chunk store shared by LMCache instances over TCP.

`protocol` is the wire format both sides speak, `store` the server's LRU memory (its values in
`arena`), `server` the TCP server, `pool` its unix-socket door for clients on the same machine that
share the arena in place (the node pool), `__main__` the `lmcache_server` command.
"""

from lmcache.server.server import LMCacheServer, ServerConfig

__all__ = ["LMCacheServer", "ServerConfig"]
