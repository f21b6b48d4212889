"""The local disk tier: background atomic writes, headers, bad files as misses, a rebuilt index,
the size bound, prefetch into the CPU tier."""

import asyncio
import os
import subprocess
import sys
import threading

import pytest
import torch
from helpers import key
from tier_helpers import DISK_SHAPE, cpu, disk_expected, disk_obj, disk_store, disk_tier, wait_for  # noqa: F401 (cpu: fixture)

from lmcache.experimental.memory_management import MemoryFormat
from lmcache.experimental.stats import TierStats
from lmcache.experimental.storage_backend import chunk_format
from lmcache.experimental.storage_backend.local_disk_backend import LocalDiskBackend, file_name_for

DISK_BYTES = DISK_SHAPE.numel() * 2  # bfloat16

def test_write_then_read_back_bit_exact(tmp_path, cpu):
    disk = disk_tier(tmp_path, cpu)
    disk_store(disk, cpu, 1, 2)
    disk.close()  # waits for the writer
    assert sorted(os.listdir(tmp_path)) == sorted([file_name_for(key(1)), file_name_for(key(2))])
    for i in (1, 2):
        obj = disk.get_blocking(key(i))
        assert torch.equal(obj.tensor, disk_expected(i)) and obj.get_ref_count() == 1
        obj.ref_count_down()
    with open(tmp_path / file_name_for(key(1)), "rb") as f:
        header = chunk_format.read_header(f)
    assert header.key == key(1).to_string() and header.shape == tuple(DISK_SHAPE) and header.dtype == torch.bfloat16


def test_writes_run_on_a_background_thread(tmp_path, cpu):
    disk = disk_tier(tmp_path, cpu)
    writers = []
    release = threading.Event()
    real_save = disk._save

    def slow_save(*args):
        writers.append(threading.current_thread().name)
        release.wait()
        return real_save(*args)

    disk._save = slow_save
    disk_store(disk, cpu, 7)  # returns although the write is blocked
    assert disk.exists_in_put_tasks(key(7)) and disk.contains(key(7))
    pending = disk.get_blocking(key(7))  # served from memory while the write is pending
    assert torch.equal(pending.tensor, disk_expected(7))
    pending.ref_count_down()
    release.set()
    disk.flush()
    assert not disk.exists_in_put_tasks(key(7)) and key(7) in disk.keys()
    disk.close()
    assert writers and writers[0] != threading.current_thread().name and writers[0].startswith("lmcache-disk-write")
    assert not disk.exists_in_put_tasks(key(7)) and os.path.exists(disk.key_to_path(key(7)))


def _idle_writer_blocked(disk, release: threading.Event) -> dict:
    """Hold the idle writer's saves until `release`; returns key -> writing thread's name."""
    writers = {}
    real_save = disk._save

    def save(key, *args):
        writers[key] = threading.current_thread().name
        if writers[key].startswith("lmcache-disk-write"):
            release.wait()
        return real_save(key, *args)

    disk._save = save
    return writers


def test_past_the_idle_writers_backlog_bound_a_catch_up_writer_writes(tmp_path, cpu):
    """The writer runs at idle priority and may not run at all while the cores are busy: the
    chunks waiting for it (which pin CPU-tier memory) stay under max_pending_bytes, and what comes
    beyond goes to a writer of normal priority - nothing dropped."""
    disk = LocalDiskBackend(str(tmp_path), 1 << 20, cpu, max_pending_bytes=3 * DISK_BYTES)
    release = threading.Event()
    writers = _idle_writer_blocked(disk, release)
    disk_store(disk, cpu, *range(5))
    # Written while the idle writer waits:
    assert wait_for(lambda: [disk.exists_in_put_tasks(key(i)) for i in range(5)] == [True] * 3 + [False] * 2)
    assert {key(3), key(4)} <= set(disk.keys())
    assert writers[key(3)].startswith("lmcache-disk-catch-up")
    release.set()
    disk.close()
    assert len(disk.keys()) == 5 and cpu.memory_allocator.used_bytes == 0
    assert {writers[key(i)][:18] for i in range(3)} == {"lmcache-disk-write"}


