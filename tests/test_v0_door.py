"""The v0 door (`v0/connector.py`) on a real LMCacheEngine and CPU KV caches in vLLM's IPEX layout.

Steps are built by vLLM's own CPU input builder (`v0_inputs`); "the forward pass" is simulated by
writing known values into the slots the step computes, so the tests can check which KV the
retrieve put where, what the store keyed, and that the rebuilt step is the one vLLM would build.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Dict, List

import pytest
import torch
from helpers import config, make_engine
from kv_reference import Geometry
from v0_inputs import BLOCK, Seq, assert_cpu_inputs_equal, build_cpu_input, decode_seq, make_seqs

from lmcache.experimental.cache_engine import LMCacheEngineBuilder
from lmcache.experimental.kv_layout import KVLayout
from lmcache.integration.vllm.v0 import connector as v0_connector
from lmcache.integration.vllm.utils import ENGINE_NAME
from lmcache.integration.vllm.v0.connector import (
    RunnerView,
    RetrieveStatus,
    StoreStatus,
    execute_with_cache,
    lmcache_retrieve_kv,
    lmcache_should_retrieve,
    lmcache_should_store,
    lmcache_store_kv,
    step_plan_of,
)

# make_seqs() uses blocks 1-39; the tests' own sequences use 40 and up.
LAYERS, HEADS, HEAD, NUM_BLOCKS = 2, 2, 16, 64
CACHE_CONFIG = types.SimpleNamespace(block_size=BLOCK)


GEO = Geometry(KVLayout.CPU_IPEX, num_layers=LAYERS, num_blocks=NUM_BLOCKS, block_size=BLOCK, num_heads=HEADS,
               head_size=HEAD, dtype=torch.float32)


def door_engine(**config_fields):
    """The engine the door finds under ENGINE_NAME: chunks of 16, vLLM's CPU (IPEX) caches."""
    return make_engine(GEO, config(chunk_size=16, max_local_cpu_size=0.02, **config_fields), register_as=ENGINE_NAME)


@pytest.fixture
def engine():
    yield door_engine()
    LMCacheEngineBuilder.destroy(ENGINE_NAME)


def new_caches() -> List[torch.Tensor]:
    """vLLM's CPU KV caches: per layer (2, num_blocks, block_size * heads * head_size), zeroed."""
    return [torch.zeros(2, NUM_BLOCKS, BLOCK * HEADS * HEAD) for _ in range(LAYERS)]


