"""Upstream's `LMCacheMPConnector` settings (`lmcache.mp.*` in `kv_connector_extra_config`) as this
package's: the node pool of the `lmcache server` on this machine as the only tier.

Upstream's multiprocess mode runs one cache process per machine and its connector talks to it at
`lmcache.mp.host:lmcache.mp.port`. Here that process is `lmcache server` (our `lm://` server), and
the connector is the v1 door with `remote_url = lm+shm:///<the pool's socket for that port>`
(`pool_address.pool_socket_path`) and no private CPU tier, so each chunk sits once in the
machine's memory. Our own `lmcache.<field>` keys still apply on top (`lmcache.local_cpu: true`
adds a private CPU tier, `lmcache.remote_password` is the pool's token); `lmcache.remote_url` is
refused, since the pool is the remote. Upstream keys with no meaning here are refused by name.

Operations:
- `pool_extra_config(extra)`: vLLM's extra config for `LMCacheMPConnector` -> the one
  `LMCacheConnectorV1` would need for the same pool.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping

from lmcache.experimental.config import EXTRA_CONFIG_PREFIX, POOL_SCHEME
from lmcache.server.pool_address import pool_socket_path

# vLLM's name for upstream's multiprocess-mode connector (`lmcache_mp_connector.py`).
MP_CONNECTOR = "LMCacheMPConnector"
MP_PREFIX = "lmcache.mp."
HOST_KEY = MP_PREFIX + "host"
PORT_KEY = MP_PREFIX + "port"
TRANSFER_MODE_KEY = MP_PREFIX + "mp_transfer_mode"
# Upstream's defaults (vLLM's `LMCacheMPConnectorUpstream`).
DEFAULT_HOST = "tcp://localhost"
DEFAULT_PORT = 5555
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1", "[::1]")
# What happens here: the vLLM worker copies its KV into and out of the shared arena itself.
TRANSFER_MODES = ("engine_driven",)
REMOTE_URL_KEY = EXTRA_CONFIG_PREFIX + "remote_url"

# Upstream keys with no counterpart here, and why.
REFUSED_KEYS: Mapping[str, str] = {
    MP_PREFIX + "mq_timeout": "there is no message queue: each request to the pool is a few small frames "
    "on a unix socket, with the lm:// client's own timeouts",
    MP_PREFIX + "heartbeat_interval": "there is no heartbeat: a pool that went away is noticed on the next "
    "request (a miss) and reconnected with backoff",
    MP_PREFIX + "server_urls": "the node pool is this machine's shared memory, one server per machine; "
    "share between machines with LMCacheConnectorV1 and remote_url lm://HOST:PORT",
}


def _host(value: Any) -> str:
    """`tcp://localhost` / `localhost` / `127.0.0.1` / `[::1]` -> the host; anything else is refused."""
    if not isinstance(value, str):
        raise ValueError(f"{HOST_KEY}={value!r}: expected a string such as {DEFAULT_HOST!r}")
    host = value[len("tcp://"):] if value.startswith("tcp://") else value
    if "://" in host or host not in LOOPBACK_HOSTS:
        raise ValueError(
            f"{HOST_KEY}={value!r}: the node pool is shared memory on this machine, so the server must be "
            f"local ({DEFAULT_HOST}); reach a server on another machine with LMCacheConnectorV1 and "
            "lmcache.remote_url lm://HOST:PORT"
        )
    return host


def _port(value: Any) -> int:
    """An int, or a string of ASCII digits (JSON configs carry both), in 1..65535."""
    if isinstance(value, str) and value.isascii() and value.isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise ValueError(f"{PORT_KEY}={value!r}: expected the lmcache server's port, an integer in 1..65535")
    return value


def pool_extra_config(extra: Mapping[str, Any]) -> Dict[str, Any]:
    """The extra config the v1 door reads for `LMCacheMPConnector`: `lmcache.mp.*` consumed (and
    checked), the pool as `lmcache.remote_url`, `lmcache.local_cpu` False unless given, every other
    key as it was."""
    if REMOTE_URL_KEY in extra:
        raise ValueError(
            f"{REMOTE_URL_KEY} is not an LMCacheMPConnector key: its tier is the node pool of the lmcache "
            f"server at {HOST_KEY}/{PORT_KEY}; use LMCacheConnectorV1 for another remote"
        )
    for key in extra:
        if not (isinstance(key, str) and key.startswith(MP_PREFIX)):
            continue
        if key in REFUSED_KEYS:
            raise ValueError(f"{key} (an upstream LMCacheMPConnector key) is not supported here: {REFUSED_KEYS[key]}")
        if key not in (HOST_KEY, PORT_KEY, TRANSFER_MODE_KEY):
            raise ValueError(
                f"{key}: not an LMCacheMPConnector key this package knows ({HOST_KEY}, {PORT_KEY}, {TRANSFER_MODE_KEY})"
            )
    mode = extra.get(TRANSFER_MODE_KEY, TRANSFER_MODES[0])
    if mode not in TRANSFER_MODES:
        raise ValueError(
            f"{TRANSFER_MODE_KEY}={mode!r} is not supported here: vLLM copies its KV into and out of the pool's "
            f"shared memory itself, which is {TRANSFER_MODES[0]!r}"
        )
    _host(extra.get(HOST_KEY, DEFAULT_HOST))
    socket = pool_socket_path(_port(extra.get(PORT_KEY, DEFAULT_PORT)))
    mapped = {key: value for key, value in extra.items() if not (isinstance(key, str) and key.startswith(MP_PREFIX))}
    mapped[REMOTE_URL_KEY] = f"{POOL_SCHEME}://{socket}"
    mapped.setdefault(EXTRA_CONFIG_PREFIX + "local_cpu", False)
    return mapped
