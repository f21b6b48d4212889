"""LMCacheEngine and LMCacheEngineBuilder on CPU tensors: round trips through each tier, layout and
dtype; masks; eviction; never raising for cache problems; another process reading the disk
cache; concurrency; builder semantics; search_range; counters."""

import os
import subprocess
import sys
import threading

import pytest
import torch
from helpers import (
    CHUNK,
    GB,
    TESTS_DIR,
    check_loaded,
    chunk_bytes,
    config,
    connector,
    geometry,
    make_engine,
    metadata,
    prompt,
    slots_for,
)
from kv_reference import gather, make_kvcaches
from lmcache.experimental.cache_engine import LMCacheEngineBuilder
from lmcache.experimental.kv_layout import KVLayout


@pytest.mark.parametrize(
    "layout,dtype",
    [
        (KVLayout.CPU_IPEX, torch.float32),
        (KVLayout.CPU_IPEX, torch.bfloat16),
        (KVLayout.CPU_PACKED, torch.bfloat16),
        (KVLayout.CPU_PACKED, torch.float16),
        (KVLayout.FLASH, torch.float16),
        (KVLayout.MLA, torch.bfloat16),
    ],
    ids=lambda v: getattr(v, "name", str(v)),
)
@pytest.mark.parametrize("tier", ["cpu", "disk"])
def test_round_trip_through_each_tier(layout, dtype, tier, tmp_path):
    geo = geometry(layout, dtype)
    cfg = config() if tier == "cpu" else config(local_cpu=False, local_disk=str(tmp_path), max_local_disk_size=0.01)
    engine = make_engine(geo, cfg)
    tokens = prompt(21)  # two full chunks and a partial one
    source, src_slots = make_kvcaches(geo, seed=1), slots_for(geo, 21, seed=1)
    engine.store(tokens, kvcaches=source, slot_mapping=src_slots)
    if tier == "disk":
        engine.storage_manager.tiers[0].close()  # let the background writes land
        assert len(os.listdir(tmp_path)) == 3
    assert engine.lookup(tokens) == 21
    target, dst_slots = make_kvcaches(geo, seed=2), slots_for(geo, 21, seed=2)
    ret = engine.retrieve(tokens, kvcaches=target, slot_mapping=dst_slots)
    assert ret.dtype == torch.bool and ret.device.type == "cpu" and bool(ret.all())
    check_loaded(geo, source, src_slots, target, dst_slots, 21)
    snap = engine.stats()
    assert (snap.stored_tokens, snap.retrieve_hit_tokens, snap.retrieve_requested_tokens) == (21, 21, 21)
    engine.close()


def test_masked_prefix_store_and_retrieve():
    geo = geometry()
    engine = make_engine(geo, config())
    tokens = prompt(24)
    source, slots = make_kvcaches(geo, seed=1), slots_for(geo, 24)
    mask = torch.ones(24, dtype=torch.bool)
    mask[:CHUNK] = False
    engine.store(tokens, mask, kvcaches=source, slot_mapping=slots)
    assert engine.lookup(tokens) == 0  # the first chunk was never stored
    engine.store(tokens[:CHUNK], kvcaches=source, slot_mapping=slots[:CHUNK])
    assert engine.lookup(tokens) == 24

    # vLLM already has the first chunk: slot_mapping starts with -1s, only the rest is loaded.
    target = make_kvcaches(geo, seed=2)
    before = gather(geo, target, slots[:CHUNK].tolist())
    full = slots.clone()
    full[:CHUNK] = -1
    ret = engine.retrieve(tokens, mask, kvcaches=target, slot_mapping=full)
    assert ret.tolist() == [False] * CHUNK + [True] * 16
    assert torch.equal(gather(geo, target, slots[CHUNK:].tolist()), gather(geo, source, slots[CHUNK:].tolist()))
    assert torch.equal(gather(geo, target, slots[:CHUNK].tolist()), before)

    bad = torch.ones(24, dtype=torch.bool)
    bad[:3] = False
    for call in (engine.store, engine.retrieve, engine.prefetch):
        with pytest.raises(ValueError, match="multiple of"):
            call(tokens, bad, kvcaches=source, slot_mapping=slots) if call != engine.prefetch else call(tokens, bad)


def test_retrieve_stops_at_the_first_missing_chunk():
    geo = geometry()
    engine = make_engine(geo, config())
    tokens = prompt(32)
    source, slots = make_kvcaches(geo, seed=1), slots_for(geo, 32)
    engine.store(tokens, kvcaches=source, slot_mapping=slots)
    keys = [k for _, _, k in engine.token_database.process_tokens(tokens)]
    engine.storage_manager.remove(keys[2])
    assert engine.lookup(tokens) == 16
    ret = engine.retrieve(tokens, kvcaches=make_kvcaches(geo, seed=2), slot_mapping=slots)
    assert ret.tolist() == [True] * 16 + [False] * 16


