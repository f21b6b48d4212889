"""Tier-level test helpers: remote backends over real servers, small disk tiers, engines sized in
chunks. Test files import from here or `helpers`, never from each other."""

from __future__ import annotations

import os
import shutil
import socket
import struct
import tempfile
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

import pytest
import torch
from helpers import check_loaded, chunk_bytes, config, geometry, key, make_engine, prompt, slots_for
from kv_reference import make_kvcaches

from lmcache.config import LMCacheEngineMetadata
from lmcache.experimental.cache_engine import LMCacheEngine
from lmcache.experimental.memory_management import HostMemoryAllocator, MemoryFormat, MemoryObj
from lmcache.experimental.remote.pool_connector import map_arena
from lmcache.experimental.storage_backend.local_cpu_backend import LocalCPUBackend
from lmcache.experimental.storage_backend.local_disk_backend import LocalDiskBackend
from lmcache.experimental.storage_backend.remote_backend import RemoteBackend, RemoteBackendOptions
from lmcache.server.protocol import HEADER_SIZE, Op, Status, parse_header, recv_exact, send_frame

# ---------------------------------------------------------------- remote backends

REMOTE_LAYERS, REMOTE_HEADS, REMOTE_HEAD_SIZE, REMOTE_CHUNK = 4, 2, 64, 256
# For tests about a tier that fails: it is found down within a second and retried quickly.
FAST_REMOTE = RemoteBackendOptions(lookup_timeout_s=0.5, timeout_s=2.0, backoff_initial_s=0.05, backoff_max_s=0.2)
# The default, for tests about what is stored and read back: on a loaded machine (CI) a first
# connect can take over 0.5 s, which would mark the tier down and drop the puts under test.
PATIENT_REMOTE = RemoteBackendOptions(lookup_timeout_s=10.0, timeout_s=10.0, backoff_initial_s=0.05, backoff_max_s=0.2)


def remote_metadata(layers: int = REMOTE_LAYERS, dtype: torch.dtype = torch.float16) -> LMCacheEngineMetadata:
    return LMCacheEngineMetadata("tiny", 1, 0, "vllm", dtype, (layers, 2, REMOTE_CHUNK, REMOTE_HEADS, REMOTE_HEAD_SIZE))


def remote_cpu() -> LocalCPUBackend:
    return LocalCPUBackend(HostMemoryAllocator(256 << 20))


def remote_chunk(cpu: LocalCPUBackend, seed: int, tokens: int = REMOTE_CHUNK, dtype=torch.float16) -> MemoryObj:
    obj = cpu.allocate(torch.Size([2, REMOTE_LAYERS, tokens, REMOTE_HEADS * REMOTE_HEAD_SIZE]), dtype, MemoryFormat.KV_BLOB)
    assert obj is not None and obj.tensor is not None
    gen = torch.Generator().manual_seed(seed)
    obj.tensor.copy_(torch.randn(obj.tensor.shape, generator=gen) * 2)
    return obj


def remote_backend(url: str, serde: str = "naive", options: RemoteBackendOptions = PATIENT_REMOTE, **kwargs) -> RemoteBackend:
    return RemoteBackend(
        url, serde, kwargs.pop("metadata", remote_metadata()), kwargs.pop("cpu", remote_cpu()), options=options, **kwargs
    )


