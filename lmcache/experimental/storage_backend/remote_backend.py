"""The remote tier: chunks on an `lm://` server, Redis or Mooncake Store, shared by every instance pointing there.

- Puts never block the serving thread: they take a reference and go into a bounded queue
  that one background thread drains in pipelined batches (serde encoding happens there too).
  A full queue drops the put and counts it; every put the server acknowledges, refuses or
  loses is counted, so a lost put is a number, not an assumption.
- `contains` (what lookup uses) asks the server `exists` under a short timeout; `get_blocking`
  fetches and decodes, and `batched_get_blocking` fetches many chunks in one pipeline. A chunk
  still waiting in the put queue is answered from memory. A prefetch reads a chunk into the CPU
  tier on a background thread; a `get_blocking` of a chunk being prefetched waits for it.
- Health: the first connection error or timeout marks the tier down and logs it once. While
  down, lookups and gets return a miss at once and puts are dropped (counted), so a dead or
  stalled server costs a request at most one timeout, after which it simply recomputes. The
  background thread probes the server with exponential backoff and, when it answers, logs
  that the tier is back: puts and hits resume on their own, through fresh connections.
- The node pool (`lm+shm://`, naive serde) can also serve as the engine's memory (`pool_in_place`):
  `reserve_in_place` hands out objects over arena blocks, whose put is a commit, and
  `lease_in_place` hands out checked objects over leased blocks.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, fields
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from lmcache.background_threads import hurry, prepared, thread_initializer
from lmcache.config import LMCacheEngineMetadata
from lmcache.experimental.holdings import Medium
from lmcache.experimental.memory_management import MemoryFormat, MemoryObj
from lmcache.experimental.remote import create_connector, redis_key_prefix
from lmcache.experimental.remote.connector import RemoteConnector, RemoteUnavailableError
from lmcache.experimental.remote.mooncake_settings import MooncakeSettings
from lmcache.experimental.remote.pool_connector import PoolConnector
from lmcache.experimental.remote.serde import Serde, create_serde
from lmcache.experimental.remote.value_reader import ValueReader
from lmcache.experimental.stats import TierStats
from lmcache.experimental.storage_backend.abstract_backend import ClosedWrites, StorageBackendInterface
from lmcache.experimental.storage_backend.local_cpu_backend import LocalCPUBackend
from lmcache.experimental.storage_backend.pool_in_place import InPlaceChunks
from lmcache.logging import init_logger
from lmcache.utils import CacheEngineKey

logger = init_logger(__name__)

# Log one "queue full" line per this many dropped puts.
_DROP_LOG_EVERY = 100


@dataclass(frozen=True)
class RemoteBackendOptions:
    """Knobs of the remote tier; the defaults suit a server on the same host or LAN."""

    put_queue_size: int = 256  # chunks waiting to be written; beyond it puts are dropped
    put_batch_size: int = 8  # chunks per pipelined write
    timeout_s: float = 10.0  # one get or put batch
    lookup_timeout_s: float = 1.0  # exists, ping and connect: what a request may wait at most
    pool_size: int = 4  # pooled connections per connector
    backoff_initial_s: float = 0.2  # first retry after the tier went down
    backoff_max_s: float = 10.0  # retries never wait longer than this
    ttl_s: Optional[float] = None  # Redis only: expire chunks after this long
    flush_timeout_s: float = 30.0  # close() waits this long for queued puts
    # Largest encoded chunk one put sends (None: 1 GiB for lm://, 512 MB for Redis); larger
    # chunks, or chunks over the server's own limit, are refused puts, never a tier failure.
    max_value_bytes: Optional[int] = None

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and value <= 0:
                raise ValueError(f"RemoteBackendOptions.{f.name} must be positive, got {value}")


@dataclass(frozen=True)
class RemoteStatsSnapshot:
    """What happened to puts and gets of the remote tier since it was created."""

    puts_acknowledged: int = 0  # the server confirmed it stored the chunk
    puts_refused: int = 0  # the server answered "no" (too large, out of memory)
    puts_lost: int = 0  # sent, but the connection failed before the acknowledgement
    puts_dropped_queue_full: int = 0
    puts_dropped_tier_down: int = 0
    puts_skipped_stored: int = 0  # not sent: the server had the chunk already
    puts_in_place: int = 0  # acknowledged puts the copy kernel wrote straight into a pool block
    reserves_refused: int = 0  # pool blocks refused at reserve: those chunks took the copying path
    gets_hit: int = 0
    gets_queued: int = 0  # hits answered from the put queue: the chunk's put not acknowledged yet
    gets_miss: int = 0
    gets_in_place: int = 0  # hits handed over as the leased pool block itself (no copy)
    gets_hashed_in_place: int = 0  # of those, checksummed here (first read of that commit by this process)
    gets_rejected: int = 0  # bytes failed the header/checksum/shape checks, or no memory to load them
    gets_failed: int = 0  # connection error or timeout
    lookups_failed: int = 0
    times_down: int = 0  # transitions to "down"
    times_recovered: int = 0  # transitions back to "up"


class _Counters:
    """Thread-safe counters behind `RemoteStatsSnapshot`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Dict[str, int] = {f.name: 0 for f in fields(RemoteStatsSnapshot)}

    def add(self, name: str, delta: int = 1) -> int:
        with self._lock:
            self._counts[name] += delta
            return self._counts[name]

    def snapshot(self) -> RemoteStatsSnapshot:
        with self._lock:
            return RemoteStatsSnapshot(**self._counts)