def test_store_skips_chunks_already_stored():
    geo = geometry()
    engine = make_engine(geo, config())
    tokens = prompt(24)
    source, slots = make_kvcaches(geo), slots_for(geo, 24)
    engine.store(tokens[:16], kvcaches=source, slot_mapping=slots[:16])
    engine.store(tokens, kvcaches=source, slot_mapping=slots)
    snap = engine.stats()
    assert (snap.store_requested_tokens, snap.stored_tokens, snap.store_skipped_tokens) == (40, 24, 16)
    assert snap.tiers["Hot"].chunks_written == 3


def test_cache_salt_separates_keys():
    geo = geometry()
    engine = make_engine(geo, config())
    tokens = prompt(16)
    engine.store(tokens, cache_salt="lora-a", kvcaches=make_kvcaches(geo), slot_mapping=slots_for(geo, 16))
    assert engine.lookup(tokens, cache_salt="lora-a") == 16
    assert engine.lookup(tokens) == 0 and engine.lookup(tokens, cache_salt="lora-b") == 0


def test_eviction_under_a_small_cpu_size():
    geo = geometry()
    cfg = config(max_local_cpu_size=4 * chunk_bytes(geo) / GB)  # room for 4 chunks
    engine = make_engine(geo, cfg)
    source = make_kvcaches(geo)
    prompts = [prompt(16, seed=s) for s in range(4)]  # 8 chunks in all
    for p in prompts:
        engine.store(p, kvcaches=source, slot_mapping=slots_for(geo, 16))
    assert [engine.lookup(p) for p in prompts] == [0, 0, 16, 16]
    snap = engine.stats()
    assert snap.evicted_chunks == 4 and snap.evicted_bytes == 4 * chunk_bytes(geo)
    assert snap.stored_tokens == 64


def test_full_memory_never_raises_and_drops_the_store(caplog):
    geo = geometry()
    engine = make_engine(geo, config(max_local_cpu_size=chunk_bytes(geo) / 2 / GB))  # not even one chunk
    tokens = prompt(16)
    source, slots = make_kvcaches(geo), slots_for(geo, 16)
    engine.store(tokens, kvcaches=source, slot_mapping=slots)
    assert engine.lookup(tokens) == 0
    assert not engine.retrieve(tokens, kvcaches=source, slot_mapping=slots).any()
    assert engine.stats().store_dropped_tokens == 16

    # Memory held by readers cannot be evicted: the next store is dropped, not an error.
    engine2 = make_engine(geo, config(max_local_cpu_size=chunk_bytes(geo) / GB))
    engine2.store(tokens[:CHUNK], kvcaches=source, slot_mapping=slots[:CHUNK])
    key = next(iter(engine2.token_database.process_tokens(tokens[:CHUNK])))[2]
    held = engine2.storage_manager.get(key)
    engine2.store(prompt(8, seed=7), kvcaches=source, slot_mapping=slots[:CHUNK])
    assert engine2.lookup(tokens[:CHUNK]) == CHUNK and engine2.lookup(prompt(8, seed=7)) == 0
    held.ref_count_down()


def test_a_failing_tier_is_a_miss(tmp_path):
    geo = geometry()
    engine = make_engine(geo, config(local_disk=str(tmp_path), max_local_disk_size=0.01))
    tokens = prompt(16)
    source, slots = make_kvcaches(geo), slots_for(geo, 16)
    engine.store(tokens, kvcaches=source, slot_mapping=slots)
    cpu, disk = engine.storage_manager.tiers
    disk.close()
    cpu.close()  # the CPU tier forgets everything; only the disk has the chunks

    def broken(key):
        raise OSError("disk gone")

    disk.get_blocking = broken
    disk.contains = broken
    assert engine.lookup(tokens) == 0
    assert not engine.retrieve(tokens, kvcaches=source, slot_mapping=slots).any()
    assert engine.stats().tiers["LocalDiskBackend"].errors >= 2


