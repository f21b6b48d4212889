"""The recorder: this instance's local holdings, kept true in the lookup records.

One background thread takes the holdings stream's `p2p` queue (`holdings.py`: every admit and
loss of every tier, bounded) when something arrives (gathering for `POLL_S`), or every
`IDLE_TICK_S` for its heartbeat, and for the local tiers (those the peer server
serves: CPU and disk) writes a record for each chunk admitted and withdraws the record of each
chunk no local tier holds any more. Nothing here runs on the request path: a store only appends
to the stream.

Whenever the records may have drifted from the truth - events dropped (the queue was full),
Redis unreachable while events went by, a local tier cleared, the live key lapsed - the
recorder resyncs: it starts a new epoch (setting the live key first makes every old record
stale at once) and records every chunk the local tiers list. Every half `RECORD_TTL_S` it
records them all again under the same epoch, which renews the records' TTLs.
"""

from __future__ import annotations

import threading
import time
from typing import Dict, List, Optional, Sequence

from lmcache.background_threads import prepared
from lmcache.experimental.holdings import P2P, Change, HoldingEvent, HoldingsStream
from lmcache.experimental.p2p.records import HEARTBEAT_S, RECORD_TTL_S, Holder, LookupDown, LookupRecords, new_epoch
from lmcache.experimental.storage_backend.storage_manager import StorageManager
from lmcache.logging import init_logger
from lmcache.utils import CacheEngineKey

logger = init_logger(__name__)

POLL_S = 0.02
IDLE_TICK_S = 0.5


class HoldingsRecorder:
    """Records the local tiers' chunks under `url` (this instance's peer server)."""

    def __init__(self, records: LookupRecords, holdings: HoldingsStream, storage: StorageManager, url: str) -> None:
        self._records = records
        self._holdings = holdings
        self._storage = storage
        self._local = storage.local_tier_names
        self.holder = Holder(url, new_epoch())
        self._resync_due = True  # the first pass records what the tiers hold at start
        self._next_heartbeat = 0.0
        self._next_refresh = 0.0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        self._thread = threading.Thread(target=prepared(self._run, "lmc-p2p-record", background=True),
                                        name="lmcache-p2p-recorder", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            if self._holdings.wait(P2P, IDLE_TICK_S):
                self._stop.wait(POLL_S)  # the rest of a store's chunks join this pass
            if self._stop.is_set():
                return
            self.step()

    def step(self) -> None:
        """One pass: take the events, then heartbeat, resync or apply them as due."""
        batch = self._holdings.take(P2P)
        events = [e for e in batch.events if e.tier in self._local]
        if batch.resync or any(e.change == Change.CLEARED for e in events):
            self._resync_due = True
        now = time.monotonic()
        try:
            if now >= self._next_heartbeat:
                if not self._records.heartbeat(self.holder) and not self._resync_due:
                    logger.info("peer-to-peer live key of %s had lapsed: recording every chunk again", self.holder.url)
                    self._resync_due = True
                self._next_heartbeat = now + HEARTBEAT_S
            if self._resync_due:
                self._resync()
                return
            if events:
                self._apply(events)
            if now >= self._next_refresh:
                self._record_all()
        except LookupDown:
            self._resync_due = True  # what went by meanwhile is lost: start over when Redis is back

    def _resync(self) -> None:
        """A new epoch (every record of the old one is stale at once), then everything held."""
        self.holder = Holder(self.holder.url, new_epoch())
        self._records.heartbeat(self.holder)
        self._record_all()
        self._resync_due = False

    def _record_all(self) -> None:
        """Record every chunk the local tiers list (which renews the records' TTLs)."""
        keys = [key for keys in self._storage.listed_keys().values() for key in keys]
        self._records.publish(dict.fromkeys(keys), self.holder)
        self._next_refresh = time.monotonic() + RECORD_TTL_S / 2
        logger.debug("peer-to-peer records of %s: epoch %s, %d chunks", self.holder.url, self.holder.epoch, len(keys))

    def _apply(self, events: Sequence[HoldingEvent]) -> None:
        last: Dict[CacheEngineKey, Change] = {}
        for event in events:
            if event.key is not None:
                last[event.key] = event.change
        held = {key: self._storage.contains(key, self._local) for key in last}
        admitted = [key for key, change in last.items() if change == Change.ADMITTED and held[key]]
        gone: List[CacheEngineKey] = [key for key in last if not held[key]]
        if admitted:
            self._records.publish(admitted, self.holder)
        if gone:
            self._records.forget(gone, [self.holder] * len(gone))

    def close(self) -> None:
        """Stop, and drop the live key: every record of this run is stale at once."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            self._records.retire(self.holder)
        except LookupDown:
            pass  # the live key expires on its own
        self._records.close()
