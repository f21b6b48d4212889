"""How LMCache's own threads share the cores with the model's.

vLLM's CPU worker pins the thread running the forward pass to one core (and each of its OpenMP
threads to another); a thread inherits its creator's pin, so every thread we start from the model
thread (the off-step saver, the tier writers, the prefault) lands on the model thread's core and
competes with exactly the thread the step waits for, while the OpenMP threads' cores sit idle
whenever the model thread runs serial work (`docs/design.md`, "Decisions"). Each of our
threads therefore calls `prepare_thread` first: it takes the process's whole CPU mask back, so the
scheduler can run it on any allowed core, carries a name `top -H` and `/proc/<pid>/task/*/comm`
show, and - for work nothing waits on (tier writes, prefault) - the `SCHED_IDLE` policy: it runs only
on a core nothing else wants, and a model thread that wakes takes the core back at once. (At nice +10
it still cost the no-reuse benchmark ~1.5% of throughput: a waking thread of normal policy does not
always preempt a niced one.) Such a thread may therefore wait as long as every core is busy, so work
handed to one has a bounded backlog: past it the disk tier's writes go to a writer of normal
priority, the remote tier's puts are dropped (its queue's bound). A close that waits for such work
first puts the thread back to ordinary priority (`hurry`); where the process may not (no
`CAP_SYS_NICE`, as in a default Docker container: `can_leave_idle`), those threads keep ordinary
priority from the start.

It also runs its torch work without an OpenMP team of its own. A thread that opens a parallel region
gets a second team from the same libgomp as the model's; with more OpenMP threads in the process than
CPUs, libgomp cuts every thread's spin-wait from ~300,000 iterations to 100 before it sleeps, so the
model's OpenMP worker sleeps between the forward pass's parallel regions and each region waits for it
to wake (a scratch test: small parallel ops on the main thread ran 1.5-1.7x slower once another thread
had run one parallel op; not at all when that thread ran single-threaded).
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from typing import Callable, Optional, Set

from lmcache.logging import init_logger

logger = init_logger(__name__)

# Nice added to threads nothing waits on where the OS has no SCHED_IDLE (not Linux).
BACKGROUND_NICE = 10
_PR_SET_NAME = 15
_COMM_BYTES = 15  # the kernel keeps 15 bytes of a thread's name


def process_cpus() -> Set[int]:
    """The CPUs any thread of this process may use: the union of its threads' masks (threads
    started before vLLM pinned the model thread keep the mask the process was started with, a
    `taskset` included)."""
    cpus: Set[int] = set()
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        tids = []
    for tid in tids:
        try:
            cpus |= os.sched_getaffinity(int(tid))
        except OSError:  # the thread ended meanwhile
            continue
    return cpus or os.sched_getaffinity(0)


def _set_name(name: str) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:_COMM_BYTES]), 0, 0, 0)
    except (OSError, AttributeError):  # no prctl (not Linux): the name is cosmetic
        pass


def _load_omp_set_num_threads() -> Optional[Callable[[int], None]]:
    try:
        return ctypes.CDLL(None).omp_set_num_threads
    except (OSError, AttributeError):  # no OpenMP runtime loaded: no team to keep out of
        return None


def _single_openmp_thread() -> None:
    """Make the calling thread's torch ops run inline, never opening an OpenMP team; the process's
    setting (what `torch.get_num_threads()` gives every other thread) stays as it is, which
    `torch.set_num_threads(1)` would change for threads that start torch work later. `lmcache.c_ops`
    has its own copy of torch's per-thread setup (inlined `at::parallel_for`), so its kernel checks
    `at::get_num_threads()` and copies inline on such a thread. A process without torch loaded (the
    `lm://` server) has no team to keep out of and does not load it."""
    torch = sys.modules.get("torch")
    if torch is None:
        return

    torch.get_num_threads()  # torch's per-thread first-use setup, which would undo the line below
    set_threads = _load_omp_set_num_threads()
    if set_threads is not None:
        set_threads(1)


def prepare_thread(name: str, background: bool) -> None:
    """Call first on a thread of ours: whole CPU mask, OS-visible `name`, a single OpenMP thread
    for its torch work, and with `background` (nothing waits for its work) the idle policy."""
    _set_name(name)
    _single_openmp_thread()
    try:
        os.sched_setaffinity(0, process_cpus())  # 0: the calling thread
    except (AttributeError, OSError) as err:  # AttributeError: no CPU masks here (not Linux)
        logger.debug("thread %s keeps its CPU mask: %r", name, err)
    if background:
        _lower_priority(name)
    else:
        _ordinary_priority(name)


def hurry(thread: threading.Thread) -> None:
    """Put a background thread back to ordinary priority because someone now waits for its work
    (a tier closing): at `SCHED_IDLE` beside a busy engine it may hold a batch it took for as long
    as the cores stay busy. Best effort: leaving the idle policy may need `CAP_SYS_NICE`."""
    tid = thread.native_id
    if tid is None or not thread.is_alive():
        return
    try:
        if os.sched_getscheduler(tid) == os.SCHED_IDLE:
            os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
    except (AttributeError, OSError) as err:  # gone meanwhile, no such policies, or not allowed
        logger.debug("thread %s keeps its priority: %r", thread.name, err)


def _ordinary_priority(name: str) -> None:
    """The calling thread back to `SCHED_OTHER` where it inherited `SCHED_IDLE`: a thread starts
    with its creator's policy, and a pool's worker made on demand by a background thread (the
    remote put thread submitting a Mooncake call) would otherwise serve lookups at idle priority
    too, starved while the cores are busy."""
    try:
        if os.sched_getscheduler(0) != os.SCHED_IDLE:
            return
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
    except (AttributeError, OSError) as err:  # no such policies here, or not allowed to leave it
        logger.debug("thread %s keeps its idle priority: %r", name, err)


# Whether threads here may be put back to ordinary priority (`can_leave_idle`), probed once.
_leave_idle: Optional[bool] = None


def can_leave_idle() -> bool:
    """Whether a thread of this process may go back from `SCHED_IDLE` (or a raised nice) to its
    ordinary priority, as `hurry` does: Linux allows it with `CAP_SYS_NICE` (which containers lack
    by default: `docker run --cap-add SYS_NICE`) or an `RLIMIT_NICE` that covers the thread's nice
    value. Probed once, by lowering the calling thread's nice by one and restoring it: the same
    kernel check, where a capability listed in a user namespace may not count."""
    global _leave_idle
    if _leave_idle is None:
        tid = threading.get_native_id()
        try:
            nice = os.getpriority(os.PRIO_PROCESS, tid)
            os.setpriority(os.PRIO_PROCESS, tid, nice - 1)
            os.setpriority(os.PRIO_PROCESS, tid, nice)
            _leave_idle = True
        except (AttributeError, OSError):  # EACCES/EPERM: not allowed; no such calls (not Unix)
            _leave_idle = False
            logger.info("LMCache's background work (tier writes, prefault) runs at ordinary priority: this "
                        "process may not raise a thread's priority back once lowered (no CAP_SYS_NICE), and a "
                        "close must not wait on a starved thread; add CAP_SYS_NICE to run it at idle priority")
    return _leave_idle


def _lower_priority(name: str) -> None:
    """The calling thread to `SCHED_IDLE`, or `BACKGROUND_NICE` added where there is no such
    policy; neither where `hurry` could not undo it (`can_leave_idle`): a close waiting for work
    queued on a thread starved beside a busy engine outlived vLLM's 5 s bound, and a prefault not
    ended by exit aborted the process."""
    if not can_leave_idle():
        return
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: the calling thread
        return
    except (AttributeError, OSError) as err:
        logger.debug("thread %s: no SCHED_IDLE (%r), lowering its nice instead", name, err)
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + BACKGROUND_NICE)
    except OSError as err:
        logger.debug("thread %s keeps its priority: %r", name, err)


def at_thread_shutdown(fn: Callable[[], None]) -> bool:
    """Run `fn` on the main thread when the interpreter starts to exit, once the threads that are
    not daemons have ended and before atexit and finalization (`threading`'s own exit hook, the
    one `concurrent.futures` uses; hooks run last-registered first). False where exit has already
    begun. Why: a daemon thread still running when Python finalizes is killed as it next takes the
    GIL, and one that torch code holds then aborts the whole process ("terminate called without an
    active exception": the kill unwinds through a torch destructor that may not throw)."""
    try:
        threading._register_atexit(fn)  # type: ignore[attr-defined]
    except RuntimeError:  # "can't register atexit after shutdown"
        return False
    return True


def thread_initializer(name: str, background: bool) -> Callable[[], None]:
    """`prepare_thread` as a `ThreadPoolExecutor(initializer=...)`."""
    return lambda: prepare_thread(name, background)


def prepared(target: Callable[..., None], name: str, background: bool) -> Callable[..., None]:
    """`target` run after `prepare_thread`, for `threading.Thread(target=...)`."""

    def run(*args, **kwargs) -> None:
        prepare_thread(name, background)
        target(*args, **kwargs)

    return run
