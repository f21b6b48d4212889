"""Host memory for the allocators' pools: 2 MiB aligned, on transparent huge pages where the
kernel allows, and faulted in ahead of its use by a background thread (`lmcache.page_advice`).

Why: a chunk copy touches the pool in head-sized rows spread over tens of MiB. On 4 KiB pages
the first touch of every page is a fault and the TLB misses on every row; on this project's
machine that held the engine's CPU-tier store at 2.5 GB/s and retrieve at 3 GB/s, against
11-15 GB/s on huge pages faulted in ahead (docs/design.md, "Decisions"). The pool is reserved
up front, as upstream's pinned pool is, and faulted in as its allocator's high-water mark
advances. Where page advice is refused the buffer is plain `torch.empty` memory and the first
touch pays as before.
"""

from typing import Optional

import torch

from lmcache import background_threads, page_advice
from lmcache.logging import init_logger
from lmcache.page_advice import HUGE_PAGE, BackgroundPrefault

logger = init_logger(__name__)

# How far beyond the highest offset its allocator has handed out a pool is kept faulted in, by a
# background thread (at start: its front, which first fit hands out first). Memory never used is
# never faulted in, so RSS grows with use: faulting a default 5 GB pool in whole took a core for
# seconds on a 2-core machine and committed 5 GB per vLLM instance even when the instance only
# stages chunks for a shared pool; a vLLM 0.32 worker doing it was still at it when vLLM shut it
# down and was killed before LMCache closed (tests/latest/test_latest_mp_connector.py). Without
# the part beyond the front, stores past it ran at 0.03-0.04x memcpy on this project's VM.
PREFAULT_AHEAD = 512 << 20


def host_buffer(size: int) -> torch.Tensor:
    """A flat uint8 host tensor of `size` bytes starting on a 2 MiB boundary, advised to use
    huge pages; nothing faulted in yet (`fault_ahead`)."""
    if size < HUGE_PAGE or not page_advice.available():
        return torch.empty(size, dtype=torch.uint8)
    raw = torch.empty(size + HUGE_PAGE, dtype=torch.uint8)
    start = (-raw.data_ptr()) % HUGE_PAGE
    buf = raw[start : start + size]
    if not page_advice.advise_huge_pages(buf.data_ptr(), _span(size)):
        logger.debug("madvise(MADV_HUGEPAGE) refused for a %d-byte pool: 4 KiB pages", size)
    return buf


def fault_ahead(buf: torch.Tensor, whole: bool = False) -> Optional[BackgroundPrefault]:
    """Start a daemon thread that keeps `PREFAULT_AHEAD` bytes of `host_buffer` `buf` faulted in
    beyond the offset last passed to its `reached` (its front at first); None where there are no
    huge pages to fault (a buffer below one, or no page advice).

    With `whole` (the buffer is a cache tier, filled and kept, not a staging pool) it faults the
    whole buffer in at once, front first, where the thread runs at idle priority
    (`background_threads.can_leave_idle`): each first touch of memory the VM never backed costs
    ~2.2 s/GiB on this project's machine, and paid while requests run it cost the no-reuse
    workload 5-6% (issue 43); paid at start it takes only cores the engine leaves idle. At ordinary
    priority it would compete with vLLM's start and forward passes, so there it stays a window."""
    if buf.numel() < HUGE_PAGE or not page_advice.available():
        return None
    span = _span(buf.numel())
    if whole and background_threads.can_leave_idle():
        gib = span / (1 << 30)
        logger.info("faulting in the CPU tier's %.2f GiB in the background", gib)
        return BackgroundPrefault(buf.data_ptr(), span, "lmcache-prefault", owner=buf.untyped_storage(),
                                  on_end=lambda done, seconds: _faulted_in(done, seconds, gib)).start()
    return BackgroundPrefault(buf.data_ptr(), span, "lmcache-prefault", owner=buf.untyped_storage(),
                              ahead=PREFAULT_AHEAD).start()


def _faulted_in(done: bool, seconds: float, gib: float) -> None:
    if done:
        logger.info("the CPU tier's memory is faulted in (%.1f s, %.2f s/GiB)", seconds, seconds / max(gib, 1e-9))
    else:
        logger.warning("could not fault the CPU tier's memory in ahead (needs Linux 5.14+): pages fault in on first use")


def _span(size: int) -> int:
    """The whole huge pages of a `size`-byte buffer: what is advised and faulted in."""
    return size - size % HUGE_PAGE
