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
import threading
import time
import weakref
from typing import Callable, Optional

from lmcache.background_threads import at_thread_shutdown, hurry, prepared
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


def prefault(address: int, length: int, stop: Optional[threading.Event] = None) -> bool:
    """Fault the range in, front first, without changing its bytes; False where refused or once
    `stop` is set (checked between steps)."""
    for offset in range(0, length, _PREFAULT_STEP):
        if stop is not None and stop.is_set():
            return False
        if not _advise(address + offset, min(_PREFAULT_STEP, length - offset), _MADV_POPULATE_WRITE):
            logger.debug("madvise(MADV_POPULATE_WRITE) refused (kernel < 5.14?): pages fault in on first use")
            return False
    return True


class BackgroundPrefault:
    """`prefault` on an idle-priority daemon thread until `owner` (the memory's owner, a torch
    buffer's storage) is gone. The thread never holds the owner, not even for a moment: a daemon
    thread still running when Python finalizes is killed as it next takes the GIL, and one that
    was letting go of a torch buffer then aborted the process ("terminate called without an active
    exception"). A step on memory freed meanwhile is refused by the kernel or faults in whatever is
    mapped there now, changing no bytes. `stop()` ends it between steps; the interpreter's exit
    does so too (`background_threads.at_thread_shutdown`), waiting `EXIT_WAIT_S` at most for it.
    Unless stopped, `on_end(done, seconds)` runs on the thread at the end (`done` False: the
    kernel refused).

    With `ahead`, it faults in only `ahead` bytes beyond the furthest offset the owner has `reached`
    so far and waits for the next `reached` (a fault-ahead): memory nobody uses is never faulted
    in, and a store that stays below the fault rate finds its memory faulted in before it."""

    EXIT_WAIT_S = 1.0

    _running: "set[BackgroundPrefault]" = set()
    _lock = threading.Lock()
    _hooked = False

    def __init__(self, address: int, length: int, name: str, owner: object = None,
                 on_end: Optional[Callable[[bool, float], None]] = None, ahead: Optional[int] = None) -> None:
        self._length = length
        self._ahead = ahead
        self._target = length if ahead is None else min(length, ahead)  # fault in up to here
        self.faulted = 0  # bytes from the front faulted in so far
        self._stop = threading.Event()
        self._wake = threading.Event()  # set when the target moves or the thread is to stop
        # Set by the owner's end (the callback holds the events, not the owner).
        self._owner_gone = weakref.ref(owner, lambda _, stop=self._stop, wake=self._wake: (stop.set(), wake.set())) \
            if owner is not None else None
        self._thread = threading.Thread(
            target=prepared(self._run, "lmc-prefault", background=True), args=(address, on_end),
            name=name, daemon=True,
        )

    def start(self) -> "BackgroundPrefault":
        """Start faulting (nothing starts once the interpreter is exiting)."""
        cls = type(self)
        with cls._lock:
            if not cls._hooked:
                cls._hooked = at_thread_shutdown(cls._stop_all)
                if not cls._hooked:
                    return self
            cls._running.add(self)
        self._thread.start()
        return self

    def reached(self, offset: int) -> None:
        """The owner uses its memory up to `offset` now: with `ahead`, fault in `ahead` bytes past it.
        For an allocator, under its lock, as its highest offset handed out grows: it wakes the
        thread once per huge page the target moves."""
        if self._ahead is None:
            return
        target = min(self._length, -(-(offset + self._ahead) // HUGE_PAGE) * HUGE_PAGE)  # whole (huge) pages
        if target > self._target:
            self._target = target
            self._wake.set()

    def stop(self, timeout_s: float = 5.0) -> None:
        """End the faulting between two steps and wait for the thread (at most `timeout_s`)."""
        self._stop.set()
        self._wake.set()
        hurry(self._thread)  # at idle priority beside a busy engine it might not get a core soon
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def _run(self, address: int, on_end: Optional[Callable[[bool, float], None]]) -> None:
        started = time.monotonic()
        try:
            done = True
            while done and self.faulted < self._length and not self._stop.is_set():
                target = self._target
                if self.faulted < target:
                    done = prefault(address + self.faulted, target - self.faulted, self._stop)
                    if done:
                        self.faulted = target
                    continue
                self._wake.clear()  # then look again, so a `reached` or `stop` meanwhile is not missed
                if self._target == target and not self._stop.is_set():
                    self._wake.wait()
            if on_end is not None and not self._stop.is_set():
                on_end(done, time.monotonic() - started)
        finally:
            with type(self)._lock:
                type(self)._running.discard(self)

    @classmethod
    def _stop_all(cls) -> None:
        with cls._lock:
            running = list(cls._running)
        deadline = time.monotonic() + cls.EXIT_WAIT_S
        for job in running:
            job.stop(max(0.0, deadline - time.monotonic()))
