"""The lookup records in Redis: which instances serve which chunk.

Layout (`P` = `lmcache:p2p:`):
- `P chunk:<CacheEngineKey string>`: a hash, one field per holder: `<url>` (host:port of its
  peer server) -> `<epoch>` (that server's run: random hex, new at each start and each resync).
  Its TTL (`RECORD_TTL_S`) is renewed by every write, and each recorder rewrites its own
  records twice per TTL.
- `P live:<url>` -> `<epoch>`, with a TTL of `LIVE_TTL_S` renewed by a heartbeat: the run that
  serves at `url` now. A holder whose epoch is not the live one (the instance died, restarted,
  or resynced) is stale: the lookup script drops it and looks no further at it, in the same
  round trip.

Each holder has its own field, so one instance evicting a chunk never hides another's copy, and
a withdraw deletes a field only if it still names the withdrawer's run (compare-and-delete).
Every Redis call has a short timeout; a failure marks Redis down for a backoff during which
calls fail at once (`Backoff`), which the read side answers as misses.
"""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry

from lmcache.experimental.config import parse_remote_url
from lmcache.logging import init_logger
from lmcache.utils import CacheEngineKey

logger = init_logger(__name__)

T = TypeVar("T")

PREFIX = "lmcache:p2p:"
CHUNK_PREFIX = PREFIX + "chunk:"
LIVE_PREFIX = PREFIX + "live:"
# A live key outlives three missed heartbeats; a dead instance's records go stale that soon.
LIVE_TTL_S = 15
HEARTBEAT_S = 5.0
# Records of an instance gone for good expire; the recorder renews its own twice per period.
RECORD_TTL_S = 24 * 3600
# One Redis command or pipeline: a lookup waits at most this long (connect included).
REDIS_TIMEOUT_S = 0.5
# Keys per pipeline or script call, so one call never holds Redis (or our memory) long.
BATCH_KEYS = 1024

# KEYS: chunk records; ARGV[1]: the live-key prefix, ARGV[2]: a url to pass over (the asker's).
# Returns, per key, "<epoch> <url>" of its first live holder, or false; stale holders are dropped.
_LOOKUP = """
local out = {}
for i, k in ipairs(KEYS) do
  local found = false
  local fields = redis.call('HGETALL', k)
  for j = 1, #fields, 2 do
    local url, epoch = fields[j], fields[j + 1]
    if redis.call('GET', ARGV[1] .. url) ~= epoch then
      redis.call('HDEL', k, url)
    elseif not found and url ~= ARGV[2] then
      found = epoch .. ' ' .. url
    end
  end
  out[i] = found
end
return out
"""
# KEYS: records; ARGV: url, epoch per key. Deletes each holder still at that epoch; the count.
_FORGET = """
local n = 0
for i, k in ipairs(KEYS) do
  if redis.call('HGET', k, ARGV[2 * i - 1]) == ARGV[2 * i] then n = n + redis.call('HDEL', k, ARGV[2 * i - 1]) end
end
return n
"""
# KEYS[1]: a live key; ARGV[1]: the epoch it must still have to be deleted.
_RETIRE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class LookupDown(Exception):
    """Redis did not answer (or is in its backoff): the caller treats it as a miss."""


@dataclass(frozen=True)
class Holder:
    """Who a record says holds a chunk."""

    url: str  # host:port of its peer server
    epoch: str  # the run of that server that recorded it

    @staticmethod
    def parse(raw: Any) -> Optional["Holder"]:
        epoch, _, url = _text(raw).partition(" ")
        return Holder(url, epoch) if epoch and url else None


def _text(raw: Any) -> str:
    """A Redis reply as text ("" for none)."""
    return raw.decode("utf-8", "replace") if isinstance(raw, bytes) else (raw or "")


def new_epoch() -> str:
    return secrets.token_hex(8)


def record_key(key: CacheEngineKey) -> str:
    return CHUNK_PREFIX + key.to_string()


def redis_client(lookup_url: str, timeout_s: float = REDIS_TIMEOUT_S) -> "redis.Redis":
    """A client of the Redis at `lookup_url` (host:port, or redis:// / rediss:// with a password),
    without retries: `Backoff` decides when to ask again."""
    common: Dict[str, Any] = dict(socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                  retry=Retry(NoBackoff(), 0), max_connections=8)
    if "://" not in lookup_url:
        host, _, port = lookup_url.rpartition(":")
        return redis.Redis(host=host.strip("[]"), port=int(port), **common)
    url = parse_remote_url(lookup_url, "lookup_url")
    (host, port), = url.hosts
    return redis.Redis(host=host, port=port, username=url.username, password=url.password, db=url.db or 0,
                       ssl=url.scheme == "rediss", **common)


