"""vLLM 0.9.2's own v0 `LMCacheConnector` driving our `vllm_adapter` with its exact calls.

On a GPU build `--kv-transfer-config '{"kv_connector":"LMCacheConnector",...}'` makes vLLM's
`ModelRunner` call this class around each step; the CPU runner has no such hooks, so the test
calls the connector the way the GPU runner does, on CPU KV caches and CPU model inputs, with a
real `VllmConfig` for the tiny model (the engine is built by `init_lmcache_engine` from it).
"""

from __future__ import annotations

import dataclasses
import os
import types

import pytest
import torch
from v0_inputs import BLOCK, Seq, build_cpu_input, make_seqs

from lmcache.experimental.cache_engine import LMCacheEngineBuilder
from lmcache.integration.vllm.utils import ENGINE_NAME
from lmcache.integration.vllm.v0.connector import init_lmcache_engine, step_plan_of

LAYERS, KV_HEADS, HEAD, NUM_BLOCKS = 4, 2, 32, 64  # the tiny model's attention geometry


@pytest.fixture
def vllm_config(tiny_model, monkeypatch):
    # vLLM's CPU platform writes thread and worker settings into os.environ while building the
    # config; put the environment back so later tests' subprocesses do not inherit them.
    saved = dict(os.environ)
    monkeypatch.setenv("VLLM_USE_V1", "0")
    monkeypatch.setenv("LMCACHE_CHUNK_SIZE", "16")
    monkeypatch.setenv("LMCACHE_MAX_LOCAL_CPU_SIZE", "0.05")
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    config = EngineArgs(
        model=tiny_model, dtype="float32", max_model_len=1024, block_size=BLOCK,
        kv_transfer_config=KVTransferConfig(kv_connector="LMCacheConnector", kv_role="kv_both"),
    ).create_engine_config()
    yield config
    LMCacheEngineBuilder.destroy(ENGINE_NAME)
    os.environ.clear()
    os.environ.update(saved)


def fill(caches, model_input, seed):
    """Stand-in for the forward pass: random KV into the slots the step computes."""
    gen = torch.Generator().manual_seed(seed)
    for slot in model_input.attn_metadata.slot_mapping.tolist():
        for cache in caches:
            view = cache.view(2, NUM_BLOCKS, KV_HEADS, BLOCK, HEAD)
            view[:, slot // BLOCK, :, slot % BLOCK, :] = torch.rand(2, KV_HEADS, HEAD, generator=gen)


@pytest.mark.vllm
def test_vllms_v0_lmcache_connector_stores_and_loads_through_our_adapter(vllm_config):
    from vllm.distributed.kv_transfer.kv_connector.lmcache_connector import LMCacheConnector

    connector = LMCacheConnector(rank=0, local_rank=0, config=vllm_config)
    engine = LMCacheEngineBuilder.get(ENGINE_NAME)
    assert engine is not None and connector.engine is engine
    assert engine.metadata.kv_shape == (LAYERS, 2, 16, KV_HEADS, HEAD)

    caches = [torch.zeros(2, NUM_BLOCKS, BLOCK * KV_HEADS * HEAD) for _ in range(LAYERS)]
    seq = make_seqs()[0]
    step = build_cpu_input([seq], {}, chunked=False)
    hidden, bypass, same = connector.recv_kv_caches_and_hidden_states(None, step, caches)
    assert (hidden, bypass, same) == (None, False, step)  # cold: nothing to load
    fill(caches, step, seed=1)
    connector.send_kv_caches_and_hidden_states(None, step, caches, None)
    assert engine.lookup(torch.tensor(seq.prompt)) == 50

    again = build_cpu_input([Seq(60, list(seq.prompt), [40, 41, 42, 43])], {}, chunked=False)
    hidden, bypass, rebuilt = connector.recv_kv_caches_and_hidden_states(None, again, caches)
    assert hidden is None and bypass is False
    assert rebuilt.input_tokens.tolist() == [seq.prompt[-1]]
    assert step_plan_of(rebuilt).loaded == [50]
    # vLLM then hands the rebuilt input to send: nothing new to store, nothing breaks.
    connector.send_kv_caches_and_hidden_states(None, rebuilt, caches, None)
    assert engine.stats().stored_tokens == 50

    connector.close()
    assert LMCacheEngineBuilder.get(ENGINE_NAME) is None


@pytest.mark.vllm
def test_init_builds_once_and_refuses_pipeline_parallelism(vllm_config):
    first = init_lmcache_engine(vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config)
    assert first is not None
    assert init_lmcache_engine(vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config) is None
    LMCacheEngineBuilder.destroy(ENGINE_NAME)
    pp = dataclasses.replace(vllm_config.parallel_config, pipeline_parallel_size=2)
    assert init_lmcache_engine(vllm_config.model_config, pp, vllm_config.cache_config) is None
    assert LMCacheEngineBuilder.get(ENGINE_NAME) is None


@pytest.mark.vllm
def test_both_doors_share_one_engine_and_one_close(vllm_config):
    """The v0 door and the v1 worker side build through `open_worker_engine`: one engine per
    process, closed once."""
    from lmcache.integration.vllm.utils import lmcache_get_config
    from lmcache.integration.vllm.worker_engine import close_worker_engine, open_worker_engine

    v0 = init_lmcache_engine(vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config)
    v1 = open_worker_engine(vllm_config, lmcache_get_config(), "v1 worker")
    assert v1.engine is v0 and (v1.world_size, v1.rank) == (1, 0)
    assert close_worker_engine("v0 door") is True
    assert LMCacheEngineBuilder.get(ENGINE_NAME) is None and close_worker_engine("v0 door") is False


def test_config_errors_are_loud(monkeypatch):
    """A bad LMCACHE_* value stops engine creation with the key named (no silent cache-off)."""
    monkeypatch.setenv("LMCACHE_CHUNK_SIZE", "lots")
    config = types.SimpleNamespace(pipeline_parallel_size=1)
    with pytest.raises(ValueError, match="chunk_size"):
        init_lmcache_engine(None, config, None, vllm_config=types.SimpleNamespace(kv_transfer_config=None))


@pytest.mark.vllm
def test_enable_pd_is_refused_by_the_v0_door(vllm_config, monkeypatch):
    """PD runs on the v1 connector only; the v0 door says so instead of serving without pushes."""
    for name, value in {"ENABLE_PD": "True", "PD_ROLE": "sender", "PD_PEER_HOST": "127.0.0.1",
                        "PD_PEER_INIT_PORT": "7300"}.items():
        monkeypatch.setenv(f"LMCACHE_{name}", value)
    with pytest.raises(ValueError, match="enable_pd=True.*v1 connector"):
        init_lmcache_engine(vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config)
