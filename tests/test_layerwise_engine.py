"""LMCacheEngine.store_layer / retrieve_layer: one layer per next(), bit-exact with the whole-chunk
store/retrieve on every paged layout (each path reads what the other wrote), layer i written by
the i-th next() and not before, masks and misses, memory released when a generator is dropped."""

import time

import pytest
import torch
from helpers import CHUNK, check_loaded, config, geometry, make_engine, prompt, slots_for
from kv_reference import gather, make_kvcaches

from lmcache.experimental.kv_layout import KVLayout
from lmcache.experimental.token_database import skip_prefix_mask

LAYOUTS = [
    (KVLayout.CPU_IPEX, torch.float32),
    (KVLayout.CPU_PACKED, torch.bfloat16),
    (KVLayout.CPU_PACKED, torch.float16),
    (KVLayout.FLASH, torch.float16),
    (KVLayout.MLA, torch.bfloat16),
]


def drain(gen) -> list:
    return list(gen)


@pytest.mark.parametrize("layout,dtype", LAYOUTS, ids=lambda v: getattr(v, "name", str(v)))
def test_layer_store_is_read_back_by_whole_chunk_retrieve(layout, dtype):
    geo = geometry(layout, dtype)
    engine = make_engine(geo, config())
    tokens = prompt(21)  # two whole chunks and a partial one
    source, src_slots = make_kvcaches(geo, seed=1), slots_for(geo, 21, seed=1)
    storer = engine.store_layer(tokens, kvcaches=source, slot_mapping=src_slots)
    assert drain(storer) == [None] * geo.num_layers
    assert engine.lookup(tokens) == 21
    target, dst_slots = make_kvcaches(geo, seed=2), slots_for(geo, 21, seed=2)
    assert bool(engine.retrieve(tokens, kvcaches=target, slot_mapping=dst_slots).all())
    check_loaded(geo, source, src_slots, target, dst_slots, 21)
    snap = engine.stats()
    assert (snap.stored_tokens, snap.store_requested_tokens) == (21, 21)
    engine.close()


@pytest.mark.parametrize("layout,dtype", LAYOUTS, ids=lambda v: getattr(v, "name", str(v)))
def test_layer_retrieve_writes_layer_i_at_the_ith_next(layout, dtype):
    geo = geometry(layout, dtype)
    engine = make_engine(geo, config())
    tokens = prompt(21)
    source, src_slots = make_kvcaches(geo, seed=1), slots_for(geo, 21, seed=1)
    engine.store(tokens, kvcaches=source, slot_mapping=src_slots)
    target, dst_slots = make_kvcaches(geo, seed=2), slots_for(geo, 21, seed=2)
    before = gather(geo, target, dst_slots.tolist())
    want = gather(geo, source, src_slots.tolist())
    retriever = engine.retrieve_layer(tokens, kvcaches=target, slot_mapping=dst_slots)
    for layer in range(geo.num_layers):
        assert next(retriever) is None
        now = gather(geo, target, dst_slots.tolist())
        assert torch.equal(now[:, : layer + 1].view(torch.uint8), want[:, : layer + 1].view(torch.uint8))
        assert torch.equal(now[:, layer + 1 :].view(torch.uint8), before[:, layer + 1 :].view(torch.uint8))
    mask = next(retriever)
    assert mask.dtype == torch.bool and bool(mask.all())
    with pytest.raises(StopIteration):
        next(retriever)
    assert engine.stats().retrieve_hit_tokens == 21
    engine.close()


def test_masked_layer_paths_skip_what_vllm_has():
    geo = geometry()
    engine = make_engine(geo, config())
    tokens = prompt(24)
    source, slots = make_kvcaches(geo, seed=1), slots_for(geo, 24)
    mask = skip_prefix_mask(24, CHUNK, CHUNK)
    drain(engine.store_layer(tokens, mask, kvcaches=source, slot_mapping=slots))
    assert engine.lookup(tokens) == 0  # the first chunk was never stored
    # A slot mapping that starts at token `offset` (the storer's own tokens only).
    drain(engine.store_layer(tokens[:CHUNK], kvcaches=source, slot_mapping=slots[:CHUNK], offset=0))
    assert engine.lookup(tokens) == 24
    target = make_kvcaches(geo, seed=2)
    full = slots.clone()
    full[:CHUNK] = -1  # vLLM has the first chunk: never written
    before = gather(geo, target, slots[:CHUNK].tolist())
    *layers, got = drain(engine.retrieve_layer(tokens, mask, kvcaches=target, slot_mapping=full))
    assert layers == [None] * geo.num_layers
    assert got.tolist() == [False] * CHUNK + [True] * 16
    assert torch.equal(gather(geo, target, slots[:CHUNK].tolist()), before)
    check_loaded(geo, source, slots[CHUNK:], target, slots[CHUNK:], 16)


