"""Our threads leave the model thread's core pin, carry an OS-visible name, and the ones nothing
waits on run at idle priority (background_threads.py; started from a thread pinned to one core,
as vLLM's CPU worker pins the model thread)."""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import socket
import subprocess
import sys
import threading

import pytest
from helpers import key
from tier_helpers import cpu, disk_store, disk_tier, remote_backend, remote_chunk, remote_cpu, wait_for  # noqa: F401

from lmcache import page_advice
from lmcache.background_threads import can_leave_idle, hurry, prepare_thread, process_cpus
from lmcache.experimental.memory_management import host_memory
from lmcache.experimental.storage_backend import LocalDiskBackend
from lmcache.integration.vllm.off_step_saver import OffStepSaver
from lmcache.server import LMCacheServer, ServerConfig
from lmcache.server.protocol import Op, Status, pack_header

pytestmark = pytest.mark.skipif(len(process_cpus()) < 2, reason="needs two CPUs to tell a pin from the whole mask")


def _state() -> tuple[str, set, int]:
    """(OS name, CPU mask, scheduling policy) of the calling thread."""
    with open(f"/proc/self/task/{threading.get_native_id()}/comm") as f:
        comm = f.read().strip()
    return comm, os.sched_getaffinity(0), os.sched_getscheduler(0)


@contextlib.contextmanager
def _pinned():
    """Pin the calling thread to one CPU, as vLLM pins the model thread; yields its policy."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(before)})
    try:
        yield os.sched_getscheduler(0)
    finally:
        os.sched_setaffinity(0, before)


def _on_thread(fn) -> tuple:
    seen = []
    t = threading.Thread(target=lambda: seen.append(fn()))
    t.start()
    t.join()
    return seen[0]


def _expected(policy: int, background: bool) -> int:
    return os.SCHED_IDLE if background and can_leave_idle() else policy


@pytest.mark.parametrize("background", [False, True])
def test_prepare_thread_unpins_names_and_idles_background_threads(background):
    with _pinned() as policy:
        assert _on_thread(lambda: _state()[1]) == {min(process_cpus())}  # inherited, as in vLLM
        state = _on_thread(lambda: (prepare_thread("lmc-test-thread", background), _state())[1])
    assert state == ("lmc-test-thread", process_cpus(), _expected(policy, background))


# What a process without CAP_SYS_NICE (a default Docker container) says and does.
_NO_WAY_BACK = """
import os, threading
from lmcache.background_threads import can_leave_idle, prepare_thread
seen = []
t = threading.Thread(target=lambda: (prepare_thread("lmc-test-idle", True), seen.append(os.sched_getscheduler(0))))
t.start(); t.join()
print("RESULT", can_leave_idle(), seen == [os.SCHED_OTHER])
"""


def test_without_cap_sys_nice_background_threads_keep_ordinary_priority():
    """Where no thread may be put back to ordinary priority, none is lowered: a close waiting on a
    starved idle writer outlived vLLM's 5 s kill in CI (no CAP_SYS_NICE there), and a prefault the
    exit could not end aborted the process."""
    cmd = [sys.executable, "-c", _NO_WAY_BACK]
    if can_leave_idle():
        if shutil.which("capsh") is None or os.geteuid() != 0:
            pytest.skip("this process may leave SCHED_IDLE and has no capsh to drop CAP_SYS_NICE with")
        cmd = ["capsh", "--drop=cap_sys_nice", "--", "-c", shlex.join(cmd)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert "RESULT False True" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert "runs at ordinary priority" in proc.stderr  # said once, at INFO


def test_a_normal_thread_made_by_an_idle_one_leaves_its_idle_priority():
    """A thread starts with its creator's policy: a pool worker made on demand by the idle put
    thread must not serve lookups at idle priority."""
    if not can_leave_idle():
        pytest.skip("leaving SCHED_IDLE needs CAP_SYS_NICE (or RLIMIT_NICE), which this process lacks")
    inherited = _on_thread(lambda: (prepare_thread("lmc-test-idle", True), _on_thread(lambda: _state()[2]))[1])
    made = _on_thread(lambda: (prepare_thread("lmc-test-idle", True),
                               _on_thread(lambda: (prepare_thread("lmc-test-call", False), _state()[2])[1]))[1])
    assert inherited == os.SCHED_IDLE and made == os.SCHED_OTHER


def test_hurry_puts_an_idle_put_thread_back_to_ordinary_priority():
    """What a closing tier does first: the put thread it waits for runs at ordinary priority."""
    if not can_leave_idle():
        pytest.skip("leaving SCHED_IDLE needs CAP_SYS_NICE (or RLIMIT_NICE), which this process lacks")
    with _remote_tier() as (backend, put, seen):
        for i in (1, 2):
            put(i)
            assert wait_for(lambda: len(seen) == i)
            if i == 1:
                worker = backend._worker
                assert os.sched_getscheduler(worker.native_id) == os.SCHED_IDLE
                hurry(worker)
        assert [state[2] for state in seen] == [os.SCHED_IDLE, os.SCHED_OTHER]


def test_saver_thread_is_unpinned_at_normal_priority():
    """The next step's flush waits for the saver: whole mask, but no lower priority."""
    seen = []
    with _pinned() as policy:
        saver = OffStepSaver("v1")
        saver.submit(lambda: seen.append(_state()), "test")
        saver.close()
    assert seen == [("lmc-v1-save", process_cpus(), policy)]


