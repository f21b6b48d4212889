"""Payload checksums computed on a thread of their own, one piece behind the reader.

Reading a chunk file from the page cache is a kernel copy; hashing each piece right after it on
the same thread held the disk tier's read to ~0.77 of the plain file read (`bench_engine.py`).
Handing each piece to this thread instead lets the next piece's copy run on one core while the
last one is hashed on the other (`c_ops.checksum_sums` releases the GIL), and the piece is
still in the shared cache when it is hashed.

The queue is bounded by construction: a reader queues at most one item per piece of the payload
in hand and waits for its digest before it reads another payload.
"""

from __future__ import annotations

import ctypes
import os
import queue
import threading
from concurrent.futures import Future
from typing import Callable, Optional, Set, Tuple, Union

from lmcache.background_threads import prepare_thread
from lmcache.experimental.storage_backend import chunk_format

# Pieces of 2 MiB: against the whole-file read of 8 x 32 MiB cached files, 512 KiB / 1 MiB / 2 MiB /
# 4 MiB pieces hashed on this thread ran at 0.89 / 0.93 / 0.95 / 0.95 (inline 1 MiB: 0.81).
PIECE = 2 << 20


def _load_getcpu() -> Optional[Callable[[], int]]:
    try:
        return ctypes.CDLL(None).sched_getcpu
    except (OSError, AttributeError):
        return None


_getcpu = _load_getcpu()


def _current_cpu() -> Optional[int]:
    cpu = _getcpu() if _getcpu is not None else -1
    return cpu if cpu >= 0 else None


_Item = Tuple["PayloadHash", Union[memoryview, "Future[bytes]"]]


class HashThread:
    """One hashing thread, started on first use; after `close` hashing happens inline."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: "queue.SimpleQueue[Optional[_Item]]" = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._stopping: Optional[threading.Thread] = None
        self._closed = False
        self._tid: Optional[int] = None
        self._cpus: Set[int] = set()

    def payload(self) -> "PayloadHash":
        """A running checksum of one payload, fed with `update` piece by piece in order."""
        self._keep_off_caller_cpu()
        return PayloadHash(self)

    def _keep_off_caller_cpu(self) -> None:
        """Let the thread run anywhere but the calling reader's CPU.

        Woken once per piece, the thread is otherwise placed by the scheduler's wake-up affinity on
        the waker's CPU whenever the other cores looked busy in the last tens of milliseconds (a
        forward pass, a copy kernel just ended): then reading and hashing take turns on one core."""
        tid = self._tid
        cpu = _current_cpu()
        if tid is None or cpu is None:
            return
        others = self._cpus - {cpu}
        try:
            os.sched_setaffinity(tid, others or self._cpus)
        except OSError:  # the thread ended, or the mask is not ours to set: leave it
            pass

    def _submit(self, item: _Item) -> bool:
        """Queue `item` for the thread; False once closed, after the thread has hashed what was
        queued before (so the caller, hashing inline from here on, keeps the pieces' order)."""
        with self._lock:
            queued = not self._closed
            stopping = None if queued else self._stopping
            if queued:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                    self._thread.start()
                self._queue.put(item)
        if stopping is not None:
            stopping.join()
        return queued

    def _run(self) -> None:
        prepare_thread(self._name, background=False)  # a read waits for its digest
        self._cpus = os.sched_getaffinity(0)
        self._tid = threading.get_native_id()
        while True:
            item = self._queue.get()
            if item is None:
                return
            payload, work = item
            if isinstance(work, Future):
                payload.settle(work)
            else:
                payload.hash_now(work)

    def close(self) -> None:
        """Finish what is queued and stop the thread."""
        with self._lock:
            if self._closed:
                thread = self._stopping
            else:
                self._closed = True
                self._stopping, self._thread = self._thread, None
                thread = self._stopping
                if thread is not None:
                    self._queue.put(None)
        if thread is not None:
            thread.join()


class PayloadHash:
    """One payload's checksum (`chunk_format.payload_checksum`'s value), hashed on a `HashThread`.

    The caller must leave each piece unchanged until `digest` has returned, and must call
    `digest` before the memory under the pieces is reused - on error paths too."""

    def __init__(self, thread: HashThread) -> None:
        self._thread = thread
        self._hasher = chunk_format.payload_hasher()
        self._error: Optional[BaseException] = None

    def update(self, piece: memoryview) -> None:
        if not self._thread._submit((self, piece)):
            self.hash_now(piece)

    def digest(self) -> bytes:
        """Wait until every queued piece is hashed; the checksum (raises what hashing raised)."""
        done: "Future[bytes]" = Future()
        if not self._thread._submit((self, done)):
            self.settle(done)
        return done.result()

    def hash_now(self, piece: memoryview) -> None:
        if self._error is None:
            try:
                self._hasher.update(piece)
            except Exception as err:  # kept for `digest`: the hashing thread must live on
                self._error = err

    def settle(self, done: "Future[bytes]") -> None:
        if self._error is not None:
            done.set_exception(self._error)
        else:
            done.set_result(self._hasher.digest())