def test_offset_slot_mapping_covers_only_the_stored_tokens():
    geo = geometry()
    engine = make_engine(geo, config())
    tokens = prompt(24)
    source, slots = make_kvcaches(geo, seed=1), slots_for(geo, 24)
    mask = skip_prefix_mask(24, CHUNK, CHUNK)
    drain(engine.store_layer(tokens, mask, kvcaches=source, slot_mapping=slots[CHUNK:], offset=CHUNK))
    target = make_kvcaches(geo, seed=2)
    engine.store(tokens[:CHUNK], kvcaches=source, slot_mapping=slots[:CHUNK])
    assert bool(engine.retrieve(tokens, kvcaches=target, slot_mapping=slots).all())
    check_loaded(geo, source, slots, target, slots, 24)
    with pytest.raises(ValueError, match="outside it"):
        engine.store_layer(prompt(24, seed=5), kvcaches=source, slot_mapping=slots[CHUNK:], offset=CHUNK)


def test_layer_retrieve_stops_at_the_first_missing_chunk():
    geo = geometry()
    engine = make_engine(geo, config())
    tokens = prompt(32)
    source, slots = make_kvcaches(geo, seed=1), slots_for(geo, 32)
    engine.store(tokens, kvcaches=source, slot_mapping=slots)
    keys = [k for _, _, k in engine.token_database.process_tokens(tokens)]
    engine.storage_manager.remove(keys[2])
    *_, got = drain(engine.retrieve_layer(tokens, kvcaches=make_kvcaches(geo, seed=2), slot_mapping=slots))
    assert got.tolist() == [True] * 16 + [False] * 16


def test_dropped_generators_release_their_memory():
    geo = geometry()
    engine = make_engine(geo, config())
    tokens = prompt(24)
    source, slots = make_kvcaches(geo, seed=1), slots_for(geo, 24)
    storer = engine.store_layer(tokens, kvcaches=source, slot_mapping=slots)
    next(storer)  # one layer copied, never put
    storer.close()
    assert engine.lookup(tokens) == 0
    assert engine.memory_allocator.used_bytes == 0
    snap = engine.stats()
    assert (snap.stored_tokens, snap.store_dropped_tokens) == (0, 24)
    engine.store(tokens, kvcaches=source, slot_mapping=slots)
    used = engine.memory_allocator.used_bytes
    retriever = engine.retrieve_layer(tokens, kvcaches=make_kvcaches(geo, seed=2), slot_mapping=slots)
    next(retriever)
    retriever.close()
    assert engine.memory_allocator.used_bytes == used
    for _, _, key in engine.token_database.process_tokens(tokens):
        obj = engine.storage_manager.get(key)
        assert obj.get_ref_count() == 2  # the tier's and this get's: the retriever kept none
        obj.ref_count_down()


def test_store_of_uncomputed_slots_and_bad_masks_raise_before_any_layer():
    geo = geometry()
    engine = make_engine(geo, config())
    slots = slots_for(geo, 16)
    slots[3] = -1
    with pytest.raises(ValueError, match="-1"):
        engine.store_layer(prompt(16), kvcaches=make_kvcaches(geo), slot_mapping=slots)
    assert engine.memory_allocator.used_bytes == 0
    with pytest.raises(ValueError):
        engine.retrieve_layer(prompt(16), torch.tensor([False] * 3 + [True] * 13), kvcaches=[], slot_mapping=slots)


def test_layer_generators_time_only_their_own_work(monkeypatch):
    """`time_to_store` / `time_to_retrieve` of a layer-wise call count the time it ran, not the
    forward pass between its layers (which made layer-wise hits look 3-9x slower than memcpy)."""
    geo = geometry(KVLayout.CPU_IPEX, torch.float32)
    engine = make_engine(geo, config())
    seen = {}
    monkeypatch.setattr(engine._metrics, "observe_store", lambda s: seen.setdefault("store", s))
    monkeypatch.setattr(engine._metrics, "observe_retrieve", lambda s: seen.setdefault("retrieve", s))
    tokens = prompt(21)
    source, src_slots = make_kvcaches(geo, seed=1), slots_for(geo, 21, seed=1)
    target, dst_slots = make_kvcaches(geo, seed=2), slots_for(geo, 21, seed=2)
    pause = 0.1
    started = time.perf_counter()
    for gen in (engine.store_layer(tokens, kvcaches=source, slot_mapping=src_slots),
                engine.retrieve_layer(tokens, kvcaches=target, slot_mapping=dst_slots)):
        for _ in gen:
            time.sleep(pause)  # the forward pass between two layers
    suspended = 2 * (geo.num_layers + 1) * pause - pause
    assert set(seen) == {"store", "retrieve"}
    assert 0 < seen["store"] + seen["retrieve"] < time.perf_counter() - started - suspended + 0.01
    engine.close()
