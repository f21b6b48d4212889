"""Worker side of the v1 door with the real engine and kernels: what the scheduler side plans is
stored from, and loaded into, paged KV caches in vLLM's CPU layout, slot by slot."""

from __future__ import annotations

import logging
import threading
import time
import uuid

import pytest
import torch

from lmcache.config import LMCacheEngineMetadata
from lmcache.experimental.cache_engine import LMCacheEngineBuilder
from lmcache.experimental.config import LMCacheEngineConfig
from lmcache.experimental.gpu_connector import VLLMPagedMemGPUConnectorV2
from lmcache.experimental.kv_layout import KVLayout
from lmcache.integration.vllm.v1.request_state import LMCacheConnectorMetadata
from lmcache.integration.vllm.v1.scheduler_side import LMCacheSchedulerSide
from lmcache.integration.vllm.v1.worker_channel import InProcessChannel
from lmcache.integration.vllm.v1.worker_side import LMCacheWorkerSide

from v1_helpers import StepDriver, make_request, make_settings, scheduler_output

LAYERS, HEADS, HEAD_SIZE, BLOCK, NUM_BLOCKS, CHUNK = 2, 2, 16, 16, 256, 256
PROMPT = [(7 * i + 3) % 1000 + 4 for i in range(600)]  # 2 whole chunks and a partial one


def make_setup(**config_fields):
    """A worker side on a fresh engine, its scheduler side, and random KV caches."""
    name = f"test-v1-worker-{uuid.uuid4().hex[:8]}"
    config = LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK, remote_url=None, max_local_cpu_size=0.05, **config_fields
    )
    metadata = LMCacheEngineMetadata(
        "tiny", 1, 0, "vllm", torch.float32, (LAYERS, 2, CHUNK, HEADS, HEAD_SIZE)
    )
    connector = VLLMPagedMemGPUConnectorV2(
        HEADS * HEAD_SIZE, LAYERS, layout=KVLayout.CPU_IPEX, num_kv_heads=HEADS, block_size=BLOCK, chunk_size=CHUNK
    )
    engine = LMCacheEngineBuilder.get_or_create(name, config, metadata, connector)
    worker = LMCacheWorkerSide(engine, KVLayout.CPU_IPEX, BLOCK)
    gen = torch.Generator().manual_seed(0)
    caches = [torch.randn(2, NUM_BLOCKS, BLOCK * HEADS * HEAD_SIZE, generator=gen) for _ in range(LAYERS)]
    worker.register_kv_caches(caches)
    settings = make_settings(chunk_size=CHUNK, block_size=BLOCK, async_loading=config.enable_async_loading)
    side = LMCacheSchedulerSide(settings, InProcessChannel(worker))
    driver = StepDriver(side, BLOCK)
    driver.next_block = 0
    yield worker, side, driver, caches
    worker.close()
    LMCacheEngineBuilder.destroy(name)


@pytest.fixture
def setup():
    yield from make_setup()


@pytest.fixture
def layerwise_setup():
    yield from make_setup(use_layerwise=True)


