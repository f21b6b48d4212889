"""The disk tier against an unlucky operator or a hostile neighbour, on real files: chunks deleted
by someone else, the whole directory removed, FIFOs named like chunks, flipped header bytes,
files of an older chunk format. Every case is a miss (or a rewrite), never an exception or a hang."""

from __future__ import annotations

import os
import shutil
import struct
import threading

import torch
from redis_fixture import lmcache_log  # noqa: F401 (fixture)
from helpers import key
from tier_helpers import (  # noqa: F401 (cpu: fixture)
    cpu,
    disk_expected,
    disk_store,
    disk_tier,
    flush,
    keys_of,
    retrieve_and_check,
    small_engine,
    store_prompt,
)

from lmcache.experimental.memory_management import MemoryFormat
from lmcache.experimental.stats import TierStats
from lmcache.experimental.storage_backend import chunk_format
from lmcache.experimental.storage_backend.local_disk_backend import LocalDiskBackend, file_name_for


def written(tmp_path, cpu, *ids: int) -> LocalDiskBackend:  # noqa: F811
    disk = disk_tier(tmp_path, cpu)
    disk_store(disk, cpu, *ids)
    disk.flush()
    return disk


def read_ok(disk: LocalDiskBackend, i: int) -> bool:
    obj = disk.get_blocking(key(i))
    if obj is None:
        return False
    try:
        return torch.equal(obj.tensor, disk_expected(i))
    finally:
        obj.ref_count_down()


def test_a_deleted_chunk_is_forgotten_and_the_next_store_writes_it_again(tmp_path, cpu) -> None:  # noqa: F811
    disk = written(tmp_path, cpu, 1, 2)
    os.unlink(tmp_path / file_name_for(key(1)))
    assert not disk.contains(key(1)) and disk.contains(key(2))  # a lookup no longer promises it
    assert len(disk) == 1 and disk.used_bytes == os.path.getsize(tmp_path / file_name_for(key(2)))
    os.unlink(tmp_path / file_name_for(key(2)))
    assert disk.get_blocking(key(2)) is None and len(disk) == 0  # a read that finds it gone forgets it
    disk_store(disk, cpu, 1, 2)
    disk.flush()
    assert read_ok(disk, 1) and read_ok(disk, 2)
    disk.close()


def test_a_pinned_lookup_never_promises_a_deleted_chunk(tmp_path) -> None:
    engine = small_engine(local_cpu=False, local_disk=str(tmp_path), max_local_disk_size=0.01)
    tokens, source, slots = store_prompt(engine, 20, seed=3)  # chunks of 8 tokens: 8 + 8 + 4
    flush(engine)
    second = keys_of(engine, tokens)[1]
    os.unlink(tmp_path / file_name_for(second))
    assert engine.lookup(tokens, request_id="r", pin=True) == 8  # the prefix ends at the hole
    assert engine.lookup(tokens) == 8
    retrieve_and_check(engine, tokens, source, slots, 8)
    engine.lookup_unpin(["r"])
    store_prompt(engine, 20, seed=3)  # the same prompt again fills the hole
    flush(engine)
    assert engine.lookup(tokens) == 20
    retrieve_and_check(engine, tokens, source, slots, 20)
    engine.close()


def test_a_removed_cache_directory_is_created_again(tmp_path, cpu, lmcache_log) -> None:  # noqa: F811
    root = tmp_path / "cache"
    disk = written(root, cpu, 1)
    shutil.rmtree(root)
    assert not disk.contains(key(1))
    disk_store(disk, cpu, 2)
    disk.flush()
    assert root.is_dir() and read_ok(disk, 2) and len(disk) == 1
    assert "was removed; created it again" in lmcache_log.text
    disk.close()


def _construct_within(path, cpu, seconds: float = 10.0) -> LocalDiskBackend:  # noqa: F811
    """Build a tier on a background thread; fail (instead of hanging the suite) if it blocks."""
    result: list = []
    worker = threading.Thread(target=lambda: result.append(disk_tier(path, cpu)), daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), "building the disk tier hung"
    return result[0]


