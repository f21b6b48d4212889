"""The CPU ("Hot") tier: reference counts, LRU eviction through allocation, never evicting in use."""

import torch
from helpers import key

from lmcache.experimental.memory_management import HostMemoryAllocator, MemoryFormat
from lmcache.experimental.stats import TierStats
from lmcache.experimental.storage_backend.local_cpu_backend import LocalCPUBackend

SHAPE = torch.Size([2, 1, 4, 32])  # 1 KiB of float32: two allocator blocks of 512 bytes


def make_tier(num_objects: int, keep: bool = True):
    allocator = HostMemoryAllocator(num_objects * 1024)
    stats = TierStats()
    return LocalCPUBackend(allocator, keep_objects=keep, stats=stats), allocator, stats


def put_new(tier: LocalCPUBackend, i: int):
    obj = tier.allocate(SHAPE, torch.float32, MemoryFormat.KV_BLOB)
    assert obj is not None
    obj.tensor.fill_(float(i))
    tier.submit_put_task(key(i), obj)
    obj.ref_count_down()  # the tier's reference is now the only one
    return obj


def test_put_get_reference_counts():
    tier, _, stats = make_tier(4)
    obj = put_new(tier, 1)
    assert tier.tier_name == "Hot" and tier.contains(key(1)) and obj.get_ref_count() == 1
    got = tier.get_blocking(key(1))
    assert got is obj and got.get_ref_count() == 2 and torch.all(got.tensor == 1.0)
    got.ref_count_down()
    assert tier.get_blocking(key(2)) is None
    assert not tier.exists_in_put_tasks(key(1)) and not tier.submit_prefetch_task(key(1))
    assert stats.snapshot().bytes_written == 1024 and stats.snapshot().chunks_read == 1


def test_allocation_evicts_least_recently_used():
    tier, allocator, stats = make_tier(3)
    for i in range(3):
        put_new(tier, i)
    tier.get_blocking(key(0)).ref_count_down()  # touch 0: now 1 is the oldest
    put_new(tier, 3)  # needs room: evicts 1 only
    assert tier.keys() == [key(2), key(0), key(3)]
    put_new(tier, 4)
    assert tier.keys() == [key(0), key(3), key(4)]
    snap = stats.snapshot()
    assert snap.evicted_chunks == 2 and snap.evicted_bytes == 2048
    assert allocator.pool.num_live_objects() == 3


def test_objects_in_use_are_never_evicted():
    tier, allocator, _ = make_tier(2)
    put_new(tier, 0)
    put_new(tier, 1)
    held = tier.get_blocking(key(0))  # a reader holds the oldest
    put_new(tier, 2)  # evicts 1, the oldest idle one
    assert tier.contains(key(0)) and not tier.contains(key(1))
    also_held = tier.get_blocking(key(2))
    assert tier.allocate(SHAPE, torch.float32) is None  # everything left is in use
    assert tier.keys() == [key(0), key(2)]
    assert torch.all(held.tensor == 0.0) and torch.all(also_held.tensor == 2.0)
    held.ref_count_down()
    obj = tier.allocate(SHAPE, torch.float32)
    assert obj is not None and not tier.contains(key(0))
    obj.ref_count_down()
    also_held.ref_count_down()


def test_remove_and_close_release_memory():
    tier, allocator, _ = make_tier(4)
    for i in range(3):
        put_new(tier, i)
    assert tier.remove(key(1)) and not tier.remove(key(1))
    assert allocator.pool.num_live_objects() == 2
    tier.close()
    assert len(tier) == 0 and allocator.pool.num_live_objects() == 0


def test_tier_that_keeps_nothing_still_allocates():
    tier, allocator, _ = make_tier(2, keep=False)
    obj = put_new(tier, 0)
    assert not tier.contains(key(0)) and not obj.is_valid()
    assert allocator.pool.num_live_objects() == 0
