"""Counters of what the cache engine and its tiers did, and the snapshots that report them.

Most numbers only grow; the pin gauges (`live_pins`, `pinned_requests`) are set to the pin
registry's current state.

The counters are bumped from the serving thread and from the tiers' background threads, so each
holder guards its numbers with a lock; readers get a frozen snapshot dataclass, never live state.
"""

import threading
from dataclasses import dataclass, field, fields
from typing import Dict, Mapping


@dataclass(frozen=True)
class TierStatsSnapshot:
    """One tier's traffic since the engine started."""

    chunks_written: int = 0  # chunks the tier finished storing
    bytes_written: int = 0  # payload bytes of those chunks
    chunks_read: int = 0  # chunks served by get_blocking
    bytes_read: int = 0
    evicted_chunks: int = 0  # chunks dropped to make room
    evicted_bytes: int = 0
    errors: int = 0  # failed reads/writes and rejected (corrupt, foreign) chunks
    rejected_chunks: int = 0  # of those errors, chunks whose bytes failed the integrity checks
    auth_refusals: int = 0  # pushes and handshakes refused for a missing or wrong token (PD receiver)


@dataclass(frozen=True)
class EngineStatsSnapshot:
    """The engine's counters plus one `TierStatsSnapshot` per tier name ("Hot", class names)."""

    retrieve_requests: int = 0  # calls of retrieve()
    store_requests: int = 0  # calls of store()
    lookup_requests: int = 0  # calls of lookup()
    retrieve_requested_tokens: int = 0  # tokens retrieve() was asked for (mask True)
    retrieve_hit_tokens: int = 0  # tokens retrieve() loaded
    lookup_requested_tokens: int = 0
    lookup_hit_tokens: int = 0
    store_requested_tokens: int = 0  # tokens store() was asked for (mask True)
    stored_tokens: int = 0  # tokens newly stored
    store_skipped_tokens: int = 0  # tokens whose chunk was already cached
    store_dropped_tokens: int = 0  # tokens not stored: memory full or a tier failed
    pin_failed_tokens: int = 0  # tokens a pinned lookup found in a tier but could not pin (read or memory failed)
    live_pins: int = 0  # gauge: (request, chunk) pins held right now; 0 once every request loaded or ended
    pinned_requests: int = 0  # gauge: request ids holding pins right now
    tiers: Mapping[str, TierStatsSnapshot] = field(default_factory=dict)

    @property
    def evicted_chunks(self) -> int:
        return sum(t.evicted_chunks for t in self.tiers.values())

    @property
    def evicted_bytes(self) -> int:
        return sum(t.evicted_bytes for t in self.tiers.values())

    @property
    def retrieve_hit_rate(self) -> float:
        """Share of requested tokens that retrieve() loaded (0.0 before any request)."""
        if self.retrieve_requested_tokens == 0:
            return 0.0
        return self.retrieve_hit_tokens / self.retrieve_requested_tokens


class TierStats:
    """Thread-safe counters of one tier."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Dict[str, int] = {f.name: 0 for f in fields(TierStatsSnapshot)}

    def _add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._counts[name] += delta

    def record_write(self, nbytes: int) -> None:
        self._add(chunks_written=1, bytes_written=nbytes)

    def record_read(self, nbytes: int) -> None:
        self._add(chunks_read=1, bytes_read=nbytes)

    def record_eviction(self, nbytes: int) -> None:
        self._add(evicted_chunks=1, evicted_bytes=nbytes)

    def record_error(self) -> None:
        self._add(errors=1)

    def record_rejected(self) -> None:
        """A chunk whose header, checksum, key or geometry did not match: an integrity miss."""
        self._add(errors=1, rejected_chunks=1)

    def record_auth_refusal(self) -> None:
        """A peer refused for its token (none, a wrong one, or a push not signed by its session)."""
        self._add(auth_refusals=1)

    def snapshot(self) -> TierStatsSnapshot:
        with self._lock:
            return TierStatsSnapshot(**self._counts)


class EngineStats:
    """Thread-safe counters of one engine and a `TierStats` per tier name."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Dict[str, int] = {f.name: 0 for f in fields(EngineStatsSnapshot) if f.name != "tiers"}
        self._tiers: Dict[str, TierStats] = {}

    def tier(self, name: str) -> TierStats:
        """The counters of tier `name`, created on first use."""
        with self._lock:
            if name not in self._tiers:
                self._tiers[name] = TierStats()
            return self._tiers[name]

    def _add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._counts[name] += delta

    def record_retrieve(self, requested: int, hit: int) -> None:
        self._add(retrieve_requests=1, retrieve_requested_tokens=requested, retrieve_hit_tokens=hit)

    def record_lookup(self, requested: int, hit: int) -> None:
        self._add(lookup_requests=1, lookup_requested_tokens=requested, lookup_hit_tokens=hit)

    def record_pin_failure(self, tokens: int) -> None:
        self._add(pin_failed_tokens=tokens)

    def set_pins(self, live_pins: int, pinned_requests: int) -> None:
        """Set the pin gauges (the pin registry calls this on every change)."""
        with self._lock:
            self._counts["live_pins"] = live_pins
            self._counts["pinned_requests"] = pinned_requests

    def record_store(self, requested: int, stored: int, skipped: int, dropped: int) -> None:
        self._add(
            store_requests=1,
            store_requested_tokens=requested,
            stored_tokens=stored,
            store_skipped_tokens=skipped,
            store_dropped_tokens=dropped,
        )

    def snapshot(self) -> EngineStatsSnapshot:
        with self._lock:
            counts = dict(self._counts)
            tiers = dict(self._tiers)
        return EngineStatsSnapshot(tiers={name: t.snapshot() for name, t in tiers.items()}, **counts)
