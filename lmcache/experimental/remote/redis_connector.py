"""Connector over a real Redis (`redis://`, `rediss://`) or Redis Cluster (`redis-cluster://`).

Keys are `key_prefix + key`, so one model's chunks can be listed (`SCAN MATCH prefix*`) or
dropped together; an optional TTL expires chunks nobody reads. Batches go through one
pipeline (Redis Cluster pipelines split per node by themselves), so a multi-chunk get or
put costs one round trip per node instead of one per chunk.

What Redis refuses is a dropped put, never an error for the request, and never takes the tier
down:
- values longer than the limit are refused here, before sending, with a message naming the
  limit and the chunk. The limit is `max_value_bytes` (default 512 MB, Redis's own default),
  lowered to the server's `proto-max-bulk-len` when `CONFIG GET` answers. Where `CONFIG` is
  disabled (managed Redis) and the server's real limit is lower, Redis rejects the value
  ("invalid bulk length") and drops that connection: if the server still answers a ping, the
  limit drops below the largest value sent, the batch is sent again under it (what is still
  too long refused before sending), and the pool simply opens a new connection;
- a write under `maxmemory` with the default `noeviction` policy gets an `OOM` reply: that put
  is counted as refused and logged (once per burst), the others in the pipeline still land.

Connection loss and timeouts raise `RemoteUnavailableError`. redis-py's own retries are turned
off: the remote backend owns retry and backoff, and a retry loop inside a lookup is exactly
what must not stall a request.
"""

from __future__ import annotations

import threading
from typing import Any, Optional, Sequence, Tuple

import redis
from redis._parsers.encoders import Encoder
from redis.backoff import NoBackoff
from redis.connection import PythonRespSerializer
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError, RedisClusterException, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from lmcache.experimental.config import RemoteUrl
from lmcache.experimental.remote.connector import (
    Buffer,
    Parts,
    Receive,
    RemoteConnector,
    RemoteUnavailableError,
    Value,
    value_nbytes,
)
from lmcache.experimental.remote.resp_get import RESP_PROTOCOL, pipelined_get_into
from lmcache.logging import init_logger

logger = init_logger(__name__)

# Redis's default `proto-max-bulk-len`; the limit used when `CONFIG GET` is not allowed.
DEFAULT_PROTO_MAX_BULK_LEN = 512 * 1024 * 1024
# The smallest `proto-max-bulk-len` Redis accepts: a value at most this large is never too long.
MIN_PROTO_MAX_BULK_LEN = 1024 * 1024
# Log one OOM (or too-long) line per this many refused puts, so the log is not flooded.
_OOM_LOG_EVERY = 100

# Values longer than this go to the socket as they are, never copied into the command buffer.
_BUFFER_CUTOFF = 6000


def _zero_copy_packer() -> PythonRespSerializer:
    """redis-py's pure-Python command packer, which sends a large value as its own buffer. With
    hiredis installed redis-py would pick hiredis's packer, which copies every value twice (into
    `bytes`, then into the packed command): that halved put bandwidth. Replies still go through
    hiredis's parser, the part where C pays."""
    return PythonRespSerializer(_BUFFER_CUTOFF, Encoder("utf-8", "strict", False).encode)


# What redis-py raises when the server is gone or slow (cluster errors include "no node").
_UNAVAILABLE = (RedisConnectionError, RedisTimeoutError, RedisClusterException, OSError)


