"""Connector over Redis behind Sentinels (`redis-sentinel://h1:p1,h2:p2[/service]`).

The URL lists Sentinels, not data servers: each new connection asks them for the current master
of the service (the URL's `/service`, else `REDIS_SERVICE_NAME`, else `mymaster`) and talks to
that. Everything else (prefixed keys, pipelined batches, refused puts) is `RedisConnector`'s.

Failover: when the master dies, calls fail with `RemoteUnavailableError` (the remote tier goes
down and probes with backoff, as for any unreachable store); once the Sentinels have promoted a
replica, the next connection reaches it and puts and gets resume. A connection still open to a
demoted master is dropped on its first `READONLY` reply (redis-py's Sentinel pool does that).
"""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence, Tuple

from redis.backoff import NoBackoff
from redis.connection import BlockingConnectionPool
from redis.retry import Retry
from redis.sentinel import Sentinel, SentinelConnectionPool

from lmcache.experimental.config import RemoteUrl
from lmcache.experimental.remote.redis_connector import RedisConnector
from lmcache.experimental.remote.resp_get import RESP_PROTOCOL

SERVICE_NAME_ENV = "REDIS_SERVICE_NAME"
DEFAULT_SERVICE_NAME = "mymaster"


def sentinel_service_name(from_url: Optional[str], environ: Optional[dict] = None) -> str:
    """The master's service name: the URL's, else `REDIS_SERVICE_NAME`, else `mymaster`."""
    env = os.environ if environ is None else environ
    return from_url or env.get(SERVICE_NAME_ENV, "").strip() or DEFAULT_SERVICE_NAME


class _BlockingSentinelPool(SentinelConnectionPool, BlockingConnectionPool):
    """Sentinel-managed connections in a bounded pool that waits for a free connection (like
    `RedisConnector`'s plain pool) instead of failing with "Too many connections"."""


class RedisSentinelConnector(RedisConnector):
    """A Redis master found through Sentinels, as a `RemoteConnector`."""

    def __init__(self, sentinels: Sequence[Tuple[str, int]], service_name: str, **options: Any) -> None:
        """`options`: `RedisConnector`'s keyword arguments (key prefix, TTL, timeouts, pool size,
        value limit), which apply unchanged to the master."""
        if not sentinels:
            raise ValueError("RedisSentinelConnector needs at least one Sentinel")
        # The base class's host is only used by `url` and `_make_client`, both replaced here.
        super().__init__([sentinels[0]], **options)
        self._sentinels = tuple(sentinels)
        self._service = service_name

    @property
    def url(self) -> str:
        return RemoteUrl("redis-sentinel", self._sentinels, self._service, **self._credentials).display()

    def _make_client(self, socket_timeout: float) -> Any:
        no_retry = Retry(NoBackoff(), 0)
        sentinel = Sentinel(
            list(self._sentinels),
            sentinel_kwargs=dict(
                socket_timeout=self._lookup_timeout,
                socket_connect_timeout=self._lookup_timeout,
                retry=no_retry,
            ),
        )
        return sentinel.master_for(
            self._service,
            connection_pool_class=_BlockingSentinelPool,
            max_connections=self._pool_size,
            timeout=socket_timeout,
            socket_timeout=socket_timeout,
            socket_connect_timeout=self._lookup_timeout,
            retry=no_retry,
            protocol=RESP_PROTOCOL,
            **self._credentials,
        )