def test_disk_writer_is_unpinned_at_background_priority(tmp_path, cpu):  # noqa: F811 (cpu: fixture)
    disk = disk_tier(tmp_path, cpu)
    seen = []
    real_save = disk._save
    disk._save = lambda *args: (seen.append(_state()), real_save(*args))[1]
    with _pinned() as policy:
        disk_store(disk, cpu, 1)
        disk.close()
    assert seen == [("lmc-disk-write", process_cpus(), _expected(policy, True))]


def test_disk_catch_up_writer_runs_at_normal_priority(tmp_path, cpu):  # noqa: F811 (cpu: fixture)
    """Past the idle writer's backlog bound the writes must progress on a busy machine too."""
    disk = LocalDiskBackend(str(tmp_path), 1 << 20, cpu, max_pending_bytes=1)
    release, seen = threading.Event(), {}
    real_save = disk._save

    def save(k, *args):
        seen[k] = _state()
        if seen[k][0] == "lmc-disk-write":
            release.wait()
        return real_save(k, *args)

    disk._save = save
    with _pinned() as policy:
        disk_store(disk, cpu, 1, 2)  # the first fills the idle writer's queue, the second goes past it
        assert wait_for(lambda: key(2) in seen)
        release.set()
        disk.close()
    assert seen[key(2)] == ("lmc-disk-catch", process_cpus(), policy)


def test_closing_the_disk_tier_hurries_its_idle_writer(tmp_path, cpu):  # noqa: F811 (cpu: fixture)
    """A write queued behind the idle writer's current one is written at ordinary priority once
    the tier closes (and waits for it)."""
    if not can_leave_idle():
        pytest.skip("leaving SCHED_IDLE needs CAP_SYS_NICE (or RLIMIT_NICE), which this process lacks")
    disk = disk_tier(tmp_path, cpu)
    release, seen = threading.Event(), {}
    real_save = disk._save

    def save(k, *args):
        seen[k] = _state()[2]
        if k == key(1):
            release.wait()
        return real_save(k, *args)

    disk._save = save
    disk_store(disk, cpu, 1, 2)
    assert wait_for(lambda: key(1) in seen)
    closing = threading.Thread(target=disk.close)
    closing.start()
    try:
        assert wait_for(lambda: os.sched_getscheduler(disk._writer_thread.native_id) == os.SCHED_OTHER)
    finally:
        release.set()
        closing.join()
    assert seen == {key(1): os.SCHED_IDLE, key(2): os.SCHED_OTHER}


@contextlib.contextmanager
def _remote_tier():
    """A remote tier on a server of its own: (tier, put(i) of chunk i, the put thread's state at
    each batch it sends); closed after."""
    srv = LMCacheServer(ServerConfig(port=0, max_size_bytes=64 << 20))
    host, port = srv.start_in_thread()
    tier_cpu = remote_cpu()
    backend = remote_backend(f"lm://{host}:{port}", cpu=tier_cpu)
    seen = []
    real_send = backend._send
    backend._send = lambda batch: (seen.append(_state()), real_send(batch))[1]

    def put(i: int) -> None:
        obj = remote_chunk(tier_cpu, i)
        backend.submit_put_task(key(i), obj)
        obj.ref_count_down()

    try:
        yield backend, put, seen
        backend.close()
    finally:
        srv.shutdown()


def test_remote_put_thread_is_unpinned_at_background_priority():
    with _remote_tier() as (backend, put, seen):
        with _pinned() as policy:
            put(1)
        assert wait_for(lambda: seen)  # before close, whose flush would send it itself
    assert seen[0] == ("lmc-remote-put", process_cpus(), _expected(policy, True))


