"""First-fit free list over one buffer's byte offsets (no torch: the `lm://` server uses it too).

    buffer: |#used#|  free  |##used##|####used####|      free      |
    free list (sorted by start): [FreeBlock(a, n), FreeBlock(b, m)]

Blocks are cut off the front of the first free block that fits and merged with their
neighbours when given back. Not thread-safe: its owner's lock guards it.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Optional


@dataclass
class FreeBlock:
    """A free region `[start, start + size)` of a buffer, in bytes."""

    start: int
    size: int


class FreeList:
    """The free regions of a buffer of `size` bytes (all free at first)."""

    def __init__(self, size: int) -> None:
        self._free: list[FreeBlock] = [FreeBlock(0, size)] if size > 0 else []

    def blocks(self) -> list[FreeBlock]:
        """A copy, sorted by start (for checks and debugging)."""
        return [FreeBlock(b.start, b.size) for b in self._free]

    def take(self, size: int) -> Optional[int]:
        """First fit: the start of `size` bytes cut off the first free block that fits, or None."""
        for i, free in enumerate(self._free):
            if free.size >= size:
                start = free.start
                if free.size == size:
                    del self._free[i]
                else:
                    free.start += size
                    free.size -= size
                return start
        return None

    def give_back(self, start: int, size: int) -> None:
        """Insert `[start, start + size)`, merging neighbours; an overlap raises (a double free)."""
        i = bisect.bisect_left(self._free, start, key=lambda b: b.start)
        prev = self._free[i - 1] if i > 0 else None
        nxt = self._free[i] if i < len(self._free) else None
        if prev is not None and prev.start + prev.size > start:
            raise RuntimeError(f"free list corrupted: block at {start} overlaps {prev}")
        if nxt is not None and start + size > nxt.start:
            raise RuntimeError(f"free list corrupted: block at {start} overlaps {nxt}")
        if prev is not None and prev.start + prev.size == start:
            prev.size += size
            if nxt is not None and prev.start + prev.size == nxt.start:
                prev.size += nxt.size
                del self._free[i]
        elif nxt is not None and start + size == nxt.start:
            nxt.start = start
            nxt.size += size
        else:
            self._free.insert(i, FreeBlock(start, size))
