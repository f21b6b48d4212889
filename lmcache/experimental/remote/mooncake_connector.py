"""Connector over Mooncake Store (`mooncakestore://MASTER:PORT`): a master keeps the metadata,
clients (this one too, unless `global_segment_size` is 0) each lend the pool a memory segment.

Data path: a put hands Mooncake the addresses of the value's parts (the chunk header and the
memory object's own bytes, `batch_put_from_multi_buffers`), so nothing is joined or copied in
Python; a get is a get session with ranged reads: the master says where each value lies (and
leases it), the first `_HEAD_BYTES` of every value come in one batch, the serde reads the header
from them, allocates the object and has the payload read straight into it (one transfer per
chunk). `batch_get_buffer` into Mooncake's receive buffer, and a copy out of it, ran at 1.01
GB/s in `bench_remote.py`, this at 1.39 (`docs/benchmarks.md`). Over `tcp` no registration of
our memory is needed; `rdma` would need the CPU pool registered (not done: no RDMA hardware).

Mooncake's calls can block for seconds when the master is gone (its client reconnects inside a
call, ~4 s seen), and its `setup` retries for ~90 s holding the GIL. So:
- `setup` runs on its own thread, started when the connector is made (the engine's start-up, so
  it is done before the first request), and only after the master accepted a TCP connection; a
  caller waits for it at most `lookup_timeout` and otherwise gets `RemoteUnavailableError` (the
  tier goes down and probes later);
- every other call runs on a small pool of call threads and is waited for at most its timeout
  (`lookup_timeout` for exists, `timeout` for gets and puts); at most `pool_size` run at once.
  A put abandoned this way may still read its object after the tier freed it: the stored value
  then fails its checksum and reads as a miss, never as wrong bytes. A read abandoned this way
  may still write into its target, so the target is freed only once Mooncake's call returns
  (`chunk_format.FillAbandoned`), never handed to another chunk meanwhile.
Threads: the setup thread and the call threads are prepared as our other threads are
(`background_threads.prepare_thread`: the process's whole CPU mask). Mooncake starts its own
transfer threads inside `setup` and the calls, and they inherit the creator's mask: created from
vLLM's model thread, they were all pinned to its one core and competed with the forward pass
(25 such threads seen in the engine's `/proc/<pid>/task`, now on every core of the process).
Return codes: RPC_FAIL (master unreachable) raises `RemoteUnavailableError`; anything else
negative is a miss or a refused put (logged, rate-limited).
"""

from __future__ import annotations

import socket
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from functools import partial
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from lmcache.background_threads import prepared, thread_initializer
from lmcache.experimental.config import MOONCAKE_SCHEME
from lmcache.experimental.remote.connector import (
    Buffer,
    Receive,
    RemoteConnector,
    RemoteUnavailableError,
    Value,
    value_buffers,
    value_nbytes,
)
from lmcache.experimental.remote.mooncake_settings import MooncakeSettings
from lmcache.experimental.remote.value_reader import ValueReader
from lmcache.experimental.storage_backend.chunk_format import MAX_HEADER_BYTES, FillAbandoned
from lmcache.logging import init_logger

try:
    from mooncake.store import MooncakeDistributedStore
except ImportError as _missing:  # the wheel, or Debian's libibverbs1 its store.so links
    raise ImportError(
        f"remote_url mooncakestore:// needs Mooncake's client: {_missing} "
        "(`make setup` installs mooncake-transfer-engine-non-cuda and libibverbs1)"
    ) from _missing

logger = init_logger(__name__)

RPC_FAIL = -900  # Mooncake's ErrorCode for "the master did not answer"
_LOG_EVERY = 100  # one line per this many refused puts or failed gets
_PROBE_KEY = "lmcache:probe"  # ping asks whether this exists: a round trip to the master
# A get reads this much of each value first, in one batch: any chunk header fits in it.
_HEAD_BYTES = MAX_HEADER_BYTES


class _TransferAbandoned(RemoteUnavailableError, FillAbandoned):
    """A read given up on while Mooncake may still write into its target."""

    def __init__(self, message: str, call: "Future[Any]") -> None:
        super().__init__(message)
        self._call = call

    def after(self, release: Callable[[], None]) -> None:
        self._call.add_done_callback(lambda _: release())