def test_prefault_thread_is_unpinned_at_background_priority(monkeypatch):
    seen = []
    done = threading.Event()
    monkeypatch.setattr(page_advice, "prefault", lambda address, length, stop: (seen.append(_state()), done.set()))
    with _pinned() as policy:
        buf = host_memory.host_buffer(4 * host_memory.HUGE_PAGE)
        host_memory.fault_ahead(buf)
    assert done.wait(10)
    assert seen == [("lmc-prefault", process_cpus(), _expected(policy, True))]
    del buf


def test_prepared_threads_run_torch_work_without_an_openmp_team():
    """A second OpenMP team in the process makes libgomp cut every thread's spin-wait, the model's
    OpenMP worker included: our threads run their torch work inline, and the setting every other
    thread gets stays the process's."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        seen = _on_thread(lambda: (prepare_thread("lmc-test-thread", False), torch.get_num_threads())[1])
        assert seen == 1
        assert _on_thread(torch.get_num_threads) == 2  # a thread that is not ours
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_prepared_threads_run_the_transfer_kernel_without_an_openmp_team():
    """The saver's copy (`c_ops`) stays inline on our thread: `at::parallel_for`'s per-thread setup,
    inlined into our extension apart from libtorch's, reset the thread to the process's count on
    its first call and opened a second team (the no-reuse benchmark's decode ran ~30% slower)."""
    import torch
    from helpers import make_case, run_multi

    from lmcache.experimental.kv_layout import KVLayout

    case = make_case(KVLayout.FLASH, torch.float32, num_tokens=512, num_blocks=40, prefix=0, start=0)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    torch.ones(1 << 20).mul_(2)  # the main thread's own team, as the model thread has one

    def copy_on_a_prepared_thread() -> tuple[int, int]:
        prepare_thread("lmc-test-thread", False)
        tasks = len(os.listdir("/proc/self/task"))
        run_multi(case, to_cache=False)
        return torch.get_num_threads(), len(os.listdir("/proc/self/task")) - tasks

    try:
        threads, started = _on_thread(copy_on_a_prepared_thread)
        assert threads == 1
        assert started == 0  # no OpenMP worker was started for it
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_server_receives_puts_at_idle_priority_and_answers_gets_at_normal():
    """The `lm://` server beside an engine: a put's payload is received on an idle thread (no
    client waits for it); gets and lookups stay on the connection's own thread."""
    srv = LMCacheServer(ServerConfig(port=0, max_size_bytes=64 << 20))
    host, port = srv.start_in_thread()
    seen = {}
    real_put, real_get = srv.store.put, srv.store.get
    srv.store.put = lambda *args: (seen.setdefault("put", _state()), real_put(*args))[1]
    srv.store.get = lambda *args: (seen.setdefault("get", _state()), real_get(*args))[1]
    tier_cpu = remote_cpu()
    backend = remote_backend(f"lm://{host}:{port}", cpu=tier_cpu)
    try:
        obj = remote_chunk(tier_cpu, 1)
        backend.submit_put_task(key(1), obj)
        obj.ref_count_down()
        backend.flush()
        got = backend.get_blocking(key(1))
        assert got is not None
        got.ref_count_down()
    finally:
        backend.close()
        srv.shutdown()
    assert seen["put"][0] == "lmc-server-put" and seen["put"][2] == _expected(os.SCHED_OTHER, True)
    assert seen["get"][0] != "lmc-server-put" and seen["get"][2] == os.SCHED_OTHER


def test_a_put_after_shutdown_closes_its_connection_quietly():
    """A put whose header arrives as the server stops: the connection ends like any other at
    shutdown, no thread dies with an exception."""
    srv = LMCacheServer(ServerConfig(port=0, max_size_bytes=64 << 20))
    srv.start_in_thread()
    srv._put_pool.shutdown(wait=True)  # as shutdown() leaves it
    died = []
    previous, threading.excepthook = threading.excepthook, lambda args: died.append(args.exc_value)
    try:
        with socket.create_connection(srv.address, timeout=5) as sock:
            sock.sendall(pack_header(Op.PUT, Status.OK, 1, 4) + b"k" + b"data")
            try:
                answer = sock.recv(1)
            except ConnectionResetError:  # closed with the payload unread
                answer = b""
            assert answer == b""  # closed, unanswered
    finally:
        threading.excepthook = previous
        srv.shutdown()
    assert died == []