class Backoff:
    """Up or down; while down, `check` raises until the next probe is due (0.2 s doubling to 10 s)."""

    def __init__(self, what: str) -> None:
        self._what = what
        self._lock = threading.Lock()
        self._delay = 0.0
        self._retry_at = 0.0

    def check(self) -> None:
        with self._lock:
            if self._delay and time.monotonic() < self._retry_at:
                raise LookupDown(f"{self._what} is down (next try in {self._retry_at - time.monotonic():.1f} s)")

    def failed(self, err: Exception) -> None:
        with self._lock:
            first = not self._delay
            self._delay = min(10.0, self._delay * 2 or 0.2)
            self._retry_at = time.monotonic() + self._delay
        if first:
            logger.warning("%s did not answer (%s): peer-to-peer lookups are misses until it does", self._what, err)

    def succeeded(self) -> None:
        with self._lock:
            was_down, self._delay = bool(self._delay), 0.0
        if was_down:
            logger.info("%s answers again: peer-to-peer lookups resume", self._what)


class LookupRecords:
    """Reads and writes the records of one Redis; every method raises `LookupDown` on failure."""

    def __init__(self, client: "redis.Redis", what: str) -> None:
        self._client = client
        self._lookup = client.register_script(_LOOKUP)
        self._forget = client.register_script(_FORGET)
        self._retire = client.register_script(_RETIRE)
        self.health = Backoff(what)

    def _call(self, fn: Callable[[], T]) -> T:
        """`fn()` unless Redis is in its backoff; a failure starts (or extends) the backoff."""
        self.health.check()
        try:
            result = fn()
        except (RedisError, OSError) as err:
            self.health.failed(err)
            raise LookupDown(str(err)) from err
        self.health.succeeded()
        return result

    def holders(self, keys: Sequence[CacheEngineKey], other_than: str = "") -> List[Optional[Holder]]:
        """A live holder of each chunk other than the server at `other_than` (None: none; stale
        holders met on the way are dropped)."""
        found: List[Optional[Holder]] = []
        for start in range(0, len(keys), BATCH_KEYS):
            names = [record_key(k) for k in keys[start : start + BATCH_KEYS]]
            replies = self._call(lambda: self._lookup(keys=names, args=[LIVE_PREFIX, other_than]))
            found.extend(Holder.parse(raw) if raw else None for raw in replies)
        return found

    def forget(self, keys: Sequence[CacheEngineKey], holders: Sequence[Holder]) -> int:
        """Delete each key's holder, if the record still names that run; how many were deleted."""
        deleted = 0
        for start in range(0, len(keys), BATCH_KEYS):
            names = [record_key(k) for k in keys[start : start + BATCH_KEYS]]
            args = [part for h in holders[start : start + BATCH_KEYS] for part in (h.url, h.epoch)]
            deleted += int(self._call(lambda: self._forget(keys=names, args=args)))
        return deleted

    def publish(self, keys: Iterable[CacheEngineKey], holder: Holder) -> None:
        """Record `holder` for every key (pipelined, in batches)."""
        batch: List[CacheEngineKey] = []
        for key in keys:
            batch.append(key)
            if len(batch) == BATCH_KEYS:
                self._publish(batch, holder)
                batch = []
        if batch:
            self._publish(batch, holder)

    def _publish(self, keys: Sequence[CacheEngineKey], holder: Holder) -> None:
        def run() -> None:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.hset(record_key(key), holder.url, holder.epoch)
                pipe.expire(record_key(key), RECORD_TTL_S)
            pipe.execute()

        self._call(run)

    def heartbeat(self, holder: Holder) -> bool:
        """Renew `holder`'s live key; False when it had lapsed or named another run (records that
        lookups may have dropped meanwhile must be written again)."""
        previous = self._call(lambda: self._client.set(LIVE_PREFIX + holder.url, holder.epoch, ex=LIVE_TTL_S, get=True))
        return _text(previous) == holder.epoch

    def retire(self, holder: Holder) -> None:
        """Drop `holder`'s live key if it is still its own: all its records go stale at once."""
        self._call(lambda: self._retire(keys=[LIVE_PREFIX + holder.url], args=[holder.epoch]))

    def close(self) -> None:
        self._client.close()