def wait_for(cond: Callable[[], bool], timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


# ---------------------------------------------------------------- the node pool as another user

NOBODY = 65534  # uid and gid of `nobody`


def as_nobody(groups: Sequence[int], fn: Callable[[], object]) -> str:
    """`repr(fn())`, or `ExcType: message`, from a forked child running as `nobody` with these
    supplementary groups: a client of another user (only root may start one)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child answers through the pipe and exits without running pytest's cleanup
        try:
            os.close(read_end)
            os.setgroups(list(groups))
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            answer = repr(fn())
        except BaseException as err:
            answer = f"{type(err).__name__}: {err}"
        os.write(write_end, answer.encode()[:4096])
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        answer = pipe.read().decode()
    os.waitpid(pid, 0)
    return answer


def read_through_pool(path: str, key: str) -> bytes:
    """Map the node pool at `path` and read `key`'s value in place (LEASE), as its clients do."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(path)
        arena = map_arena(sock, None)
        send_frame(sock, Op.LEASE, key=key.encode())
        head = parse_header(recv_exact(sock, HEADER_SIZE, "header"), 1 << 20, is_request=False)
        recv_exact(sock, head.key_len, "key")
        payload = bytes(recv_exact(sock, head.payload_len, "payload"))
        if head.status != Status.OK:
            raise LookupError(f"LEASE {key}: {head.status.name}")
        _, offset, length = struct.unpack("!QQQ", payload)
        return bytes(arena.block(offset, length))


@contextmanager
def passable_dir() -> Iterator[str]:
    """A fresh directory any user may pass through (0711), for a socket another user must reach
    (pytest's tmp_path lies under a directory only its owner may enter)."""
    path = tempfile.mkdtemp(prefix="lmc-pool-")
    os.chmod(path, 0o711)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------- small disk tiers

DISK_SHAPE = torch.Size([2, 2, 4, 16])  # 512 bytes of bfloat16


@pytest.fixture
def cpu() -> LocalCPUBackend:
    """A CPU tier of 64 KiB for the disk tier's read buffers."""
    return LocalCPUBackend(HostMemoryAllocator(64 * 1024))


def disk_obj(cpu: LocalCPUBackend, i: int):
    obj = cpu.allocate(DISK_SHAPE, torch.bfloat16, MemoryFormat.KV_BLOB)
    gen = torch.Generator().manual_seed(i)
    obj.tensor.copy_(torch.randn(DISK_SHAPE, generator=gen).to(torch.bfloat16))
    return obj


def disk_expected(i: int) -> torch.Tensor:
    return torch.randn(DISK_SHAPE, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)


def disk_store(disk: LocalDiskBackend, cpu: LocalCPUBackend, *ids: int) -> None:
    for i in ids:
        obj = disk_obj(cpu, i)
        disk.submit_put_task(key(i), obj)
        obj.ref_count_down()


def disk_tier(path, cpu, max_bytes=1 << 20, stats=None) -> LocalDiskBackend:
    return LocalDiskBackend(str(path), max_bytes, cpu, stats)


# ---------------------------------------------------------------- engines sized in chunks

ENGINE_GEO = geometry()
ENGINE_CHUNK_BYTES = chunk_bytes(ENGINE_GEO)


def small_engine(num_chunks: int = 64, **overrides) -> LMCacheEngine:
    """An engine whose CPU memory holds exactly `num_chunks` chunks (sized in bytes, not GB)."""
    return make_engine(ENGINE_GEO, config(**overrides), cpu_bytes=num_chunks * ENGINE_CHUNK_BYTES)


def keys_of(engine: LMCacheEngine, tokens: torch.Tensor) -> list:
    return [key for _, _, key in engine.token_database.process_tokens(tokens)]


def store_prompt(engine: LMCacheEngine, n: int, seed: int, **store_kwargs):
    """Store a prompt of `n` tokens (`store_kwargs`: `engine.store`'s); its tokens, source caches and slots."""
    tokens, source, slots = prompt(n, seed=seed), make_kvcaches(ENGINE_GEO, seed=seed), slots_for(ENGINE_GEO, n, seed=seed)
    engine.store(tokens, kvcaches=source, slot_mapping=slots, **store_kwargs)
    return tokens, source, slots


def retrieve_and_check(engine: LMCacheEngine, tokens, source, slots, expected: int) -> None:
    target, dst = make_kvcaches(ENGINE_GEO, seed=99), slots_for(ENGINE_GEO, len(tokens), seed=98)
    got = engine.retrieve(tokens, kvcaches=target, slot_mapping=dst)
    assert int(got.sum()) == expected and bool(got[:expected].all())
    check_loaded(ENGINE_GEO, source, slots, target, dst, expected)


def flush(engine: LMCacheEngine) -> None:
    """Wait for the slow tiers' writes (a pending write holds a reference: its chunk is not idle)."""
    for tier in engine.storage_manager.tiers:
        if hasattr(tier, "flush"):
            tier.flush()
