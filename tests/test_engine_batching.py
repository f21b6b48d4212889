"""The engine copies a request's chunks in one connector call (one kernel call): store and a
retrieve, bit-exact; a pool too small for the whole batch still stores (and loads) every chunk:
the batch is copied early. The kernel sums each chunk as it stores it only where a tier writes
headers."""

from typing import List

import torch
from helpers import CHUNK, GB, chunk_bytes, check_loaded, config, geometry, metadata, prompt, slots_for
from kv_reference import make_kvcaches

from lmcache.experimental.cache_engine import LMCacheEngine
from lmcache.experimental.gpu_connector import VLLMPagedMemGPUConnectorV2
from lmcache.experimental.memory_management import HostMemoryAllocator
from lmcache.experimental.storage_backend import chunk_format
from lmcache.experimental.token_database import ChunkedTokenDatabase


class CountingConnector(VLLMPagedMemGPUConnectorV2):
    """The real connector, recording how many chunks each batched call carried."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.stores: List[int] = []
        self.retrieves: List[int] = []

    def batched_from_gpu(self, memory_objs, starts, ends, *, checksums=False, **kwargs):
        self.stores.append(len(memory_objs))
        self.checksums_asked = checksums
        return super().batched_from_gpu(memory_objs, starts, ends, checksums=checksums, **kwargs)

    def batched_to_gpu(self, memory_objs, starts, ends, **kwargs) -> None:
        self.retrieves.append(len(memory_objs))
        super().batched_to_gpu(memory_objs, starts, ends, **kwargs)


def _engine(geo, cfg, cpu_bytes: int):
    meta = metadata(geo, cfg.chunk_size)
    conn = CountingConnector(geo.hidden, geo.num_layers, layout=geo.layout, num_kv_heads=geo.num_heads)
    engine = LMCacheEngine(cfg, meta, HostMemoryAllocator(cpu_bytes), ChunkedTokenDatabase(cfg, meta), conn)
    return engine, conn


def test_one_connector_call_per_store_and_per_retrieve() -> None:
    geo = geometry()
    engine, conn = _engine(geo, config(), 8 * chunk_bytes(geo))
    n = 4 * CHUNK
    tokens, src_slots, dst_slots = prompt(n), slots_for(geo, n, 1), slots_for(geo, n, 2)
    source, target = make_kvcaches(geo, 1), make_kvcaches(geo, 2)
    engine.store(tokens, kvcaches=source, slot_mapping=src_slots)
    assert conn.stores == [4] and conn.checksums_asked is False  # a CPU tier does not use them
    assert bool(engine.retrieve(tokens, kvcaches=target, slot_mapping=dst_slots).all())
    assert conn.retrieves == [4]
    check_loaded(geo, source, src_slots, target, dst_slots, n)
    engine.close()


def test_a_pool_smaller_than_the_request_still_stores_every_chunk() -> None:
    geo = geometry()
    engine, conn = _engine(geo, config(), 2 * chunk_bytes(geo) + 1024)  # room for 2 of the 4 chunks
    n = 4 * CHUNK
    tokens = prompt(n, 3)
    engine.store(tokens, kvcaches=make_kvcaches(geo, 1), slot_mapping=slots_for(geo, n, 1))
    assert conn.stores == [2, 2]  # flushed when the pool was full, then the rest
    stats = engine.stats()
    assert stats.stored_tokens == n and stats.store_dropped_tokens == 0, stats
    engine.close()


def test_a_retrieve_that_outgrows_the_pool_copies_early_and_reads_again(tmp_path) -> None:
    """Room for 3 chunks: the batch holds them when the 4th must be read from disk, so the read
    finds no memory; the engine copies the batch, reads again, and loads everything."""
    geo = geometry()
    cfg = config(local_disk=str(tmp_path), max_local_disk_size=0.01)
    n = 4 * CHUNK
    tokens, src_slots, dst_slots = prompt(n, 4), slots_for(geo, n, 1), slots_for(geo, n, 2)
    source, target = make_kvcaches(geo, 1), make_kvcaches(geo, 2)
    writer, _ = _engine(geo, cfg, 8 * chunk_bytes(geo))
    writer.store(tokens, kvcaches=source, slot_mapping=src_slots)
    writer.close()  # the chunks are on disk; a new engine starts with an empty CPU tier
    engine, conn = _engine(geo, cfg, 3 * chunk_bytes(geo) + 1024)
    assert bool(engine.retrieve(tokens, kvcaches=target, slot_mapping=dst_slots).all())
    assert sum(conn.retrieves) == 4 and len(conn.retrieves) == 2, conn.retrieves
    check_loaded(geo, source, src_slots, target, dst_slots, n)
    engine.close()


def test_with_a_disk_tier_the_kernel_sums_each_chunk_and_the_writer_hashes_none(tmp_path, monkeypatch) -> None:
    """A tier that writes headers takes the checksum the kernel summed as it stored each chunk:
    the disk writer does not hash the payload, and a new engine reads every chunk back checked."""
    geo = geometry()
    cfg = config(local_disk=str(tmp_path), max_local_disk_size=0.01)
    n = 4 * CHUNK
    tokens, src_slots, dst_slots = prompt(n, 6), slots_for(geo, n, 1), slots_for(geo, n, 2)
    source, target = make_kvcaches(geo, 1), make_kvcaches(geo, 2)
    hashers = []
    real_hasher = chunk_format.payload_hasher
    monkeypatch.setattr(chunk_format, "payload_hasher", lambda: hashers.append(1) or real_hasher())
    writer, conn = _engine(geo, cfg, 8 * chunk_bytes(geo))
    writer.store(tokens, kvcaches=source, slot_mapping=src_slots)
    writer.close()  # waits for the disk writes
    assert conn.checksums_asked is True and hashers == []
    engine, _ = _engine(geo, cfg, 8 * chunk_bytes(geo))
    assert bool(engine.retrieve(tokens, kvcaches=target, slot_mapping=dst_slots).all())
    check_loaded(geo, source, src_slots, target, dst_slots, n)
    assert len(hashers) == 4  # each read checks its chunk against the kernel's checksum
    engine.close()


def test_a_miss_ends_the_retrieve_with_one_copy(tmp_path) -> None:
    geo = geometry()
    engine, conn = _engine(geo, config(local_disk=str(tmp_path), max_local_disk_size=0.01), 8 * chunk_bytes(geo))
    n = 4 * CHUNK
    tokens, src_slots, dst_slots = prompt(n, 5), slots_for(geo, n, 1), slots_for(geo, n, 2)
    source, target = make_kvcaches(geo, 1), make_kvcaches(geo, 2)
    engine.store(tokens[: 2 * CHUNK], kvcaches=source, slot_mapping=src_slots)
    got = engine.retrieve(tokens, kvcaches=target, slot_mapping=dst_slots)
    assert int(got.sum()) == 2 * CHUNK and conn.retrieves == [2]
    check_loaded(geo, source, src_slots, target, dst_slots, 2 * CHUNK)
    engine.close()
