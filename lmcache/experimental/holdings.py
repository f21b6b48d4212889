"""One stream of what this instance's tiers hold: every admit and every loss, per chunk.

Operations:
- `HoldingsStream.tier(name, medium)`: the `TierHoldings` a tier reports through
  (`admitted(key)`, `lost(key, reason)`, `cleared(reason)`).
- `HoldingsStream.take()`: the events reported since the last take, as one `HoldingsBatch`.

Reporting never blocks on a consumer and never raises: a tier reports from its own threads (the
store, an eviction inside an allocation, a disk writer), so a report is one append to a bounded
queue under a lock. When the queue is full the event is dropped and counted, and the stream
needs a resync: every event still gets its sequence number, so a consumer also sees the gap.
"""

import enum
import threading
from collections import deque
from dataclasses import dataclass
from typing import Deque, Optional, Tuple

from lmcache.utils import CacheEngineKey

# Events held for a consumer that is late; beyond it they are dropped and a resync is asked for.
DEFAULT_MAX_PENDING = 65536


class Change(enum.Enum):
    ADMITTED = "admitted"  # the tier holds the chunk now (a write landed, a promotion)
    LOST = "lost"  # the tier no longer holds it (eviction, failed write, corrupt chunk, remove)
    CLEARED = "cleared"  # the tier lost everything (clear, its store restarted or was removed)


class Medium(enum.Enum):
    """Where a tier keeps chunks, in the terms routers rank them by (vLLM's `medium`)."""

    CPU = "CPU"  # host memory: the CPU tier, the node pool
    STORAGE = "STORAGE"  # local disk, remote stores


@dataclass(frozen=True)
class HoldingEvent:
    seq: int  # 1, 2, ... per stream; a consumer that sees a jump missed events
    change: Change
    tier: str  # the tier's name (`StorageBackendInterface.tier_name`)
    medium: Medium
    key: Optional[CacheEngineKey]  # None for CLEARED
    reason: str  # "store", "eviction", "write failed", "corrupt", "remove", "clear", ...


@dataclass(frozen=True)
class HoldingsBatch:
    events: Tuple[HoldingEvent, ...]  # in sequence order, with gaps where events were dropped
    next_seq: int  # the sequence number the next event will get
    dropped: int  # events dropped (queue full) since the stream started
    resync: bool  # events were dropped since the last take: what a consumer built may be wrong


class HoldingsStream:
    """The bounded queue every tier of one engine reports into."""

    def __init__(self, max_pending: int = DEFAULT_MAX_PENDING) -> None:
        if max_pending <= 0:
            raise ValueError(f"HoldingsStream max_pending must be positive, got {max_pending}")
        self._lock = threading.Lock()
        self._events: Deque[HoldingEvent] = deque()
        self._max_pending = max_pending
        self._next_seq = 1
        self._dropped = 0
        self._resync = False

    def tier(self, name: str, medium: Medium) -> "TierHoldings":
        return TierHoldings(self, name, medium)

    def report(self, change: Change, tier: str, medium: Medium, key: Optional[CacheEngineKey], reason: str) -> None:
        with self._lock:
            event = HoldingEvent(self._next_seq, change, tier, medium, key, reason)
            self._next_seq += 1
            if len(self._events) >= self._max_pending:
                self._dropped += 1
                self._resync = True
                return
            self._events.append(event)

    def take(self) -> HoldingsBatch:
        """Everything reported since the last take; the resync flag is handed over with it."""
        with self._lock:
            events = tuple(self._events)
            self._events.clear()
            batch = HoldingsBatch(events, self._next_seq, self._dropped, self._resync)
            self._resync = False
            return batch


class TierHoldings:
    """One tier's handle on the stream; the default handle (`QUIET`) reports nowhere."""

    def __init__(self, stream: Optional[HoldingsStream], tier: str, medium: Medium) -> None:
        self._stream = stream
        self._tier = tier
        self._medium = medium

    def admitted(self, key: CacheEngineKey, reason: str = "store") -> None:
        if self._stream is not None:
            self._stream.report(Change.ADMITTED, self._tier, self._medium, key, reason)

    def lost(self, key: CacheEngineKey, reason: str) -> None:
        if self._stream is not None:
            self._stream.report(Change.LOST, self._tier, self._medium, key, reason)

    def cleared(self, reason: str) -> None:
        if self._stream is not None:
            self._stream.report(Change.CLEARED, self._tier, self._medium, None, reason)


QUIET = TierHoldings(None, "", Medium.STORAGE)