def test_search_range_and_promotion(tmp_path):
    geo = geometry()
    engine = make_engine(geo, config(local_disk=str(tmp_path), max_local_disk_size=0.01))
    tokens = prompt(16)
    source, slots = make_kvcaches(geo), slots_for(geo, 16)
    engine.store(tokens, kvcaches=source, slot_mapping=slots)
    cpu, disk = engine.storage_manager.tiers
    disk.close()
    keys = [k for _, _, k in engine.token_database.process_tokens(tokens)]
    cpu.remove(keys[1])
    assert engine.lookup(tokens, ["Hot"]) == CHUNK
    assert engine.lookup(tokens, ["LocalDiskBackend"]) == 16
    assert engine.lookup(tokens, ["Hot", "LocalDiskBackend"]) == 16
    assert engine.lookup(tokens) == 16
    with pytest.raises(ValueError, match="search_range"):
        engine.lookup(tokens, "Hot")
    target = make_kvcaches(geo, seed=3)
    assert engine.retrieve(tokens, kvcaches=target, slot_mapping=slots).all()
    check_loaded(geo, source, slots, target, slots, 16)
    assert engine.lookup(tokens, ["Hot"]) == 16  # the disk hit was promoted


def test_prefetch_loads_disk_chunks_into_the_cpu_tier(tmp_path):
    geo = geometry()
    cfg = config(local_disk=str(tmp_path), max_local_disk_size=0.01)
    first = make_engine(geo, cfg)
    tokens = prompt(24)
    source, slots = make_kvcaches(geo), slots_for(geo, 24)
    first.store(tokens, kvcaches=source, slot_mapping=slots)
    first.close()
    second = make_engine(geo, cfg)
    assert second.lookup(tokens, ["Hot"]) == 0 and second.lookup(tokens) == 24
    second.prefetch(tokens)
    second.storage_manager.tiers[1].close()  # wait for the prefetch thread
    assert second.lookup(tokens, ["Hot"]) == 24