def test_fifos_named_like_chunks_never_hang_the_index_scan_or_a_read(tmp_path, cpu) -> None:  # noqa: F811
    written(tmp_path, cpu, 1, 2).close()
    os.mkfifo(tmp_path / file_name_for(key(7)))
    os.mkfifo(tmp_path / "elsewhere.fifo")
    os.symlink(tmp_path / "elsewhere.fifo", tmp_path / file_name_for(key(8)))
    disk = _construct_within(tmp_path, cpu)
    assert len(disk) == 2 and read_ok(disk, 1)
    # A chunk swapped for a FIFO after it was indexed: the read returns at once, a miss.
    os.unlink(tmp_path / file_name_for(key(2)))
    os.mkfifo(tmp_path / file_name_for(key(2)))
    reader = threading.Thread(target=lambda: disk.get_blocking(key(2)), daemon=True)
    reader.start()
    reader.join(10)
    assert not reader.is_alive(), "reading a FIFO hung"
    assert len(disk) == 1
    disk.close()


def _header_size(path) -> int:
    with open(path, "rb") as f:
        header = chunk_format.read_header(f)
    assert header is not None
    return header.size


def test_every_flipped_header_byte_is_a_miss_and_the_file_is_removed(tmp_path, cpu) -> None:  # noqa: F811
    stats = TierStats()
    disk = LocalDiskBackend(str(tmp_path / "live"), 1 << 20, cpu, stats)
    disk_store(disk, cpu, 1)
    disk.flush()
    path = tmp_path / "live" / file_name_for(key(1))
    pristine = path.read_bytes()
    size = _header_size(path)
    for i in range(size):
        for indexed in (True, False):  # a flip under a live index, and one found by the scan
            bad = bytearray(pristine)
            bad[i] ^= 0x10
            if indexed:
                disk_store(disk, cpu, 1)
                disk.flush()
                path.write_bytes(bad)
                assert disk.get_blocking(key(1)) is None, f"flip at header byte {i} was served"
            else:
                path.write_bytes(bad)
                fresh = disk_tier(tmp_path / "live", cpu)
                assert len(fresh) == 0, f"flip at header byte {i} was indexed"
            assert not path.exists(), f"file with a flip at header byte {i} was kept"
            assert len(disk) == 0 or not indexed
    assert cpu.memory_allocator.pool.num_live_objects() == 0  # nothing leaked by the rejected reads
    disk.close()


def test_a_valid_header_the_cpu_tier_cannot_allocate_is_a_miss_not_an_exception(tmp_path, cpu) -> None:  # noqa: F811
    """A well-formed chunk whose shape the allocator refuses (a zero dimension) - crafted, since
    the header checksum stops such values from arising by corruption."""
    crafted = key(5)
    header = chunk_format.encode_header(crafted, (2, 0, 4, 16), torch.bfloat16, MemoryFormat.KV_BLOB, b"")
    (tmp_path / file_name_for(crafted)).write_bytes(header)
    disk = disk_tier(tmp_path, cpu)
    assert disk.contains(crafted)
    assert disk.get_blocking(crafted) is None
    assert not (tmp_path / file_name_for(crafted)).exists() and len(disk) == 0
    disk.close()


def test_chunks_of_the_previous_format_are_misses_and_removed(tmp_path, cpu) -> None:  # noqa: F811
    disk = written(tmp_path / "d", cpu, 1, 2)
    for i in (1, 2):
        path = tmp_path / "d" / file_name_for(key(i))
        blob = bytearray(path.read_bytes())
        struct.pack_into("<H", blob, 4, chunk_format.VERSION - 1)  # what version 2 wrote there
        path.write_bytes(bytes(blob))
    assert disk.get_blocking(key(1)) is None  # indexed before: a miss on read
    assert not (tmp_path / "d" / file_name_for(key(1))).exists()
    fresh = disk_tier(tmp_path / "d", cpu)  # found by the scan: never indexed
    assert len(fresh) == 0 and not os.listdir(tmp_path / "d")
    disk.close()