class _RangeReader(ValueReader):
    """One value in the store: its first bytes from the batch's head read, the rest by ranged
    reads straight into the reader's memory, the whole payload in one read (`fill_piece`)."""

    def __init__(self, size: int, head: memoryview, read_range: Callable[[int, memoryview], None]) -> None:
        super().__init__(size)
        self._head = head
        self._read_range = read_range
        self.fill_piece = size

    def _fill(self, view: memoryview) -> int:
        start = self.size - self.remaining
        if start < self._head.nbytes:
            n = min(view.nbytes, self._head.nbytes - start)
            view[:n] = self._head[start : start + n]
            return n
        self._read_range(start, view)
        return view.nbytes

    def drain(self) -> None:
        """Nothing to skip: what is not read stays in the store."""
        self._left = 0


def _memory_replica_size(replicas: Sequence[Any]) -> Optional[int]:
    """The value's size from the master's replica descriptors (None: no replica in memory)."""
    for replica in replicas:
        if replica.is_memory_replica():
            return int(replica.get_memory_descriptor().buffer_descriptor.size)
    return None


class MooncakeStoreConnector(RemoteConnector):
    """One Mooncake Store client as a `RemoteConnector`."""

    def __init__(
        self,
        master: Tuple[str, int],
        settings: MooncakeSettings,
        timeout: float = 10.0,
        lookup_timeout: float = 1.0,
        pool_size: int = 4,
        max_value_bytes: Optional[int] = None,
    ) -> None:
        """`max_value_bytes` caps a put (default and ceiling: `local_buffer_size`, so that a
        client reading whole values into that buffer, as Mooncake's own gets do, can read it)."""
        self._master = master
        self._settings = settings
        self._timeout = timeout
        self._lookup_timeout = lookup_timeout
        self._max_value = min(max_value_bytes or settings.local_buffer_size, settings.local_buffer_size)
        self._lock = threading.Lock()
        self._store: Any = None
        self._setup: Optional[threading.Thread] = None
        self._setup_done = threading.Event()
        self._setup_error = ""
        self._calls = ThreadPoolExecutor(max_workers=pool_size, thread_name_prefix="lmcache-mooncake",
                                         initializer=thread_initializer("lmc-mooncake", background=False))
        self._slots = threading.BoundedSemaphore(pool_size)
        self._refused = 0
        self._failed_gets = 0
        self._session_lock = threading.Lock()
        self._sessions: Dict[str, int] = {}  # key -> get batches reading it now
        self._closed = False
        # Set up now, while vLLM is still starting: a first request that found the setup still
        # running (seconds on a busy machine) would take the tier for down and miss.
        self._begin_setup()

    @property
    def url(self) -> str:
        host, port = self._master
        return f"{MOONCAKE_SCHEME}://[{host}]:{port}" if ":" in host else f"{MOONCAKE_SCHEME}://{host}:{port}"

    # ---- the store's operations ---------------------------------------------------------

    def batched_exists(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        codes = self._call("batch_is_exist", self._lookup_timeout, list(keys))
        self._raise_if_unreachable(codes, "exists")
        return [code == 1 for code in codes]

    def batched_get(self, keys: Sequence[str]) -> list[Optional[Buffer]]:
        out: List[Optional[Buffer]] = [None] * len(keys)

        def keep(i: int, reader: Any) -> None:
            out[i] = bytes(reader.read(reader.remaining))

        self.batched_get_into(keys, keep)
        return out

    def batched_get_into(self, keys: Sequence[str], receive: Receive) -> None:
        """Ranged reads in a get session: the master is asked once for where every value lies
        (which also leases them), each value's first `_HEAD_BYTES` come in one batch, and
        `receive` reads the rest straight into its own memory, one transfer per read. A key
        listed but not readable (its segment's owner left, its lease ran out) is a miss."""
        if not keys:
            return
        keys = list(keys)
        with self._get_session(keys) as sizes:
            if not sizes:
                return
            ready = sorted(sizes)
            heads = np.empty((len(ready), _HEAD_BYTES), dtype=np.uint8)
            lengths = [min(sizes[i], _HEAD_BYTES) for i in ready]
            codes = self._call_into(
                "batch_get_into_multi_buffer_ranges", heads, [keys[i] for i in ready],
                [[heads[j].ctypes.data] for j in range(len(ready))], [[n] for n in lengths], [[0]] * len(ready),
            )  # fmt: skip
            unread = [keys[i] for i, code, n in zip(ready, codes, lengths) if code != n]
            if unread:
                self._count_failed_gets(len(unread), unread[0])
            for j, (i, code, n) in enumerate(zip(ready, codes, lengths)):
                if code == n:
                    receive(i, _RangeReader(sizes[i], memoryview(heads[j, :n]), partial(self._read_range, keys[i])))

    @contextmanager
    def _get_session(self, keys: List[str]) -> Iterator[Dict[int, int]]:
        """A get session over `keys`: {index: value size} of those the master lists. A key two
        batches read at once stays in its session until the last of them ends it (Mooncake keeps
        one session per key: counting, starting and ending are serialized by `_session_lock`)."""
        with self._session_lock:
            for key in keys:
                self._sessions[key] = self._sessions.get(key, 0) + 1
            try:
                codes = self._call("batch_get_session_start", self._timeout, keys)
            except RemoteUnavailableError:
                self._leave_sessions(keys)
                raise
        try:
            self._raise_if_unreachable(codes, "get")
            listed = [key for key, code in zip(keys, codes) if code == 0]
            replicas = self._call("batch_get_replica_desc", self._timeout, listed) if listed else {}
            sizes: Dict[int, int] = {}
            for i, key in enumerate(keys):
                size = _memory_replica_size(replicas.get(key) or [])
                if codes[i] == 0 and size is not None:
                    sizes[i] = size
            if len(sizes) < len(listed):  # listed, but no longer in memory
                self._count_failed_gets(len(listed) - len(sizes), listed[0])
            yield sizes
        finally:
            with self._session_lock:
                self._leave_sessions(keys)

    def _leave_sessions(self, keys: List[str]) -> None:
        """One batch less reading `keys`; the sessions no batch reads any more end (with
        `_session_lock` held)."""
        done = []
        for key in keys:
            self._sessions[key] -= 1
            if not self._sessions[key]:
                del self._sessions[key]
                done.append(key)
        if done:
            try:
                self._call("batch_get_session_end", self._timeout, done)
            except RemoteUnavailableError:
                pass  # the master is gone, or the client closed: nothing is left to end

    def _read_range(self, key: str, offset: int, view: memoryview) -> None:
        """`view`'s bytes from the value's byte `offset` on, read straight into `view`."""
        target = np.frombuffer(view, dtype=np.uint8)
        codes = self._call_into("batch_get_into_multi_buffer_ranges", target, [key], [[target.ctypes.data]],
                                [[target.nbytes]], [[offset]])
        self._raise_if_unreachable(codes, "get")
        if codes[0] != target.nbytes:  # gone meanwhile, or its lease ran out: a miss
            self._count_failed_gets(1, key)
            raise ValueError(f"{self.url}: {key} could not be read (Mooncake error {codes[0]})")

    def batched_put(self, items: Sequence[Tuple[str, Value]]) -> list[bool]:
        results = [False] * len(items)
        keys: List[str] = []
        pointers: List[List[int]] = []
        sizes: List[List[int]] = []
        arrays: List[np.ndarray] = []  # keep every part's buffer alive until the call returns
        slots: List[int] = []
        for i, (key, value) in enumerate(items):
            if value_nbytes(value) > self._max_value:
                self._count_refused(f"{key}: {value_nbytes(value)} bytes exceed {self._max_value} "
                                    "(mooncake_local_buffer_size bounds what a get can read back)")
                continue
            parts = [np.frombuffer(buf, dtype=np.uint8) for buf in value_buffers(value) if memoryview(buf).nbytes]
            arrays.extend(parts)
            keys.append(key)
            pointers.append([part.ctypes.data for part in parts])
            sizes.append([part.nbytes for part in parts])
            slots.append(i)
        if not keys:
            return results
        codes = self._call("batch_put_from_multi_buffers", self._timeout, keys, pointers, sizes)
        self._raise_if_unreachable(codes, "put")
        for slot, key, code in zip(slots, keys, codes):
            if code == 0:
                results[slot] = True
            else:
                self._count_refused(f"{key}: Mooncake error {code} (no space in the pool's segments?)")
        return results

    def delete(self, key: str) -> bool:
        code = self._call("remove", self._timeout, key)
        self._raise_if_unreachable([code], "delete")
        return code == 0

    def ping(self) -> None:
        """Set up (waiting up to `timeout` for it) and ask the master one question."""
        self._store_or_raise(self._timeout)
        self.batched_exists([_PROBE_KEY])

    def close(self) -> None:
        with self._lock:
            self._closed = True
            store, self._store = self._store, None
        self._calls.shutdown(wait=False, cancel_futures=True)
        if store is not None:
            store.close()

    # ---- setup and timed calls ----------------------------------------------------------

    def _store_or_raise(self, wait: float) -> Any:
        """The set-up client; a setup in the background if none runs; at most `wait` seconds."""
        with self._lock:
            if self._closed:
                raise RemoteUnavailableError(f"{self.url}: connector closed")
            if self._store is not None:
                return self._store
        self._begin_setup().wait(wait)
        with self._lock:
            if self._store is not None:
                return self._store
            reason = self._setup_error if self._setup_done.is_set() else f"setup still running after {wait:.1f} s"
        raise RemoteUnavailableError(f"{self.url}: Mooncake client not set up ({reason})")

    def _begin_setup(self) -> threading.Event:
        """Start a setup thread unless one runs or the client is set up; its done event."""
        with self._lock:
            if self._store is None and not self._closed and (self._setup is None or not self._setup.is_alive()):
                self._setup_done.clear()
                self._setup = threading.Thread(target=prepared(self._run_setup, "lmc-mooncake-set", background=False),
                                               name="lmcache-mooncake-setup", daemon=True)
                self._setup.start()
            return self._setup_done

    def _run_setup(self) -> None:
        s = self._settings
        store = MooncakeDistributedStore()
        error = ""
        try:
            # Mooncake's setup holds the GIL while it retries an absent master (~90 s, every
            # Python thread stopped): it runs only once the master accepts a connection.
            socket.create_connection(self._master, timeout=self._lookup_timeout).close()
            host, port = self._master
            code = store.setup(s.hostname_towards(self._master), s.metadata_server, s.global_segment_size,
                               s.local_buffer_size, s.protocol, s.device_name, f"{host}:{port}")
            if code != 0:
                error = f"setup returned {code}: master unreachable or settings refused"
        except (OSError, RuntimeError, ValueError) as err:
            error = f"setup failed: {err}"
        with self._lock:
            if error or self._closed:
                self._setup_error = error or "closed"
            else:
                self._store = store
            keep = self._store is store
        if not keep:  # failed, or closed meanwhile: nothing may hold its segment
            store.close()
        self._setup_done.set()

    def _call(self, method: str, timeout: float, *args: Any) -> Any:
        """`store.<method>(*args)` on a call thread, waited for at most `timeout` seconds."""
        future = self._submit(method, timeout, *args)
        try:
            return future.result(timeout=timeout)
        except FutureTimeout:
            raise RemoteUnavailableError(f"{self.url}: {method} did not return within {timeout:.1f} s") from None

    def _call_into(self, method: str, target: np.ndarray, *args: Any) -> Any:
        """`_call` of a read into `target`. When it is given up on, Mooncake may still write into
        `target` (for up to its own transfer timeout): `target` is kept alive until it returns,
        and `_TransferAbandoned` lets whoever owns the memory free it only then."""
        future = self._submit(method, self._timeout, *args)
        try:
            return future.result(timeout=self._timeout)
        except FutureTimeout:
            future.add_done_callback(lambda _, keep=target: None)
            raise _TransferAbandoned(f"{self.url}: {method} did not return within {self._timeout:.1f} s", future) from None

    def _submit(self, method: str, timeout: float, *args: Any) -> "Future[Any]":
        store = self._store_or_raise(self._lookup_timeout)
        if not self._slots.acquire(timeout=timeout):
            raise RemoteUnavailableError(f"{self.url}: every call thread is still waiting on Mooncake")
        fn: Callable[..., Any] = getattr(store, method)
        try:
            future = self._calls.submit(fn, *args)
        except RuntimeError as err:  # closed meanwhile
            self._slots.release()
            raise RemoteUnavailableError(f"{self.url}: {err}") from err
        future.add_done_callback(lambda _: self._slots.release())
        return future

    def _raise_if_unreachable(self, codes: Sequence[int], what: str) -> None:
        if any(code == RPC_FAIL for code in codes):
            raise RemoteUnavailableError(f"{self.url}: {what}: the master did not answer (RPC_FAIL)")

    def _count_refused(self, why: str) -> None:
        with self._lock:
            self._refused += 1
            n = self._refused
        if n % _LOG_EVERY == 1:
            logger.warning("%s refused a put: %s (%d refused so far)", self.url, why, n)

    def _count_failed_gets(self, n: int, example: str) -> None:
        with self._lock:
            before = self._failed_gets
            self._failed_gets += n
        if before // _LOG_EVERY != self._failed_gets // _LOG_EVERY or before == 0:
            logger.warning("%s lists %d value(s) it could not hand back (e.g. %s: its segment's owner left?): "
                           "miss (%d so far)", self.url, n, example, self._failed_gets)
