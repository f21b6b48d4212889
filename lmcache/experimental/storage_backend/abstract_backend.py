"""The one interface every storage tier (CPU, disk, remote) implements.

The storage manager and the engine only talk to tiers through it, so adding a tier never adds a
branch on a backend's name elsewhere. Reference-count rules (see docs/design.md): a tier that
keeps an object takes its own reference; `get_blocking` hands the caller one reference.
"""

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from lmcache.experimental.holdings import QUIET, Medium, TierHoldings
from lmcache.experimental.memory_management import MemoryObj
from lmcache.utils import CacheEngineKey


# How long a tier's close waits for its queued writes when its caller gives no bound.
TIER_CLOSE_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class ClosedWrites:
    """What a tier's close did with the writes still queued when it began."""

    written: int = 0  # landed (or found stored already) during the close
    unwritten: int = 0  # given up: refused, lost, or still queued at the deadline
    why: str = ""  # why the unwritten were given up ("tier down", "deadline", ...); "" when none were


class StorageBackendInterface(ABC):
    """A place chunks can be put into and read back from, keyed by `CacheEngineKey`.

    A tier reports each chunk it admits or loses to `holdings` (`holdings.py`); the storage
    manager sets it, and until then it reports nowhere.
    """

    holdings: TierHoldings = QUIET
    # Each read costs a round trip, and one exchange reads many chunks (peers): a retrieve without
    # a pinned lookup reads a prefix's chunks from it in one batch (`StorageManager.read_ahead`).
    reads_ahead: bool = False

    @property
    def medium(self) -> Medium:
        """Where the tier keeps chunks (host memory or storage), as routers rank them."""
        return Medium.STORAGE

    def report_holdings_to(self, holdings: TierHoldings) -> None:
        """Report each admit and loss to `holdings` from now on."""
        self.holdings = holdings

    @property
    def tier_name(self) -> str:
        """The name `search_range` uses for this tier (the class name unless overridden)."""
        return type(self).__name__

    @property
    def used_bytes(self) -> Optional[int]:
        """Bytes the tier holds now (the usage gauge), or None for a tier that cannot tell (remote)."""
        return None

    @abstractmethod
    def contains(self, key: CacheEngineKey) -> bool:
        """Whether `get_blocking(key)` would find the chunk now (stored or still being written)."""

    def batched_contains(self, keys: Sequence[CacheEngineKey]) -> List[bool]:
        """`contains` of each key (a remote tier asks in one round trip)."""
        return [self.contains(key) for key in keys]

    def contains_locally(self, key: CacheEngineKey) -> bool:
        """`contains` from what this process knows, asking no server: a store's test for chunks
        to skip, which runs per chunk while a step may wait for it."""
        return self.contains(key)

    def reserve_in_place(
        self, keys: Sequence[CacheEngineKey], shapes: Sequence[torch.Size], dtype: torch.dtype
    ) -> Optional[List[Optional[MemoryObj]]]:
        """For a tier that can be the engine's memory (the node pool): an object to fill for each
        chunk (None where it has no room), whose put then stores it without a copy. None: this
        tier stores copies of host memory objects."""
        return None

    def lease_in_place(
        self, keys: Sequence[CacheEngineKey], dtype: torch.dtype, hold: bool = False
    ) -> Optional[List[Optional[MemoryObj]]]:
        """For such a tier: each chunk as an object over its own stored bytes, checked (None: a
        miss); the last reference gives them back. None: this tier reads into host memory (or,
        with `hold`, for objects kept until a later load, it holds all it may now)."""
        return None

    @abstractmethod
    def exists_in_put_tasks(self, key: CacheEngineKey) -> bool:
        """Whether a put of `key` was submitted and has not finished yet."""

    @abstractmethod
    def submit_put_task(self, key: CacheEngineKey, obj: MemoryObj) -> None:
        """Keep a copy of `obj` under `key`; takes its own reference. Slow tiers return at once."""

    @abstractmethod
    def submit_prefetch_task(self, key: CacheEngineKey) -> bool:
        """Start bringing `key` into the CPU tier; True when a prefetch was started."""

    @abstractmethod
    def get_blocking(self, key: CacheEngineKey) -> Optional[MemoryObj]:
        """The chunk under `key`, or None on a miss; the caller owns one reference of it."""

    def batched_get_blocking(self, keys: Sequence[CacheEngineKey]) -> List[Optional[MemoryObj]]:
        """`get_blocking` of each key (a remote tier reads them in one pipeline); the caller
        owns one reference of each object."""
        return [self.get_blocking(key) for key in keys]

    @abstractmethod
    def remove(self, key: CacheEngineKey) -> bool:
        """Drop `key` from this tier; True when something was removed."""

    @abstractmethod
    def close(self, timeout_s: Optional[float] = None) -> ClosedWrites:
        """Finish pending writes, waiting at most `timeout_s` (None: the tier's own bound) and giving
        up what is left then, and release the tier's resources."""