class _Health:
    """Up/down state with exponential backoff between reconnection probes."""

    def __init__(self, url: str, options: RemoteBackendOptions, counters: _Counters,
                 on_down: Callable[[], None]) -> None:
        self._url = url
        self._on_down = on_down  # told once per outage: what the tier held is out of reach
        self._options = options
        self._counters = counters
        self._lock = threading.Lock()
        self._up = True
        self._down_since = 0.0
        self._backoff = options.backoff_initial_s
        self._next_probe = 0.0

    @property
    def up(self) -> bool:
        return self._up

    def seconds_to_probe(self) -> float:
        with self._lock:
            return max(0.0, self._next_probe - time.monotonic())

    def mark_down(self, reason: str) -> None:
        went_down = False
        with self._lock:
            now = time.monotonic()
            if self._up:
                self._up = False
                self._down_since = now
                self._backoff = self._options.backoff_initial_s
                self._counters.add("times_down")
                went_down = True
                logger.warning(
                    "remote tier %s is down (%s): lookups miss and requests recompute; "
                    "reconnecting in the background",
                    self._url,
                    reason,
                )
            else:
                self._backoff = min(self._backoff * 2, self._options.backoff_max_s)
                logger.debug("remote tier %s still down (%s); next probe in %.1f s", self._url, reason, self._backoff)
            self._next_probe = now + self._backoff
        if went_down:
            self._on_down()

    def mark_up(self) -> None:
        with self._lock:
            if self._up:
                return
            self._counters.add("times_recovered")
            logger.warning(
                "remote tier %s is back after %.1f s: puts and hits resume",
                self._url,
                time.monotonic() - self._down_since,
            )
            # Last, so whoever sees the tier up also finds the line saying so in the log.
            self._up = True


@dataclass
class _PutTask:
    key: CacheEngineKey
    obj: MemoryObj


