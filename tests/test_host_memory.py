"""Pool memory (`memory_management.host_memory`): aligned, on huge pages, faulted in ahead."""

import resource
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

import pytest
import torch

from lmcache import page_advice
from lmcache.experimental.memory_management import HostMemoryAllocator, MemoryFormat
from lmcache.experimental.memory_management import host_memory
from lmcache.experimental.memory_management.host_memory import HUGE_PAGE, fault_ahead, host_buffer

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


# A process whose pool is still being faulted in when its main thread ends: each step is slowed
# (0.2 s, or 3 s for a thread the exit cannot hurry), so the idle-priority thread is mid-range at
# exit; or not (0 s): the thread waits for the pool's high-water mark to move.
_EXIT_WHILE_PREFAULTING = """
import atexit, sys, threading, time
from lmcache import page_advice
from lmcache.experimental.memory_management import host_memory
from lmcache.experimental.memory_management.host_memory import HUGE_PAGE, fault_ahead, host_buffer
step_s = float(sys.argv[1])
if step_s == 0:
    host_memory.PREFAULT_AHEAD = 8 * HUGE_PAGE  # less than the pool: the thread waits once it is in
if step_s > 1:
    page_advice.hurry = lambda thread: None  # as without CAP_SYS_NICE: the thread stays starved
slow = page_advice._advise
page_advice._advise = lambda *args: (time.sleep(step_s), slow(*args))[1]
buf = host_buffer(64 * HUGE_PAGE)
fault_ahead(buf)
time.sleep(0.3)
assert [t for t in threading.enumerate() if t.name == "lmcache-prefault"], "the prefault ended before exit"
atexit.register(lambda: print("at atexit:", [t.name for t in threading.enumerate() if t is not threading.main_thread()]))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="page advice is Linux's")
@pytest.mark.parametrize(("step_s", "left"), [(0.2, "[]"), (3.0, "['lmcache-prefault']"), (0.0, "[]")],
                         ids=["ends", "starved", "waiting"])
def test_a_prefault_still_running_at_exit_is_stopped_and_never_delays_it(step_s, left) -> None:
    """A daemon thread alive while Python finalizes is killed when it next takes the GIL; the
    prefault thread that held the pool's torch buffer then aborted the process when it let go of
    it ("terminate called without an active exception", seen in CI on a busy machine). Threading's
    exit hook stops it and waits a second at most: one that cannot get a core meanwhile (idle
    priority that cannot be raised back) holds nothing unsafe to kill."""
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", _EXIT_WHILE_PREFAULTING, str(step_s)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"at atexit: {left}" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    assert time.monotonic() - started < 30  # stopped between steps, not faulted to the end


def test_the_prefault_never_holds_the_buffer_it_faults_in(monkeypatch) -> None:
    """The owner is weakly referenced, so the thread can never be the one to free a torch buffer
    (the abort above, whenever the exit hook could not end it); once the owner is gone the thread
    ends at the next step."""
    steps, go = [], threading.Event()

    def advise(address, length, advice):
        if advice == page_advice._MADV_POPULATE_WRITE:
            steps.append(length)
            go.wait(10)
        return True

    monkeypatch.setattr(page_advice, "_advise", advise)
    monkeypatch.setattr(page_advice, "_PREFAULT_STEP", HUGE_PAGE)
    buf = host_buffer(8 * HUGE_PAGE)
    fault_ahead(buf)
    gone = weakref.ref(buf.untyped_storage())
    deadline = time.monotonic() + 10
    while not steps and time.monotonic() < deadline:
        time.sleep(0.01)
    (thread,) = [t for t in threading.enumerate() if t.name == "lmcache-prefault"]
    del buf
    assert gone() is None  # freed here, while the thread is inside a step
    go.set()
    thread.join(10)
    assert not thread.is_alive() and len(steps) == 1


@pytest.mark.skipif(not page_advice.available(), reason="no page advice: every page faults on first use")
def test_a_store_beyond_the_front_does_not_fault_page_by_page(monkeypatch) -> None:
    """The pool is faulted in a window ahead of its allocator's high-water mark, so a store past
    the front (the first `PREFAULT_AHEAD` bytes) lands on memory faulted in meanwhile: with only
    the front faulted in, stores beyond it faulted on every (huge) page, 0.03-0.04x memcpy on this
    project's VM (issue 43)."""
    window, obj_bytes = 8 * HUGE_PAGE, 16 * HUGE_PAGE
    monkeypatch.setattr(host_memory, "PREFAULT_AHEAD", window)
    src = torch.randint(0, 256, (obj_bytes,), dtype=torch.uint8)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the copy's faults are then all this thread's

    def faults_of_a_store_past_the_front(ahead: bool) -> int:
        alloc = HostMemoryAllocator(4 * obj_bytes)
        front = alloc.allocate((window,), torch.uint8, MemoryFormat.KV_BLOB)  # the front, used
        obj = alloc.allocate((obj_bytes,), torch.uint8, MemoryFormat.KV_BLOB)
        # As between an engine's two stores: the window past the high-water mark gets faulted in.
        deadline = time.monotonic() + 30
        while alloc.fault_ahead.faulted < (2 * window + obj_bytes if ahead else window) and time.monotonic() < deadline:
            time.sleep(0.02)
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        obj.tensor.copy_(src)
        faults = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
        assert torch.equal(obj.tensor, src)
        obj.ref_count_down()
        front.ref_count_down()
        return faults

    try:
        assert faults_of_a_store_past_the_front(ahead=True) < 4
        # Only the front faulted in (as before the fault-ahead): a fault per page of the store.
        monkeypatch.setattr(page_advice.BackgroundPrefault, "reached", lambda self, offset: None)
        assert faults_of_a_store_past_the_front(ahead=False) >= obj_bytes // HUGE_PAGE
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(not page_advice.available(), reason="no page advice: every page faults on first use")
@pytest.mark.parametrize("idle_priority", [True, False])
def test_a_cpu_tier_is_faulted_in_whole_only_where_the_thread_runs_at_idle_priority(monkeypatch, idle_priority) -> None:
    """A cache tier fills for good, so its whole pool is faulted in at start (the no-reuse workload
    paid the first touches while serving: 1.05-1.06x vLLM alone, issue 43) - but only at idle
    priority: at ordinary priority the thread would take cores from vLLM's start, so it keeps the
    window. A staging pool (not a tier) keeps the window either way; a close stops the thread."""
    window = 4 * HUGE_PAGE
    monkeypatch.setattr(host_memory, "PREFAULT_AHEAD", window)
    monkeypatch.setattr(host_memory.background_threads, "can_leave_idle", lambda: idle_priority)
    size = 32 * HUGE_PAGE
    tier, staging = HostMemoryAllocator(size, tier=True), HostMemoryAllocator(size)
    expected = size if idle_priority else window
    deadline = time.monotonic() + 30
    while tier.fault_ahead.faulted < expected and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.1)  # a window that kept going would show now
    assert tier.fault_ahead.faulted == expected
    assert staging.fault_ahead.faulted == window
    tier.close()
    staging.close()
    assert not tier.fault_ahead._thread.is_alive() and not staging.fault_ahead._thread.is_alive()
