"""Pool memory (`memory_management.host_memory`): aligned, on huge pages, faulted in ahead."""

import sys
import time
from pathlib import Path

import pytest
import torch

from lmcache.experimental.memory_management import HostMemoryAllocator, MemoryFormat
from lmcache.experimental.memory_management.host_memory import HUGE_PAGE, host_buffer

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _mapping_stats(address: int) -> dict:
    """The /proc/self/smaps counters (kB) of the mapping that holds `address`."""
    stats: dict = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head.endswith(":") and len(line.split()) >= 2 and line.split()[1].isdigit():
            stats[head[:-1]] = int(line.split()[1])
    return stats


def test_buffer_is_aligned_sized_and_writable() -> None:
    buf = host_buffer(3 * HUGE_PAGE + 123)
    assert buf.dtype == torch.uint8 and buf.numel() == 3 * HUGE_PAGE + 123
    assert buf.data_ptr() % HUGE_PAGE == 0
    buf.fill_(7)
    assert int(buf.sum()) == 7 * buf.numel()
    small = host_buffer(4096)  # below a huge page: plain memory
    assert small.numel() == 4096


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or not THP.exists() or "[never]" in THP.read_text(),
    reason="transparent huge pages are off",
)
def test_pool_is_faulted_in_on_huge_pages_without_being_touched() -> None:
    """The regression this catches: the pool back on 4 KiB pages faulted in by the first copy
    (engine store/retrieve 3-5x slower, docs/design.md, "Decisions")."""
    size = 64 * HUGE_PAGE
    alloc = HostMemoryAllocator(size)
    address = alloc.pool.buffer.data_ptr()
    deadline = time.monotonic() + 30
    while _mapping_stats(address).get("Rss", 0) < size // 1024 and time.monotonic() < deadline:
        time.sleep(0.05)
    stats = _mapping_stats(address)
    assert stats["Rss"] >= size // 1024, stats
    assert stats["AnonHugePages"] >= size // 2 // 1024, stats  # most of it on 2 MiB pages
    obj = alloc.allocate((2, 4, 16, 64), torch.float32, MemoryFormat.KV_BLOB)
    assert obj is not None and obj.tensor.data_ptr() % 512 == 0
    obj.ref_count_down()
