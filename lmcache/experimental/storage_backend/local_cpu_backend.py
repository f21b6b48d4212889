"""The CPU tier ("Hot" in `search_range`): memory objects kept in host RAM, evicted LRU.

It also owns allocation for the whole engine. The engine has one allocator of
`max_local_cpu_size` GB; when it is full, this tier frees least recently used objects that nobody
else holds (an object whose only reference is the tier's own) until the allocation fits. Objects
in use - being copied to a connector, waiting for a disk/remote write, or pinned by a lookup
(`pins.py`) - are never evicted.
"""

import math
import threading
from collections import OrderedDict
from concurrent.futures import Future
from typing import Any, List, Optional, Tuple

import torch

from lmcache.experimental.holdings import Medium
from lmcache.experimental.memory_management import MemoryAllocatorInterface, MemoryFormat, MemoryObj
from lmcache.experimental.stats import TierStats
from lmcache.experimental.storage_backend.abstract_backend import ClosedWrites, StorageBackendInterface
from lmcache.logging import init_logger
from lmcache.utils import CacheEngineKey

logger = init_logger(__name__)


class LocalCPUBackend(StorageBackendInterface):
    """LRU map of key -> memory object, plus allocation with eviction.

    With `keep_objects=False` (config `local_cpu: false`) the tier stores nothing and only
    allocates: lower tiers still need host memory to stage their reads and writes.
    """

    def __init__(
        self,
        memory_allocator: MemoryAllocatorInterface,
        keep_objects: bool = True,
        stats: Optional[TierStats] = None,
    ) -> None:
        self._allocator = memory_allocator
        self._keep = keep_objects
        self._stats = stats if stats is not None else TierStats()
        # Guards the map and every allocate/free made through this tier.
        self._lock = threading.RLock()
        self._objs: "OrderedDict[CacheEngineKey, MemoryObj]" = OrderedDict()

    @property
    def tier_name(self) -> str:
        return "Hot"

    @property
    def medium(self) -> Medium:
        return Medium.CPU

    @property
    def used_bytes(self) -> int:
        return self._allocator.used_bytes

    @property
    def memory_allocator(self) -> MemoryAllocatorInterface:
        return self._allocator

    @property
    def keeps_objects(self) -> bool:
        return self._keep

    def __len__(self) -> int:
        with self._lock:
            return len(self._objs)

    def keys(self) -> List[CacheEngineKey]:
        """The stored keys, least recently used first."""
        with self._lock:
            return list(self._objs)

    def contains(self, key: CacheEngineKey) -> bool:
        with self._lock:
            return key in self._objs

    def exists_in_put_tasks(self, key: CacheEngineKey) -> bool:
        # Puts into RAM are synchronous: nothing is ever pending.
        return False

    def submit_put_task(self, key: CacheEngineKey, obj: MemoryObj) -> None:
        if not self._keep:
            return
        with self._lock:
            if key in self._objs:
                self._objs.move_to_end(key)
                return
            obj.ref_count_up()
            self._objs[key] = obj
        self._stats.record_write(obj.get_size())
        self.holdings.admitted(key)

    def submit_prefetch_task(self, key: CacheEngineKey) -> bool:
        # This is the prefetch destination; there is nothing faster to bring a chunk into.
        return False

    def get_blocking(self, key: CacheEngineKey) -> Optional[MemoryObj]:
        with self._lock:
            obj = self._objs.get(key)
            if obj is None:
                return None
            self._objs.move_to_end(key)
            obj.ref_count_up()
        self._stats.record_read(obj.get_size())
        return obj

    def get_after_prefetch(self, prefetch: Optional["Future[Any]"], key: CacheEngineKey) -> Optional[MemoryObj]:
        """For a slower tier asked for `key` while its own prefetch of it is in flight: wait for
        that prefetch and serve the chunk from here, so it is never read twice (None: there was
        no prefetch, or it brought nothing; the tier then reads the chunk itself)."""
        if prefetch is None:
            return None
        prefetch.result()
        return self.get_blocking(key)

    def remove(self, key: CacheEngineKey) -> bool:
        with self._lock:
            obj = self._objs.pop(key, None)
            if obj is None:
                return False
            obj.ref_count_down()
        self.holdings.lost(key, "remove")
        return True

    def allocate(
        self,
        shape: torch.Size,
        dtype: Optional[torch.dtype],
        fmt: MemoryFormat = MemoryFormat.KV_BLOB,
    ) -> Optional[MemoryObj]:
        """A new object (caller owns its one reference), evicting idle LRU objects if needed.

        Returns None when even evicting every idle object does not make room.
        """
        wanted = math.prod(shape) * (dtype.itemsize if dtype is not None else 1)
        with self._lock:
            obj = self._allocator.allocate(shape, dtype, fmt)
            while obj is None:
                freed = 0
                # Free at least the wanted size before retrying: fewer failed allocate calls.
                while freed < wanted:
                    nbytes = self._evict_one()
                    if nbytes is None:
                        break
                    freed += nbytes
                if freed == 0:
                    logger.debug("CPU tier full: cannot allocate %s %s, nothing idle to evict", shape, dtype)
                    return None
                obj = self._allocator.allocate(shape, dtype, fmt)
            return obj

    def _evict_one(self) -> Optional[int]:
        """Free the least recently used object only this tier holds; its size, or None."""
        victim: Optional[Tuple[CacheEngineKey, MemoryObj]] = None
        for key, obj in self._objs.items():
            if obj.get_ref_count() <= 1:
                victim = (key, obj)
                break
        if victim is None:
            return None
        key, obj = victim
        del self._objs[key]
        nbytes = obj.get_size()
        obj.ref_count_down()
        self._stats.record_eviction(nbytes)
        self.holdings.lost(key, "eviction")
        return nbytes

    def close(self, timeout_s: Optional[float] = None) -> ClosedWrites:
        """Release every object (writes here are done when `submit_put_task` returns)."""
        with self._lock:
            objs = list(self._objs.values())
            self._objs.clear()
            for obj in objs:
                obj.ref_count_down()
        if objs:
            self.holdings.cleared("close")
        return ClosedWrites()
