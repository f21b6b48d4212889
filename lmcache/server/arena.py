"""The `lm://` server's value memory: one anonymous mapping as large as the store, reused.

Why: a put received into fresh memory pays a page fault (the kernel zeroing the page) for every
page before its payload lands; on a server beside the engine that work competes with the model
for the same cores (issue 12: about 1.5% of serving throughput with no reuse). Values live in
blocks of one mapping instead: a block given back when its entry is evicted keeps its pages, so
the next put writes only its payload; with `prefault`, an idle-priority thread faults the whole
mapping in at start (`--prefault`), so no put ever faults. Pages nobody touched cost nothing.

With `shared`, the mapping is a sealed memfd instead (`--unix-socket`): the server hands its
descriptor to clients on the same machine (`pool.py`), which read and write values in place.
Sealed against shrinking, so no client can truncate it under the server (or another client).

Blocks come from a first-fit free list (`lmcache.free_list`), rounded up to `ALIGN`, so a store
of many tiny values holds a few less than its byte count says (the store evicts until a block
fits). Not thread-safe: the store's lock guards it.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
from typing import Optional

from lmcache import page_advice
from lmcache.free_list import FreeList
from lmcache.logging import init_logger

logger = init_logger(__name__)

# Blocks start on cache lines; large values land on huge pages whatever their alignment.
ALIGN = 64


class ValueArena:
    """`capacity` bytes of value memory (rounded up to `ALIGN`), handed out in blocks."""

    def __init__(self, capacity: int, shared: bool = False) -> None:
        if capacity <= 0:
            raise ValueError(f"arena capacity must be positive, got {capacity}")
        self.capacity = -(-capacity // ALIGN) * ALIGN
        # The memfd of a shared arena (kept open: every client gets a duplicate); else None.
        self.fd: Optional[int] = None
        if shared:
            self.fd = shared_memory_fd(self.capacity)
            self._map = mmap.mmap(self.fd, self.capacity, flags=mmap.MAP_SHARED)
        else:
            self._map = mmap.mmap(-1, self.capacity, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._view = memoryview(self._map)
        self._address = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self._free = FreeList(self.capacity)
        self.used_bytes = 0
        page_advice.advise_huge_pages(self._address, self.capacity)

    @staticmethod
    def block_size(nbytes: int) -> int:
        """What a value of `nbytes` takes of the arena."""
        return max(ALIGN, -(-nbytes // ALIGN) * ALIGN)

    def take(self, nbytes: int) -> Optional[int]:
        """The start of a block for `nbytes`, or None when no free region is large enough."""
        size = self.block_size(nbytes)
        start = self._free.take(size)
        if start is not None:
            self.used_bytes += size
        return start

    def view(self, start: int, nbytes: int) -> memoryview:
        """The first `nbytes` of the block at `start`."""
        return self._view[start : start + nbytes]

    def give_back(self, start: int, nbytes: int) -> None:
        """Return the block taken for `nbytes` at `start` (its pages stay faulted in)."""
        size = self.block_size(nbytes)
        self._free.give_back(start, size)
        self.used_bytes -= size

    def prefault_in_background(self) -> None:
        """Fault the whole mapping in on an idle-priority thread (its bytes are left as they are,
        so puts may land meanwhile); logs when it is done."""
        logger.info("faulting in the store's %.2f GiB in the background (--prefault)", self.capacity / (1 << 30))
        gib = self.capacity / (1 << 30)
        page_advice.BackgroundPrefault(self._address, self.capacity, "lmcache-server-prefault",
                                       on_end=lambda done, seconds: self._prefaulted(done, seconds, gib)).start()

    def close(self) -> None:
        """Close the memfd (mappings made from it stay valid)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    @staticmethod
    def _prefaulted(done: bool, seconds: float, gib: float) -> None:
        if done:
            logger.info("the store's memory is faulted in (%.1f s, %.2f s/GiB)", seconds, seconds / max(gib, 1e-9))
        else:
            logger.warning("could not fault the store's memory in ahead (needs Linux 5.14+): "
                           "pages fault in on first use")


# Seals every shared arena carries: its size is fixed for good (a shrink would SIGBUS readers).
ARENA_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def shared_memory_fd(size: int) -> int:
    """An anonymous memfd of `size` bytes, sealed at that size (Linux 3.17+)."""
    if not hasattr(os, "memfd_create"):
        raise OSError("the node pool (--unix-socket) needs Linux: this system has no memfd_create")
    fd = os.memfd_create("lmcache-pool", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, ARENA_SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd
