"""Storage manager: ordered tiers, write-to-all, fastest read with promotion, search_range,
failing tiers as misses, flush on close (bounded, counted); and the factory that builds tiers from
the config."""

import multiprocessing
import os
import socket
import time
from typing import Iterator, Optional

import pytest
import torch
from helpers import key
from redis_fixture import lmcache_log  # noqa: F401
from tier_helpers import remote_backend

from lmcache.config import LMCacheEngineMetadata
from lmcache.experimental.config import LMCacheEngineConfig
from lmcache.experimental.memory_management import HostMemoryAllocator, MemoryFormat, MemoryObj
from lmcache.experimental.stats import EngineStats
from lmcache.experimental.storage_backend import (
    LocalCPUBackend,
    LocalDiskBackend,
    StorageBackendInterface,
    StorageManager,
    create_storage_manager,
)
from lmcache.experimental.storage_backend.abstract_backend import ClosedWrites
from lmcache.experimental.storage_backend.remote_backend import RemoteBackend, RemoteBackendOptions
from lmcache.server import LMCacheServer, ServerConfig
from lmcache.integration.vllm.worker_engine import CHILD_CLOSE_TIMEOUT_S, exit_close_timeout

SHAPE = torch.Size([2, 1, 4, 64])  # 2 KiB of float32


class BrokenTier(StorageBackendInterface):
    """A tier whose every call fails, as a remote one might."""

    def contains(self, key) -> bool:
        raise ConnectionError("down")

    def exists_in_put_tasks(self, key) -> bool:
        raise ConnectionError("down")

    def submit_put_task(self, key, obj) -> None:
        raise ConnectionError("down")

    def submit_prefetch_task(self, key) -> bool:
        raise ConnectionError("down")

    def get_blocking(self, key) -> Optional[MemoryObj]:
        raise ConnectionError("down")

    def remove(self, key) -> bool:
        raise ConnectionError("down")

    def close(self, timeout_s=None) -> None:
        raise ConnectionError("down")


def build(tmp_path, extra=(), cpu_objects: int = 8):
    stats = EngineStats()
    cpu = LocalCPUBackend(HostMemoryAllocator(cpu_objects * 2048), stats=stats.tier("Hot"))
    disk = LocalDiskBackend(str(tmp_path), 1 << 20, cpu, stats.tier("LocalDiskBackend"))
    return StorageManager(cpu, [cpu, disk, *extra], stats), cpu, disk, stats


def put(manager: StorageManager, i: int) -> None:
    obj = manager.allocate(SHAPE, torch.float32, MemoryFormat.KV_BLOB)
    obj.tensor.fill_(float(i))
    assert manager.put(key(i), obj) >= 2
    obj.ref_count_down()


def test_writes_every_tier_reads_fastest_and_promotes(tmp_path):
    manager, cpu, disk, stats = build(tmp_path)
    assert manager.tier_names == ["Hot", "LocalDiskBackend"]
    put(manager, 1)
    disk.close()  # let the write land (the manager keeps working)
    assert cpu.contains(key(1)) and os.path.exists(disk.key_to_path(key(1)))
    cpu.remove(key(1))
    obj = manager.get(key(1))  # from disk...
    assert torch.all(obj.tensor == 1.0)
    obj.ref_count_down()
    assert cpu.contains(key(1))  # ...and promoted
    snap = stats.snapshot()
    assert snap.tiers["LocalDiskBackend"].chunks_read == 1 and snap.tiers["Hot"].chunks_written == 2


def test_search_range_limits_where_it_looks(tmp_path):
    manager, cpu, disk, _ = build(tmp_path)
    put(manager, 1)
    disk.close()
    cpu.remove(key(1))
    assert not manager.contains(key(1), ["Hot"])
    assert manager.contains(key(1), ["LocalDiskBackend"])
    assert manager.contains(key(1), None)
    assert manager.get(key(1), ["Hot"]) is None
    assert not manager.contains(key(1), ["RemoteBackend"])  # not configured: nothing there


def test_a_failing_tier_is_a_miss_not_an_error(tmp_path):
    manager, cpu, disk, stats = build(tmp_path, extra=[BrokenTier()])
    put(manager, 1)  # the broken tier's put is logged and counted
    assert manager.get(key(2)) is None
    assert not manager.contains(key(2))
    assert manager.remove(key(1)) == 2
    manager.close()
    assert stats.snapshot().tiers["BrokenTier"].errors >= 4


def test_prefetch_through_the_manager(tmp_path):
    manager, cpu, disk, _ = build(tmp_path)
    put(manager, 3)
    disk.close()
    cpu.remove(key(3))
    manager2, cpu2, disk2, _ = build(tmp_path)
    assert manager2.prefetch(key(3))
    assert not manager2.prefetch(key(4))
    disk2.close()  # waits for the prefetch
    assert cpu2.contains(key(3))
    manager2.close()
    assert not cpu2.contains(key(3))  # close released the CPU tier's objects


def test_close_flushes_pending_writes(tmp_path):
    manager, cpu, disk, _ = build(tmp_path)
    for i in range(5):
        put(manager, i)
    manager.close()
    assert sorted(LocalDiskBackend(str(tmp_path), 1 << 20, cpu).keys(), key=lambda k: k.chunk_hash) == [key(i) for i in range(5)]


class ClosingTier(BrokenTier):
    """A tier that records the bound its close was given."""

    tier_name = "ClosingTier"
    bounds: list = []

    def close(self, timeout_s=None) -> ClosedWrites:
        self.bounds.append(timeout_s)
        return ClosedWrites()


