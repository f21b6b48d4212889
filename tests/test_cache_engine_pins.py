"""Pinned lookups on CPU tensors: a prefix a lookup promised is still retrieved bit-exact after its
lower-tier copy is gone or the CPU tier had to make room; pins under memory pressure make stores
skip instead of evicting; replace / unpin / close release every reference; two threads."""

from __future__ import annotations

import os
import threading

import pytest

from helpers import CHUNK, check_loaded, prompt, slots_for
from tier_helpers import ENGINE_GEO, flush, keys_of, retrieve_and_check, small_engine, store_prompt

from kv_reference import make_kvcaches
from lmcache.experimental.pins import PinRegistry
from lmcache.server import LMCacheServer, ServerConfig


@pytest.mark.parametrize("local_cpu", [True, False], ids=["cpu+disk", "disk-only"])
def test_pinned_prefix_survives_its_chunks_leaving_every_tier(local_cpu, tmp_path):
    engine = small_engine(local_cpu=local_cpu, local_disk=str(tmp_path), max_local_disk_size=0.01)
    tokens, source, slots = store_prompt(engine, 20, seed=1)  # two whole chunks and a partial one
    flush(engine)
    assert engine.lookup(tokens, request_id="r", pin=True) == 20
    assert engine.stats().live_pins == 3 and engine.stats().pinned_requests == 1
    for key in keys_of(engine, tokens):  # the disk's LRU, a remove, or the CPU tier: all copies gone
        engine.storage_manager.remove(key)
    assert not os.listdir(tmp_path)
    assert engine.lookup(tokens) == 0  # not cached any more ...
    retrieve_and_check(engine, tokens, source, slots, 20)  # ... but the promise is kept
    engine.lookup_unpin(["r"])
    assert engine.stats().live_pins == 0 and engine.stats().pinned_requests == 0
    assert engine.retrieve(tokens, kvcaches=make_kvcaches(ENGINE_GEO), slot_mapping=slots).sum() == 0
    assert engine.memory_allocator.pool.num_live_objects() == 0  # the pins held the last references
    engine.close()


def test_pinned_prefix_survives_the_remote_server_going_away():
    server = LMCacheServer(ServerConfig(port=0, max_size_bytes=64 << 20))
    server.start_in_thread()
    host, port = server.address
    engine = small_engine(local_cpu=False, remote_url=f"lm://{host}:{port}", remote_serde="naive")
    try:
        tokens, source, slots = store_prompt(engine, 24, seed=2)
        flush(engine)
        assert engine.lookup(tokens, request_id="r", pin=True) == 24
    finally:
        server.shutdown()
    retrieve_and_check(engine, tokens, source, slots, 24)
    engine.lookup_unpin(["r"])
    engine.close()
    assert engine.memory_allocator.pool.num_live_objects() == 0


def test_a_pinned_lookup_asks_the_remote_tier_once_and_pins_only_past_vllms_own_prefix(monkeypatch):
    """One EXISTS exchange for the prefix, one read for the chunks to pin; chunks that end within
    `pin_from` (the serving engine's own prefix cache) are found but not read."""
    server = LMCacheServer(ServerConfig(port=0, max_size_bytes=64 << 20))
    server.start_in_thread()
    host, port = server.address
    engine = small_engine(local_cpu=False, remote_url=f"lm://{host}:{port}", remote_serde="naive")
    calls = []
    connector = engine.storage_manager.tiers[0]._connector
    for name in ("batched_exists", "batched_get_into"):
        real = getattr(connector, name)
        monkeypatch.setattr(connector, name, lambda keys, *rest, _r=real, _n=name: calls.append((_n, len(keys))) or _r(keys, *rest))
    try:
        tokens, source, slots = store_prompt(engine, 3 * CHUNK + 4, seed=5)  # chunks end at 8, 16, 24, 28
        flush(engine)
        calls.clear()
        assert engine.lookup(tokens, request_id="r", pin=True, pin_from=2 * CHUNK + 3) == 3 * CHUNK + 4
        assert calls == [("batched_exists", 4), ("batched_get_into", 2)]
        assert engine.stats().live_pins == 2
        calls.clear()
        assert engine.lookup(tokens, request_id="r", pin=True, pin_from=3 * CHUNK + 4) == 3 * CHUNK + 4
        assert calls == [("batched_exists", 4)] and engine.stats().live_pins == 0
        assert engine.lookup(tokens[: 2 * CHUNK], request_id="r", pin=True) == 2 * CHUNK
        assert engine.stats().live_pins == 2
    finally:
        server.shutdown()
    retrieve_and_check(engine, tokens[: 2 * CHUNK], source, slots, 2 * CHUNK)  # from the pins
    engine.lookup_unpin(["r"])
    engine.close()
    assert engine.memory_allocator.pool.num_live_objects() == 0