def test_a_second_process_reads_the_disk_cache(tmp_path):
    geo = geometry(KVLayout.CPU_PACKED, torch.bfloat16)
    cfg = config(local_disk=str(tmp_path / "disk"), max_local_disk_size=0.01)
    engine = make_engine(geo, cfg)
    tokens = prompt(20, seed=4)
    engine.store(tokens, kvcaches=make_kvcaches(geo, seed=4), slot_mapping=slots_for(geo, 20, seed=4))
    engine.close()
    script = f"""
import sys, torch
sys.path.insert(0, {TESTS_DIR!r})
from helpers import *
from kv_reference import make_kvcaches
geo = geometry(KVLayout.CPU_PACKED, torch.bfloat16)
engine = make_engine(geo, config(local_disk={str(tmp_path / "disk")!r}, max_local_disk_size=0.01))
tokens = prompt(20, seed=4)
target, dst = make_kvcaches(geo, seed=5), slots_for(geo, 20, seed=5)
ret = engine.retrieve(tokens, kvcaches=target, slot_mapping=dst)
check_loaded(geo, make_kvcaches(geo, seed=4), slots_for(geo, 20, seed=4), target, dst, 20)
print("LOOKUP", engine.lookup(tokens), "RETRIEVED", int(ret.sum()))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=TESTS_DIR)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["LOOKUP", "20", "RETRIEVED", "20"]


def test_corrupted_disk_chunk_is_a_miss_and_removed(tmp_path):
    geo = geometry()
    cfg = config(local_cpu=False, local_disk=str(tmp_path), max_local_disk_size=0.01)
    engine = make_engine(geo, cfg)
    tokens = prompt(16)
    source, slots = make_kvcaches(geo), slots_for(geo, 16)
    engine.store(tokens, kvcaches=source, slot_mapping=slots)
    engine.close()
    disk_engine = make_engine(geo, cfg)
    disk = disk_engine.storage_manager.tiers[0]
    second_key = [k for _, _, k in disk_engine.token_database.process_tokens(tokens)][1]
    path = disk.key_to_path(second_key)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 100)
        f.write(b"\x00" * 8 + b"\xff" * 8)
    ret = disk_engine.retrieve(tokens, kvcaches=make_kvcaches(geo, seed=3), slot_mapping=slots)
    assert ret.tolist() == [True] * CHUNK + [False] * CHUNK
    assert not os.path.exists(path) and disk_engine.lookup(tokens) == CHUNK


def test_concurrent_store_and_retrieve(tmp_path):
    geo = geometry(KVLayout.CPU_IPEX, torch.bfloat16)
    engine = make_engine(geo, config(max_local_cpu_size=8 * chunk_bytes(geo) / GB, local_disk=str(tmp_path), max_local_disk_size=0.01))
    source = make_kvcaches(geo, seed=1)
    errors = []

    def worker(worker_id: int) -> None:
        try:
            for round_id in range(6):
                seed = (worker_id * 3 + round_id) % 8  # threads share some prompts
                tokens = prompt(16, seed=seed)
                src_slots = slots_for(geo, 16, seed=seed)  # a prompt's KV is the same in every thread
                engine.store(tokens, kvcaches=source, slot_mapping=src_slots)
                target, dst_slots = make_kvcaches(geo, seed=100 + worker_id), slots_for(geo, 16, seed=50 + worker_id)
                ret = engine.retrieve(tokens, kvcaches=target, slot_mapping=dst_slots)
                n = int(ret.sum())
                # a loaded prefix (a store may be dropped while other threads hold all the memory),
                # holding exactly the stored KV
                assert ret[:n].all() and not ret[n:].any()
                check_loaded(geo, source, src_slots, target, dst_slots, n)
        except Exception as err:  # surfaced below
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    cpu, disk = engine.storage_manager.tiers
    disk.close()  # all writes landed: every chunk stored by any thread is on disk now
    snap = engine.stats()
    assert snap.evicted_chunks > 0 and snap.retrieve_hit_tokens > 0
    for seed in range(8):
        if engine.lookup(prompt(16, seed=seed)) == 16:
            target = make_kvcaches(geo, seed=7)
            assert engine.retrieve(prompt(16, seed=seed), kvcaches=target, slot_mapping=slots_for(geo, 16, seed=9)).all()
            check_loaded(geo, source, slots_for(geo, 16, seed=seed), target, slots_for(geo, 16, seed=9), 16)
    assert len(disk) >= 8  # most prompts' chunks made it to disk
    engine.close()
    assert engine.memory_allocator.pool.num_live_objects() == 0  # no leaked references


def test_builder_semantics(tmp_path):
    geo = geometry()
    cfg = config(local_disk=str(tmp_path), max_local_disk_size=0.01)
    meta = metadata(geo)
    name = "test-builder-engine"
    try:
        engine = LMCacheEngineBuilder.get_or_create(name, cfg, meta, connector(geo))
        assert LMCacheEngineBuilder.get(name) is engine
        assert LMCacheEngineBuilder.get_or_create(name, config(local_disk=str(tmp_path), max_local_disk_size=0.01), meta, connector(geo)) is engine
        with pytest.raises(ValueError, match="different config"):
            LMCacheEngineBuilder.get_or_create(name, config(chunk_size=16), meta, connector(geo))
        assert engine.storage_manager.tier_names == ["Hot", "LocalDiskBackend"]
        tokens = prompt(16)
        engine.store(tokens, kvcaches=make_kvcaches(geo), slot_mapping=slots_for(geo, 16))
    finally:
        LMCacheEngineBuilder.destroy(name)
    assert LMCacheEngineBuilder.get(name) is None
    assert len(os.listdir(tmp_path)) == 2  # destroy waited for the pending writes
    LMCacheEngineBuilder.destroy(name)  # destroying an unknown engine is a no-op
    with pytest.raises(ValueError, match="max_local_cpu_size"):
        LMCacheEngineBuilder.get_or_create("zero", config(max_local_cpu_size=0.0), meta, connector(geo))


def test_a_closed_engine_stores_and_loads_nothing():
    geo = geometry()
    engine = make_engine(geo, config())
    tokens = prompt(16)
    source, slots = make_kvcaches(geo), slots_for(geo, 16)
    engine.close()
    engine.close()  # idempotent
    engine.store(tokens, kvcaches=source, slot_mapping=slots)
    assert engine.lookup(tokens) == 0
    assert not engine.retrieve(tokens, kvcaches=source, slot_mapping=slots).any()
    assert engine.stats().store_dropped_tokens == 16


def test_retrieve_reads_the_next_chunk_ahead(tmp_path):
    """While one chunk is copied into the KV cache, the disk tier is already reading the next."""
    geo = geometry()
    cfg = config(local_disk=str(tmp_path), max_local_disk_size=0.01)
    first = make_engine(geo, cfg)
    tokens = prompt(32)
    source, slots = make_kvcaches(geo), slots_for(geo, 32)
    first.store(tokens, kvcaches=source, slot_mapping=slots)
    first.close()
    engine = make_engine(geo, cfg)
    asked = []
    real_prefetch = engine.storage_manager.prefetch
    engine.storage_manager.prefetch = lambda key: asked.append(key) or real_prefetch(key)
    target = make_kvcaches(geo, seed=2)
    assert engine.retrieve(tokens, kvcaches=target, slot_mapping=slots).all()
    check_loaded(geo, source, slots, target, slots, 32)
    assert asked == [k for _, _, k in engine.token_database.process_tokens(tokens)][1:]
    assert engine.lookup(tokens, ["Hot"]) == 32  # read-ahead and promotion both landed in RAM


def test_engine_refuses_a_switch_whose_feature_it_lacks():
    geo = geometry()
    with pytest.raises(ValueError, match="enable_blending=True"):
        LMCacheEngineBuilder.get_or_create("refused", config(enable_blending=True), metadata(geo), connector(geo))
    assert LMCacheEngineBuilder.get("refused") is None
