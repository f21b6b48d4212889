"""The local disk tier: one self-describing file per chunk, written off the serving thread.

- Writes go to a background writer thread (started on the first put, not at construction);
  the serving thread only queues them. Until a write lands, the pending object stays readable.
  The writer runs at idle priority, so while every core is busy it may wait, and the chunks
  waiting for it pin CPU-tier memory. Once `max_pending_bytes` wait (half that tier's pool by
  default), further writes go to a catch-up writer of normal priority instead, so a busy machine
  never has more than that pinned by writes (nor drops any).
- A file is written to a temporary name and `os.replace`d into place, so a reader sees either
  nothing or a whole file. Its name comes from a hash of the key string, never from user text.
- Every file starts with a `chunk_format` header. A file that is truncated, corrupted, foreign
  or not what the index expects is a miss and is deleted.
- The index (key -> file) is rebuilt on start from the directory's headers, so a new process
  finds what an earlier one wrote. Only regular files are read (opened non-blocking, without
  following links), so a FIFO or device named like a chunk cannot hang the scan. Total file
  size is bounded; the least recently used files go.
- Others may delete files or the whole directory: a lookup or read that finds a file gone
  forgets its entry (so the chunk is written again by the next store), and a write that finds
  the directory gone recreates it. Nothing here raises into the engine: a failure is a miss or
  a dropped write, logged and counted.
- Prefetch reads a file on a background reader thread into the CPU tier.
"""

import asyncio
import enum
import hashlib
import os
import stat
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from lmcache.background_threads import hurry, prepare_thread, thread_initializer
from lmcache.experimental.holdings import TierHoldings
from lmcache.experimental.memory_management import MemoryFormat, MemoryObj
from lmcache.experimental.stats import TierStats
from lmcache.experimental.storage_backend import chunk_format, hash_thread
from lmcache.experimental.storage_backend.abstract_backend import TIER_CLOSE_TIMEOUT_S, ClosedWrites, StorageBackendInterface
from lmcache.experimental.storage_backend.local_cpu_backend import LocalCPUBackend
from lmcache.logging import init_logger
from lmcache.utils import CacheEngineKey

logger = init_logger(__name__)

FILE_SUFFIX = ".lmck"
TMP_SUFFIX = ".tmp"
# Idle writer's backlog bound where the CPU tier has no fixed pool to take half of.
DEFAULT_MAX_PENDING_BYTES = 1 << 30


@dataclass(frozen=True)
class DiskEntry:
    """What the index knows about one chunk file."""

    path: str
    file_size: int
    shape: Tuple[int, ...]
    dtype: Optional[torch.dtype]
    fmt: MemoryFormat


@dataclass
class _PutTask:
    """A queued write; it holds one reference of `obj` until the write is done or dropped."""

    obj: MemoryObj
    cancelled: bool = False


class _Read(enum.Enum):
    """How reading one indexed chunk file went."""

    OK = "ok"
    BAD = "bad"  # corrupted, truncated, foreign, not a regular file: delete it
    MISSING = "missing"  # someone else removed it: forget the entry
    NO_MEMORY = "no_memory"  # the CPU tier is full: a miss, the file stays


