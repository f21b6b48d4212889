"""Remote stores for the remote tier: connectors (`lm://`, `lms://`, `lm+shm://`, `redis://`, `rediss://`,
`redis-cluster://`, `redis-sentinel://`, `mooncakestore://`) behind one byte-level interface, and the serdes that
fill them.

`create_connector(url)` is the one place that maps a `remote_url` to a connector class; the
URL grammar is the config's (`lmcache.experimental.config.parse_remote_url`).
"""

from __future__ import annotations

import os
from typing import Optional

from lmcache.experimental.config import MOONCAKE_SCHEME, POOL_SCHEME, parse_remote_url
from lmcache.experimental.remote.connector import RemoteConnector, RemoteUnavailableError
from lmcache.experimental.remote.mooncake_settings import MooncakeSettings
from lmcache.server.security import CLIENT_CA_ENV, CLIENT_TOKEN_ENV, client_tls_context

__all__ = ["RemoteConnector", "RemoteUnavailableError", "create_connector", "redis_key_prefix"]


def redis_key_prefix(model_name: str) -> str:
    """The Redis key prefix of one model's chunks: `lmcache:<model>:`."""
    return f"lmcache:{model_name}:"


def create_connector(
    url: str,
    key_prefix: str = "",
    timeout: float = 10.0,
    lookup_timeout: float = 1.0,
    pool_size: int = 4,
    ttl_s: Optional[float] = None,
    max_value_bytes: Optional[int] = None,
    password: Optional[str] = None,
    mooncake: Optional[MooncakeSettings] = None,
) -> RemoteConnector:
    """A connector for `url`; nothing is connected until the first call.

    `key_prefix` and `ttl_s` apply to Redis (the `lm://` server keys by the full chunk key and
    bounds its memory with LRU instead of expiry). `max_value_bytes` caps what one put sends
    (None = the connector's default: 1 GiB for `lm://`, 512 MB for Redis); each connector also
    learns its server's own limit and refuses larger values without sending them.

    Secrets: the URL's userinfo first, else `password` (the `remote_password` config key); for
    `lm://`/`lms://`/`lm+shm://` the token is the URL's password, else `LMCACHE_REMOTE_TOKEN`,
    else `password`. `lms://` and `rediss://` check the server against `LMCACHE_REMOTE_TLS_CA` (or the
    system store). `mooncake`: the Mooncake client's settings (defaults if None), overridden by
    `MOONCAKE_CONFIG_PATH`'s file when that is set.
    """
    parsed = parse_remote_url(url)
    if parsed.scheme == MOONCAKE_SCHEME:
        from lmcache.experimental.remote.mooncake_connector import MooncakeStoreConnector

        master = parsed.hosts[0]
        return MooncakeStoreConnector(
            master,
            (mooncake or MooncakeSettings()).with_config_file(master),
            timeout=timeout,
            lookup_timeout=lookup_timeout,
            pool_size=pool_size,
            max_value_bytes=max_value_bytes,
        )
    lm_limit = {} if max_value_bytes is None else {"max_payload_bytes": max_value_bytes}
    lm_token = parsed.password or os.environ.get(CLIENT_TOKEN_ENV, "").strip() or password
    if parsed.scheme == POOL_SCHEME:
        from lmcache.experimental.remote.pool_connector import PoolConnector

        assert parsed.socket is not None  # parse_remote_url gives every pool URL its path
        return PoolConnector(
            parsed.socket,
            timeout=timeout,
            lookup_timeout=lookup_timeout,
            pool_size=pool_size,
            token=lm_token,
            **lm_limit,
        )
    if parsed.scheme in ("lm", "lms"):
        from lmcache.experimental.remote.lm_connector import LMServerConnector

        host, port = parsed.hosts[0]
        return LMServerConnector(
            host,
            port,
            timeout=timeout,
            lookup_timeout=lookup_timeout,
            pool_size=pool_size,
            token=lm_token,
            tls=client_tls_context() if parsed.scheme == "lms" else None,
            **lm_limit,
        )
    redis_limit = {} if max_value_bytes is None else {"max_value_bytes": max_value_bytes}
    credentials = dict(username=parsed.username, password=parsed.password or password)
    if parsed.scheme == "redis-sentinel":
        from lmcache.experimental.remote.redis_sentinel_connector import (
            RedisSentinelConnector,
            sentinel_service_name,
        )

        return RedisSentinelConnector(
            parsed.hosts,
            sentinel_service_name(parsed.service),
            key_prefix=key_prefix,
            ttl_s=ttl_s,
            timeout=timeout,
            lookup_timeout=lookup_timeout,
            pool_size=pool_size,
            **credentials,
            **redis_limit,
        )
    from lmcache.experimental.remote.redis_connector import RedisConnector

    return RedisConnector(
        parsed.hosts,
        cluster=parsed.scheme == "redis-cluster",
        ssl=parsed.scheme == "rediss",
        key_prefix=key_prefix,
        ttl_s=ttl_s,
        timeout=timeout,
        lookup_timeout=lookup_timeout,
        pool_size=pool_size,
        db=parsed.db,
        ssl_ca_certs=os.environ.get(CLIENT_CA_ENV, "").strip() or None,
        **credentials,
        **redis_limit,
    )