def token_kv(caches, slots):
    """[layer, k/v, token, head, dim] read from the IPEX layout at the given slots."""
    out = []
    for cache in caches:
        kv = cache.view(2, NUM_BLOCKS, HEADS, BLOCK, HEAD_SIZE)
        idx = torch.tensor(slots)
        # Two index tensors around a slice put the token dim first: [T, 2, heads, head_size].
        out.append(kv[:, idx // BLOCK, :, idx % BLOCK, :].permute(1, 0, 2, 3))
    return torch.stack(out)


def finish(side, request):
    side.request_finished(request, [])


def test_store_then_load_into_other_blocks_copies_every_token(setup):
    worker, side, driver, caches = setup
    first = make_request("a", PROMPT)
    meta = driver.admit(first, len(PROMPT))
    worker.start_load_kv(meta, None)  # nothing to load
    worker.wait_for_save(meta)
    assert worker.pop_request_counters("a").stored_tokens == 600
    expected = token_kv(caches, driver.slots("a", 600))

    second = make_request("b", PROMPT)
    meta = driver.admit(second, len(PROMPT))
    assert driver.returned["b"] == 599
    slots_b = driver.slots("b", 600)
    assert set(slots_b).isdisjoint(driver.slots("a", 600))
    assert not torch.equal(token_kv(caches, slots_b), expected)
    worker.start_load_kv(meta, None)
    worker.wait_for_save(meta)
    assert torch.equal(token_kv(caches, slots_b), expected)
    assert worker.pop_request_counters("b").loaded_tokens == 600
    assert worker.engine.stats().stored_tokens == 600  # the second request stored nothing new


def test_load_never_writes_the_prefix_vllm_already_has(setup):
    worker, side, driver, caches = setup
    meta = driver.admit(make_request("a", PROMPT), len(PROMPT))
    worker.wait_for_save(meta)
    expected = token_kv(caches, driver.slots("a", 600))

    vllm_cached = 272  # 17 blocks: not on a chunk boundary, the load starts at chunk 1
    meta = driver.admit(make_request("c", PROMPT), len(PROMPT), vllm_cached=vllm_cached)
    assert driver.returned["c"] == 599 - vllm_cached
    slots_c = driver.slots("c", 600)
    for cache in caches:
        cache.view(2, NUM_BLOCKS, -1)[:, slots_c[0] // BLOCK : slots_c[-1] // BLOCK + 1] = float("nan")
    worker.start_load_kv(meta, None)
    after = token_kv(caches, slots_c)
    assert torch.isnan(after[:, :, :vllm_cached]).all()
    assert torch.equal(after[:, :, vllm_cached:], expected[:, :, vllm_cached:])
    assert worker.pop_request_counters("c").loaded_tokens == 600 - vllm_cached


def test_chunked_prefill_stores_each_chunk_once(setup):
    worker, side, driver, caches = setup
    request = make_request("a", PROMPT)
    metas = [driver.admit(request, 200)]
    while request.num_computed_tokens < len(PROMPT):
        metas.append(driver.run(request, min(200, len(PROMPT) - request.num_computed_tokens)))
    for meta in metas:
        worker.wait_for_save(meta)
    worker.saver.flush()  # the stores ran after their steps
    stats = worker.engine.stats()
    assert stats.stored_tokens == 600 and stats.store_skipped_tokens == 0
    assert worker.lookup(PROMPT, "") == 600
    assert worker.pop_request_counters("a").stored_tokens == 600


def test_salted_keys_do_not_match_plain_ones(setup):
    worker, side, driver, caches = setup
    worker.wait_for_save(driver.admit(make_request("a", PROMPT), len(PROMPT)))
    assert worker.lookup(PROMPT, "") == 600
    assert worker.lookup(PROMPT, '{"lora":["x",""]}') == 0
    assert worker.lookup(PROMPT[:300] + [5] + PROMPT[301:], "") == 256


def live_pins(worker) -> int:
    return worker.engine.stats().live_pins


def test_chunks_gone_after_the_lookup_are_still_loaded_then_released(setup):
    worker, side, driver, caches = setup
    worker.wait_for_save(driver.admit(make_request("a", PROMPT), len(PROMPT)))
    expected = token_kv(caches, driver.slots("a", 600))
    meta = driver.admit(make_request("b", PROMPT), len(PROMPT))
    assert live_pins(worker) == 3  # the scheduler side's lookup pinned the 3 chunks for "b"
    # Every chunk disappears between the lookup and the load (evicted, a tier lost it).
    for key in [key for _, _, key in worker.engine.token_database.process_tokens(PROMPT)]:
        worker.engine.storage_manager.remove(key)
    assert worker.lookup(PROMPT, "") == 0
    worker.start_load_kv(meta, None)
    assert worker.pop_request_counters("b").loaded_tokens == 600
    assert torch.equal(token_kv(caches, driver.slots("b", 600)), expected)
    assert live_pins(worker) == 0
    assert worker.engine.memory_allocator.used_bytes == 0  # the pins held the last references


def test_fewer_tokens_than_promised_are_reported(setup, caplog):
    worker, side, driver, caches = setup
    worker.wait_for_save(driver.admit(make_request("a", PROMPT), len(PROMPT)))
    meta = driver.admit(make_request("b", PROMPT), len(PROMPT))
    # Without its pins (released behind the door's back), the last chunk can disappear.
    worker.unpin(["b"])
    keys = [key for _, _, key in worker.engine.token_database.process_tokens(PROMPT)]
    worker.engine.storage_manager.remove(keys[-1])
    logging.getLogger("lmcache").addHandler(caplog.handler)
    try:
        worker.start_load_kv(meta, None)
    finally:
        logging.getLogger("lmcache").removeHandler(caplog.handler)
    assert worker.pop_request_counters("b").loaded_tokens == 512
    assert "promised 600 tokens but loaded 512" in caplog.text


def test_every_way_a_promise_ends_releases_its_pins(setup):
    worker, side, driver, caches = setup
    worker.wait_for_save(driver.admit(make_request("a", PROMPT), len(PROMPT)))
    assert live_pins(worker) == 0

    # vLLM already has more than LMCache: the scheduler side drops the promise at once.
    meta = driver.admit(make_request("b", PROMPT[:300]), 300, vllm_cached=288)
    assert driver.returned["b"] == 0 and live_pins(worker) == 0

    # vLLM allocated no blocks for LMCache's tokens.
    request = make_request("c", PROMPT)
    assert side.get_num_new_matched_tokens(request, 0) == 599
    assert live_pins(worker) == 3
    side.update_state_after_alloc(request, 0)
    assert live_pins(worker) == 0

    # Looked up twice (no blocks the first time): replaced, not added; then aborted while waiting.
    request = make_request("d", PROMPT)
    side.get_num_new_matched_tokens(request, 0)
    side.get_num_new_matched_tokens(request, 0)
    assert live_pins(worker) == 3 and worker.engine.stats().pinned_requests == 1
    side.request_finished(request, [])
    assert worker.get_finished({"d", "never-seen"}) == (None, None)
    assert live_pins(worker) == 0

    # A load that fails does not fail the step: it releases what it promised and reports every
    # block it should have filled as a load error (once), so vLLM 0.3x recomputes them.
    meta = driver.admit(make_request("e", PROMPT), len(PROMPT))
    assert live_pins(worker) == 3

    def broken_retrieve(*args, **kwargs):
        raise RuntimeError("kernel failed")

    worker.engine.retrieve = broken_retrieve
    worker.start_load_kv(meta, None)
    assert live_pins(worker) == 0
    (req,) = meta.requests
    promised = req.slot_mapping[: req.load_spec.lmcache_cached_tokens]
    assert worker.get_block_ids_with_load_errors() == set((promised // worker.block_size).tolist())
    assert worker.get_block_ids_with_load_errors() == set()
    assert worker.pop_request_counters("e").loaded_tokens == 0
    del worker.engine.retrieve

    # Two requests loading in one step: both released after the step's loads.
    metas = [driver.admit(make_request(r, PROMPT), len(PROMPT)) for r in ("f", "g")]
    assert live_pins(worker) == 6 and worker.engine.stats().pinned_requests == 2
    both = LMCacheConnectorMetadata(requests=metas[0].requests + metas[1].requests)
    worker.start_load_kv(both, None)
    assert live_pins(worker) == 0
    assert [worker.pop_request_counters(r).loaded_tokens for r in ("f", "g")] == [600, 600]


def test_a_step_without_loads_leaves_pins_alone(setup):
    worker, side, driver, caches = setup
    worker.wait_for_save(driver.admit(make_request("a", PROMPT), len(PROMPT)))
    request = make_request("b", PROMPT)
    side.get_num_new_matched_tokens(request, 0)  # waiting for blocks
    worker.start_load_kv(LMCacheConnectorMetadata(), None)
    worker.start_load_kv(driver.run(driver.requests["a"], 1), None)
    assert live_pins(worker) == 3
    worker.engine.close()
    assert live_pins(worker) == 0 and worker.engine.memory_allocator.used_bytes == 0


def test_counters_of_finished_requests_are_dropped(setup):
    worker, side, driver, caches = setup
    worker.wait_for_save(driver.admit(make_request("a", PROMPT), len(PROMPT)))
    assert worker.get_finished({"a"}) == (None, None)
    assert worker.pop_request_counters("a").stored_tokens == 0


def test_metadata_of_another_connector_is_ignored(setup):
    worker, side, driver, caches = setup
    worker.start_load_kv(object(), None)
    worker.wait_for_save(object())
    worker.wait_for_save(LMCacheConnectorMetadata())
    assert worker.engine.stats().store_requested_tokens == 0


def test_kv_caches_that_contradict_the_metadata_are_refused(setup):
    worker, side, driver, caches = setup
    with pytest.raises(ValueError, match="layer 1 has dtype torch.float16"):
        worker.register_kv_caches([caches[0], caches[1].half()])
    with pytest.raises(ValueError, match="1 attention layers"):
        worker.register_kv_caches(caches[:1])
    with pytest.raises(ValueError, match="layer 0 has shape"):
        worker.register_kv_caches([c.view(2, NUM_BLOCKS * 2, -1) for c in caches])


# ----- use_layerwise: the same plans, moved layer by layer on the copy thread -------------------


def layerwise_step(worker, meta):
    """A step as vLLM runs it with `use_layerwise`: loads started, a wait and a save per layer."""
    worker.start_load_kv(meta, None)
    for _ in range(LAYERS):
        worker.wait_for_layer_load()
        worker.save_kv_layer(meta)
    worker.wait_for_save(meta)


def test_layerwise_saves_per_layer_and_loads_layer_i_by_the_ith_wait(layerwise_setup):
    worker, side, driver, caches = layerwise_setup
    layerwise_step(worker, driver.admit(make_request("a", PROMPT), len(PROMPT)))  # nothing to load
    assert worker.pop_request_counters("a").stored_tokens == 600
    assert worker.engine.stats().stored_tokens == 600
    expected = token_kv(caches, driver.slots("a", 600))

    meta = driver.admit(make_request("b", PROMPT), len(PROMPT))
    slots_b = driver.slots("b", 600)
    before = token_kv(caches, slots_b)
    assert live_pins(worker) == 3
    worker.start_load_kv(meta, None)
    for layer in range(LAYERS):
        worker.wait_for_layer_load()
        now = token_kv(caches, slots_b)
        assert torch.equal(now[: layer + 1], expected[: layer + 1])  # waited-for layers are in
    worker.wait_for_save(meta)
    assert torch.equal(token_kv(caches, slots_b), expected) and not torch.equal(before, expected)
    assert worker.pop_request_counters("b").loaded_tokens == 600
    assert live_pins(worker) == 0  # released once the load settled
    assert worker.get_block_ids_with_load_errors() == set()


def test_layerwise_load_failing_part_way_reports_every_promised_block(layerwise_setup, caplog, monkeypatch):
    from lmcache.experimental.layerwise import LayerCopier

    worker, side, driver, caches = layerwise_setup
    meta = driver.admit(make_request("a", PROMPT), len(PROMPT))
    for _ in range(LAYERS):
        worker.save_kv_layer(meta)
    worker.wait_for_save(meta)
    meta = driver.admit(make_request("b", PROMPT), len(PROMPT))
    real_copy = LayerCopier.copy_layer

    def copy_layer(self, layer):
        if layer == 1:  # layer 0 is written, layer 1 never is
            raise RuntimeError("copy failed")
        real_copy(self, layer)

    monkeypatch.setattr(LayerCopier, "copy_layer", copy_layer)
    with caplog.at_level(logging.ERROR, logger="lmcache"):
        worker.start_load_kv(meta, None)
        for _ in range(LAYERS):
            worker.wait_for_layer_load()
        worker.wait_for_save(meta)
    assert worker.get_block_ids_with_load_errors() == {s // BLOCK for s in driver.slots("b", 600)}
    assert worker.pop_request_counters("b").loaded_tokens == 0
    assert "layer-wise load failed" in caplog.text
    assert live_pins(worker) == 0


@pytest.mark.parametrize("spare_core", [True, False])
def test_layerwise_loads_are_copied_by_the_model_thread_when_no_core_is_spare(spare_core, monkeypatch):
    """The copy thread overlaps the forward pass only on a core the model's OpenMP team leaves
    free; where the team covers every CPU, a copy there ran on one core while the team idled (hits
    1.16x slower than whole-chunk loads), so the model thread copies each layer as it asks for it."""
    from lmcache.background_threads import process_cpus
    from lmcache.experimental.layerwise import LayerCopier

    cpus = len(process_cpus())
    if spare_core and cpus < 2:
        pytest.skip("one CPU: no core to spare")
    before = torch.get_num_threads()
    torch.set_num_threads(1 if spare_core else cpus)
    gen = make_setup(use_layerwise=True)
    worker, side, driver, caches = next(gen)
    try:
        layerwise_step(worker, driver.admit(make_request("a", PROMPT), len(PROMPT)))
        expected = token_kv(caches, driver.slots("a", 600))
        meta = driver.admit(make_request("b", PROMPT), len(PROMPT))
        copied_on = []
        real_copy = LayerCopier.copy_layer

        def copy_layer(self, layer):
            copied_on.append(threading.current_thread().name)
            real_copy(self, layer)

        monkeypatch.setattr(LayerCopier, "copy_layer", copy_layer)
        worker.start_load_kv(meta, None)
        for layer in range(LAYERS):
            worker.wait_for_layer_load()
            assert torch.equal(token_kv(caches, driver.slots("b", 600))[: layer + 1], expected[: layer + 1])
        worker.wait_for_save(meta)
        assert torch.equal(token_kv(caches, driver.slots("b", 600)), expected)
        assert worker.pop_request_counters("b").loaded_tokens == 600
        assert live_pins(worker) == 0
        assert worker.get_block_ids_with_load_errors() == set()
    finally:
        torch.set_num_threads(before)
        next(gen, None)
    assert len(copied_on) == LAYERS
    if spare_core:
        assert all(name.startswith("lmcache-layerwise") for name in copied_on)
    else:
        assert copied_on == [threading.current_thread().name] * LAYERS


# ----- enable_async_loading: a prefix only on disk loads in the background -------------------


@pytest.fixture
def async_setup(tmp_path):
    yield from make_setup(enable_async_loading=True, local_disk=str(tmp_path), max_local_disk_size=0.1)


def only_on_disk(worker, prompt):
    """Let the disk writes land, then drop the prompt's chunks from CPU memory."""
    worker.saver.flush()  # the store ran after its step
    manager = worker.engine.storage_manager
    manager.tiers[1].flush()
    for _, _, key in worker.engine.token_database.process_tokens(prompt):
        manager.tiers[0].remove(key)


def wait_finished(worker, finished=frozenset(), which=1):
    """Call get_finished as vLLM does every step until it reports something."""
    for _ in range(500):
        reported = worker.get_finished(set(finished))[which]
        if reported:
            return reported
        finished = ()
        time.sleep(0.01)
    raise AssertionError("the background load never finished")


def park(side, driver, request):
    """What vLLM's scheduler does for an async answer: allocate, hand over the blocks, park."""
    external, is_async = side.match_tokens(request, 0)
    driver._alloc(request.request_id, external)
    side.update_state_after_alloc(request, external, [list(driver.blocks[request.request_id])])
    return external, is_async, side.build_connector_meta(scheduler_output())


def test_async_load_of_a_disk_prefix_runs_in_the_background_and_is_reported(async_setup):
    worker, side, driver, caches = async_setup
    worker.wait_for_save(driver.admit(make_request("a", PROMPT), len(PROMPT)))
    expected = token_kv(caches, driver.slots("a", 600))
    only_on_disk(worker, PROMPT)

    request = make_request("b", PROMPT)
    external, is_async, meta = park(side, driver, request)
    assert (external, is_async) == (599, True)
    assert live_pins(worker) == 0  # nothing pinned by the lookup: the background load pins
    (req,) = meta.requests
    assert req.load_spec.is_async and req.slot_mapping.tolist() == driver.slots("b", 600)
    worker.start_load_kv(meta, None)  # returns at once
    assert wait_finished(worker) == {"b"}
    assert torch.equal(token_kv(caches, driver.slots("b", 600)), expected)
    assert side.async_loaded_tokens("b") == 600
    assert side.async_loaded_tokens("b") is None  # popped
    assert live_pins(worker) == 0


def test_async_answer_only_for_slow_tiers_and_once_per_request(async_setup):
    worker, side, driver, caches = async_setup
    worker.wait_for_save(driver.admit(make_request("a", PROMPT), len(PROMPT)))
    assert side.match_tokens(make_request("m", PROMPT), 0) == (599, False)  # all in CPU memory: as before
    assert live_pins(worker) == 3
    side.update_state_after_alloc(make_request("m", PROMPT), 0)
    assert live_pins(worker) == 0
    only_on_disk(worker, PROMPT)
    request = make_request("s", PROMPT)
    assert park(side, driver, request)[:2] == (599, True)
    assert side.match_tokens(request, 0)[1] is False  # asked again (a load fell short): synchronous


def park_behind_a_stored_prompt(worker, side, driver):
    """Request "a" stores PROMPT, which is then only on disk; request "b" of the same prompt is
    parked for a background load from it. Returns "b" and the step metadata carrying its load."""
    worker.wait_for_save(driver.admit(make_request("a", PROMPT), len(PROMPT)))
    only_on_disk(worker, PROMPT)
    request = make_request("b", PROMPT)
    _, _, meta = park(side, driver, request)
    return request, meta


def test_a_chunk_unreadable_after_the_lookup_is_reported_short(async_setup):
    worker, side, driver, caches = async_setup
    _, meta = park_behind_a_stored_prompt(worker, side, driver)
    keys = [key for _, _, key in worker.engine.token_database.process_tokens(PROMPT)]
    worker.engine.storage_manager.tiers[1].remove(keys[1])  # gone between lookup and read
    worker.start_load_kv(meta, None)
    assert wait_finished(worker) == {"b"}
    assert side.async_loaded_tokens("b") == 256
    slots = driver.slots("b", 600)
    assert worker.get_block_ids_with_load_errors() == {s // BLOCK for s in slots[256:]}


def gate_retrieve(worker, monkeypatch):
    """Hold every retrieve until the returned event is set: a load that is surely in flight."""
    gate = threading.Event()
    real_retrieve = worker.engine.retrieve
    monkeypatch.setattr(worker.engine, "retrieve", lambda *a, **k: (gate.wait(10), real_retrieve(*a, **k))[1])
    return gate


IDLE_WORKER = {"queued_stores": 0, "request_counters": 0, "running_loads": 0, "unreported_loads": 0,
               "load_results": 0, "load_jobs": 0, "releasing_requests": 0}


def test_a_request_ending_while_it_loads_keeps_its_blocks_until_the_load_is_done(async_setup, monkeypatch):
    """An abort while the load writes: the blocks are reported free (`finished_sending`) only after
    the loader stopped, and the request is never reported as loaded (vLLM 0.32 frees an ended
    request's blocks on that report, then dies on the release report); nothing is left behind."""
    worker, side, driver, caches = async_setup
    request, meta = park_behind_a_stored_prompt(worker, side, driver)
    gate = gate_retrieve(worker, monkeypatch)
    worker.start_load_kv(meta, None)
    assert side.request_finished(request, []) == (True, None)  # aborted while waiting
    meta = side.build_connector_meta(scheduler_output(finished={"b"}))
    assert meta.release_after_load == ["b"]
    worker.start_load_kv(meta, None)
    assert worker.get_finished({"b"}) == (None, None)  # still writing: the blocks stay vLLM's
    gate.set()
    reports = [worker.get_finished(set())]
    while reports[-1][0] is None and len(reports) < 500:
        time.sleep(0.01)
        reports.append(worker.get_finished(set()))
    assert reports[-1][0] == {"b"}
    reports.append(worker.get_finished(set()))
    assert all(loaded is None for _, loaded in reports) and reports[-1] == (None, None)  # once, never as loaded
    assert worker.get_block_ids_with_load_errors() == set()  # "b"'s blocks may be another's by now
    assert worker.held() == {**IDLE_WORKER, "request_counters": 1}  # "a" still runs
    assert live_pins(worker) == 0 and side.num_tracked_requests() == 1


def test_a_load_ending_unreported_before_the_abort_is_reported_only_as_released(async_setup):
    worker, side, driver, caches = async_setup
    request, meta = park_behind_a_stored_prompt(worker, side, driver)
    worker.start_load_kv(meta, None)
    deadline = time.monotonic() + 10
    while worker.async_loader.held()["running_loads"] and time.monotonic() < deadline:
        time.sleep(0.01)  # the load ends; no get_finished reports it before the abort
    assert side.request_finished(request, []) == (True, None)
    worker.start_load_kv(side.build_connector_meta(scheduler_output(finished={"b"})), None)
    assert worker.get_finished({"b"}) == ({"b"}, None)
    assert worker.held() == {**IDLE_WORKER, "request_counters": 1}  # "a" still runs


def test_leading_run_counts_the_set_prefix_of_a_mask():
    from lmcache.integration.vllm.v1.async_loader import leading_run

    for mask, run in (([1, 1, 0, 1], 2), ([1, 1, 1], 3), ([0, 1], 0), ([], 0)):
        assert leading_run(torch.tensor(mask, dtype=torch.bool)) == run


def test_a_step_with_nothing_scheduled_waits_for_a_running_load(async_setup, monkeypatch):
    """vLLM steps again at once when every request waits: the worker gives the loader the GIL
    until a load ends (bounded), instead of returning to a loop that holds it. A step that
    computes something never waits."""
    from lmcache.integration.vllm.v1 import worker_side

    worker, side, driver, caches = async_setup
    worker.wait_for_save(driver.admit(make_request("a", PROMPT), len(PROMPT)))
    only_on_disk(worker, PROMPT)
    _, _, meta = park(side, driver, make_request("b", PROMPT))
    assert meta.nothing_scheduled  # the scheduler output of `park` schedules no token
    assert not side.build_connector_meta(scheduler_output(num_scheduled={"a": 1})).nothing_scheduled
    gate = gate_retrieve(worker, monkeypatch)
    monkeypatch.setattr(worker_side, "IDLE_STEP_WAIT_S", 10.0)
    worker.start_load_kv(LMCacheConnectorMetadata(requests=meta.requests), None)  # a step with work
    started = time.monotonic()
    assert worker.get_finished(set()) == (None, None) and time.monotonic() - started < 1
    worker.start_load_kv(LMCacheConnectorMetadata(nothing_scheduled=True), None)
    threading.Timer(0.3, gate.set).start()
    started = time.monotonic()
    assert worker.get_finished(set())[1] == {"b"}  # reported by the call that waited
    assert 0.2 < time.monotonic() - started < 5
    started = time.monotonic()
    assert worker.get_finished(set()) == (None, None) and time.monotonic() - started < 1  # none runs


# ----- off-step saving ---------------------------------------------------------------------------


@pytest.mark.parametrize("barrier", ["bind_step", "start_load_kv"])
def test_stores_run_after_the_step_and_finish_before_vllms_cache_is_written_again(setup, monkeypatch, barrier):
    """The next step's first worker hook waits for the copy: vLLM 0.32 binds the metadata before
    the forward pass and runs `start_load_kv` after it on steps without synchronous loads, so
    both must be barriers."""
    worker, side, driver, caches = setup
    real_store = worker.engine.store
    started, release, where = threading.Event(), threading.Event(), []

    def slow_store(*args, **kwargs):
        where.append(threading.current_thread().name)
        started.set()
        release.wait(5)
        return real_store(*args, **kwargs)

    monkeypatch.setattr(worker.engine, "store", slow_store)
    meta = driver.admit(make_request("a", PROMPT), len(PROMPT))
    worker.wait_for_save(meta)  # returns while the store is still held
    assert started.wait(5) and where[0].startswith("lmcache-v1-save")
    assert not release.is_set()
    expected = token_kv(caches, driver.slots("a", 600))

    barrier_passed = threading.Event()

    def next_step():
        if barrier == "bind_step":
            worker.bind_step()
        else:
            worker.start_load_kv(LMCacheConnectorMetadata(), None)
        barrier_passed.set()

    t = threading.Thread(target=next_step)
    t.start()
    assert not barrier_passed.wait(0.3)  # the next step waits for the copy out of vLLM's blocks
    release.set()
    t.join(5)
    assert barrier_passed.is_set() and worker.engine.stats().stored_tokens == 600
    assert worker.pop_request_counters("a").stored_tokens == 600
    assert worker.lookup(PROMPT, "") == 600
    assert torch.equal(token_kv(caches, driver.slots("a", 600)), expected)


def test_layerwise_and_async_together(tmp_path):
    """One step: a disk-only prefix loads in the background while a CPU-tier hit loads layer by layer."""
    gen = make_setup(use_layerwise=True, enable_async_loading=True, local_disk=str(tmp_path), max_local_disk_size=0.1)
    worker, side, driver, caches = next(gen)
    other = [t + 1 for t in PROMPT]
    meta = driver.admit(make_request("a", PROMPT), len(PROMPT))
    for _ in range(LAYERS):
        worker.save_kv_layer(meta)
    worker.wait_for_save(meta)
    meta = driver.admit(make_request("o", other), len(other))
    for _ in range(LAYERS):
        worker.save_kv_layer(meta)
    worker.wait_for_save(meta)
    expected = token_kv(caches, driver.slots("a", 600))
    expected_other = token_kv(caches, driver.slots("o", 600))
    only_on_disk(worker, PROMPT)  # "a"'s prompt is on disk only, "o"'s still in CPU memory

    slow = make_request("s", PROMPT)
    assert side.match_tokens(slow, 0) == (599, True)
    driver._alloc("s", 599)
    side.update_state_after_alloc(slow, 599, [list(driver.blocks["s"])])
    fast = make_request("f", other)
    assert side.match_tokens(fast, 0) == (599, False)
    driver._alloc("f", 600)
    side.update_state_after_alloc(fast, 599)
    from vllm.v1.core.sched.output import NewRequestData

    fast.num_computed_tokens = 599
    data = NewRequestData.from_request(fast, (list(driver.blocks["f"]),))
    meta = side.build_connector_meta(scheduler_output([data], num_scheduled={"f": 1}))
    assert sorted((r.req_id, r.load_spec.is_async) for r in meta.requests) == [("f", False), ("s", True)]
    worker.start_load_kv(meta, None)
    for _ in range(LAYERS):
        worker.wait_for_layer_load()
    worker.wait_for_save(meta)
    assert torch.equal(token_kv(caches, driver.slots("f", 600)), expected_other)
    assert wait_finished(worker) == {"s"}
    assert torch.equal(token_kv(caches, driver.slots("s", 600)), expected)
    assert live_pins(worker) == 0
    next(gen, None)


def test_vllms_plain_shell_keeps_the_synchronous_path_and_says_so_once(async_setup, caplog):
    worker, side, driver, caches = async_setup
    worker.wait_for_save(driver.admit(make_request("a", PROMPT), len(PROMPT)))
    only_on_disk(worker, PROMPT)
    with caplog.at_level(logging.WARNING, logger="lmcache"):
        # vLLM's own LMCacheConnectorV1 asks for the int answer: the disk prefix is pinned now.
        assert side.get_num_new_matched_tokens(make_request("b", PROMPT), 0) == 599
        assert live_pins(worker) == 3
        side.get_num_new_matched_tokens(make_request("c", PROMPT), 0)
    assert caplog.text.count("run vLLM through lmcache_vllm for background loads") == 1
