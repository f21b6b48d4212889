"""One stream of what this instance's tiers hold: every admit and every loss, per chunk.

Operations:
- `HoldingsStream(consumers=...)`: one bounded queue per consumer named at construction (the KV
  events publisher, the controller client), so each sees every event, none steals another's,
  and none misses what the tiers report while the engine starts (a disk tier's "found at start").
- `HoldingsStream.tier(name, medium)`: the `TierHoldings` a tier reports through
  (`admitted(key)`, `lost(key, reason)`, `cleared(reason)`).
- `HoldingsStream.take(consumer)`: the events reported since that consumer's last take, as one
  `HoldingsBatch` (the default consumer is the KV events publisher's).

Reporting never blocks on a consumer and never raises: a tier reports from its own threads (the
store, an eviction inside an allocation, a disk writer), so a report is one append per consumer
to a bounded queue under a lock. When a consumer's queue is full the event is dropped for it and
counted, and that consumer needs a resync: every event still gets its sequence number, so the
consumer also sees the gap. A slow consumer costs the others nothing.
"""

import enum
import threading
from collections import deque
from dataclasses import dataclass
from typing import Deque, Dict, Optional, Sequence, Tuple

from lmcache.utils import CacheEngineKey

# Events held for a consumer that is late; beyond it they are dropped and a resync is asked for.
DEFAULT_MAX_PENDING = 65536
# The consumers' names: the KV events publisher (`integration/vllm/kv_events.py`), the
# controller client (`lmcache/controller/worker.py`) and the peer-to-peer recorder (`p2p/recorder.py`).
KV_EVENTS = "kv_events"
CONTROLLER = "controller"
P2P = "p2p"


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
    dropped: int  # events dropped for this consumer (its queue full) since the stream started
    resync: bool  # events were dropped since this consumer's last take: what it built may be wrong


class _Queue:
    """One consumer's pending events, its count of drops and its resync flag."""

    def __init__(self) -> None:
        self.events: Deque[HoldingEvent] = deque()
        self.dropped = 0
        self.resync = False


class HoldingsStream:
    """The bounded queues every tier of one engine reports into, one per consumer."""

    def __init__(self, max_pending: int = DEFAULT_MAX_PENDING, consumers: Sequence[str] = (KV_EVENTS,)) -> None:
        if max_pending <= 0:
            raise ValueError(f"HoldingsStream max_pending must be positive, got {max_pending}")
        if not consumers or len(set(consumers)) != len(consumers):
            raise ValueError(f"HoldingsStream consumers must be distinct names, at least one, got {list(consumers)}")
        self._lock = threading.Lock()
        # Wakes consumers blocked in `wait` when something is reported (shares the one lock).
        self._arrived = threading.Condition(self._lock)
        self._queues: Dict[str, _Queue] = {name: _Queue() for name in consumers}
        self._max_pending = max_pending
        self._next_seq = 1

    @property
    def consumers(self) -> Tuple[str, ...]:
        return tuple(self._queues)

    def tier(self, name: str, medium: Medium) -> "TierHoldings":
        return TierHoldings(self, name, medium)

    def report(self, change: Change, tier: str, medium: Medium, key: Optional[CacheEngineKey], reason: str) -> None:
        with self._lock:
            event = HoldingEvent(self._next_seq, change, tier, medium, key, reason)
            self._next_seq += 1
            for queue in self._queues.values():
                if len(queue.events) >= self._max_pending:
                    queue.dropped += 1
                    queue.resync = True
                else:
                    queue.events.append(event)
            self._arrived.notify_all()

    def wait(self, consumer: str, timeout_s: float) -> bool:
        """Block until `consumer` has something to take (events, or a resync to ask for), at most
        `timeout_s`; True if it has. Lets a consumer sleep while nothing changes instead of
        waking on a short timer (a 10 ms timer cost the controller client ~1% of a core)."""
        with self._arrived:
            queue = self._queues[consumer]
            return self._arrived.wait_for(lambda: bool(queue.events) or queue.resync, timeout_s)

    def take(self, consumer: str = KV_EVENTS) -> HoldingsBatch:
        """Everything reported since `consumer`'s last take; its resync flag is handed over with it."""
        with self._lock:
            queue = self._queues.get(consumer)
            if queue is None:
                raise KeyError(f"HoldingsStream has no consumer {consumer!r} (has {list(self._queues)})")
            events = tuple(queue.events)
            queue.events.clear()
            batch = HoldingsBatch(events, self._next_seq, queue.dropped, queue.resync)
            queue.resync = False
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
