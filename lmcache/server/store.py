"""The `lm://` server's memory: a byte-bounded LRU map from key bytes to value bytes.

Thread-safe (one lock; every operation is a dict update, the bytes are never copied under
it). Values are kept as the buffers they arrived in and never mutated afterwards, so a
reader may keep sending one after it has been replaced or evicted.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Optional, Union

Value = Union[bytes, bytearray, memoryview]


@dataclass
class StoreStats:
    """Counters since start; `bytes_used` counts keys and values."""

    entries: int = 0
    bytes_used: int = 0
    max_bytes: int = 0
    puts: int = 0
    refused_puts: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    deletes: int = 0

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


class LRUChunkStore:
    """Holds at most `max_bytes` of keys + values; the least recently used entries go first."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self._max_bytes = max_bytes
        self._entries: OrderedDict[bytes, Value] = OrderedDict()
        self._lock = threading.Lock()
        self._stats = StoreStats(max_bytes=max_bytes)

    @property
    def max_bytes(self) -> int:
        return self._max_bytes

    def fits(self, key_len: int, value_len: int) -> bool:
        """Whether an entry of this size could ever be stored (even in an empty store)."""
        return key_len + value_len <= self._max_bytes

    def put(self, key: bytes, value: Value) -> bool:
        """Store `value`, evicting LRU entries as needed; False if it can never fit."""
        size = len(key) + memoryview(value).nbytes
        with self._lock:
            if size > self._max_bytes:
                self._stats.refused_puts += 1
                return False
            old = self._entries.pop(key, None)
            if old is not None:
                self._stats.bytes_used -= len(key) + memoryview(old).nbytes
            while self._entries and self._stats.bytes_used + size > self._max_bytes:
                old_key, old_value = self._entries.popitem(last=False)
                self._stats.bytes_used -= len(old_key) + memoryview(old_value).nbytes
                self._stats.evictions += 1
            self._entries[key] = value
            self._stats.bytes_used += size
            self._stats.puts += 1
            self._stats.entries = len(self._entries)
            return True

    def get(self, key: bytes) -> Optional[Value]:
        """The value (and mark it recently used), or None."""
        with self._lock:
            value = self._entries.get(key)
            if value is None:
                self._stats.misses += 1
                return None
            self._entries.move_to_end(key)
            self._stats.hits += 1
            return value

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
            self._stats.bytes_used -= len(key) + memoryview(old).nbytes
            self._stats.deletes += 1
            self._stats.entries = len(self._entries)
            return True

    def stats(self) -> StoreStats:
        """A snapshot of the counters."""
        with self._lock:
            return StoreStats(**asdict(self._stats))