def test_reading_an_earlier_chunk_cannot_evict_a_later_pinned_one(tmp_path):
    """Chunk 0 only on disk, chunk 1 only in a full CPU tier where it is the least recently used.
    Reading chunk 0 into memory must evict something: without pins it is chunk 1 (short load)."""

    def scene(seed: int):
        engine = small_engine(num_chunks=3, local_disk=str(tmp_path / str(seed)), max_local_disk_size=0.01)
        tokens, source, slots = store_prompt(engine, 16, seed=seed)
        flush(engine)
        first, second = keys_of(engine, tokens)
        cpu, disk = engine.storage_manager.tiers
        cpu.remove(first)
        disk.remove(second)
        store_prompt(engine, CHUNK, seed=seed + 100)  # two fillers make the CPU tier full; chunk 1 is LRU
        store_prompt(engine, CHUNK, seed=seed + 200)
        flush(engine)
        assert len(cpu) == 3 and cpu.keys()[0] == second
        return engine, tokens, source, slots

    engine, tokens, source, slots = scene(3)
    assert engine.lookup(tokens) == 16
    retrieve_and_check(engine, tokens, source, slots, CHUNK)  # the bug pins exist to prevent
    engine.close()

    engine, tokens, source, slots = scene(4)
    assert engine.lookup(tokens, request_id="r", pin=True) == 16
    retrieve_and_check(engine, tokens, source, slots, 16)
    assert engine.stats().tiers["Hot"].evicted_chunks == 1  # a filler made the room
    engine.lookup_unpin(["r"])
    engine.close()
    assert engine.memory_allocator.pool.num_live_objects() == 0


def test_memory_pressure_with_pins_skips_stores_and_shortens_pins_never_raises(tmp_path):
    engine = small_engine(num_chunks=2, local_disk=str(tmp_path), max_local_disk_size=0.01)
    other, other_source, other_slots = store_prompt(engine, 16, seed=5)
    flush(engine)
    tokens, source, slots = store_prompt(engine, 16, seed=6)  # evicts `other` from RAM (still on disk)
    flush(engine)
    assert engine.lookup(tokens, request_id="a", pin=True) == 16
    cpu = engine.storage_manager.tiers[0]
    for key in keys_of(engine, tokens):
        obj = cpu.get_blocking(key)
        assert obj.get_ref_count() == 3  # the tier's, the pin's, ours: in use, so never evicted
        obj.ref_count_down()
    # A new prompt finds no room: nothing idle to evict, so the store is dropped, not raised.
    dropped_before = engine.stats().store_dropped_tokens
    new, _, _ = store_prompt(engine, 16, seed=7)
    assert engine.stats().store_dropped_tokens - dropped_before == 16
    assert engine.lookup(new) == 0
    assert engine.lookup(tokens, ["Hot"]) == 16 and engine.stats().tiers["Hot"].evicted_chunks == 2  # `other` only
    # A pinned lookup of a disk-only prompt cannot read it into memory: 0 pinned, counted, no raise.
    assert engine.lookup(other) == 16
    assert engine.lookup(other, request_id="b", pin=True) == 0
    assert engine.stats().pin_failed_tokens == 16 and engine.stats().pinned_requests == 1
    retrieve_and_check(engine, tokens, source, slots, 16)
    # Once unpinned, the memory is usable again.
    engine.lookup_unpin(["a"])
    assert engine.lookup(other, request_id="b", pin=True) == 16
    retrieve_and_check(engine, other, other_source, other_slots, 16)
    engine.lookup_unpin(["b"])
    store_prompt(engine, 16, seed=7)
    assert engine.lookup(new) == 16
    engine.close()
    assert engine.memory_allocator.pool.num_live_objects() == 0