def test_a_chunk_larger_than_the_bound_goes_to_an_empty_idle_writer(tmp_path, cpu):
    disk = LocalDiskBackend(str(tmp_path), 1 << 20, cpu, max_pending_bytes=DISK_BYTES // 2)
    release = threading.Event()
    writers = _idle_writer_blocked(disk, release)
    disk_store(disk, cpu, 1, 2)
    assert wait_for(lambda: not disk.exists_in_put_tasks(key(2)))
    release.set()
    disk.close()
    assert writers[key(1)].startswith("lmcache-disk-write") and writers[key(2)].startswith("lmcache-disk-catch-up")


def test_backlog_bound_defaults_to_half_the_cpu_pool(tmp_path, cpu):
    assert disk_tier(tmp_path, cpu)._max_pending_bytes == cpu.memory_allocator.total_bytes // 2
    with pytest.raises(ValueError, match="max_pending_bytes"):
        LocalDiskBackend(str(tmp_path), 1 << 20, cpu, max_pending_bytes=0)


def test_index_survives_a_restart_in_lru_order(tmp_path, cpu):
    disk = disk_tier(tmp_path, cpu)
    for i in range(3):
        disk_store(disk, cpu, i)
        disk.close()
        os.utime(disk.key_to_path(key(i)), (1000 + i, 1000 + i))
        disk = disk_tier(tmp_path, cpu)
    again = disk_tier(tmp_path, cpu)
    assert again.keys() == [key(0), key(1), key(2)]
    obj = again.get_blocking(key(1))
    assert torch.equal(obj.tensor, disk_expected(1))
    obj.ref_count_down()


def test_a_second_process_reads_the_cache(tmp_path, cpu):
    disk = disk_tier(tmp_path / "cache", cpu)
    disk_store(disk, cpu, 5)
    disk.close()
    script = f"""
import torch
from lmcache.experimental.memory_management import HostMemoryAllocator
from lmcache.experimental.storage_backend.local_cpu_backend import LocalCPUBackend
from lmcache.experimental.storage_backend.local_disk_backend import LocalDiskBackend
from lmcache.utils import CacheEngineKey
disk = LocalDiskBackend({str(tmp_path / "cache")!r}, 1 << 20, LocalCPUBackend(HostMemoryAllocator(1 << 16)))
obj = disk.get_blocking({key(5)!r})
ref = torch.randn({list(DISK_SHAPE)}, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
print("HIT" if obj is not None and torch.equal(obj.tensor, ref) else "MISS")
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "HIT", out.stderr


def test_corrupted_file_is_a_miss_and_removed(tmp_path, cpu):
    stats = TierStats()
    disk = disk_tier(tmp_path, cpu, stats=stats)
    disk_store(disk, cpu, 1)
    disk.close()
    path = disk.key_to_path(key(1))
    with open(path, "r+b") as f:
        f.seek(-3, os.SEEK_END)
        byte = f.read(1)
        f.seek(-3, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert disk.get_blocking(key(1)) is None
    assert not os.path.exists(path) and not disk.contains(key(1))
    assert stats.snapshot().errors == 1
    assert cpu.memory_allocator.pool.num_live_objects() == 0  # the rejected read freed its object


def test_bad_files_found_at_start_are_removed_and_others_left_alone(tmp_path, cpu):
    disk = disk_tier(tmp_path, cpu)
    disk_store(disk, cpu, 1, 2, 3)
    disk.close()
    with open(disk.key_to_path(key(1)), "r+b") as f:  # truncated
        f.truncate(os.path.getsize(disk.key_to_path(key(1))) - 10)
    os.replace(disk.key_to_path(key(2)), tmp_path / file_name_for(key(9)))  # header names another key
    (tmp_path / ("0" * 32 + ".lmck")).write_bytes(b"\x80\x04\x95 not a chunk")  # foreign, our suffix
    (tmp_path / "notes.txt").write_text("user file")  # not ours: untouched
    dead_tmp = tmp_path / f".{file_name_for(key(4))}.999999999.1.tmp"  # writer long gone
    dead_tmp.write_bytes(b"partial")
    again = disk_tier(tmp_path, cpu)
    assert again.keys() == [key(3)]
    assert sorted(os.listdir(tmp_path)) == sorted([file_name_for(key(3)), "notes.txt"])


def test_size_bound_evicts_least_recently_used_files(tmp_path, cpu):
    disk = disk_tier(tmp_path, cpu)
    disk_store(disk, cpu, 0, 1)
    disk.close()
    one_file = os.path.getsize(disk.key_to_path(key(0)))  # header + payload
    disk = disk_tier(tmp_path, cpu, max_bytes=2 * one_file + one_file // 2)
    disk.get_blocking(key(0)).ref_count_down()  # 0 is now the most recent
    disk_store(disk, cpu, 2)
    disk.close()
    assert disk.keys() == [key(0), key(2)]
    assert not os.path.exists(disk.key_to_path(key(1)))
    assert disk.used_bytes <= 2 * one_file


def test_prefetch_brings_a_chunk_into_the_cpu_tier(tmp_path, cpu):
    disk = disk_tier(tmp_path, cpu)
    disk_store(disk, cpu, 4)
    disk.close()
    disk = disk_tier(tmp_path, cpu)
    assert not cpu.contains(key(4))
    assert disk.submit_prefetch_task(key(4))
    assert not disk.submit_prefetch_task(key(99))  # not on disk
    obj = disk.get_blocking(key(4))  # waits for the prefetch, then serves it from RAM
    assert torch.equal(obj.tensor, disk_expected(4))
    obj.ref_count_down()
    disk.close()
    assert cpu.contains(key(4))
    assert not disk.submit_prefetch_task(key(4))  # already in the CPU tier


def test_remove_deletes_the_file(tmp_path, cpu):
    disk = disk_tier(tmp_path, cpu)
    disk_store(disk, cpu, 1)
    disk.close()
    assert disk.remove(key(1)) and not disk.remove(key(1))
    assert os.listdir(tmp_path) == [] and disk.used_bytes == 0


def test_async_save_and_load(tmp_path, cpu):
    disk = disk_tier(tmp_path, cpu)
    obj = disk_obj(cpu, 3)

    async def roundtrip():
        assert await disk.async_save_bytes_to_disk(key(3), obj)
        return await disk.async_load_bytes_from_disk(disk.key_to_path(key(3)), torch.bfloat16, tuple(DISK_SHAPE), MemoryFormat.KV_BLOB, key(3))

    back = asyncio.run(roundtrip())
    assert torch.equal(back.tensor, disk_expected(3)) and disk.contains(key(3))
    back.ref_count_down()
    obj.ref_count_down()
    loaded = disk.load_disk(disk.key_to_path(key(3)), dtype=torch.bfloat16)
    assert torch.equal(loaded.tensor, disk_expected(3))
    loaded.ref_count_down()
    assert disk.load_bytes_from_disk(disk.key_to_path(key(3)), torch.float16, None, None) is None  # wrong dtype
    with pytest.raises(ValueError, match="backend"):
        disk.load_disk(disk.key_to_path(key(3)), backend="safetensors")
    disk.close()


def test_insert_key_indexes_a_file_written_elsewhere(tmp_path, cpu):
    disk = disk_tier(tmp_path, cpu)
    obj = disk_obj(cpu, 8)
    payload = chunk_format.memory_obj_payload(obj)
    meta = obj.metadata
    with open(disk.key_to_path(key(8)), "wb") as f:
        f.write(chunk_format.encode_header(key(8), meta.shape, meta.dtype, meta.fmt, payload))
        f.write(payload)
    assert not disk.contains(key(8))
    disk.insert_key(key(8), obj)
    obj.ref_count_down()
    assert disk.contains(key(8)) and disk.used_bytes == os.path.getsize(disk.key_to_path(key(8)))
    back = disk.get_blocking(key(8))
    assert torch.equal(back.tensor, disk_expected(8))
    back.ref_count_down()