class RedisConnector(RemoteConnector):
    """A Redis server or cluster as a `RemoteConnector`."""

    def __init__(
        self,
        hosts: Sequence[Tuple[str, int]],
        cluster: bool = False,
        ssl: bool = False,
        key_prefix: str = "",
        ttl_s: Optional[float] = None,
        timeout: float = 10.0,
        lookup_timeout: float = 1.0,
        pool_size: int = 8,
        max_value_bytes: int = DEFAULT_PROTO_MAX_BULK_LEN,
        username: Optional[str] = None,
        password: Optional[str] = None,
        db: Optional[int] = None,
        ssl_ca_certs: Optional[str] = None,
    ) -> None:
        """`username`/`password`: Redis AUTH (an ACL user, or the `requirepass` password alone);
        `db`: the database number (plain Redis only); `ssl_ca_certs`: the CA `rediss://` checks
        the server against (None = the system's trust store)."""
        if not hosts:
            raise ValueError("RedisConnector needs at least one host")
        if not cluster and len(hosts) != 1:
            raise ValueError(f"plain Redis takes one host, got {list(hosts)}")
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive or None, got {ttl_s}")
        if max_value_bytes <= 0:
            raise ValueError(f"max_value_bytes must be positive, got {max_value_bytes}")
        if cluster and db:
            raise ValueError(f"Redis Cluster has only database 0, got {db}")
        self._hosts = tuple(hosts)
        self._credentials = {"username": username, "password": password}
        self._db = db
        self._tls_options = {"ssl_ca_certs": ssl_ca_certs} if ssl and ssl_ca_certs else {}
        self._cluster = cluster
        self._ssl = ssl
        self._prefix = key_prefix
        self._ttl_ms = None if ttl_s is None else max(1, int(ttl_s * 1000))
        self._timeout = timeout
        self._lookup_timeout = lookup_timeout
        self._pool_size = pool_size
        self._max_value_configured = max_value_bytes
        # The limit in force, once known; whether the server's CONFIG confirmed it.
        self._max_value: Optional[int] = None
        self._limit_from_config = False
        self._lock = threading.Lock()
        # Two clients over separate pools: lookups must fail fast, data transfers may take longer.
        self._data_client: Any = None
        self._lookup_client: Any = None
        self._oom_refusals = 0
        self._oversize_refusals = 0

    @property
    def url(self) -> str:
        scheme = "redis-cluster" if self._cluster else ("rediss" if self._ssl else "redis")
        return RemoteUrl(scheme, self._hosts, db=self._db, **self._credentials).display()

    @property
    def refused_puts(self) -> int:
        """Puts Redis would not take (OOM replies plus values over the size limit)."""
        return self._oom_refusals + self._oversize_refusals

    def delete(self, key: str) -> bool:
        client, _ = self._clients()
        try:
            return bool(client.delete(self._prefix + key))
        except _UNAVAILABLE as err:
            raise self._unavailable(err) from err

    def batched_exists(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        _, lookup = self._clients()
        replies = self._run(lookup, [("EXISTS", self._prefix + k) for k in keys])
        return [isinstance(r, int) and r > 0 for r in replies]

    def batched_get(self, keys: Sequence[str]) -> list[Optional[Buffer]]:
        if not keys:
            return []
        data, _ = self._clients()
        replies = self._run(data, [("GET", self._prefix + k) for k in keys])
        out: list[Optional[Buffer]] = []
        for key, reply in zip(keys, replies):
            if isinstance(reply, Exception):
                logger.warning("GET %s on %s failed: %s", key, self.url, reply)
                out.append(None)
            else:
                out.append(reply)
        return out

    def batched_get_into(self, keys: Sequence[str], receive: Receive) -> None:
        """Plain Redis (and Sentinel's master): our own reader for the replies, which hands each
        value over unread (`resp_get.py`). A cluster routes keys to nodes: redis-py's pipeline."""
        if not keys:
            return
        if self._cluster:
            super().batched_get_into(keys, receive)
            return
        data, _ = self._clients()
        try:
            pipelined_get_into(data.connection_pool, [self._prefix + k for k in keys], receive, self.url)
        except RemoteUnavailableError:
            raise
        except _UNAVAILABLE as err:
            raise self._unavailable(err) from err

    def batched_put(self, items: Sequence[Tuple[str, Value]]) -> list[bool]:
        if not items:
            return []
        data, _ = self._clients()
        limit = self._value_limit(data)
        results = [False] * len(items)
        commands: list[tuple] = []
        slots: list[int] = []
        for i, (key, value) in enumerate(items):
            size = value_nbytes(value)
            if size > limit:
                refusals = self._count_refusal("oversize")
                if refusals % _OOM_LOG_EVERY == 1:
                    logger.warning(
                        "not storing %s on %s: %d bytes exceed the server's proto-max-bulk-len of %d "
                        "(raise it in redis.conf, or use a smaller chunk_size; %d refused so far)",
                        key,
                        self.url,
                        size,
                        limit,
                        refusals,
                    )
                continue
            # A Redis value is one bulk string: parts are joined.
            command: tuple = ("SET", self._prefix + key, value.joined() if isinstance(value, Parts) else value)
            if self._ttl_ms is not None:
                command += ("PX", self._ttl_ms)
            commands.append(command)
            slots.append(i)
        try:
            replies = self._run(data, commands)
        except RemoteUnavailableError:
            if not self._rejected_for_size([value_nbytes(items[i][1]) for i in slots]):
                raise
            # Again under the lowered limit: what is still too long is refused without sending.
            return self.batched_put(items)
        for slot, reply in zip(slots, replies):
            if _is_too_long(reply):
                self._learn_limit(value_nbytes(items[slot][1]), items[slot][0])
            elif isinstance(reply, OutOfMemoryError) or (
                isinstance(reply, ResponseError) and str(reply).startswith("OOM")
            ):
                refusals = self._count_refusal("oom")
                if refusals % _OOM_LOG_EVERY == 1:
                    logger.warning(
                        "%s is out of memory (maxmemory reached, policy noeviction): put of %s "
                        "dropped (%d OOM refusals so far)",
                        self.url,
                        items[slot][0],
                        refusals,
                    )
            elif isinstance(reply, Exception):
                logger.warning("SET %s on %s failed: %s", items[slot][0], self.url, reply)
            else:
                results[slot] = bool(reply)
        return results

    def ping(self) -> None:
        _, lookup = self._clients()
        try:
            lookup.ping()
        except _UNAVAILABLE as err:
            raise self._unavailable(err) from err

    def close(self) -> None:
        with self._lock:
            clients = [c for c in (self._data_client, self._lookup_client) if c is not None]
            self._data_client = self._lookup_client = None
        for client in clients:
            try:
                client.close()
            except RedisError as err:
                logger.debug("closing %s: %s", self.url, err)

    def _clients(self) -> Tuple[Any, Any]:
        """(data client, lookup client), created on first use (a cluster client connects then)."""
        with self._lock:
            if self._data_client is None:
                try:
                    self._data_client = self._make_client(self._timeout)
                    self._lookup_client = self._make_client(self._lookup_timeout)
                except _UNAVAILABLE as err:
                    self._data_client = self._lookup_client = None
                    raise self._unavailable(err) from err
            return self._data_client, self._lookup_client

    def _make_client(self, socket_timeout: float) -> Any:
        common = dict(
            socket_timeout=socket_timeout,
            socket_connect_timeout=self._lookup_timeout,
            retry=Retry(NoBackoff(), 0),
            ssl=self._ssl,
            **self._credentials,
            **self._tls_options,
        )
        if self._cluster:
            return RedisCluster(
                startup_nodes=[ClusterNode(h, p) for h, p in self._hosts],
                max_connections=self._pool_size,
                **common,
            )
        host, port = self._hosts[0]
        pool_cls = redis.SSLConnection if self._ssl else redis.Connection
        pool = redis.BlockingConnectionPool(
            connection_class=pool_cls,
            max_connections=self._pool_size,
            timeout=socket_timeout,
            host=host,
            port=port,
            socket_timeout=socket_timeout,
            socket_connect_timeout=self._lookup_timeout,
            retry=Retry(NoBackoff(), 0),
            db=self._db or 0,
            protocol=RESP_PROTOCOL,
            command_packer=_zero_copy_packer(),
            **self._credentials,
            **self._tls_options,
        )
        return redis.Redis(connection_pool=pool)

    def _value_limit(self, client: Any) -> int:
        """Largest value sent: `max_value_bytes`, or the server's proto-max-bulk-len if lower."""
        if self._max_value is None:
            try:
                values = _config_values(client.config_get("proto-max-bulk-len"))
            except ResponseError:
                values = []  # CONFIG is often disabled on managed Redis: the configured limit
            except _UNAVAILABLE as err:
                raise self._unavailable(err) from err
            self._limit_from_config = bool(values)
            self._max_value = min([self._max_value_configured, *values])
        return self._max_value

    def _count_refusal(self, kind: str, n: int = 1) -> int:
        """Count `n` refused puts of `kind` ("oom" or "oversize"); the new count of that kind."""
        with self._lock:
            if kind == "oom":
                self._oom_refusals += n
                return self._oom_refusals
            self._oversize_refusals += n
            return self._oversize_refusals

    def _learn_limit(self, size: int, key: str, refused: int = 1) -> None:
        """Redis called a value of `size` bytes too long: refuse that size from now on."""
        with self._lock:
            self._oversize_refusals += refused
            self._max_value = min(self._max_value or size, size - 1)
            limit = self._max_value
        logger.warning(
            "%s refused %s as too long (%d bytes): its proto-max-bulk-len is lower than the "
            "configured limit; values over %d bytes are refused from now on",
            self.url,
            key,
            size,
            limit,
        )

    def _rejected_for_size(self, sizes: Sequence[int]) -> bool:
        """After a put batch lost its connection: True (limit learned) if Redis dropped it for a
        value over its bulk limit, which it does without CONFIG telling us that limit."""
        largest = max(sizes, default=0)
        if self._limit_from_config or largest <= MIN_PROTO_MAX_BULK_LEN:
            return False
        try:
            self.ping()
        except RemoteUnavailableError:
            return False  # the server is really gone
        self._learn_limit(largest, f"a batch of {len(sizes)} values", refused=0)
        return True

    def _run(self, client: Any, commands: Sequence[tuple]) -> list[Any]:
        """Execute `commands` in one pipeline; per-command errors come back as exceptions."""
        if not commands:
            return []
        try:
            pipe = client.pipeline(transaction=False)
            for command in commands:
                pipe.execute_command(*command)
            replies = pipe.execute(raise_on_error=False)
        except _UNAVAILABLE as err:
            raise self._unavailable(err) from err
        for reply in replies:
            if isinstance(reply, _UNAVAILABLE):
                raise self._unavailable(reply)
        return list(replies)

    def _unavailable(self, err: BaseException) -> RemoteUnavailableError:
        return RemoteUnavailableError(f"{self.url}: {type(err).__name__}: {err}")


def _is_too_long(reply: Any) -> bool:
    """Redis's reply to a value over its `proto-max-bulk-len`."""
    return isinstance(reply, ResponseError) and "invalid bulk length" in str(reply)


def _config_values(reply: Any) -> list[int]:
    """The integer values of a `CONFIG GET` reply (a dict, or per-node dicts for a cluster)."""
    if isinstance(reply, dict) and reply and all(isinstance(v, dict) for v in reply.values()):
        return [v for sub in reply.values() for v in _config_values(sub)]
    out: list[int] = []
    if isinstance(reply, dict):
        for value in reply.values():
            try:
                out.append(int(value))
            except (TypeError, ValueError):
                continue
    return out
