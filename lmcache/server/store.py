"""The `lm://` server's memory: a byte-bounded LRU map from key bytes to value bytes.

Thread-safe (one lock; every operation is a dict update, the bytes are never copied under it).
Every value lives in the store's arena (`arena.py`), whose pages are reused once its entry goes,
so the store's memory stays within its size: a put's payload is received into a `Reservation`
of it, or - where the arena's share for puts still arriving is taken - into a buffer of its own
that is copied in when stored. A reader holds a `Lease` while it sends a value, so an entry
replaced or evicted meanwhile keeps its memory until the last reader is done.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Optional, Union

from lmcache.server.arena import ValueArena

Value = Union[bytes, bytearray, memoryview]


@dataclass
class StoreStats:
    """Counters since start; `bytes_used` counts keys and values."""

    entries: int = 0
    bytes_used: int = 0
    max_bytes: int = 0
    puts: int = 0
    refused_puts: int = 0
    # Payloads received outside the arena (its share for puts still arriving taken, or no room):
    # each paid for fresh memory and a copy into the arena.
    puts_outside_arena: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    deletes: int = 0

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass(eq=False)
class _Entry:
    value: memoryview
    size: int  # key + value bytes
    block: Optional[int]  # start of its arena block; None once given back
    readers: int = 0
    dropped: bool = False


@dataclass(eq=False)
class Reservation:
    """Arena memory for one put's payload, not yet stored: fill `view`, then `put` or `cancel`."""

    view: memoryview
    block: int


class Lease:
    """A stored value held for reading (`with store.get(k) as view:`); its memory is not reused
    before `release()`."""

    def __init__(self, store: "LRUChunkStore", entry: _Entry) -> None:
        self._store = store
        self._entry: Optional[_Entry] = entry
        self.view = entry.value
        # Where the value starts in the store's arena (what a pool client reads in place).
        assert entry.block is not None  # a leased entry keeps its block until its last release
        self.block = entry.block

    def release(self) -> None:
        if self._entry is not None:
            self._store._release(self._entry)
            self._entry = None

    def __enter__(self) -> memoryview:
        return self.view

    def __exit__(self, *exc: object) -> None:
        self.release()


class LRUChunkStore:
    """Holds at most `max_bytes` of keys + values; the least recently used entries go first.

    At most `max_unfinished_bytes` of the arena is reserved for puts still arriving, so peers
    that announce payloads and never send them keep little of it from the others."""

    def __init__(self, max_bytes: int, max_unfinished_bytes: Optional[int] = None, shared: bool = False) -> None:
        """`shared`: the arena is a memfd that pool clients map (`arena.py`)."""
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self._max_bytes = max_bytes
        self._max_unfinished = max_bytes if max_unfinished_bytes is None else max_unfinished_bytes
        self.arena = ValueArena(max_bytes, shared=shared)
        self._unfinished = 0
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self._lock = threading.Lock()
        self._stats = StoreStats(max_bytes=max_bytes)

    @property
    def max_bytes(self) -> int:
        return self._max_bytes

    def fits(self, key_len: int, value_len: int) -> bool:
        """Whether an entry of this size could ever be stored (even in an empty store)."""
        return key_len + value_len <= self._max_bytes

    def reserve(self, nbytes: int) -> Optional[Reservation]:
        """Arena memory for a payload of `nbytes` about to arrive, evicting least recently used
        entries while no free region is large enough; None when the arena cannot hold it now (the
        caller receives the payload into a buffer of its own, copied in by `put`)."""
        return self._reserve(nbytes, arriving=True)

    def _reserve(self, nbytes: int, arriving: bool) -> Optional[Reservation]:
        with self._lock:
            if arriving and self._unfinished + ValueArena.block_size(nbytes) > self._max_unfinished:
                self._stats.puts_outside_arena += 1
                return None
            start = self.arena.take(nbytes)
            while start is None and self._entries:
                self._evict_oldest()
                start = self.arena.take(nbytes)
            if start is None:  # what is left is held by readers or by puts still arriving
                if arriving:
                    self._stats.puts_outside_arena += 1
                return None
            self._unfinished += ValueArena.block_size(nbytes)
            return Reservation(self.arena.view(start, nbytes), start)

    def cancel(self, reservation: Reservation) -> None:
        """Give back a reservation whose put did not arrive whole."""
        with self._lock:
            self._finish(reservation)
            self.arena.give_back(reservation.block, reservation.view.nbytes)

    def put(self, key: bytes, value: Union[Value, Reservation]) -> bool:
        """Store `value` (a filled reservation, or a buffer copied into the arena), evicting LRU
        entries as needed; False if it can never fit, or the arena has no room for a buffer now
        (what is left of it is being read or received). A refused reservation is given back."""
        if isinstance(value, Reservation):
            reservation = value
        else:
            reservation = self._copy_in(len(key), memoryview(value))
            if reservation is None:
                return False
        view = reservation.view
        size = len(key) + view.nbytes
        with self._lock:
            self._finish(reservation)
            if size > self._max_bytes:
                self._stats.refused_puts += 1
                self.arena.give_back(reservation.block, view.nbytes)
                return False
            old = self._entries.pop(key, None)
            if old is not None:
                self._drop(old)
            while self._entries and self._stats.bytes_used + size > self._max_bytes:
                self._evict_oldest()
            self._entries[key] = _Entry(view, size, reservation.block)
            self._stats.bytes_used += size
            self._stats.puts += 1
            self._stats.entries = len(self._entries)
            return True

    def get(self, key: bytes) -> Optional[Lease]:
        """The value, leased for reading (and marked recently used), or None."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self._stats.misses += 1
                return None
            self._entries.move_to_end(key)
            self._stats.hits += 1
            entry.readers += 1
            return Lease(self, entry)

    def exists(self, key: bytes) -> bool:
        """Whether `key` is stored; a lookup also counts as a use for LRU order."""
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return True
            return False

    def delete(self, key: bytes) -> bool:
        with self._lock:
            old = self._entries.pop(key, None)
            if old is None:
                return False
            self._drop(old)
            self._stats.deletes += 1
            self._stats.entries = len(self._entries)
            return True

    def stats(self) -> StoreStats:
        """A snapshot of the counters."""
        with self._lock:
            return StoreStats(**asdict(self._stats))

    def _copy_in(self, key_len: int, view: memoryview) -> Optional[Reservation]:
        """A reservation holding a copy of `view`, or None (the put refused and counted)."""
        reservation = self._reserve(view.nbytes, arriving=False) if self.fits(key_len, view.nbytes) else None
        if reservation is None:
            with self._lock:
                self._stats.refused_puts += 1
            return None
        reservation.view[:] = view.cast("B")
        return reservation

    # ---- under the lock -------------------------------------------------------------------

    def _finish(self, reservation: Reservation) -> None:
        self._unfinished -= ValueArena.block_size(reservation.view.nbytes)

    def _evict_oldest(self) -> None:
        _, old = self._entries.popitem(last=False)
        self._drop(old)
        self._stats.evictions += 1
        self._stats.entries = len(self._entries)

    def _drop(self, entry: _Entry) -> None:
        """`entry` has left the map: its bytes no longer count, its block goes back once unread."""
        self._stats.bytes_used -= entry.size
        entry.dropped = True
        if entry.readers == 0:
            self._free_block(entry)

    def _free_block(self, entry: _Entry) -> None:
        if entry.block is not None:
            self.arena.give_back(entry.block, entry.value.nbytes)
            entry.block = None

    def _release(self, entry: _Entry) -> None:
        with self._lock:
            entry.readers -= 1
            if entry.dropped and entry.readers == 0:
                self._free_block(entry)
