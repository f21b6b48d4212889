"""Page advice for large host buffers: transparent huge pages, and faulting in ahead.

Why: the first touch of every 4 KiB page of a fresh buffer is a fault (the kernel zeroes the
page), and rows spread over tens of MiB miss the TLB on 4 KiB pages. Linux's default THP mode
(`madvise`) gives huge pages only to memory that asks (`MADV_HUGEPAGE`); `MADV_POPULATE_WRITE`
(Linux 5.14+) faults a range in without writing to it, so it is safe while the range is already
being filled. Elsewhere (not Linux, older kernels) both are refused and pages fault on first use.
No torch here: the CPU tier's pool (`host_memory`) and the `lm://` server's arena use it.
"""

from __future__ import annotations

import ctypes
import sys
from typing import Optional

from lmcache.logging import init_logger

logger = init_logger(__name__)

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_MADV_POPULATE_WRITE = 23
# One madvise call per step: a buffer is faulted in front to back, each step a short syscall.
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


def available() -> bool:
    """Whether this platform takes page advice at all."""
    return _madvise is not None


def _advise(address: int, length: int, advice: int) -> bool:
    """`madvise` on `[address, address + length)`; False (never raises) where it is refused."""
    if _madvise is None:
        return False
    return _madvise(address, length, advice) == 0


def advise_huge_pages(address: int, length: int) -> bool:
    """Ask for transparent huge pages on the range (2 MiB aligned for any effect)."""
    return _advise(address, length, _MADV_HUGEPAGE)


def prefault(address: int, length: int) -> bool:
    """Fault the range in, front first, without changing its bytes; False where refused."""
    for offset in range(0, length, _PREFAULT_STEP):
        if not _advise(address + offset, min(_PREFAULT_STEP, length - offset), _MADV_POPULATE_WRITE):
            logger.debug("madvise(MADV_POPULATE_WRITE) refused (kernel < 5.14?): pages fault in on first use")
            return False
    return True