def kv_at(caches: List[torch.Tensor], slot: int) -> torch.Tensor:
    """K and V of every layer for one slot (IPEX layout: [blocks, heads, block_size, head])."""
    views = [c.view(2, NUM_BLOCKS, HEADS, BLOCK, HEAD) for c in caches]
    return torch.stack([v[:, slot // BLOCK, :, slot % BLOCK, :] for v in views])


def forward(caches: List[torch.Tensor], model_input, seed: int) -> None:
    """Stand-in for the forward pass: write a recognisable KV into every slot the step computes."""
    gen = torch.Generator().manual_seed(seed)
    for slot in model_input.attn_metadata.slot_mapping.tolist():
        values = torch.rand(LAYERS, 2, HEADS, HEAD, generator=gen)
        for layer, cache in enumerate(caches):
            view = cache.view(2, NUM_BLOCKS, HEADS, BLOCK, HEAD)
            view[:, slot // BLOCK, :, slot % BLOCK, :] = values[layer]


def slots_of(seq: Seq) -> List[int]:
    return [seq.blocks[i // BLOCK] * BLOCK + i % BLOCK for i in range(len(seq.prompt))]


def run_store(model_input, caches) -> List[StoreStatus]:
    statuses = lmcache_should_store(model_input)
    lmcache_store_kv(None, None, CACHE_CONFIG, None, model_input, caches, statuses)
    return statuses


def test_hit_partial_hit_and_miss_in_one_batch(engine):
    caches = new_caches()
    first = make_seqs()[0]  # 50 tokens
    step1 = build_cpu_input([first], {}, chunked=False)
    forward(caches, step1, seed=1)
    assert run_store(step1, caches) == [StoreStatus.PREFILL]
    assert engine.lookup(torch.tensor(first.prompt)) == 50

    # Same prompt, a prompt sharing 40 tokens, and a new prompt - all in blocks not used before.
    again = Seq(10, list(first.prompt), [40, 41, 42, 43])
    shared = Seq(11, first.prompt[:40] + list(range(600, 620)), [44, 45, 46, 47])
    fresh = Seq(12, list(range(700, 720)), [48, 49])
    seqs = [again, shared, fresh]
    step2 = build_cpu_input(seqs, {}, chunked=False)
    statuses = lmcache_should_retrieve(step2, caches)
    assert statuses == [RetrieveStatus.PREFILL] * 3
    rebuilt, bypass, hidden = lmcache_retrieve_kv(None, step2, CACHE_CONFIG, caches, statuses)
    assert bypass is False and hidden is None

    # Full hit: 50 loaded, last token computed; partial: 32 (two whole chunks), miss: 0.
    plan = step_plan_of(rebuilt)
    assert plan.loaded == [50, 32, 0]
    assert_cpu_inputs_equal(rebuilt, build_cpu_input(seqs, {10: 49, 11: 32, 12: 0}, chunked=True))
    for i, (src, dst) in enumerate(zip(slots_of(first), slots_of(again))):
        assert torch.equal(kv_at(caches, src), kv_at(caches, dst)), f"token {i}"
    for i in range(32):
        assert torch.equal(kv_at(caches, slots_of(first)[i]), kv_at(caches, slots_of(shared)[i]))
    assert not kv_at(caches, slots_of(shared)[32]).any()  # not loaded: chunk 2 differs
    assert not any(kv_at(caches, s).any() for s in slots_of(fresh))

    # After the (simulated) forward pass, the store keys whole prompts from the plan.
    forward(caches, rebuilt, seed=2)
    assert run_store(rebuilt, caches) == [StoreStatus.PREFILL] * 3
    assert engine.lookup(torch.tensor(shared.prompt)) == 60
    assert engine.lookup(torch.tensor(fresh.prompt)) == 20
    # What was stored for the shared prompt's new chunks is what the forward pass wrote there.
    other = Seq(13, list(shared.prompt), [50, 51, 52, 53])
    step3 = build_cpu_input([other], {}, chunked=False)
    lmcache_retrieve_kv(None, step3, CACHE_CONFIG, caches, lmcache_should_retrieve(step3))
    for src, dst in zip(slots_of(shared), slots_of(other)):
        assert torch.equal(kv_at(caches, src), kv_at(caches, dst))


def lora_input(seqs: List[Seq], lora_ids: List[int]):
    from vllm.lora.layers import LoRAMapping
    from vllm.lora.request import LoRARequest

    model_input = build_cpu_input(seqs, {}, chunked=False)
    ids: List[int] = []
    for seq, lora in zip(seqs, lora_ids):
        ids += [lora] * len(seq.prompt)
    requests = {LoRARequest("adapter-a", 1, "/adapters/a"), LoRARequest("adapter-b", 2, "/adapters/b")}
    return dataclasses.replace(
        model_input,
        lora_mapping=LoRAMapping(tuple(ids), tuple(lora_ids), is_prefill=True),
        lora_requests={r for r in requests if r.lora_int_id in lora_ids},
    )


def test_lora_adapters_are_part_of_the_key(engine):
    caches = new_caches()
    seq = make_seqs()[0]
    step = lora_input([seq], [1])
    forward(caches, step, seed=3)
    run_store(step, caches)
    prompt = torch.tensor(seq.prompt)
    assert engine.lookup(prompt) == 0
    # The salt is the v1 door's for the same adapter, so v0 and v1 share the entries.
    from lmcache.integration.vllm.v1.request_policy import request_identity

    v1_salt = request_identity(types.SimpleNamespace(lora_request=next(iter(step.lora_requests)))).cache_salt
    assert engine.lookup(prompt, cache_salt=v1_salt) == 50
    # The same prompt under another adapter, or none, misses; under the same adapter it hits.
    seqs = [Seq(20, list(seq.prompt), [40, 41, 42, 43]), Seq(21, list(seq.prompt), [44, 45, 46, 47])]
    step2 = lora_input(seqs, [2, 1])
    rebuilt, _, _ = lmcache_retrieve_kv(None, step2, CACHE_CONFIG, caches, lmcache_should_retrieve(step2))
    assert step_plan_of(rebuilt).loaded == [0, 50]
    assert rebuilt.lora_mapping.index_mapping == tuple([2] * 50 + [1])


def test_unnamed_lora_adapter_bypasses_the_cache(engine):
    step = lora_input([make_seqs()[0]], [1])
    step = dataclasses.replace(step, lora_requests=set())
    assert lmcache_should_retrieve(step) == [RetrieveStatus.NONE]
    assert lmcache_should_store(step) == [StoreStatus.NONE]


def test_prompt_logprobs_are_stored_but_never_skipped(engine):
    caches = new_caches()
    seq = make_seqs()[0]
    step = build_cpu_input([seq], {}, chunked=False)
    forward(caches, step, seed=4)
    run_store(step, caches)
    again = Seq(30, list(seq.prompt), [40, 41, 42, 43], prompt_logprobs=1)
    step2 = build_cpu_input([again], {}, chunked=False)
    assert lmcache_should_retrieve(step2) == [RetrieveStatus.NONE]
    assert lmcache_should_store(step2) == [StoreStatus.PREFILL]


@pytest.mark.parametrize(
    "change",
    [
        {"inputs_embeds": torch.zeros(1)},
        {"multi_modal_kwargs": {"pixel_values": torch.zeros(1)}},
        {"token_type_ids": torch.zeros(110, dtype=torch.long)},
    ],
    ids=["prompt-embeds", "multimodal", "token-types"],
)
def test_inputs_that_shape_kv_beyond_tokens_bypass(engine, change):
    step = build_cpu_input(make_seqs(), {}, chunked=False)
    if "inputs_embeds" in change:
        step = types.SimpleNamespace(**{**step.__dict__, **change})
    else:
        step = dataclasses.replace(step, **change)
    assert lmcache_should_retrieve(step) == [RetrieveStatus.NONE] * 3
    assert lmcache_should_store(step) == [StoreStatus.NONE] * 3


def test_later_chunks_are_served_and_decodes_left_alone(engine):
    seqs = make_seqs() + [decode_seq()]
    step = build_cpu_input(seqs, {0: 16}, chunked=True)
    assert lmcache_should_retrieve(step) == [RetrieveStatus.PREFILL] * 3 + [RetrieveStatus.NONE]
    assert lmcache_should_store(step) == [StoreStatus.PREFILL] * 3 + [StoreStatus.NONE]


def test_a_prompt_in_three_chunks_is_stored_and_loaded_chunk_by_chunk(engine):
    """Chunked prefill: each step stores the chunks it completed (keyed by the whole prompt so
    far) and loads the cached chunks beyond the context, never writing vLLM's context slots."""
    caches = new_caches()
    prompt = make_seqs()[0].prompt  # 50 tokens; chunks of 16
    steps = [(0, 20), (20, 40), (40, 50)]
    first = Seq(60, list(prompt), [40, 41, 42, 43])
    for (done, upto), stored in zip(steps, [16, 32, 50]):
        step = build_cpu_input([first], {60: done}, chunked=True, upto={60: upto})
        rebuilt, _, _ = lmcache_retrieve_kv(None, step, CACHE_CONFIG, caches, lmcache_should_retrieve(step))
        assert rebuilt is step  # nothing cached yet
        forward(caches, step, seed=upto)
        assert run_store(step, caches) == [StoreStatus.PREFILL]
        # Mid-prompt only whole chunks; the last step adds the trailing partial one.
        assert engine.lookup(torch.tensor(prompt)) == stored

    # Step 1 ends mid-chunk, so only chunk 0 is a hit (a 4-token tail has a key of its own);
    # step 2 loads from the chunk straddling its context to the end of the cached whole chunks;
    # step 3 finds the prompt's trailing partial chunk and computes only the last token.
    again = Seq(61, list(prompt), [44, 45, 46, 47])
    for (done, upto), loaded in zip(steps, [16, 12, 10]):
        context = slots_of(again)[:done]
        for slot in context[-4:]:  # vLLM's own KV of the context: the load must leave it alone
            for cache in caches:
                cache.view(2, NUM_BLOCKS, HEADS, BLOCK, HEAD)[:, slot // BLOCK, :, slot % BLOCK, :] = 7.0
        step = build_cpu_input([again], {61: done}, chunked=True, upto={61: upto})
        rebuilt, _, _ = lmcache_retrieve_kv(None, step, CACHE_CONFIG, caches, lmcache_should_retrieve(step))
        assert step_plan_of(rebuilt).loaded == [loaded]
        skipped = min(loaded, upto - done - 1)
        want = build_cpu_input([again], {61: done + skipped}, chunked=True, upto={61: upto})
        assert rebuilt.input_tokens.tolist() == want.input_tokens.tolist() == prompt[done + skipped : upto]
        blocks = -(-upto // BLOCK)  # the blocks attention reads (vLLM's own row may list more)
        got_row, want_row = (x.attn_metadata.prefill_block_tables[0, :blocks].tolist() for x in (rebuilt, want))
        assert got_row == want_row == again.blocks[:blocks]
        for i in range(done, done + loaded):
            assert torch.equal(kv_at(caches, slots_of(first)[i]), kv_at(caches, slots_of(again)[i])), f"token {i}"
        for slot in context[-4:]:
            assert bool((kv_at(caches, slot) == 7.0).all())
        forward(caches, rebuilt, seed=upto)
        run_store(rebuilt, caches)


def test_force_skip_save(engine, monkeypatch):
    step = build_cpu_input(make_seqs(), {}, chunked=False)
    monkeypatch.setenv("LMCACHE_FORCE_SKIP_SAVE", "1")
    assert lmcache_should_store(step) == [StoreStatus.NONE] * 3


def fake_runner(kv_transfer_config=None, pp: int = 1, sliding_window=None, model_config=None):
    return types.SimpleNamespace(
        vllm_config=types.SimpleNamespace(kv_transfer_config=kv_transfer_config),
        parallel_config=types.SimpleNamespace(pipeline_parallel_size=pp),
        model_config=model_config, cache_config=CACHE_CONFIG, model=None, sliding_window=sliding_window,
    )


def fake_model_config(interleaved_window=None, hybrid=False):
    """vLLM 0.9.2's `ModelConfig` as the door reads it: Gemma 2 / 3 keep their window in
    `hf_text_config.interleaved_sliding_window` (and the runner's `sliding_window` is None)."""
    text = types.SimpleNamespace(interleaved_sliding_window=interleaved_window) if interleaved_window else types.SimpleNamespace()
    return types.SimpleNamespace(hf_text_config=text, is_attention_free=False, is_hybrid=hybrid, has_inner_state=hybrid)


def test_execute_with_cache_runs_vllms_step_on_the_rebuilt_input(engine):
    caches = new_caches()
    seq = make_seqs()[0]
    seen: Dict[str, object] = {}

    def vllm_step(model_input):
        seen["input"] = model_input
        forward(caches, model_input, seed=5)
        return ["output"]

    step = build_cpu_input([seq], {}, chunked=False)
    assert execute_with_cache(fake_runner(), step, caches, vllm_step) == ["output"]
    v0_connector.flush_stores()  # the store ran after the step
    assert seen["input"] is step and engine.lookup(torch.tensor(seq.prompt)) == 50
    step2 = build_cpu_input([Seq(40, list(seq.prompt), [40, 41, 42, 43])], {}, chunked=False)
    execute_with_cache(fake_runner(), step2, caches, vllm_step)
    assert seen["input"].input_tokens.tolist() == [seq.prompt[-1]]


def test_execute_with_cache_steps_aside(engine):
    caches = new_caches()
    step = build_cpu_input(make_seqs(), {}, chunked=False)
    seen = []
    for runner, kv in [
        (fake_runner(kv_transfer_config=object()), caches),  # the user's own connector is in charge
        (fake_runner(pp=2), caches),
        (fake_runner(sliding_window=32), caches),
        (fake_runner(model_config=fake_model_config(interleaved_window=32)), caches),  # Gemma 2 / 3
        (fake_runner(model_config=fake_model_config(hybrid=True)), caches),  # Mamba state
        (fake_runner(), [torch.empty(0)] * LAYERS),  # profiling run
    ]:
        execute_with_cache(runner, step, kv, seen.append)
    assert all(s is step for s in seen) and len(seen) == 6
    assert engine.stats().store_requested_tokens == 0
    # A plain model's runner is served (the two checks above could not pass for every runner).
    assert RunnerView.of(fake_runner(model_config=fake_model_config())).reason_to_step_aside() is None
    reasons = [RunnerView.of(fake_runner(model_config=fake_model_config(**kw))).reason_to_step_aside()
               for kw in ({"interleaved_window": 32}, {"hybrid": True})]
    assert reasons == ["sliding-window attention (window 32) is not supported",
                       "LMCache does not support Mamba / recurrent state beside its attention layers"]


def test_a_failing_retrieve_computes_the_whole_step(engine, monkeypatch):
    caches = new_caches()
    seq = make_seqs()[0]
    step = build_cpu_input([seq], {}, chunked=False)
    forward(caches, step, seed=6)
    run_store(step, caches)

    def broken(*args, **kwargs):
        raise RuntimeError("tier exploded")

    monkeypatch.setattr(v0_connector, "rebuild_model_input", broken)
    step2 = build_cpu_input([Seq(50, list(seq.prompt), [40, 41, 42, 43])], {}, chunked=False)
    seen = []
    execute_with_cache(fake_runner(), step2, caches, seen.append)
    assert seen == [step2]


def test_unfull_last_chunk_is_not_stored_when_configured_so():
    eng = door_engine(save_unfull_chunk=False)
    try:
        caches = new_caches()
        seq = make_seqs()[0]
        step = build_cpu_input([seq], {}, chunked=False)
        forward(caches, step, seed=7)
        run_store(step, caches)
        assert eng.lookup(torch.tensor(seq.prompt)) == 48
    finally:
        LMCacheEngineBuilder.destroy(ENGINE_NAME)
