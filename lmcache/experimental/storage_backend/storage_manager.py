"""The tiers in one ordered list (fastest first) behind one small API for the engine.

Writes go to every tier; reads come from the fastest tier that has the chunk, and a hit in a
lower tier is promoted into the CPU tier. A tier that raises is logged and counted, and the
operation degrades to a miss or a dropped put: a cache problem never reaches the serving path.
Allocation goes through the CPU tier, which evicts idle objects to make room.

Pins (`pins.py`): `pin_prefix` makes a run of chunks resident in CPU memory and holds them for a
request until it is unpinned; reads look at pinned objects right after the CPU tier, so a pinned
chunk is served from memory even if every tier has lost it since.
"""

import threading
import time
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Set

import torch

from lmcache.experimental.holdings import HoldingsStream
from lmcache.experimental.memory_management import MemoryFormat, MemoryObj
from lmcache.experimental.pins import PinRegistry
from lmcache.experimental.stats import EngineStats
from lmcache.experimental.storage_backend.abstract_backend import ClosedWrites, StorageBackendInterface
from lmcache.experimental.storage_backend.local_cpu_backend import LocalCPUBackend
from lmcache.logging import init_logger
from lmcache.utils import CacheEngineKey

logger = init_logger(__name__)

class StorageManager:
    """Ordered tiers plus the CPU tier that allocates (it is in `tiers` only if it keeps objects)."""

    def __init__(
        self,
        local_cpu_backend: LocalCPUBackend,
        tiers: Sequence[StorageBackendInterface],
        stats: Optional[EngineStats] = None,
        holdings: Optional[HoldingsStream] = None,
    ) -> None:
        """`holdings`: the stream every tier reports its admits and losses into (none: unreported)."""
        names = [t.tier_name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"StorageManager: tier names must be unique, got {names}")
        self._cpu = local_cpu_backend
        self._tiers: List[StorageBackendInterface] = list(tiers)
        self._stats = stats if stats is not None else EngineStats()
        self.pins = PinRegistry(self._stats)
        self._lock = threading.Lock()
        self._warned_names: Set[str] = set()
        self._closed = False
        if holdings is not None:
            for tier in {id(t): t for t in [local_cpu_backend, *tiers]}.values():
                tier.report_holdings_to(holdings.tier(tier.tier_name, tier.medium))

    @property
    def tier_names(self) -> List[str]:
        """Names usable in `search_range`, fastest tier first."""
        return [t.tier_name for t in self._tiers]

    @property
    def tiers(self) -> List[StorageBackendInterface]:
        return list(self._tiers)

    @property
    def local_tier_names(self) -> List[str]:
        """The tiers that can list their keys: this instance's own (CPU, disk), not a shared
        store nor a peer's; the ones its peer server serves."""
        return [t.tier_name for t in self._tiers if hasattr(t, "keys")]

    def listed_keys(self) -> Dict[str, List[CacheEngineKey]]:
        """The keys each tier that can list them holds now (the CPU and disk tiers; a remote store
        is shared and cannot), by tier name."""
        return {t.tier_name: t.keys() for t in self._tiers if hasattr(t, "keys")}

    def clear_tier(self, name: str) -> int:
        """Drop every chunk of the tier named `name`; how many were dropped. ValueError naming
        the tiers that can be cleared when `name` is none of them."""
        tier = {t.tier_name: t for t in self._tiers if hasattr(t, "keys")}.get(name)
        if tier is None:
            listable = sorted(t.tier_name for t in self._tiers if hasattr(t, "keys"))
            raise ValueError(f"tier={name!r}: expected one of {listable}")
        return sum(1 for key in tier.keys() if tier.remove(key))

    def usage_bytes(self) -> Dict[str, int]:
        """Bytes each tier that can tell holds now, by tier name."""
        usage = ((t.tier_name, t.used_bytes) for t in self._tiers)
        return {name: used for name, used in usage if used is not None}

    def _selected(self, search_range: Optional[Iterable[str]]) -> List[StorageBackendInterface]:
        if search_range is None:
            return self._tiers
        wanted = set(search_range)
        unknown = wanted.difference(self.tier_names)
        with self._lock:
            fresh = unknown - self._warned_names
            self._warned_names |= fresh
        if fresh:
            logger.warning(
                "search_range names tiers that are not configured: %s (have %s)", sorted(fresh), self.tier_names
            )
        return [t for t in self._tiers if t.tier_name in wanted]

    def _tier_failed(self, tier: StorageBackendInterface, what: str, key: CacheEngineKey, err: Exception) -> None:
        logger.warning("tier %s failed to %s chunk %s: %r", tier.tier_name, what, key.chunk_hash, err)
        self._stats.tier(tier.tier_name).record_error()

    def allocate(
        self, shape: torch.Size, dtype: Optional[torch.dtype], fmt: MemoryFormat = MemoryFormat.KV_BLOB
    ) -> Optional[MemoryObj]:
        """A fresh object (caller owns one reference), evicting idle CPU-tier objects if needed."""
        try:
            return self._cpu.allocate(shape, dtype, fmt)
        except Exception as err:  # an allocator failure is a skipped store, never a crash
            logger.warning("allocating %s %s failed: %r", tuple(shape), dtype, err)
            return None

    def _sole_lower_tier(self) -> Optional[StorageBackendInterface]:
        """The one tier when it is the only one and not the CPU tier (`local_cpu: false`): then it
        may be the engine's memory itself (`reserve_in_place`, `lease_in_place`)."""
        if len(self._tiers) == 1 and self._tiers[0] is not self._cpu:
            return self._tiers[0]
        return None

    def reserve_in_place(
        self, keys: Sequence[CacheEngineKey], shapes: Sequence[torch.Size], dtype: torch.dtype
    ) -> List[Optional[MemoryObj]]:
        """For each chunk to store, an object of the sole tier to fill and `put` (no copy to the
        tier), or None: allocate one as usual (no such tier, or it had no room)."""
        tier = self._sole_lower_tier()
        objs = None
        if tier is not None and keys:
            try:
                objs = tier.reserve_in_place(keys, shapes, dtype)
            except Exception as err:
                self._tier_failed(tier, "reserve", keys[0], err)
        return objs if objs is not None else [None] * len(keys)

    def writes_headers(self) -> bool:
        """Whether a tier stores chunks with headers (disk, remote, the node pool), so a store
        should have the kernel sum each payload as it writes it (`MemoryObj.payload_checksum`)."""
        return any(tier is not self._cpu for tier in self._tiers)

    def lease_in_place(self, keys: Sequence[CacheEngineKey], dtype: torch.dtype) -> Optional[List[Optional[MemoryObj]]]:
        """`get` of many chunks from a sole tier that hands out its own bytes (pinned chunks from
        their pins), caller owning one reference of each; None when there is no such tier."""
        tier = self._sole_lower_tier()
        if tier is None or not keys:
            return None
        objs: List[Optional[MemoryObj]] = [self.pins.get(key) for key in keys]
        ask = [i for i, obj in enumerate(objs) if obj is None]
        try:
            got = tier.lease_in_place([keys[i] for i in ask], dtype) if ask else []
        except Exception as err:
            self._tier_failed(tier, "read", keys[ask[0]], err)
            got = [None] * len(ask)
        if got is None:
            for obj in objs:
                if obj is not None:
                    obj.ref_count_down()
            return None
        for i, obj in zip(ask, got):
            objs[i] = obj
        return objs

    def contains(self, key: CacheEngineKey, search_range: Optional[Iterable[str]] = None) -> bool:
        return self._any_tier_holds(self._selected(search_range), key, local=False)

    def contains_prefix(self, keys: Sequence[CacheEngineKey], search_range: Optional[Iterable[str]] = None) -> int:
        """How many leading `keys` some selected tier holds. Each tier is asked once, for the
        keys no faster tier holds (a remote tier answers them in one round trip, where one
        `contains` per chunk cost a round trip each)."""
        held = [False] * len(keys)
        for tier in self._selected(search_range):
            ask = [i for i, found in enumerate(held) if not found]
            if not ask:
                break
            try:
                answers = tier.batched_contains([keys[i] for i in ask])
            except Exception as err:
                self._tier_failed(tier, "look up", keys[ask[0]], err)
                continue
            for i, found in zip(ask, answers):
                held[i] = found
        return held.index(False) if False in held else len(keys)

    def contains_locally(self, key: CacheEngineKey) -> bool:
        """Whether a tier holds `key`, asking no server (`StorageBackendInterface.contains_locally`)."""
        return self._any_tier_holds(self._tiers, key, local=True)

    def _any_tier_holds(self, tiers: Iterable[StorageBackendInterface], key: CacheEngineKey, local: bool) -> bool:
        for tier in tiers:
            try:
                if tier.contains_locally(key) if local else tier.contains(key):
                    return True
            except Exception as err:
                self._tier_failed(tier, "look up", key, err)
        return False

    def put(self, key: CacheEngineKey, obj: MemoryObj) -> int:
        """Hand `obj` to every tier; the number of tiers that took it. Each tier skips a chunk it
        holds or is writing by what it knows locally: asking `contains` here cost the remote tier
        a round trip per chunk on top of the one the store's own `contains` had just made."""
        taken = 0
        for tier in self._tiers:
            try:
                tier.submit_put_task(key, obj)
                taken += 1
            except Exception as err:
                self._tier_failed(tier, "store", key, err)
        return taken

    def _read(self, tier: StorageBackendInterface, key: CacheEngineKey) -> Optional[MemoryObj]:
        try:
            return tier.get_blocking(key)
        except Exception as err:
            self._tier_failed(tier, "read", key, err)
            return None

    def _lease(self, tier: StorageBackendInterface, keys: Sequence[CacheEngineKey], dtype: torch.dtype) -> Optional[List[Optional[MemoryObj]]]:
        try:
            return tier.lease_in_place(keys, dtype, hold=True)
        except Exception as err:
            self._tier_failed(tier, "read", keys[0], err)
            return [None] * len(keys)

    def _read_many(self, tier: StorageBackendInterface, keys: Sequence[CacheEngineKey]) -> List[Optional[MemoryObj]]:
        try:
            return tier.batched_get_blocking(keys)
        except Exception as err:
            self._tier_failed(tier, "read", keys[0], err)
            return [None] * len(keys)

    def get(self, key: CacheEngineKey, search_range: Optional[Iterable[str]] = None) -> Optional[MemoryObj]:
        """The chunk from the CPU tier, a pin, or the fastest selected lower tier that has it
        (caller owns one reference); a lower-tier hit is promoted into the CPU tier."""
        selected = self._selected(search_range)
        obj = self.get_resident(key, cpu_tier=self._cpu in selected)
        if obj is not None:
            return obj
        for tier in selected:
            if tier is self._cpu:
                continue
            obj = self._read(tier, key)
            if obj is None:
                continue
            if self._cpu in self._tiers:
                self._promote(key, obj)
            return obj
        return None

    def get_resident(self, key: CacheEngineKey, cpu_tier: bool = True) -> Optional[MemoryObj]:
        """The chunk if it is in CPU memory already (CPU tier or a pin), without reading a lower tier."""
        if cpu_tier and self._cpu in self._tiers:
            obj = self._read(self._cpu, key)
            if obj is not None:
                return obj
        return self.pins.get(key)

    def pin_prefix(
        self,
        request_id: str,
        keys: Sequence[CacheEngineKey],
        search_range: Optional[Iterable[str]] = None,
        usable: Optional[Callable[[int, MemoryObj], bool]] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> int:
        """Hold the longest run of leading `keys` in CPU memory for `request_id` (replacing its
        earlier pins); the number of keys pinned. Never raises for a cache problem.

        Chunks already in memory are taken first, so reading the others from slower tiers (which
        allocates, and may evict idle objects) cannot evict a later chunk of the same run; the
        others are read in one batch per tier. A sole tier that hands out its own bytes (the
        node pool) pins them where they are, leased (`lease_in_place`, given the KV `dtype`):
        no copy. A chunk that cannot be read, or that `usable(index, obj)` rejects, ends the run.
        """
        selected = self._selected(search_range)
        held: List[Optional[MemoryObj]] = [self.get_resident(key, cpu_tier=self._cpu in selected) for key in keys]
        sole = self._sole_lower_tier()
        ask = [i for i, obj in enumerate(held) if obj is None]
        if ask and sole in selected and dtype is not None:
            leased = self._lease(sole, [keys[i] for i in ask], dtype)
            if leased is not None:
                for i, obj in zip(ask, leased):
                    held[i] = obj
                selected = []  # what the lease missed is missing
        for tier in selected:
            ask = [i for i, obj in enumerate(held) if obj is None]
            if not ask or tier is self._cpu:
                continue
            for i, obj in zip(ask, self._read_many(tier, [keys[i] for i in ask])):
                if obj is not None and self._cpu in self._tiers:
                    self._promote(keys[i], obj)
                held[i] = obj
        count = len(keys)
        for i, obj in enumerate(held):
            if obj is None or (usable is not None and not usable(i, obj)):
                count = i
                break
        for obj in held[count:]:
            if obj is not None:
                obj.ref_count_down()
        pinned = [(key, obj) for key, obj in zip(keys[:count], held[:count]) if obj is not None]
        assert len(pinned) == count
        return count if self.pins.pin(request_id, pinned) else 0

    def read_ahead(self, keys: Sequence[CacheEngineKey]) -> None:
        """Bring the chunks of `keys` not in CPU memory into the CPU tier from the tiers that read
        many in one exchange (`reads_ahead`: peers), one batch each, so that a retrieve without
        a pinned lookup (the v0 door, CacheBlend's fetch) pays a round trip per request, not per
        chunk. What a tier does not have is left to the retrieve's own reads."""
        tiers = [tier for tier in self._tiers if tier.reads_ahead]
        if not tiers or self._cpu not in self._tiers:
            return
        ask = [key for key in keys if not (self._cpu.contains(key) or self.pins.contains(key))]
        for tier in tiers:
            if not ask:
                return
            missed = []
            for key, obj in zip(ask, self._read_many(tier, ask)):
                if obj is None:
                    missed.append(key)
                    continue
                self._promote(key, obj)
                obj.ref_count_down()
            ask = missed

    def _promote(self, key: CacheEngineKey, obj: MemoryObj) -> None:
        try:
            self._cpu.submit_put_task(key, obj)
        except Exception as err:
            self._tier_failed(self._cpu, "promote", key, err)

    def prefetch(self, key: CacheEngineKey) -> bool:
        """Start bringing `key` into the CPU tier; True if some tier has it (there or on its way)."""
        if (self._cpu in self._tiers and self._cpu.contains(key)) or self.pins.contains(key):
            return True
        for tier in self._tiers:
            if tier is self._cpu:
                continue
            try:
                if tier.contains(key):
                    tier.submit_prefetch_task(key)
                    return True
            except Exception as err:
                self._tier_failed(tier, "prefetch", key, err)
        return False

    def remove(self, key: CacheEngineKey) -> int:
        """Drop `key` from every tier; the number of tiers that had it."""
        removed = 0
        for tier in self._tiers:
            try:
                removed += int(tier.remove(key))
            except Exception as err:
                self._tier_failed(tier, "remove", key, err)
        return removed

    def close(self, timeout_s: Optional[float] = None) -> None:
        """Flush the tiers' pending writes, all at once and each within `timeout_s` (None: each
        tier's own bound; a stalled remote tier must not cost the disk tier its writes), log one
        line with the counts, then release pins and the CPU tier."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.pins.close()
        start = time.monotonic()
        lower = [tier for tier in self._tiers if tier is not self._cpu]
        results: Dict[str, ClosedWrites] = {}

        def close_tier(tier: StorageBackendInterface) -> None:
            try:
                results[tier.tier_name] = tier.close(timeout_s)
            except Exception as err:
                logger.warning("closing tier %s failed: %r", tier.tier_name, err)
                results[tier.tier_name] = ClosedWrites(why=f"close failed: {err!r}")

        # Plain threads: at interpreter exit a ThreadPoolExecutor refuses work.
        closing = [threading.Thread(target=close_tier, args=(tier,), name=f"lmcache-close-{tier.tier_name}")
                   for tier in lower]
        for thread in closing:
            thread.start()
        for thread in closing:
            thread.join()  # each close keeps to `timeout_s`
        self._cpu.close()
        if lower:
            written = sum(r.written for r in results.values())
            unwritten = [f"{r.unwritten} to {name} ({r.why})" for name, r in results.items() if r.unwritten]
            (logger.warning if unwritten else logger.info)(
                "LMCache tiers closed: flushed %d queued puts in %.2f s; %s", written, time.monotonic() - start,
                f"not written: {', '.join(unwritten)}" if unwritten else "none left unwritten")