def test_replace_unpin_and_close_release_every_reference():
    engine = small_engine()
    a_tokens, _, _ = store_prompt(engine, 16, seed=8)
    b_tokens, _, _ = store_prompt(engine, 24, seed=9)
    cpu = engine.storage_manager.tiers[0]

    def refs(tokens):
        counts = []
        for key in keys_of(engine, tokens):
            obj = cpu.get_blocking(key)
            counts.append(obj.get_ref_count() - 1)  # minus the reference get_blocking gave us
            obj.ref_count_down()
        return counts

    assert refs(a_tokens) == [1, 1]  # the tier's own
    assert engine.lookup(a_tokens, request_id="r", pin=True) == 16
    assert refs(a_tokens) == [2, 2]
    assert engine.lookup(a_tokens, request_id="r", pin=True) == 16  # the same again: replaced, not added
    assert refs(a_tokens) == [2, 2] and engine.stats().live_pins == 2
    assert engine.lookup(b_tokens, request_id="r", pin=True) == 24  # another prompt: a's pins released
    assert refs(a_tokens) == [1, 1] and refs(b_tokens) == [2, 2, 2]
    assert engine.lookup(prompt(16, seed=77), request_id="r", pin=True) == 0  # a miss releases too
    assert refs(b_tokens) == [1, 1, 1] and engine.stats().live_pins == 0

    assert engine.lookup(a_tokens, request_id="x", pin=True) == 16
    assert engine.lookup(a_tokens, request_id="y", pin=True) == 16
    assert engine.lookup(b_tokens[:CHUNK], request_id="z", pin=True) == CHUNK
    assert refs(a_tokens) == [3, 3]
    snap = engine.stats()
    assert (snap.live_pins, snap.pinned_requests) == (5, 3)
    engine.lookup_unpin(["x", "never-looked-up"])
    assert refs(a_tokens) == [2, 2] and engine.stats().live_pins == 3
    assert engine.lookup(a_tokens, request_id="w") == 16  # no pin=True: nothing held
    assert engine.stats().pinned_requests == 2
    with pytest.raises(TypeError, match="single string"):
        engine.lookup_unpin("y")
    with pytest.raises(ValueError, match="request_id"):
        engine.lookup(a_tokens, pin=True)

    engine.close()
    assert engine.stats().live_pins == 0 and engine.stats().pinned_requests == 0
    assert engine.memory_allocator.pool.num_live_objects() == 0
    assert engine.memory_allocator.used_bytes == 0
    assert engine.lookup(a_tokens, request_id="late", pin=True) == 0  # closed: nothing pinned
    assert engine.stats().live_pins == 0


def test_registry_refuses_pins_after_close_and_keeps_copies_apart():
    engine = small_engine()
    tokens, _, _ = store_prompt(engine, 8, seed=10)
    (key,) = keys_of(engine, tokens)
    registry = PinRegistry()
    first, second = engine.storage_manager.get(key), engine.storage_manager.get(key)
    assert registry.pin("r1", [(key, first)]) and registry.pin("r2", [(key, second)])
    got = registry.get(key)
    assert got is first and first.get_ref_count() == 4  # tier, r1, r2 (same object), ours
    got.ref_count_down()
    assert registry.unpin(["r1"]) == 1 and registry.contains(key)
    assert registry.unpin(["r2", "r2"]) == 1 and not registry.contains(key) and registry.get(key) is None
    assert first.get_ref_count() == 1
    assert registry.close() == 0
    third = engine.storage_manager.get(key)
    assert not registry.pin("r3", [(key, third)])  # released at once
    assert third.get_ref_count() == 1 and registry.num_pins == 0
    engine.close()


def test_pinned_lookups_retrieves_and_stores_from_two_threads(tmp_path):
    engine = small_engine(num_chunks=6, local_disk=str(tmp_path), max_local_disk_size=0.01)
    source = make_kvcaches(ENGINE_GEO, seed=1)
    errors: list[BaseException] = []
    promised_and_loaded: list[tuple[int, int]] = []

    def worker(worker_id: int) -> None:
        try:
            for round_id in range(12):
                seed = (worker_id * 5 + round_id) % 10  # the threads share prompts
                tokens, src_slots = prompt(24, seed=seed), slots_for(ENGINE_GEO, 24, seed=seed)
                engine.store(tokens, kvcaches=source, slot_mapping=src_slots)
                request_id = f"w{worker_id}-{round_id}"
                hit = engine.lookup(tokens, request_id=request_id, pin=True)
                # The other thread stores in between, which needs memory the pins must not give up.
                other = prompt(24, seed=seed + 1000 + worker_id)
                engine.store(other, kvcaches=source, slot_mapping=slots_for(ENGINE_GEO, 24, seed=seed + 1))
                target, dst = make_kvcaches(ENGINE_GEO, seed=100 + worker_id), slots_for(ENGINE_GEO, 24, seed=50 + worker_id)
                got = engine.retrieve(tokens[:hit], kvcaches=target, slot_mapping=dst[:hit])
                engine.lookup_unpin([request_id])
                promised_and_loaded.append((hit, int(got.sum())))
                check_loaded(ENGINE_GEO, source, src_slots, target, dst, hit)
        except BaseException as err:  # surfaced below
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert all(hit == loaded for hit, loaded in promised_and_loaded), promised_and_loaded
    assert any(hit > 0 for hit, _ in promised_and_loaded)
    snap = engine.stats()
    assert snap.live_pins == 0 and snap.pinned_requests == 0 and snap.evicted_chunks > 0
    engine.close()
    assert engine.memory_allocator.pool.num_live_objects() == 0
