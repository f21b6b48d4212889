"""Engine throughput beside the machine's own bandwidth, measured in one run, printed as ratios.

Every ratio is a median over --rounds rounds in which the measured path and its limit run
alternately (the machine is shared and noisy: a slow patch hits both alike); `--json` writes
the rows with every round's time.

- CPU tier: store / retrieve GB/s through `LMCacheEngine` vs `memcpy` (a torch copy of the same
  number of bytes between two host buffers), for every KV layout the CPU backends use (vLLM 0.9.2's
  CPU_IPEX and CPU_PACKED, vLLM 0.32's CPU_ATTN, FLASH) and bfloat16 / float32; the slots are
  vLLM's (whole blocks, in a random block order). The first store into a fresh engine (its pool
  still being faulted in) is reported apart from the steady state. Then the first fill
  (`--first-fill-runs` fresh engines per variant, `--cpu-first-fill-only` for just these): the first
  2.5 GB stored into a fresh 3 GB tier, `--first-fill-gap-s` apart, after its start-up prefault ran
  (as during vLLM's start): the whole tier faulted in (a CPU tier at idle priority), and a window
  ahead of its high-water mark (a staging pool, or no CAP_SYS_NICE); and the steady state of that
  tier, full, every store evicting.
- Disk tier (CPU tier off, so every retrieve reads files): store GB/s until the background writes
  landed (copy out of the KV cache, checksum, write) vs writing files of the same sizes, and the
  writer's share alone (filled chunks into new files: checksum, header, write); retrieve
  GB/s (read, checksum, copy into the KV cache, checked bit-exact) with the files in the page cache
  (warm) and evicted from it with posix_fadvise(DONTNEED) (cold) vs reading the tier's own chunk
  files the same ways: the limit is the file system delivering those bytes, nothing more.
- Node pool (`--pool`): an `lm://` server process with `--unix-socket`, the engine at
  `lm+shm:///PATH` with no CPU tier (`local_cpu=False`), so every retrieve reads the pool: store
  GB/s until the server acknowledged every chunk (reserve, copy out of the KV cache straight into
  the arena's blocks, checksum in place, commit) and retrieve GB/s of a prompt stored before
  (lease, copy out of the arena straight into the KV cache, checked bit-exact) vs memcpy: by the
  engine that stored it (which hashed it at commit) and by another engine reading it for the
  first time (its checksum computed in place first); and the same engine over the same
  server's TCP port (`lm://`) for comparison. Then the first fill: the first 1.5 GB stored into a
  fresh pool by a fresh engine (`--first-fill-runs` new servers per variant), with the engine's
  mapping faulted in first (as during vLLM's start), from the moment it opened, and without the
  mapping's prefault.
- Lookup latency for a 32k-token prompt that is fully cached, and one that misses at once.
- The payload checksum (chunk format 5) a tier computes where the kernel did not (the disk tier
  on every read, a pool's first read of a chunk), one thread: its ceiling.

The geometry is Llama-8B-like by default; the disk rows use the CPU_IPEX bfloat16 case.
Usage: OMP_NUM_THREADS=2 .venv/bin/python scripts/bench/bench_engine.py [--tokens 2048] [--rounds 7]
       [--pool | --pool-only | --cpu-first-fill-only] [--json bench/results/engine.json]
"""

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch

from lmcache.config import LMCacheEngineMetadata
from lmcache.experimental.cache_engine import LMCacheEngine
from lmcache.experimental.config import LMCacheEngineConfig
from lmcache.experimental.gpu_connector import VLLMPagedMemGPUConnectorV2
from lmcache.experimental.kv_layout import KVLayout, layout_shape
from lmcache.experimental.memory_management import MixedMemoryAllocator
from lmcache.experimental.memory_management.host_memory import HUGE_PAGE, PREFAULT_AHEAD, host_buffer
from lmcache.experimental.remote.pool_connector import PoolArena
from lmcache.experimental.storage_backend import GB
from lmcache.experimental.storage_backend.chunk_format import payload_checksum
from lmcache.experimental.token_database import ChunkedTokenDatabase

GIB = 1024**3
CASES = [(KVLayout.CPU_IPEX, 16), (KVLayout.CPU_PACKED, 16), (KVLayout.CPU_ATTN, 32), (KVLayout.FLASH, 16)]