class RemoteBackend(StorageBackendInterface):
    """A `RemoteConnector` plus a serde behind the tier interface."""

    def __init__(
        self,
        url: str,
        serde: str,
        metadata: LMCacheEngineMetadata,
        local_cpu_backend: LocalCPUBackend,
        stats: Optional[TierStats] = None,
        options: Optional[RemoteBackendOptions] = None,
        connector: Optional[RemoteConnector] = None,
        password: Optional[str] = None,
        mooncake: Optional[MooncakeSettings] = None,
    ) -> None:
        self._options = options if options is not None else RemoteBackendOptions()
        opts = self._options
        self._connector = connector if connector is not None else create_connector(
            url,
            key_prefix=redis_key_prefix(metadata.model_name),
            timeout=opts.timeout_s,
            lookup_timeout=opts.lookup_timeout_s,
            pool_size=opts.pool_size,
            ttl_s=opts.ttl_s,
            max_value_bytes=opts.max_value_bytes,
            password=password,
            mooncake=mooncake,
        )
        self._serde: Serde = create_serde(serde)
        self._in_place: Optional[InPlaceChunks] = None
        if isinstance(self._connector, PoolConnector) and self._serde.name == "naive":
            self._in_place = InPlaceChunks(self._connector)
        self._metadata = metadata
        self._cpu = local_cpu_backend
        self._stats = stats if stats is not None else TierStats()
        self._counters = _Counters()
        # A store that went away (down, restarted) may have lost everything: reported as cleared.
        self._health = _Health(self._connector.url, opts, self._counters,
                               on_down=lambda: self.holdings.cleared("tier down"))
        self._queue: "queue.Queue[_PutTask]" = queue.Queue(maxsize=opts.put_queue_size)
        self._lock = threading.Lock()
        self._pending: Dict[CacheEngineKey, MemoryObj] = {}
        self._settled = threading.Condition(self._lock)  # notified when puts leave `_pending`
        self._stop = threading.Event()
        self._closed = False
        self._worker: Optional[threading.Thread] = None
        self._prefetch_pool: Optional[ThreadPoolExecutor] = None
        # Prefetches in flight; `get_blocking` of such a key waits for it (design.md, tiers).
        self._prefetching: Dict[CacheEngineKey, Future] = {}

    @property
    def url(self) -> str:
        return self._connector.url

    @property
    def medium(self) -> Medium:
        """The node pool is host memory; every other remote store is storage."""
        return Medium.CPU if isinstance(self._connector, PoolConnector) else Medium.STORAGE

    @property
    def is_up(self) -> bool:
        return self._health.up

    def remote_stats(self) -> RemoteStatsSnapshot:
        return self._counters.snapshot()

    # ---- lookups and reads (serving thread) ----------------------------------------------

    def contains(self, key: CacheEngineKey) -> bool:
        return self.batched_contains([key])[0]

    def batched_contains(self, keys: Sequence[CacheEngineKey]) -> List[bool]:
        """Chunks still in the put queue from memory, the others in one EXISTS round trip."""
        self._ensure_worker()
        with self._lock:
            found = [key in self._pending for key in keys]
        ask = [i for i, queued in enumerate(found) if not queued]
        if not ask or not self._health.up:
            return found
        try:
            answers = self._connector.batched_exists([keys[i].to_string() for i in ask])
        except RemoteUnavailableError as err:
            self._counters.add("lookups_failed")
            self._health.mark_down(str(err))
            return found
        for i, exists in zip(ask, answers):
            found[i] = exists
        return found

    def contains_locally(self, key: CacheEngineKey) -> bool:
        """Only puts still pending: whether the server has a chunk is the put thread's question
        (one pipelined EXISTS per batch, before sending it)."""
        return self.exists_in_put_tasks(key)

    def exists_in_put_tasks(self, key: CacheEngineKey) -> bool:
        with self._lock:
            return key in self._pending

    def get_blocking(self, key: CacheEngineKey) -> Optional[MemoryObj]:
        with self._lock:
            prefetch = self._prefetching.get(key)
        obj = self._cpu.get_after_prefetch(prefetch, key)
        return obj if obj is not None else self._fetch([key])[0]

    def batched_get_blocking(self, keys: Sequence[CacheEngineKey]) -> List[Optional[MemoryObj]]:
        """`get_blocking` for many chunks in one pipelined round trip; caller owns each result."""
        return self._fetch(keys)

    def reserve_in_place(
        self, keys: Sequence[CacheEngineKey], shapes: Sequence[torch.Size], dtype: torch.dtype
    ) -> Optional[List[Optional[MemoryObj]]]:
        """Objects over reserved pool blocks (None where refused: counted, and those chunks take
        the copying path); None when this tier is not a node pool."""
        if self._in_place is None:
            return None
        self._ensure_worker()
        objs: List[Optional[MemoryObj]] = [None] * len(keys)
        if self._health.up and keys:
            try:
                objs = self._in_place.reserve(keys, shapes, dtype)
            except RemoteUnavailableError as err:
                self._stats.record_error()
                self._health.mark_down(str(err))
        refused = sum(obj is None for obj in objs)
        if refused:
            self._counters.add("reserves_refused", refused)
        return objs

    def lease_in_place(
        self, keys: Sequence[CacheEngineKey], dtype: torch.dtype, hold: bool = False
    ) -> Optional[List[Optional[MemoryObj]]]:
        """`batched_get_blocking` with each hit the leased pool block itself, checked in place (its
        last reference releases the lease); None when this tier is not a node pool, or with
        `hold` when it holds as many long-kept batches as it may (`pool_in_place`)."""
        if self._in_place is None:
            return None
        self._ensure_worker()
        results, remote_slots = self._queued(keys)
        if not remote_slots or not self._health.up:
            return results
        try:
            outcome = self._in_place.lease([keys[i] for i in remote_slots], dtype, hold)
        except RemoteUnavailableError as err:
            self._counters.add("gets_failed", len(remote_slots))
            self._stats.record_error()
            self._health.mark_down(str(err))
            return results
        if outcome is None:  # the caller reads through `_fetch`, which counts the queued chunks again
            for obj in results:
                if obj is not None:
                    obj.ref_count_down()
            self._counters.add("gets_queued", len(remote_slots) - len(keys))
            return None
        hits = 0
        for i, obj in zip(remote_slots, outcome.objs):
            if obj is not None:
                results[i] = obj
                hits += 1
                self._stats.record_read(obj.get_size())
        for _ in range(outcome.rejected):
            self._stats.record_rejected()
        self._counters.add("gets_hit", hits)
        self._counters.add("gets_in_place", hits)
        self._counters.add("gets_hashed_in_place", outcome.hashed)
        self._counters.add("gets_rejected", outcome.rejected)
        self._counters.add("gets_miss", len(remote_slots) - hits - outcome.rejected)
        return results

    def _queued(self, keys: Sequence[CacheEngineKey]) -> Tuple[List[Optional[MemoryObj]], List[int]]:
        """Chunks still in the put queue (a new reference each), and the indexes of the others.

        A queued chunk written into a pool block is not handed out: once committed, that block is
        the server's to evict and reuse, whoever still holds the object. Its put is waited for
        instead (at most `timeout_s`), and the chunk read from the pool like the others."""
        results: List[Optional[MemoryObj]] = [None] * len(keys)
        remote_slots: List[int] = []
        committing: List[CacheEngineKey] = []
        with self._lock:
            for i, key in enumerate(keys):
                queued = self._pending.get(key)
                if queued is not None and not (self._in_place is not None and self._in_place.holds(queued)):
                    queued.ref_count_up()
                    results[i] = queued
                else:
                    remote_slots.append(i)
                    if queued is not None:
                        committing.append(key)
        self._counters.add("gets_queued", len(keys) - len(remote_slots))
        deadline = time.monotonic() + self._options.timeout_s
        with self._settled:
            while committing and time.monotonic() < deadline:
                self._settled.wait(deadline - time.monotonic())
                committing = [key for key in committing if key in self._pending]
        return results, remote_slots

    def _fetch(self, keys: Sequence[CacheEngineKey]) -> List[Optional[MemoryObj]]:
        """Queued puts from memory, the rest from the server in one pipeline."""
        self._ensure_worker()
        results, remote_slots = self._queued(keys)
        if not remote_slots or not self._health.up:
            return results
        answered = 0

        def receive(n: int, reader: ValueReader) -> None:
            nonlocal answered
            answered += 1
            i = remote_slots[n]
            results[i] = self._decode(keys[i], reader)
            if results[i] is not None:
                self._counters.add("gets_hit")
                self._stats.record_read(results[i].get_size())  # type: ignore[union-attr]

        try:
            # Each chunk is read from the connection straight into its object (value_reader.py).
            self._connector.batched_get_into([keys[i].to_string() for i in remote_slots], receive)
        except RemoteUnavailableError as err:
            # What arrived before the failure was checked and is kept.
            self._counters.add("gets_failed", len(remote_slots) - answered)
            self._stats.record_error()
            self._health.mark_down(str(err))
            return results
        self._counters.add("gets_miss", len(remote_slots) - answered)
        return results

    def _decode(self, key: CacheEngineKey, reader: ValueReader) -> Optional[MemoryObj]:
        try:
            obj = self._serde.receive(key, reader, self._cpu.allocate, dtype=self._metadata.kv_dtype)
        except RemoteUnavailableError:
            raise  # the connection broke: the tier goes down, not this chunk
        except Exception as err:  # a chunk we cannot read is a miss, whatever went wrong
            logger.warning("remote chunk %s could not be decoded: %r", key.chunk_hash, err)
            obj = None
        if obj is not None and not self._shape_ok(obj):
            logger.warning(
                "remote chunk %s has shape %s, which does not fit this model's KV %s: miss",
                key.chunk_hash,
                tuple(obj.metadata.shape),
                self._metadata.kv_shape,
            )
            obj.ref_count_down()
            obj = None
        if obj is None:
            self._counters.add("gets_rejected")
            self._stats.record_rejected()
            self.holdings.lost(key, "corrupt")
        return obj

    def _shape_ok(self, obj: MemoryObj) -> bool:
        if obj.metadata.fmt != MemoryFormat.KV_BLOB:
            return True
        shape = tuple(obj.metadata.shape)
        meta = self._metadata
        hidden = meta.kv_shape[4] if meta.use_mla else meta.hidden_size
        return (
            len(shape) == 4
            and shape[0] == meta.kv_shape[1]
            and shape[1] == meta.num_layers
            and 0 < shape[2] <= meta.chunk_size
            and shape[3] == hidden
        )

    # ---- writes (serving thread enqueues, worker sends) -----------------------------------

    def submit_put_task(self, key: CacheEngineKey, obj: MemoryObj) -> None:
        self._ensure_worker()
        if not self._health.up:
            self._counters.add("puts_dropped_tier_down")
            return
        with self._lock:
            if self._closed or key in self._pending:
                return
            obj.ref_count_up()
            try:
                self._queue.put_nowait(_PutTask(key, obj))
            except queue.Full:
                obj.ref_count_down()
                dropped = self._counters.add("puts_dropped_queue_full")
                if dropped % _DROP_LOG_EVERY == 1:
                    logger.warning(
                        "remote tier %s: put queue full (%d chunks), dropping puts (%d so far)",
                        self.url,
                        self._options.put_queue_size,
                        dropped,
                    )
                return
            self._pending[key] = obj

    def _ensure_worker(self) -> None:
        """Start the background thread on first use (never at construction or import)."""
        if self._worker is not None:
            return
        with self._lock:
            if self._worker is None and not self._closed:
                self._worker = threading.Thread(
                    target=prepared(self._run_worker, "lmc-remote-put", background=True),
                    name="lmcache-remote-put", daemon=True,
                )
                self._worker.start()

    def _run_worker(self) -> None:
        while not self._stop.is_set():
            if not self._health.up:
                self._drop_queued("puts_dropped_tier_down")
                if self._stop.wait(min(self._health.seconds_to_probe(), 0.5)):
                    break
                if self._health.seconds_to_probe() == 0.0:
                    self._probe()
                continue
            try:
                first = self._queue.get(timeout=0.2)
            except queue.Empty:
                continue
            self._send(self._batch_after(first))
        self._drop_queued("puts_dropped_tier_down")

    def _batch_after(self, first: _PutTask) -> List[_PutTask]:
        """`first` and what else is queued, up to a batch."""
        batch = [first]
        while len(batch) < self._options.put_batch_size:
            try:
                batch.append(self._queue.get_nowait())
            except queue.Empty:
                break
        return batch

    def _probe(self) -> None:
        try:
            self._connector.ping()
        except RemoteUnavailableError as err:
            self._health.mark_down(str(err))
        else:
            self._health.mark_up()

    def _send(self, batch: List[_PutTask]) -> None:
        in_place = [task for task in batch if self._in_place is not None and self._in_place.holds(task.obj)]
        if in_place:
            self._commit(in_place)
            batch = [task for task in batch if task not in in_place]
            if not batch:
                return
        try:
            stored = self._connector.batched_exists([task.key.to_string() for task in batch])
        except RemoteUnavailableError as err:
            self._counters.add("puts_dropped_tier_down", len(batch))
            self._stats.record_error()
            self._health.mark_down(str(err))
            self._finish(batch)
            return
        encoded: List[tuple] = []
        sent: List[_PutTask] = []
        for task, present in zip(batch, stored):
            if present:  # another engine stored it first: nothing to send
                self._counters.add("puts_skipped_stored")
                self.holdings.admitted(task.key, "stored already")
                continue
            try:
                encoded.append((task.key.to_string(), self._serde.encode_parts(task.key, task.obj)))
                sent.append(task)
            except Exception as err:  # a chunk we cannot encode is a dropped put
                logger.warning("remote tier: cannot encode chunk %s: %r", task.key.chunk_hash, err)
                self._counters.add("puts_refused")
                self._stats.record_error()
                self.holdings.lost(task.key, "write failed")
        try:
            acks = self._connector.batched_put(encoded) if encoded else []
        except RemoteUnavailableError as err:
            self._counters.add("puts_lost", len(sent))
            self._stats.record_error()
            self._health.mark_down(str(err))
            acks = [False] * len(sent)
        else:
            for task, ok in zip(sent, acks):
                if ok:
                    self._counters.add("puts_acknowledged")
                    self._stats.record_write(task.obj.get_size())
                    self.holdings.admitted(task.key)
                else:
                    self._counters.add("puts_refused")
                    self.holdings.lost(task.key, "write failed")
        self._finish(batch)

    def _commit(self, tasks: List[_PutTask]) -> None:
        """Seal and commit chunks the kernel wrote into reserved pool blocks (no `exists` first:
        the block is this store's already)."""
        assert self._in_place is not None
        acks = self._in_place.commit([task.obj for task in tasks])
        for task, ok in zip(tasks, acks):
            if ok:
                self._counters.add("puts_acknowledged")
                self._counters.add("puts_in_place")
                self._stats.record_write(task.obj.get_size())
                self.holdings.admitted(task.key)
            else:
                self._counters.add("puts_refused" if ok is False else "puts_lost")
                self.holdings.lost(task.key, "write failed")
        if None in acks:
            self._stats.record_error()
            self._health.mark_down("committing chunks to the node pool failed")
        self._finish(tasks)

    def _finish(self, batch: List[_PutTask]) -> None:
        with self._lock:
            for task in batch:
                if self._pending.get(task.key) is task.obj:
                    del self._pending[task.key]
            self._settled.notify_all()
        for task in batch:
            task.obj.ref_count_down()

    def _drop_queued(self, counter: str) -> None:
        dropped: List[_PutTask] = []
        while True:
            try:
                dropped.append(self._queue.get_nowait())
            except queue.Empty:
                break
        if dropped:
            self._counters.add(counter, len(dropped))
            self._finish(dropped)

    # ---- prefetch, remove, close ----------------------------------------------------------

    def submit_prefetch_task(self, key: CacheEngineKey) -> bool:
        """Fetch `key` into the CPU tier on a background thread; False if that cannot help."""
        if not self._cpu.keeps_objects or self._cpu.contains(key) or not self._health.up:
            return False
        with self._lock:
            if self._closed or key in self._prefetching:
                return False
            if self._prefetch_pool is None:
                self._prefetch_pool = ThreadPoolExecutor(  # a load may wait for a prefetch: not background
                    max_workers=1, thread_name_prefix="lmcache-remote-prefetch",
                    initializer=thread_initializer("lmc-remote-pref", background=False),
                )
            future: Future = Future()
            self._prefetching[key] = future
            self._prefetch_pool.submit(self._run_prefetch, key, future)
        return True

    def _run_prefetch(self, key: CacheEngineKey, future: Future) -> None:
        try:
            obj = self._fetch([key])[0]
            if obj is not None:
                self._cpu.submit_put_task(key, obj)
                obj.ref_count_down()
        except Exception as err:  # a failed prefetch is only a lost optimisation
            logger.warning("remote tier: prefetch of chunk %s failed: %r", key.chunk_hash, err)
        finally:
            with self._lock:
                self._prefetching.pop(key, None)
            future.set_result(None)

    def remove(self, key: CacheEngineKey) -> bool:
        if not self._health.up:
            return False
        try:
            removed = self._connector.delete(key.to_string())
        except RemoteUnavailableError as err:
            self._health.mark_down(str(err))
            return False
        if removed:
            self.holdings.lost(key, "remove")
        return removed

    def flush(self, timeout_s: Optional[float] = None) -> bool:
        """Wait until every queued put was sent (or dropped); True if the queue drained in time.

        The caller sends queued batches itself meanwhile: the put thread runs at idle priority
        and gets no CPU while the cores are busy (another engine's forward passes), so an engine
        closing beside a busy one dropped its last puts when it waited for that thread alone."""
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self._options.flush_timeout_s)
        while time.monotonic() < deadline:
            with self._lock:
                if not self._pending:
                    return True
            try:
                first = self._queue.get_nowait() if self._health.up else None
            except queue.Empty:
                first = None
            if first is not None:
                self._send(self._batch_after(first))
                continue
            with self._settled:  # woken as puts finish; every 10 ms, look for queued batches again
                if self._pending:
                    self._settled.wait(min(0.01, max(0.0, deadline - time.monotonic())))
        return False

    def close(self, timeout_s: Optional[float] = None) -> ClosedWrites:
        """Flush queued puts (at most `timeout_s`, default `flush_timeout_s`), give up the rest,
        stop the threads, close connections."""
        if self._closed:
            return ClosedWrites()
        deadline = time.monotonic() + (self._options.flush_timeout_s if timeout_s is None else timeout_s)
        with self._lock:
            queued = len(self._pending)
        before = self._counters.snapshot()
        if self._worker is not None:
            hurry(self._worker)  # a batch it holds must not wait for idle CPU
        # On a thread of its own: a batch sent to a stalled server waits for the connector's
        # timeout (10 s), which must not stretch the deadline. Past it the send is given up.
        flusher = threading.Thread(target=prepared(self.flush, "lmc-remote-flush", background=False),
                                   args=(max(0.0, deadline - time.monotonic()),), name="lmcache-remote-flush",
                                   daemon=True)
        flusher.start()
        flusher.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            drained = not self._pending
            self._closed = True
            pool = self._prefetch_pool
        self._stop.set()
        if self._worker is not None:  # a batch it still sends is given up at the deadline
            self._worker.join(timeout=max(0.0, deadline - time.monotonic()))
        self._drop_queued("puts_dropped_tier_down")
        if pool is not None:
            pool.shutdown(wait=True)
        self._connector.close()
        after = self._counters.snapshot()
        written = min(queued, after.puts_acknowledged + after.puts_skipped_stored
                      - before.puts_acknowledged - before.puts_skipped_stored)
        stats = after
        logger.info(
            "remote tier %s closed: %d puts acknowledged, %d refused, %d lost, %d dropped; %d hits (%d from the "
            "put queue)",
            self.url,
            stats.puts_acknowledged,
            stats.puts_refused,
            stats.puts_lost,
            stats.puts_dropped_queue_full + stats.puts_dropped_tier_down,
            stats.gets_hit + stats.gets_queued,
            stats.gets_queued,
        )
        why = "tier down" if not self._health.up else "deadline" if not drained else "refused"
        return ClosedWrites(written, queued - written, why if written < queued else "")
