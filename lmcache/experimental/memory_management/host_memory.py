"""Host memory for the allocators' pools: 2 MiB aligned, on transparent huge pages where the
kernel allows, and faulted in by a background thread.

Why: a chunk copy touches the pool in head-sized rows spread over tens of MiB. On 4 KiB pages
the first touch of every page is a fault and the TLB misses on every row; on this project's
machine that held the engine's CPU-tier store at 2.5 GB/s and retrieve at 3 GB/s, against
11-15 GB/s on huge pages faulted in ahead (docs/design.md, "Where the time goes"). Linux's
default THP mode (`madvise`) gives huge pages only to memory that asks for them, which is what
`madvise(MADV_HUGEPAGE)` does here. `MADV_POPULATE_WRITE` (Linux 5.14+) then faults the pool in
without writing to it, so it is safe while objects are already being allocated and filled; the
pool is committed up front, as upstream's pinned pool is. Elsewhere (not Linux, older kernels)
the buffer is plain `torch.empty` memory and the first touch pays as before.
"""

import ctypes
import sys
import threading
from typing import Optional

import torch

from lmcache.background_threads import prepared
from lmcache.logging import init_logger

logger = init_logger(__name__)

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_MADV_POPULATE_WRITE = 23
# One madvise call per step: a pool is faulted in front to back, each step a short syscall.
_PREFAULT_STEP = 64 << 20


def _load_madvise() -> Optional[ctypes._CFuncPtr]:  # type: ignore[name-defined]
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_madvise = _load_madvise()


def _advise(address: int, length: int, advice: int) -> bool:
    """`madvise` on `[address, address + length)`; False (never raises) where it is refused."""
    if _madvise is None:
        return False
    return _madvise(address, length, advice) == 0


def host_buffer(size: int, *, prefault: bool = True) -> torch.Tensor:
    """A flat uint8 host tensor of `size` bytes starting on a 2 MiB boundary, advised to use
    huge pages; with `prefault`, a daemon thread faults it in (front first)."""
    if size < HUGE_PAGE or _madvise is None:
        return torch.empty(size, dtype=torch.uint8)
    raw = torch.empty(size + HUGE_PAGE, dtype=torch.uint8)
    start = (-raw.data_ptr()) % HUGE_PAGE
    buf = raw[start : start + size]
    span = size - size % HUGE_PAGE
    if not _advise(buf.data_ptr(), span, _MADV_HUGEPAGE):
        logger.debug("madvise(MADV_HUGEPAGE) refused for a %d-byte pool: 4 KiB pages", size)
    if prefault:
        threading.Thread(
            target=prepared(_prefault, "lmc-prefault", background=True), args=(buf, span),
            name="lmcache-prefault", daemon=True,
        ).start()
    return buf


def _prefault(buf: torch.Tensor, span: int) -> None:
    """Fault `buf`'s first `span` bytes in without changing them (holds `buf` until done)."""
    base = buf.data_ptr()
    for offset in range(0, span, _PREFAULT_STEP):
        if not _advise(base + offset, min(_PREFAULT_STEP, span - offset), _MADV_POPULATE_WRITE):
            logger.debug("madvise(MADV_POPULATE_WRITE) refused (kernel < 5.14?): pages fault in on first use")
            return