@dataclass(frozen=True)
class Setup:
    layers: int
    heads: int
    head_size: int
    block_size: int
    chunk_size: int
    tokens: int
    dtype: torch.dtype
    layout: KVLayout = KVLayout.CPU_IPEX

    @property
    def hidden(self) -> int:
        return self.heads * self.head_size

    @property
    def kv_bytes(self) -> int:
        """Bytes of K and V for all tokens and layers: what one store/retrieve moves."""
        return 2 * self.layers * self.tokens * self.hidden * self.dtype.itemsize

    @property
    def num_blocks(self) -> int:
        return -(-self.tokens // self.block_size)


def timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def interleaved(rounds: int, contenders: Dict[str, Callable[[], float]]) -> Dict[str, List[float]]:
    """Seconds of every round of each contender, run in turn round by round."""
    times: Dict[str, List[float]] = {name: [] for name in contenders}
    for _ in range(rounds):
        for name, fn in contenders.items():
            times[name].append(fn())
    return times


def make_caches(s: Setup, seed: int) -> List[torch.Tensor]:
    """One layer cache per layer as vLLM hands it over: the CPU backend's (2, num_blocks, block
    elements) for CPU_IPEX / CPU_PACKED, flash's (2, num_blocks, block_size, heads, head_size),
    vLLM 0.32's (num_blocks, heads, block_size, 2 * head_size) for CPU_ATTN. Twice the blocks the
    prompt needs, so the used ones are spread as in a busy server."""
    gen = torch.Generator().manual_seed(seed)
    nb = 2 * s.num_blocks
    if s.layout == KVLayout.CPU_ATTN:
        shape = layout_shape(s.layout, nb, s.block_size, s.heads, s.head_size, s.dtype)
    elif s.layout == KVLayout.FLASH:
        shape = (2, *layout_shape(s.layout, nb, s.block_size, s.heads, s.head_size, s.dtype))
    else:
        shape = (2, nb, s.block_size * s.hidden)
    return [torch.randn(shape, generator=gen).to(s.dtype) for _ in range(s.layers)]


def vllm_slots(s: Setup, seed: int) -> torch.Tensor:
    """Slots as vLLM assigns them: whole blocks, the blocks in a random order."""
    blocks = torch.randperm(2 * s.num_blocks, generator=torch.Generator().manual_seed(seed))[: s.num_blocks]
    pos = torch.arange(s.tokens)
    return (blocks[pos // s.block_size] * s.block_size + pos % s.block_size).to(torch.int64)


def make_engine(s: Setup, cpu_gb: float, allocator: Optional[MixedMemoryAllocator] = None,
                **overrides) -> LMCacheEngine:
    overrides.setdefault("remote_url", None)
    cfg = LMCacheEngineConfig.from_defaults(chunk_size=s.chunk_size, max_local_cpu_size=cpu_gb, **overrides)
    meta = LMCacheEngineMetadata("bench/model", 1, 0, "vllm", s.dtype, (s.layers, 2, s.chunk_size, s.heads, s.head_size))
    conn = VLLMPagedMemGPUConnectorV2(s.hidden, s.layers, layout=s.layout, num_kv_heads=s.heads)
    allocator = allocator or MixedMemoryAllocator(int(cpu_gb * GB), tier=cfg.local_cpu)
    return LMCacheEngine(cfg, meta, allocator, ChunkedTokenDatabase(cfg, meta), conn)


def prompt(s: Setup, seed: int) -> torch.Tensor:
    return torch.randint(0, 32000, (s.tokens,), generator=torch.Generator().manual_seed(seed))


def drop_from_page_cache(paths: List[str]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


class Memcpy:
    """The limit: a torch copy of `nbytes` between two host buffers faulted in ahead."""

    def __init__(self, nbytes: int) -> None:
        self.src = host_buffer(nbytes)
        self.dst = host_buffer(nbytes)
        self.src.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
        self.dst.zero_()

    def __call__(self) -> float:
        return timed(lambda: self.dst.copy_(self.src))


class FileLimit:
    """The disk limit: the same bytes read from the tier's own chunk files (in the retrieve's
    order, into one huge-page buffer faulted in ahead), and written as files of the same sizes
    (unlink the last round's, create, write, close), each file in one call.

    Reads take whichever way was faster in a side test here: a whole file per call from the
    page cache (5.3 vs 5.0 GB/s for 1 MiB calls), 1 MiB calls from disk (2.1 vs 1.6 GB/s: the
    read-ahead of the next piece overlaps the copy of this one)."""

    COLD_PIECE = 1 << 20

    def __init__(self, read_paths: List[str], write_dir: str, data: torch.Tensor) -> None:
        self.read_paths = read_paths
        self.sizes = [os.path.getsize(path) for path in read_paths]
        self.write_paths = [os.path.join(write_dir, f"limit{i}.bin") for i in range(len(read_paths))]
        total = sum(self.sizes)
        self.view = memoryview(data.view(torch.uint8)[:total].numpy())
        # The same kind of memory the tier reads into: huge pages, faulted in ahead.
        self.back = memoryview(host_buffer(total).numpy())
        self.back[:] = self.view

    def write(self) -> float:
        os.sync()  # start clean: the writeback of earlier rounds would throttle whoever writes next

        def run() -> None:
            off = 0
            for path, size in zip(self.write_paths, self.sizes):
                # A new file each time, as the tier writes (and unlinks what it evicts): on ext4 a
                # file truncated and rewritten starts its writeback at close (auto_da_alloc),
                # which the tier's new files do not, so overwriting in place is not the limit.
                if os.path.exists(path):
                    os.unlink(path)
                with open(path, "wb") as f:
                    f.write(self.view[off : off + size])
                off += size

        return timed(run)

    def read(self, cold: bool = False) -> float:
        if cold:
            drop_from_page_cache(self.read_paths)
        piece = self.COLD_PIECE if cold else max(self.sizes)

        def run() -> None:
            off = 0
            for path, size in zip(self.read_paths, self.sizes):
                with open(path, "rb", buffering=0) as f:
                    got = 0
                    while got < size:
                        n = f.readinto(self.back[off + got : off + min(size, got + piece)])
                        assert n, f"{path} is shorter than {size} bytes"
                        got += n
                off += size

        return timed(run)


@dataclass
class Row:
    name: str
    nbytes: int
    times: List[float]
    limit: Optional[str] = None  # the row this one is a ratio of

    @property
    def median_s(self) -> float:
        return statistics.median(self.times)


def cpu_tier_rows(s: Setup, rounds: int, memcpy: Memcpy, seeds) -> List[Row]:
    """Store and retrieve through the CPU tier beside memcpy, plus the first store (fresh pool)."""
    n = s.kv_bytes
    source, target = make_caches(s, 1), make_caches(s, 2)
    slots = vllm_slots(s, 3)
    kv, kv_out = dict(kvcaches=source, slot_mapping=slots), dict(kvcaches=target, slot_mapping=slots)
    engine = make_engine(s, cpu_gb=2.2 * n / GB)  # room for two prompts: every new store evicts
    first = timed(lambda: engine.store(prompt(s, next(seeds)), **kv))
    tokens = prompt(s, 7)
    engine.store(tokens, **kv)
    assert engine.retrieve(tokens, **kv_out).all()
    tag = f"{s.layout.name} {str(s.dtype).replace('torch.', '')}"
    times = interleaved(
        rounds,
        {
            "memcpy": memcpy,
            "store": lambda: timed(lambda: engine.store(prompt(s, next(seeds)), **kv)),
            "memcpy2": memcpy,
            # the stores above evict the oldest prompt: store `tokens` again first (untimed)
            "retrieve": lambda: (engine.store(tokens, **kv), timed(lambda: engine.retrieve(tokens, **kv_out)))[1],
        },
    )
    blocks = torch.unique(slots // s.block_size)
    dim = 0 if s.layout == KVLayout.CPU_ATTN else 1
    for got, want in zip(target, source):  # what came back is what was stored, bit for bit
        assert torch.equal(got.index_select(dim, blocks).view(torch.uint8), want.index_select(dim, blocks).view(torch.uint8))
    engine.close()
    return [
        Row(f"memcpy ({tag} round)", n, times["memcpy"] + times["memcpy2"]),
        Row(f"CPU tier store, {tag}", n, times["store"], f"memcpy ({tag} round)"),
        Row(f"CPU tier retrieve, {tag}", n, times["retrieve"], f"memcpy ({tag} round)"),
        Row(f"CPU tier first store into a fresh engine, {tag}", n, [first], f"memcpy ({tag} round)"),
    ]
def disk_rows(s: Setup, rounds: int, directory: Optional[str], seeds) -> List[Row]:
    """The disk tier (CPU tier off, so every retrieve reads files) beside the same files' bytes."""
    n = s.kv_bytes
    source, target = make_caches(s, 1), make_caches(s, 2)
    slots = vllm_slots(s, 3)
    kv, kv_out = dict(kvcaches=source, slot_mapping=slots), dict(kvcaches=target, slot_mapping=slots)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        disk_dir = os.path.join(tmp, "tier")
        # room for the held chunks of the tier-write row beside one store's or read's objects
        engine = make_engine(s, cpu_gb=2.5 * n / GB, local_cpu=False, local_disk=disk_dir, max_local_disk_size=3.5 * n / GB)
        disk = next(t for t in engine.storage_manager.tiers if t.tier_name == "LocalDiskBackend")

        def store() -> float:
            p = prompt(s, next(seeds))
            os.sync()  # start clean, like the file write: no earlier round's writeback to wait for
            return timed(lambda: (engine.store(p, **kv), disk.flush()))

        store()  # warm-up: directory created
        tokens = prompt(s, 7)
        engine.store(tokens, **kv)
        disk.flush()
        files = [disk.key_to_path(key) for _, _, key in engine.token_database.process_tokens(tokens)]
        flat = torch.randint(0, 256, (n + (1 << 20),), dtype=torch.uint8)  # room for the headers
        seq = FileLimit(files, tmp, flat)
        seq.write()

        keys = [key for _, _, key in engine.token_database.process_tokens(tokens)]
        memcpy = Memcpy(n)

        def retrieve(cold: bool) -> float:
            if cold:
                drop_from_page_cache(files)
            return timed(lambda: engine.retrieve(tokens, **kv_out))

        def tier_read(cold: bool) -> float:
            """What a pinned lookup does on a disk hit: every chunk into a checked memory object."""
            if cold:
                drop_from_page_cache(files)

            def run() -> None:
                objs = [disk.get_blocking(key) for key in keys]
                assert all(obj is not None for obj in objs)
                for obj in objs:
                    obj.ref_count_down()

            return timed(run)

        held = [disk.get_blocking(key) for key in keys]  # filled, checked chunks, as a store hands them over

        def tier_write() -> float:
            """The disk writer's share of a store: filled memory objects into new chunk files."""
            new_keys = [key for _, _, key in engine.token_database.process_tokens(prompt(s, next(seeds)))]
            os.sync()  # start clean, like the file write

            def run() -> None:
                for key, obj in zip(new_keys, held):
                    disk.submit_put_task(key, obj)
                disk.flush()

            return timed(run)

        times = interleaved(
            rounds,
            {
                "file write": seq.write,
                "store": store,
                "tier write": tier_write,
                "file read": seq.read,
                "tier read": lambda: tier_read(False),
                "memcpy": memcpy,
                "warm": lambda: retrieve(False),
                "file read cold": lambda: seq.read(cold=True),
                "tier read cold": lambda: tier_read(True),
                "cold": lambda: retrieve(True),
            },
        )
        assert engine.retrieve(tokens, **kv_out).all()
        for obj in held:
            obj.ref_count_down()
        engine.close()
    blocks = torch.unique(slots // s.block_size)
    for got, want in zip(target, source):  # what came back from disk is what was stored, bit for bit
        assert torch.equal(got.index_select(1, blocks).view(torch.uint8), want.index_select(1, blocks).view(torch.uint8))
    return [
        Row("file write, same sizes", n, times["file write"]),
        Row("disk tier store (until written)", n, times["store"], "file write, same sizes"),
        Row("disk tier write from memory (the writer's share)", n, times["tier write"], "file write, same sizes"),
        Row("file write + memcpy", n, [w + c for w, c in zip(times["file write"], times["memcpy"])]),
        Row("disk tier store (vs write + memcpy)", n, times["store"], "file write + memcpy"),
        Row("file read, page cache", n, times["file read"]),
        Row("disk tier read into memory, page cache", n, times["tier read"], "file read, page cache"),
        Row("disk tier retrieve, page cache", n, times["warm"], "file read, page cache"),
        Row("file read + memcpy, page cache", n, [r + c for r, c in zip(times["file read"], times["memcpy"])]),
        Row("disk tier retrieve, page cache (vs read + memcpy)", n, times["warm"], "file read + memcpy, page cache"),
        Row("file read, cold", n, times["file read cold"]),
        Row("disk tier read into memory, cold", n, times["tier read cold"], "file read, cold"),
        Row("disk tier retrieve, cold", n, times["cold"], "file read, cold"),
        Row("file read + memcpy, cold", n, [r + c for r, c in zip(times["file read cold"], times["memcpy"])]),
        Row("disk tier retrieve, cold (vs read + memcpy)", n, times["cold"], "file read + memcpy, cold"),
    ]


@contextmanager
def pool_server(max_bytes: int) -> Iterator[Tuple[str, str]]:
    """An `lm://` server process with the node pool: (`lm+shm://` URL, `lm://` URL of it)."""
    with tempfile.TemporaryDirectory() as workdir, socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        probe.close()
        path = os.path.join(workdir, "pool.sock")
        proc = subprocess.Popen([sys.executable, "-m", "lmcache.server", "127.0.0.1", str(port), "--unix-socket", path,
                                 "--max-size-gb", str(max_bytes / GB)])
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    if time.monotonic() > deadline or proc.poll() is not None:
                        raise RuntimeError("the pool server did not start")
                    time.sleep(0.1)
            yield f"lm+shm://{path}", f"lm://127.0.0.1:{port}"
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def shared_tier_rows(s: Setup, rounds: int, memcpy: Memcpy, seeds) -> List[Row]:
    """Store (until acknowledged) and retrieve through the node pool and over TCP to the same
    server, no CPU tier, beside memcpy."""
    n = s.kv_bytes
    source, target = make_caches(s, 1), make_caches(s, 2)
    slots = vllm_slots(s, 3)
    kv, kv_out = dict(kvcaches=source, slot_mapping=slots), dict(kvcaches=target, slot_mapping=slots)
    rows: List[Row] = []
    times: Dict[str, List[float]] = {}
    contenders: Dict[str, Callable[[], float]] = {}
    engines = []
    with pool_server(int(4.5 * n)) as urls:
        # A second engine on the pool: every chunk it reads is new to it (its payload hashed).
        reader = make_engine(s, cpu_gb=2.2 * n / GB, remote_url=urls[0], remote_serde="naive", local_cpu=False)
        engines.append(reader)
        for name, url in zip(("pool", "tcp"), urls):
            engine = make_engine(s, cpu_gb=2.2 * n / GB, remote_url=url, remote_serde="naive", local_cpu=False)
            engines.append(engine)
            remote = engine.storage_manager.tiers[-1]

            def store(engine=engine, remote=remote) -> float:
                return timed(lambda: (engine.store(prompt(s, next(seeds)), **kv), remote.flush()))

            def retrieve(engine=engine, remote=remote) -> float:
                tokens = prompt(s, next(seeds))
                engine.store(tokens, **kv)
                assert remote.flush()
                t = timed(lambda: engine.retrieve(tokens, **kv_out))
                assert engine.lookup(tokens) == s.tokens
                return t

            contenders[f"memcpy {name}"] = memcpy
            contenders[f"{name} store"] = store
            contenders[f"memcpy {name} 2"] = memcpy
            contenders[f"{name} retrieve"] = retrieve
            if name == "pool":

                def first_read(engine=engine, remote=remote) -> float:
                    tokens = prompt(s, next(seeds))
                    engine.store(tokens, **kv)
                    assert remote.flush()
                    return timed(lambda: reader.retrieve(tokens, **kv_out))

                contenders["memcpy pool 3"] = memcpy
                contenders["pool first read"] = first_read
        for _ in range(5):  # fault the whole arena in, untimed: rounds then reuse evicted blocks
            store(engines[0], engines[0].storage_manager.tiers[-1])
        times = interleaved(rounds, contenders)
        blocks = torch.unique(slots // s.block_size)
        dim = 0 if s.layout == KVLayout.CPU_ATTN else 1
        for got, want in zip(target, source):  # what came back is what was stored, bit for bit
            assert torch.equal(got.index_select(dim, blocks).view(torch.uint8), want.index_select(dim, blocks).view(torch.uint8))
        for engine in engines:
            engine.close()
    tag = f"{s.layout.name} {str(s.dtype).replace('torch.', '')}"
    for name, label in (("pool", "node pool (lm+shm)"), ("tcp", "lm:// on loopback TCP")):
        limit = f"memcpy ({label} round)"
        rows += [
            Row(limit, n, times[f"memcpy {name}"] + times[f"memcpy {name} 2"]),
            Row(f"{label} store until acknowledged, no CPU tier, {tag}", n, times[f"{name} store"], limit),
            Row(f"{label} retrieve, no CPU tier, {tag}", n, times[f"{name} retrieve"], limit),
        ]
        if name == "pool":
            first = f"memcpy ({label} first-read round)"
            rows += [
                Row(first, n, times["memcpy pool 3"]),
                Row(f"{label} retrieve by an engine reading it first (hashed), {tag}", n, times["pool first read"], first),
            ]
    return rows


# The private CPU tier's first fill: the first 2.5 GB of a fresh 3 GB tier, well past the window a
# staging pool keeps faulted in (`host_memory.PREFAULT_AHEAD`).
CPU_FILL_TIER_BYTES = 3 * GB
CPU_FILL_BYTES = int(2.5 * GB)
# Memory a process just freed comes back cheap for a few seconds on this VM (populating 1 GiB took
# 0.09 s right after a free, 0.4-2.4 s otherwise), so each fresh tier waits this long first.
FRESH_MEMORY_PAUSE_S = 5.0
STEADY_STORES = 5  # per run, once the first-fill tier is full


def cpu_first_fill_rows(s: Setup, runs: int, memcpy: Memcpy, seeds, gap_s: float) -> List[Row]:
    """The first 2.5 GB stored into a fresh 3 GB CPU tier (a new engine each run), per prompt beside
    memcpy, each of the two after a `gap_s` pause (a GPU engine's forward pass between two stores,
    the cores idle), after
    the tier's start-up prefault has run as it does during vLLM's start: the whole tier (a CPU tier
    where the thread runs at idle priority), and a window ahead of the allocator's high-water mark
    (a staging pool, or a tier without CAP_SYS_NICE). Then the steady state of the whole-tier
    case: full, every store evicting and reusing blocks, with the same pauses."""
    n = s.kv_bytes
    count = -(-CPU_FILL_BYTES // n)
    source, slots = make_caches(s, 1), vllm_slots(s, 3)
    kv = dict(kvcaches=source, slot_mapping=slots)
    variants = {"whole": ("faulted in whole at start (idle priority)", True),
                "fault-ahead": (f"faulted in {PREFAULT_AHEAD >> 20} MiB ahead of its high-water mark", False)}
    times: Dict[str, List[float]] = {name: [] for name in [*variants, "steady"]}
    limits: Dict[str, List[float]] = {name: [] for name in times}
    for _ in range(runs):
        for name, (_, tier) in variants.items():
            time.sleep(FRESH_MEMORY_PAUSE_S)
            allocator = MixedMemoryAllocator(CPU_FILL_TIER_BYTES, tier=tier)
            engine = make_engine(s, cpu_gb=CPU_FILL_TIER_BYTES / GB, allocator=allocator)
            ahead = allocator.fault_ahead
            goal = CPU_FILL_TIER_BYTES - CPU_FILL_TIER_BYTES % HUGE_PAGE if tier else PREFAULT_AHEAD
            deadline = time.monotonic() + PREFAULT_WAIT_S
            while ahead is not None and ahead.faulted < goal and time.monotonic() < deadline:
                time.sleep(0.05)
            for _ in range(count):
                # Each after the same pause: a copy after an idle second first wakes torch's thread
                # team and warms the caches (0.71x memcpy with the pause before the store only,
                # 0.98x without pauses, whole-tier case, 20:50 on 2026-11-28).
                tokens = prompt(s, next(seeds))
                time.sleep(gap_s)
                times[name].append(timed(lambda: engine.store(tokens, **kv)))
                time.sleep(gap_s)
                limits[name].append(memcpy())
            if tier:
                fill_up = -(-(CPU_FILL_TIER_BYTES - count * n) // n) + 1  # untimed: the tier full, one evicting
                for i in range(fill_up + STEADY_STORES):
                    tokens = prompt(s, next(seeds))
                    if i < fill_up:
                        engine.store(tokens, **kv)
                        continue
                    time.sleep(gap_s)
                    times["steady"].append(timed(lambda: engine.store(tokens, **kv)))
                    time.sleep(gap_s)
                    limits["steady"].append(memcpy())
            engine.close()
            del engine, allocator, ahead
    tag = f"{s.layout.name} {str(s.dtype).replace('torch.', '')}"
    rows: List[Row] = []
    for name, (what, _) in variants.items():
        limit = f"memcpy (CPU tier first fill, {name})"
        rows += [Row(limit, n, limits[name]),
                 Row(f"CPU tier first fill: {count} prompts into a fresh {CPU_FILL_TIER_BYTES / GB:g} GB tier "
                     f"{gap_s:g} s apart, {what}, {tag}", n, times[name], limit)]
    limit = "memcpy (CPU tier steady state)"
    rows += [Row(limit, n, limits["steady"]),
             Row(f"CPU tier steady state: the same tier full, every store evicting, {gap_s:g} s apart, {tag}", n, times["steady"], limit)]
    return rows


# How long a first-fill run waits for a fresh mapping's (or tier's front's) background prefault:
# vLLM starts for 15 s or more after its connector maps the pool, so a user's first request finds it done.
PREFAULT_WAIT_S = 60.0
FIRST_FILL_BYTES = int(1.5 * GB)


def _prefaulting() -> bool:
    return any(t.name == "lmcache-pool-prefault" for t in threading.enumerate())


def pool_first_fill_rows(s: Setup, runs: int, memcpy: Memcpy, seeds) -> List[Row]:
    """The first 1.5 GB stored into a fresh pool by a fresh engine (a new server each run), per
    prompt beside memcpy: as a user's first requests meet it (the engine's mapping faulted in
    meanwhile, as during vLLM's start), with the stores starting the moment the engine opened,
    and without the mapping's prefault (as before it existed). The steady state - an arena whose
    blocks are reused - is `shared_tier_rows`."""
    n = s.kv_bytes
    count = -(-FIRST_FILL_BYTES // n)
    source, slots = make_caches(s, 1), vllm_slots(s, 3)
    kv = dict(kvcaches=source, slot_mapping=slots)
    variants = {"after start": "faulted in during the engine's start", "at once": "stores from the moment it opened",
                "no prefault": "mapping not faulted in (as before)"}
    times: Dict[str, List[float]] = {name: [] for name in variants}
    limits: Dict[str, List[float]] = {name: [] for name in variants}
    real_prefault = PoolArena.prefault_in_background
    for _ in range(runs):
        for name in variants:
            PoolArena.prefault_in_background = real_prefault if name != "no prefault" else lambda self: None
            try:
                with pool_server(int((count + 1) * n)) as urls:
                    engine = make_engine(s, cpu_gb=2.2 * n / GB, remote_url=urls[0], remote_serde="naive",
                                         local_cpu=False)
                    remote = engine.storage_manager.tiers[-1]
                    deadline = time.monotonic() + PREFAULT_WAIT_S
                    while name == "after start" and _prefaulting() and time.monotonic() < deadline:
                        time.sleep(0.05)
                    for _ in range(count):
                        tokens = prompt(s, next(seeds))
                        times[name].append(timed(lambda: (engine.store(tokens, **kv), remote.flush())))
                        limits[name].append(memcpy())
                    engine.close()
            finally:
                PoolArena.prefault_in_background = real_prefault
    tag = f"{s.layout.name} {str(s.dtype).replace('torch.', '')}"
    rows: List[Row] = []
    for name, what in variants.items():
        limit = f"memcpy (pool first fill, {name})"
        rows += [Row(limit, n, limits[name]),
                 Row(f"node pool first fill: {count} prompts into a fresh pool, {what}, {tag}", n, times[name], limit)]
    return rows


def checksum_rows(s: Setup, rounds: int) -> List[Row]:
    """The payload checksum of one prompt's chunks on one thread, beside memcpy."""
    checksum_src = memoryview(torch.randint(0, 256, (s.kv_bytes,), dtype=torch.uint8).numpy())
    step = s.chunk_size * s.kv_bytes // s.tokens
    memcpy = Memcpy(s.kv_bytes)
    times = interleaved(rounds, {
        "memcpy": memcpy,
        "checksum": lambda: timed(lambda: [payload_checksum(checksum_src[o : o + step]) for o in range(0, s.kv_bytes, step)]),
    })
    return [Row("memcpy (checksum round)", s.kv_bytes, times["memcpy"]),
            Row("payload checksum, one thread", s.kv_bytes, times["checksum"], "memcpy (checksum round)")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--layouts", default=",".join(layout.name for layout, _ in CASES))
    ap.add_argument("--no-disk", action="store_true", help="leave the disk tier rows out")
    ap.add_argument("--disk-only", action="store_true", help="only the disk tier rows")
    ap.add_argument("--pool", action="store_true", help="add the node pool rows (and lm:// to the same server)")
    ap.add_argument("--pool-only", action="store_true", help="only the node pool rows")
    ap.add_argument("--first-fill-runs", type=int, default=3, help="fresh pools / CPU tiers per first-fill variant")
    ap.add_argument("--first-fill-gap-s", type=float, default=1.0,
                    help="seconds between two prompts of the CPU tier's first fill (the engine's forward pass)")
    ap.add_argument("--cpu-first-fill-only", action="store_true", help="only the CPU tier's first-fill rows")
    ap.add_argument("--dir", default=None, help="directory for the disk tier (default: a temp dir)")
    ap.add_argument("--json", default=None, help="write the rows (every round's seconds) here")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    seeds = iter(range(100, 10**6))
    rows: List[Row] = []
    block_sizes = dict(CASES)
    base = Setup(args.layers, args.heads, args.head_size, 16, args.chunk_size, args.tokens, torch.bfloat16)
    if args.pool or args.pool_only:
        rows += shared_tier_rows(base, args.rounds, Memcpy(base.kv_bytes), seeds)
        rows += pool_first_fill_rows(base, args.first_fill_runs, Memcpy(base.kv_bytes), seeds)
    if not (args.disk_only or args.pool_only):
        rows += cpu_first_fill_rows(base, args.first_fill_runs, Memcpy(base.kv_bytes), seeds, args.first_fill_gap_s)
    only = args.disk_only or args.pool_only or args.cpu_first_fill_only
    for layout_name in [] if only else args.layouts.split(","):
        layout = KVLayout[layout_name]
        for dtype_name in args.dtypes.split(","):
            s = Setup(args.layers, args.heads, args.head_size, block_sizes[layout], args.chunk_size, args.tokens,
                      getattr(torch, dtype_name), layout)
            print(f"{layout.name} {dtype_name}: {s.layers} layers x {s.heads} kv heads x {s.head_size}, block "
                  f"{s.block_size}, chunk {s.chunk_size}, {s.tokens} tokens = {s.kv_bytes / GIB:.2f} GiB", flush=True)
            rows += cpu_tier_rows(s, args.rounds, Memcpy(s.kv_bytes), seeds)
    if not args.cpu_first_fill_only:
        rows += checksum_rows(base, args.rounds)
    if not (args.no_disk or args.pool_only or args.cpu_first_fill_only):
        rows += disk_rows(base, args.rounds, args.dir, seeds)

    by_name = {row.name: row for row in rows}
    width = max(len(row.name) for row in rows)
    print(f"{'':{width}} {'GB/s':>8}  ratio to its limit (medians of {args.rounds} interleaved rounds)")
    out = []
    for row in rows:
        rate = gbps(row.nbytes, row.median_s)
        ratio = None if row.limit is None else by_name[row.limit].median_s / row.median_s
        print(f"{row.name:{width}} {rate:8.2f}  {'' if ratio is None else f'{ratio:.2f}'}")
        out.append({"name": row.name, "bytes": row.nbytes, "seconds": row.times, "gbps": rate, "limit": row.limit,
                    "ratio": ratio})
    if not args.cpu_first_fill_only:
        lookup_line(args.chunk_size)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({
                "bench": "engine", "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "machine": f"{platform.node()}: {os.cpu_count()} CPUs, shared with other developers' jobs",
                "torch_threads": torch.get_num_threads(),
                "method": f"median of {args.rounds} rounds; each path and its limit run alternately in every round",
                "rows": out,
            }, f, indent=1)
        print(f"wrote {args.json}")


def lookup_line(chunk_size: int) -> None:
    """Lookup latency of a 32k-token prompt (a tiny geometry keeps memory low)."""
    tiny = Setup(1, 1, 16, 16, chunk_size, 32768, torch.bfloat16)
    engine = make_engine(tiny, cpu_gb=4 * tiny.kv_bytes / GB)
    long_prompt = prompt(tiny, 11)
    engine.store(long_prompt, kvcaches=make_caches(tiny, 4), slot_mapping=torch.arange(tiny.tokens))
    assert engine.lookup(long_prompt) == tiny.tokens
    miss_prompt = prompt(tiny, 12)
    lookups = 20
    hit_s = min(timed(lambda: [engine.lookup(long_prompt) for _ in range(lookups)]) for _ in range(3)) / lookups
    miss_s = min(timed(lambda: [engine.lookup(miss_prompt) for _ in range(lookups)]) for _ in range(3)) / lookups
    engine.close()
    print(f"lookup, {tiny.tokens} tokens ({tiny.tokens // chunk_size} chunks): all cached {hit_s * 1e3:.3f} ms, "
          f"first chunk missing {miss_s * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
