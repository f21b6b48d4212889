"""The v1 door's PD path without engines: a prefiller's scheduler and worker sides (real engine,
real kernels, real `PDSender`) push each chunked-prefill step into a decoder engine's receive
buffer over loopback ZeroMQ; the decoder's own door then loads the prompt bit-exact. A push that
raises costs only the push."""

from __future__ import annotations

import uuid

import pytest
import torch
from redis_fixture import free_port
from v1_helpers import StepDriver, make_request, make_settings

from lmcache.config import LMCacheEngineMetadata
from lmcache.experimental.cache_engine import LMCacheEngineBuilder
from lmcache.experimental.config import LMCacheEngineConfig
from lmcache.experimental.gpu_connector import VLLMPagedMemGPUConnectorV2
from lmcache.experimental.kv_layout import KVLayout
from lmcache.experimental.pd.sender import PDSender
from lmcache.integration.vllm.v1.scheduler_side import LMCacheSchedulerSide
from lmcache.integration.vllm.v1.worker_channel import InProcessChannel
from lmcache.integration.vllm.v1.worker_side import LMCacheWorkerSide

LAYERS, HEADS, HEAD_SIZE, BLOCK, NUM_BLOCKS, CHUNK = 2, 2, 16, 16, 128, 128
PROMPT = [(7 * i + 3) % 1000 + 4 for i in range(300)]  # 2 whole chunks and a partial one
STEP = 128  # the prefiller's chunked prefill


def _side(role: str, config: LMCacheEngineConfig, seed: int):
    name = f"test-pd-{role}-{uuid.uuid4().hex[:8]}"
    metadata = LMCacheEngineMetadata("tiny", 1, 0, "vllm", torch.float32, (LAYERS, 2, CHUNK, HEADS, HEAD_SIZE))
    connector = VLLMPagedMemGPUConnectorV2(
        HEADS * HEAD_SIZE, LAYERS, layout=KVLayout.CPU_IPEX, num_kv_heads=HEADS, block_size=BLOCK, chunk_size=CHUNK
    )
    engine = LMCacheEngineBuilder.get_or_create(name, config, metadata, connector)
    worker = LMCacheWorkerSide(engine, KVLayout.CPU_IPEX, BLOCK)
    gen = torch.Generator().manual_seed(seed)
    caches = [torch.randn(2, NUM_BLOCKS, BLOCK * HEADS * HEAD_SIZE, generator=gen) for _ in range(LAYERS)]
    worker.register_kv_caches(caches)
    return name, worker, caches


@pytest.fixture
def pd():
    port = free_port()
    base = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK, remote_url=None, max_local_cpu_size=0.05)
    pd_keys = {"enable_pd": True, "pd_peer_host": "127.0.0.1", "pd_peer_init_port": port}
    p_name, prefiller, p_caches = _side("sender", base.with_overrides({**pd_keys, "pd_role": "sender"}), 0)
    prefiller.pd_sender = PDSender(worker_id=0)
    d_name, decoder, d_caches = _side("receiver", base.with_overrides({**pd_keys, "pd_role": "receiver",
                                                                       "local_cpu": False}), 1)
    p_sched = LMCacheSchedulerSide(make_settings(chunk_size=CHUNK, block_size=BLOCK, kv_role="kv_producer",
                                                 pd_sender_peer="127.0.0.1"), InProcessChannel(prefiller))
    d_sched = LMCacheSchedulerSide(make_settings(chunk_size=CHUNK, block_size=BLOCK, kv_role="kv_consumer"),
                                   InProcessChannel(decoder))
    yield {"port": port, "prefiller": prefiller, "p_caches": p_caches, "p_driver": StepDriver(p_sched, BLOCK),
           "decoder": decoder, "d_caches": d_caches, "d_driver": StepDriver(d_sched, BLOCK)}
    prefiller.close()
    for name in (p_name, d_name):
        LMCacheEngineBuilder.destroy(name)


def _kv(caches, slots):
    out = []
    for cache in caches:
        kv = cache.view(2, NUM_BLOCKS, HEADS, BLOCK, HEAD_SIZE)
        idx = torch.tensor(slots)
        out.append(kv[:, idx // BLOCK, :, idx % BLOCK, :])
    return torch.stack(out)


def _prefill(pd, spec_port: int) -> None:
    driver, worker = pd["p_driver"], pd["prefiller"]
    spec = {"req_id": "proxy-1", "receiver_host": "127.0.0.1", "receiver_init_port": spec_port,
            "receiver_alloc_port": spec_port + 1}
    request = make_request("p", PROMPT, kv_transfer_params={"disagg_spec": spec})
    metas = [driver.admit(request, STEP), driver.run(request, STEP), driver.run(request, len(PROMPT) - 2 * STEP)]
    for meta in metas:
        worker.start_load_kv(meta, None)
        worker.wait_for_save(meta)


def test_each_prefill_step_is_pushed_and_the_decoder_loads_it_bit_exact(pd, caplog):
    caplog.set_level("INFO", logger="lmcache")
    _prefill(pd, pd["port"])
    pushes = [r.getMessage() for r in caplog.records if r.getMessage().startswith("PD: request proxy-1 pushed")]
    assert [m.split(" pushed ")[1].split()[0] for m in pushes] == ["128", "128", "44"], pushes
    assert "last prefill" in pushes[-1]
    driver, decoder = pd["d_driver"], pd["decoder"]
    request = make_request("d", PROMPT)
    meta = driver.admit(request, len(PROMPT))
    assert driver.returned["d"] == len(PROMPT) - 1
    decoder.start_load_kv(meta, None)
    want = _kv(pd["p_caches"], pd["p_driver"].slots("p", len(PROMPT)))
    got = _kv(pd["d_caches"], driver.slots("d", len(PROMPT)))
    assert torch.equal(got[:, :, : len(PROMPT) - 1], want[:, :, : len(PROMPT) - 1])
    assert decoder.pop_request_counters("d").loaded_tokens >= len(PROMPT) - 1


def test_a_push_that_raises_costs_only_the_push(pd, caplog):
    class Broken:
        def push_stored(self, *args):
            raise RuntimeError("boom")

        def close(self):
            pass

    pd["prefiller"].pd_sender = Broken()
    _prefill(pd, pd["port"])  # no exception: the prefill steps ran and stored
    assert pd["prefiller"].pop_request_counters("p").stored_tokens == len(PROMPT)
    assert any("push failed" in r.getMessage() for r in caplog.records)
    assert pd["decoder"].engine.lookup(torch.tensor(PROMPT)) == 0
