"""Host memory for the allocators' pools: 2 MiB aligned, on transparent huge pages where the
kernel allows, and faulted in by a background thread (`lmcache.page_advice`).

Why: a chunk copy touches the pool in head-sized rows spread over tens of MiB. On 4 KiB pages
the first touch of every page is a fault and the TLB misses on every row; on this project's
machine that held the engine's CPU-tier store at 2.5 GB/s and retrieve at 3 GB/s, against
11-15 GB/s on huge pages faulted in ahead (docs/design.md, "Decisions"). The pool is
committed up front, as upstream's pinned pool is. Where page advice is refused the buffer is
plain `torch.empty` memory and the first touch pays as before.
"""

import torch

from lmcache import page_advice
from lmcache.logging import init_logger
from lmcache.page_advice import HUGE_PAGE

logger = init_logger(__name__)

# How much of a pool the background thread faults in ahead (its front, which the allocators hand
# out first); the rest faults in on first use. Faulting a default 5 GB pool in whole took a core
# for seconds on a 2-core machine and committed 5 GB per vLLM instance even when the instance
# only stages chunks for a shared pool; a vLLM 0.32 worker doing it was still at it when vLLM shut
# it down and was killed before LMCache closed (tests/latest/test_latest_mp_connector.py).
PREFAULT_AHEAD = 512 << 20


def host_buffer(size: int, *, prefault: bool = True) -> torch.Tensor:
    """A flat uint8 host tensor of `size` bytes starting on a 2 MiB boundary, advised to use
    huge pages; with `prefault`, a daemon thread faults its first `PREFAULT_AHEAD` bytes in."""
    if size < HUGE_PAGE or not page_advice.available():
        return torch.empty(size, dtype=torch.uint8)
    raw = torch.empty(size + HUGE_PAGE, dtype=torch.uint8)
    start = (-raw.data_ptr()) % HUGE_PAGE
    buf = raw[start : start + size]
    span = size - size % HUGE_PAGE
    if not page_advice.advise_huge_pages(buf.data_ptr(), span):
        logger.debug("madvise(MADV_HUGEPAGE) refused for a %d-byte pool: 4 KiB pages", size)
    if prefault:
        page_advice.BackgroundPrefault(buf.data_ptr(), min(span, PREFAULT_AHEAD), "lmcache-prefault",
                                       owner=buf.untyped_storage()).start()
    return buf