def _open_regular(path: str):
    """Open `path` for reading only if it is a regular file.

    Non-blocking and without following a symlink, so a FIFO (or a link to one) named like a
    chunk returns at once instead of waiting for a writer; `OSError` otherwise."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def file_name_for(key: CacheEngineKey) -> str:
    """The chunk file name of `key`: a 128-bit hash of its string form."""
    return hashlib.blake2b(key.to_string().encode("utf-8"), digest_size=16).hexdigest() + FILE_SUFFIX


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class LocalDiskBackend(StorageBackendInterface):
    """Chunk files under `path`, at most `max_size_bytes` of them (headers included); beyond
    `max_pending_bytes` of chunks waiting for the idle writer, writes go to the catch-up writer."""

    def __init__(
        self,
        path: str,
        max_size_bytes: int,
        local_cpu_backend: LocalCPUBackend,
        stats: Optional[TierStats] = None,
        max_pending_bytes: Optional[int] = None,
    ) -> None:
        if max_size_bytes <= 0:
            raise ValueError(f"LocalDiskBackend max_size_bytes must be positive, got {max_size_bytes}")
        if max_pending_bytes is None:
            pool = local_cpu_backend.memory_allocator.total_bytes
            max_pending_bytes = pool // 2 if pool is not None else DEFAULT_MAX_PENDING_BYTES
        if max_pending_bytes <= 0:
            raise ValueError(f"LocalDiskBackend max_pending_bytes must be positive, got {max_pending_bytes}")
        self._max_pending_bytes = max_pending_bytes
        self._idle_pending_bytes = 0  # of chunks queued on the idle writer
        self._dir = os.path.abspath(path)
        os.makedirs(self._dir, exist_ok=True)
        self._max_bytes = max_size_bytes
        self._cpu = local_cpu_backend
        self._stats = stats if stats is not None else TierStats()
        self._lock = threading.Lock()
        self._index: "OrderedDict[CacheEngineKey, DiskEntry]" = OrderedDict()
        self._used_bytes = 0
        self._put_tasks: Dict[CacheEngineKey, _PutTask] = {}
        self._settled = threading.Condition(self._lock)  # notified as writes leave `_put_tasks`
        self._failed_writes = 0  # queued writes that did not land (`close` reports them)
        self._prefetch_tasks: Dict[CacheEngineKey, Future] = {}
        self._writer_pool: Optional[ThreadPoolExecutor] = None
        self._writer_thread: Optional[threading.Thread] = None  # the idle writer, once started
        self._catch_up_pool: Optional[ThreadPoolExecutor] = None
        self._reader_pool: Optional[ThreadPoolExecutor] = None
        self._tmp_seq = 0
        self._closed = False
        self._hash_thread = hash_thread.HashThread("lmc-disk-hash")
        self._rebuild_index()

    # ---- index ---------------------------------------------------------------------------

    @property
    def path(self) -> str:
        return self._dir

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._used_bytes

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    def keys(self) -> List[CacheEngineKey]:
        """Keys with a finished file, least recently used first."""
        with self._lock:
            return list(self._index)

    def report_holdings_to(self, holdings: TierHoldings) -> None:
        """Report from now on, starting with the chunks found in the directory at start."""
        with self._lock:
            self.holdings = holdings
            for key in self._index:
                holdings.admitted(key, "found at start")

    def key_to_path(self, key: CacheEngineKey) -> str:
        return os.path.join(self._dir, file_name_for(key))

    def _rebuild_index(self) -> None:
        """Index every valid chunk file in the directory (oldest first); delete bad ones."""
        found: List[Tuple[float, CacheEngineKey, DiskEntry]] = []
        with os.scandir(self._dir) as entries:
            names = [e.name for e in entries if e.is_file(follow_symlinks=False)]
        for name in names:
            path = os.path.join(self._dir, name)
            if name.endswith(TMP_SUFFIX) and name.startswith("."):
                self._remove_stale_tmp(name, path)
            elif name.endswith(FILE_SUFFIX):
                scanned = self._scan_file(name, path)
                if scanned is None:
                    self._stats.record_rejected()
                    self._unlink(path)
                else:
                    found.append(scanned)
        found.sort(key=lambda item: item[0])
        with self._lock:
            for _, key, entry in found:
                self._index[key] = entry
                self._used_bytes += entry.file_size
            self._make_room(0)
        if found:
            logger.info("disk tier %s: found %d chunks (%d bytes)", self._dir, len(found), self._used_bytes)

    def _scan_file(self, name: str, path: str) -> Optional[Tuple[float, CacheEngineKey, DiskEntry]]:
        try:
            with _open_regular(path) as f:
                header = chunk_format.read_header(f)
                st = os.fstat(f.fileno())
        except OSError as err:
            logger.warning("disk tier: cannot read %s: %s", path, err)
            return None
        if header is None:
            logger.warning("disk tier: %s has no valid chunk header; removing it", path)
            return None
        try:
            key = CacheEngineKey.from_string(header.key)
        except ValueError as err:
            logger.warning("disk tier: %s: %s; removing it", path, err)
            return None
        if file_name_for(key) != name or st.st_size != header.size + header.payload_len:
            logger.warning("disk tier: %s does not match its header (name or length); removing it", path)
            return None
        entry = DiskEntry(path, st.st_size, header.shape, header.dtype, header.fmt)
        return st.st_mtime, key, entry

    def _remove_stale_tmp(self, name: str, path: str) -> None:
        """Delete a temporary file whose writer process is gone (a crash mid-write)."""
        parts = name.split(".")
        # "." + file name + "." + pid + "." + seq + ".tmp" -> ["", hash, "lmck", pid, seq, "tmp"]
        pid = int(parts[3]) if len(parts) == 6 and parts[3].isdigit() else None
        # A live writer (another process, or another tier object in this one) may still be
        # writing it: only files of dead processes are removed.
        if pid is None or (pid != os.getpid() and not _pid_alive(pid)):
            self._unlink(path)

    def _unlink(self, path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as err:
            logger.warning("disk tier: cannot remove %s: %s", path, err)

    def _make_room(self, nbytes: int) -> None:
        """Evict least recently used files until `nbytes` more fit (caller holds the lock)."""
        while self._index and self._used_bytes + nbytes > self._max_bytes:
            key, entry = self._index.popitem(last=False)
            self._used_bytes -= entry.file_size
            self._unlink(entry.path)
            self._stats.record_eviction(entry.file_size)
            self.holdings.lost(key, "eviction")

    def insert_key(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        """Index the finished file of `key` holding `memory_obj`'s chunk, evicting to fit."""
        meta = memory_obj.metadata
        path = self.key_to_path(key)
        entry = DiskEntry(path, os.path.getsize(path), tuple(meta.shape), meta.dtype, meta.fmt)
        with self._lock:
            self._insert_locked(key, entry)

    def _insert_locked(self, key: CacheEngineKey, entry: DiskEntry) -> None:
        old = self._index.pop(key, None)
        if old is not None:
            self._used_bytes -= old.file_size
        self._make_room(entry.file_size)
        self._index[key] = entry
        self._used_bytes += entry.file_size
        if old is None:
            self.holdings.admitted(key)

    # ---- interface -------------------------------------------------------------------------

    def contains(self, key: CacheEngineKey) -> bool:
        with self._lock:
            if key in self._put_tasks:
                return True
            entry = self._index.get(key)
        if entry is None:
            return False
        if os.path.isfile(entry.path):
            return True
        self._forget(key, entry, "is gone")
        return False

    def _forget(self, key: CacheEngineKey, entry: DiskEntry, why: str) -> None:
        """Drop `key`'s entry (if it is still `entry`) after its file turned out missing."""
        with self._lock:
            if self._index.get(key) is not entry:
                return
            del self._index[key]
            self._used_bytes -= entry.file_size
        self.holdings.lost(key, "file gone")
        logger.info("disk tier: %s %s; forgetting chunk %s", entry.path, why, key.chunk_hash)

    def exists_in_put_tasks(self, key: CacheEngineKey) -> bool:
        with self._lock:
            return key in self._put_tasks

    def submit_put_task(self, key: CacheEngineKey, obj: MemoryObj) -> None:
        """Queue a write of `obj` (returns at once); a chunk already on disk is not rewritten."""
        if obj.get_size() > self._max_bytes:
            logger.warning("disk tier: chunk %s (%d bytes) exceeds the tier size", key.chunk_hash, obj.get_size())
            return
        with self._lock:
            if self._closed:
                logger.debug("disk tier closed: not writing chunk %s", key.chunk_hash)
                return
            if key in self._index or key in self._put_tasks:
                return
            task = _PutTask(obj)
            obj.ref_count_up()
            self._put_tasks[key] = task
            # An empty idle queue takes any chunk, so one larger than the bound still goes there.
            room = self._idle_pending_bytes + obj.get_size() <= self._max_pending_bytes
            if room or not self._idle_pending_bytes:
                self._idle_pending_bytes += obj.get_size()
                self._writer().submit(self._run_put_task, key, task, True)
            else:
                self._catch_up_writer().submit(self._run_put_task, key, task, False)

    def _run_put_task(self, key: CacheEngineKey, task: _PutTask, idle: bool) -> None:
        saved = False
        try:
            saved = not task.cancelled and self._save(key, task)  # given up at close: not written
        finally:
            with self._lock:
                if self._put_tasks.get(key) is task:
                    del self._put_tasks[key]
                if idle:
                    self._idle_pending_bytes -= task.obj.get_size()
                self._failed_writes += not saved
                self._settled.notify_all()
            task.obj.ref_count_down()

    def _save(self, key: CacheEngineKey, task: Optional[_PutTask], obj: Optional[MemoryObj] = None) -> bool:
        """Write one chunk file atomically and index it; False (logged) when it failed."""
        obj = task.obj if task is not None else obj
        assert obj is not None
        path = self.key_to_path(key)
        with self._lock:
            self._tmp_seq += 1
            tmp = os.path.join(self._dir, f".{os.path.basename(path)}.{os.getpid()}.{self._tmp_seq}{TMP_SUFFIX}")
        try:
            payload = chunk_format.memory_obj_payload(obj)
            meta = obj.metadata
            placeholder = bytes(chunk_format.CHECKSUM_BYTES)  # the header's length does not depend on it
            unsummed = chunk_format.encode_header(key, meta.shape, meta.dtype, meta.fmt, payload, placeholder)
            with self._create(tmp) as f:
                # The payload first, each piece hashed right after the write has read it (still in
                # cache: hashing the whole payload first read it from memory twice), then the
                # header; unless the kernel summed the payload as it stored it.
                f.seek(len(unsummed))
                hasher = chunk_format.payload_hasher() if obj.payload_checksum is None else None
                for start, end in chunk_format.hashed_pieces(payload.nbytes):
                    f.write(payload[start:end])
                    if hasher is not None:
                        hasher.update(payload[start:end])
                checksum = obj.payload_checksum if hasher is None else hasher.digest()
                header = chunk_format.encode_header(key, meta.shape, meta.dtype, meta.fmt, payload, checksum)
                f.seek(0)
                f.write(header)
            entry = DiskEntry(path, len(header) + payload.nbytes, tuple(meta.shape), meta.dtype, meta.fmt)
            with self._lock:
                if task is not None and task.cancelled:
                    self._unlink(tmp)
                    return False
                os.replace(tmp, path)
                self._insert_locked(key, entry)
        except (OSError, ValueError) as err:
            logger.warning("disk tier: writing chunk %s failed: %s", key.chunk_hash, err)
            self._stats.record_error()
            self._unlink(tmp)
            self.holdings.lost(key, "write failed")
            return False
        self._stats.record_write(payload.nbytes)
        return True

    def _create(self, tmp: str):
        """Open `tmp` for writing; a cache directory someone removed is created again (and
        every entry of the old one forgotten: its files went with it)."""
        try:
            return open(tmp, "wb")
        except FileNotFoundError:
            if os.path.isdir(self._dir):
                raise
        os.makedirs(self._dir, exist_ok=True)
        with self._lock:
            lost = len(self._index)
            self._index.clear()
            self._used_bytes = 0
        self.holdings.cleared("directory removed")
        logger.warning("disk tier: %s was removed; created it again (%d chunks lost)", self._dir, lost)
        return open(tmp, "wb")

    def get_blocking(self, key: CacheEngineKey) -> Optional[MemoryObj]:
        with self._lock:
            task = self._put_tasks.get(key)
            if task is not None and not task.cancelled:
                # Still queued for writing: the object is right here in memory.
                task.obj.ref_count_up()
                self._stats.record_read(task.obj.get_size())
                return task.obj
            prefetch = self._prefetch_tasks.get(key)
        obj = self._cpu.get_after_prefetch(prefetch, key)
        return obj if obj is not None else self._load_indexed(key)

    def _load_indexed(self, key: CacheEngineKey) -> Optional[MemoryObj]:
        """Read `key`'s file; drop it from the index and disk when it turns out to be bad."""
        with self._lock:
            entry = self._index.get(key)
            if entry is None:
                return None
            self._index.move_to_end(key)
        obj, outcome = self._read_file(entry.path, entry.dtype, entry.shape, entry.fmt, key)
        if outcome is _Read.BAD:
            self._stats.record_rejected()
            with self._lock:
                if self._index.get(key) is entry:
                    del self._index[key]
                    self._used_bytes -= entry.file_size
                    self._unlink(entry.path)
                    self.holdings.lost(key, "corrupt")
        elif outcome is _Read.MISSING:
            self._forget(key, entry, "was removed by someone else")
        if obj is not None:
            self._stats.record_read(obj.get_size())
        return obj

    def _read_file(
        self,
        path: str,
        dtype: Optional[torch.dtype],
        shape: Optional[Tuple[int, ...]],
        fmt: Optional[MemoryFormat],
        key: Optional[CacheEngineKey],
    ) -> Tuple[Optional[MemoryObj], _Read]:
        """The object (or None) and how the read went; never raises."""
        obj: Optional[MemoryObj] = None
        try:
            with _open_regular(path) as f:
                header = chunk_format.read_header(f)
                if header is None or not chunk_format.header_matches(header, key, shape, dtype, fmt):
                    logger.warning("disk tier: %s is not the expected chunk", path)
                    return None, _Read.BAD
                obj = self._cpu.allocate(torch.Size(header.shape), header.dtype, header.fmt)
                if obj is None:
                    logger.info("disk tier: no memory to load %s", path)
                    return None, _Read.NO_MEMORY
                payload = chunk_format.memory_obj_payload(obj)
                hasher = self._hash_thread.payload()
                got = 0
                try:
                    for start, end in chunk_format.hashed_pieces(payload.nbytes, hash_thread.PIECE):
                        while got < end:  # the hash thread takes each piece while the next is read
                            n = f.readinto(payload[got:end])
                            if not n:
                                break
                            got += n
                        if got < end:
                            break
                        hasher.update(payload[start:end])
                    intact = got == header.payload_len and not f.read(1)
                finally:
                    checksum = hasher.digest()  # also waits until the thread is done with `payload`
            if intact and checksum == header.checksum:
                return obj, _Read.OK
            logger.warning("disk tier: %s is truncated or corrupted", path)
            outcome = _Read.BAD
        except FileNotFoundError:
            outcome = _Read.MISSING  # evicted, or removed by someone else meanwhile
        except Exception as err:  # an unreadable file, or one the CPU tier cannot allocate for
            logger.warning("disk tier: cannot read %s: %r", path, err)
            outcome = _Read.BAD
        if obj is not None:
            obj.ref_count_down()
        return None, outcome

    def load_bytes_from_disk(
        self, path: str, dtype: Optional[torch.dtype], shape: Optional[Tuple[int, ...]],
        fmt: Optional[MemoryFormat], key: Optional[CacheEngineKey] = None,
    ) -> Optional[MemoryObj]:
        """Read one chunk file into a new object if it is intact and matches (None = don't care)."""
        obj, _ = self._read_file(path, dtype, None if shape is None else tuple(shape), fmt, key)
        return obj

    def load_disk(
        self,
        path: str,
        backend: str = "bytes",
        dtype: Optional[torch.dtype] = None,
        shape: Optional[Tuple[int, ...]] = None,
        fmt: Optional[MemoryFormat] = None,
    ) -> Optional[MemoryObj]:
        """Read a chunk file with the named reader; only the "bytes" (chunk_format) one exists."""
        if backend != "bytes":
            raise ValueError(f"LocalDiskBackend.load_disk: unknown backend {backend!r} (only 'bytes')")
        return self.load_bytes_from_disk(path, dtype, shape, fmt)

    async def async_save_bytes_to_disk(self, key: CacheEngineKey, memory_obj: MemoryObj) -> bool:
        """Write `memory_obj` under `key` on the writer thread; the caller keeps its reference."""
        loop = asyncio.get_running_loop()
        with self._lock:
            pool = self._writer()
        return await loop.run_in_executor(pool, self._save, key, None, memory_obj)

    async def async_load_bytes_from_disk(
        self, path: str, dtype: Optional[torch.dtype], shape: Optional[Tuple[int, ...]],
        fmt: Optional[MemoryFormat], key: Optional[CacheEngineKey] = None,
    ) -> Optional[MemoryObj]:
        """`load_bytes_from_disk` on the reader thread."""
        loop = asyncio.get_running_loop()
        with self._lock:
            pool = self._reader()
        return await loop.run_in_executor(pool, self.load_bytes_from_disk, path, dtype, shape, fmt, key)

    def submit_prefetch_task(self, key: CacheEngineKey) -> bool:
        """Start reading `key` into the CPU tier; False if not on disk or already there/going."""
        if not self._cpu.keeps_objects or self._cpu.contains(key):
            return False
        with self._lock:
            if self._closed or key not in self._index or key in self._prefetch_tasks:
                return False
            future: Future = Future()
            self._prefetch_tasks[key] = future
            self._reader().submit(self._run_prefetch, key, future)
        return True

    def _run_prefetch(self, key: CacheEngineKey, future: Future) -> None:
        try:
            obj = self._load_indexed(key)
            if obj is not None:
                self._cpu.submit_put_task(key, obj)
                obj.ref_count_down()
        except Exception as err:  # a failed prefetch is only a lost optimisation
            logger.warning("disk tier: prefetch of chunk %s failed: %s", key.chunk_hash, err)
            self._stats.record_error()
        finally:
            with self._lock:
                self._prefetch_tasks.pop(key, None)
            future.set_result(None)

    def remove(self, key: CacheEngineKey) -> bool:
        with self._lock:
            removed = False
            task = self._put_tasks.pop(key, None)
            if task is not None:
                task.cancelled = True  # the writer drops it; it still releases its reference
                removed = True
            entry = self._index.pop(key, None)
            if entry is not None:
                self._used_bytes -= entry.file_size
                self._unlink(entry.path)
                self.holdings.lost(key, "remove")
                removed = True
            return removed

    def flush(self) -> None:
        """Wait until every write queued so far has landed (the tier stays open)."""
        with self._lock:
            if self._closed:
                return
            # Each writer is one FIFO thread: its marker done means all before it are.
            markers = [p.submit(lambda: None) for p in (self._writer_pool, self._catch_up_pool) if p is not None]
        for marker in markers:
            marker.result()

    def close(self, timeout_s: Optional[float] = None) -> ClosedWrites:
        """Refuse new writes, wait for the queued ones at most `timeout_s` (default
        `TIER_CLOSE_TIMEOUT_S`) and give up the rest (each writer skips them; a file being written is
        discarded), wait for prefetches."""
        deadline = time.monotonic() + (TIER_CLOSE_TIMEOUT_S if timeout_s is None else timeout_s)
        with self._lock:
            self._closed = True
            queued, failed_before = len(self._put_tasks), self._failed_writes
            writers = [p for p in (self._writer_pool, self._catch_up_pool) if p is not None]
            writer = self._writer_thread
        if writer is not None:
            hurry(writer)  # its queue must not wait for idle CPU now
        with self._settled:
            while self._put_tasks and self._settled.wait(max(0.0, deadline - time.monotonic())):
                pass
            for task in self._put_tasks.values():
                task.cancelled = True
            left = len(self._put_tasks)
            unwritten = left + self._failed_writes - failed_before
        for pool in writers:
            pool.shutdown(wait=False)  # what is left finishes at once, skipped
        if self._reader_pool is not None:
            self._reader_pool.shutdown(wait=True)
        self._hash_thread.close()
        why = "deadline" if left else "write failed" if unwritten else ""
        return ClosedWrites(written=queued - unwritten, unwritten=unwritten, why=why)

    # ---- threads ---------------------------------------------------------------------------

    def _writer(self) -> ThreadPoolExecutor:
        """The single writer thread, created on first use (caller holds the lock)."""
        if self._writer_pool is None:
            self._writer_pool = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="lmcache-disk-write", initializer=self._start_writer,
            )
        return self._writer_pool

    def _start_writer(self) -> None:
        prepare_thread("lmc-disk-write", background=True)
        with self._lock:
            self._writer_thread = threading.current_thread()

    def _catch_up_writer(self) -> ThreadPoolExecutor:
        """The writer of normal priority for what the idle one has no room for (caller holds the
        lock): on a machine busy for long the idle writer may not run at all."""
        if self._catch_up_pool is None:
            self._catch_up_pool = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="lmcache-disk-catch-up",
                initializer=thread_initializer("lmc-disk-catch", background=False),
            )
        return self._catch_up_pool

    def _reader(self) -> ThreadPoolExecutor:
        """The single prefetch thread, created on first use (caller holds the lock)."""
        if self._reader_pool is None:
            self._reader_pool = ThreadPoolExecutor(  # a load may wait for a prefetch: not background
                max_workers=1, thread_name_prefix="lmcache-disk-read",
                initializer=thread_initializer("lmc-disk-read", background=False),
            )
        return self._reader_pool