def test_close_without_a_bound_leaves_each_tier_its_own_and_only_a_child_exits_within_4_s(tmp_path):
    """A main process (an offline v0 `LLM`, `close_lmcache_engine()`) waits for each tier's own
    bound: a shared 4 s there gave up cachegen puts a busy machine was still encoding. Only a
    process vLLM started (and kills 5 s after asking it to stop) closes at exit within 4 s."""
    tier = ClosingTier()
    manager, _, _, _ = build(tmp_path, extra=[tier])
    manager.close()
    assert tier.bounds == [None]
    assert exit_close_timeout() is None  # pytest's own process
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        assert pool.apply(exit_close_timeout) == CHILD_CLOSE_TIMEOUT_S == 4.0


@pytest.fixture
def lm_url() -> Iterator[str]:
    srv = LMCacheServer(ServerConfig(port=0, max_size_bytes=64 << 20))
    srv.start_in_thread()
    host, port = srv.address
    yield f"lm://{host}:{port}"
    srv.shutdown()


def with_remote(tmp_path, url: str, options: RemoteBackendOptions):
    """CPU, disk and remote tiers, as an engine with `remote_url` and `local_disk` has them."""
    stats = EngineStats()
    cpu = LocalCPUBackend(HostMemoryAllocator(16 * 2048), stats=stats.tier("Hot"))
    disk = LocalDiskBackend(str(tmp_path), 1 << 20, cpu, stats.tier("LocalDiskBackend"))
    return StorageManager(cpu, [cpu, disk, remote_backend(url, cpu=cpu, options=options)], stats), cpu


def test_close_right_after_puts_lands_them_in_every_tier_though_the_put_thread_never_runs(
        tmp_path, lm_url, monkeypatch, lmcache_log):  # noqa: F811
    # The remote put thread at idle priority beside a busy engine: closing must not wait for it.
    monkeypatch.setattr(RemoteBackend, "_ensure_worker", lambda self: None)
    manager, cpu = with_remote(tmp_path, lm_url, RemoteBackendOptions())
    for i in range(5):
        put(manager, i)
    manager.close()
    assert len(LocalDiskBackend(str(tmp_path), 1 << 20, cpu)) == 5
    reader = remote_backend(lm_url)
    assert reader.batched_contains([key(i) for i in range(5)]) == [True] * 5
    reader.close()
    assert "none left unwritten" in lmcache_log.text


def test_close_with_a_stalled_remote_keeps_its_deadline_and_the_disk_its_writes(tmp_path, lmcache_log):  # noqa: F811
    listener = socket.socket()  # accepts through the backlog, never answers
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    patient = RemoteBackendOptions(lookup_timeout_s=30.0, timeout_s=30.0)  # a put would wait 30 s
    try:
        manager, cpu = with_remote(tmp_path, f"lm://127.0.0.1:{listener.getsockname()[1]}", patient)
        for i in range(3):
            put(manager, i)
        start = time.monotonic()
        manager.close(timeout_s=1.0)
        took = time.monotonic() - start
    finally:
        listener.close()
    assert took < 3.0
    assert len(LocalDiskBackend(str(tmp_path), 1 << 20, cpu)) == 3
    assert "not written: 3 to RemoteBackend (deadline)" in lmcache_log.text


def test_tier_names_must_be_unique(tmp_path):
    cpu = LocalCPUBackend(HostMemoryAllocator(4096))
    with pytest.raises(ValueError, match="unique"):
        StorageManager(cpu, [cpu, cpu])


def test_factory_builds_tiers_from_config(tmp_path):
    meta = LMCacheEngineMetadata("m", 1, 0, "vllm", torch.float32, (1, 2, 4, 1, 64))
    allocator = HostMemoryAllocator(1 << 16)
    cpu_only = LMCacheEngineConfig.from_defaults(remote_url=None)
    assert create_storage_manager(cpu_only, meta, allocator).tier_names == ["Hot"]
    both = LMCacheEngineConfig.from_defaults(remote_url=None, local_disk=str(tmp_path), max_local_disk_size=0.01)
    assert create_storage_manager(both, meta, allocator).tier_names == ["Hot", "LocalDiskBackend"]
    disk_only = LMCacheEngineConfig.from_defaults(
        remote_url=None, local_cpu=False, local_disk=f"file://{tmp_path}", max_local_disk_size=0.01
    )
    manager = create_storage_manager(disk_only, meta, allocator)
    assert manager.tier_names == ["LocalDiskBackend"]
    obj = manager.allocate(torch.Size([2, 1, 4, 64]), torch.float32)  # the CPU tier still allocates
    assert obj is not None
    obj.ref_count_down()


def test_put_hands_to_every_tier_without_asking_contains():
    """Each tier skips what it holds by itself: a `contains` per tier and chunk would be a round
    trip per chunk for the remote tier, on top of the store's own skip test."""

    class AskedTier(LocalCPUBackend):
        asked = 0
        tier_name = "Asked"

        def contains(self, key) -> bool:
            self.asked += 1
            return super().contains(key)

    cpu = LocalCPUBackend(HostMemoryAllocator(8 * 2048))
    other = AskedTier(HostMemoryAllocator(8 * 2048))
    manager = StorageManager(cpu, [cpu, other])
    put(manager, 1)
    put(manager, 1)  # held already: each tier keeps its one copy
    assert other.asked == 0 and other.keys() == [key(1)] and cpu.keys() == [key(1)]
    assert manager.contains_locally(key(1)) and not manager.contains_locally(key(2))
    manager.close()
