"""vLLM 0.32 (the current line, .venv-latest) end to end on the tiny float32 model: vLLM's own
`LMCacheConnectorV1` loading our `LMCacheConnectorV1Impl` and the wrapper's `LLM`
(`lmcache_vllm serve` over HTTP: test_latest_request_kinds.py).

Every run is compared with one cache-off run (same chunked-prefill settings): greedy tokens equal,
logprobs equal up to float rounding. Hit, load and store counts come from the door's per-request
log line. vLLM 0.32 keeps the CPU cache as CPU_ATTN blocks of 128 tokens and prefills in chunks of
`max_num_batched_tokens`; P_LONG is longer than one such chunk. Engine starts cost most of the
time, so there are three: cache off, vLLM's connector with its prefix cache off, and the wrapper
with it on. The layer-wise test and the wrapper's (background loads) run on the node
pool (`lm+shm://`, a server started in the test) as their only tier, vLLM's connector's on
Mooncake Store (a master and a storage process started in the test) as its only tier.
"""

from __future__ import annotations

import os
import re

import pytest
from mooncake_fixture import MooncakeMaster, MooncakeStorage
from redis_fixture import LMServerProcess
from test_v1_e2e import (
    LMCACHE_ENV,
    MAX_BATCHED,
    P_LONG,
    P_OTHER,
    P_SHARED_A,
    P_SHARED_B,
    PREEMPT_PROMPTS,
    PREFIX_CACHE_ON_HITS,
    assert_no_pins_left,
    assert_same_as_baseline,
    check_kv_events,
    check_preemption,
    connector_kwargs,
    hits,
    run,
)

from lmcache.experimental.remote.lm_connector import LMServerConnector

pytestmark = pytest.mark.vllm

PROMPTS = [P_LONG, P_SHARED_A, P_SHARED_B, P_OTHER]
# vLLM 0.32 has no VLLM_USE_V1 (one engine); the shared settings set it to 1, which it ignores.
ENV = {**LMCACHE_ENV}


@pytest.fixture
def pool(tmp_path):
    """The node pool (a server started here) as the engine's only tier: every hit is read from
    the server's arena (`lm+shm://`), every store written into it."""
    server = LMServerProcess(log_path=tmp_path / "server.log", unix_socket=tmp_path / "pool.sock").start()
    env = {**ENV, "LMCACHE_LOCAL_CPU": "False", "LMCACHE_REMOTE_URL": server.pool_url, "LMCACHE_REMOTE_SERDE": "naive"}
    yield env
    tcp = LMServerConnector("127.0.0.1", server.port)
    info = tcp.info()
    tcp.close()
    server.stop()
    assert info["entries"] > 0 and info["pool_leases"] == 0 and info["pool_reservations"] == 0


@pytest.fixture
def mooncake(tmp_path):
    """Mooncake Store (a master and a storage process lending the segment) as the engine's only
    tier; the engine lends no segment: every hit is read from the storage process."""
    master = MooncakeMaster(tmp_path / "master.log").start()
    storage = MooncakeStorage(master, tmp_path / "storage.log").start()
    env = {**ENV, "LMCACHE_LOCAL_CPU": "False", "LMCACHE_REMOTE_URL": master.url, "LMCACHE_REMOTE_SERDE": "naive",
           "LMCACHE_MOONCAKE_GLOBAL_SEGMENT_SIZE": "0", "LMCACHE_MOONCAKE_LOCAL_BUFFER_SIZE": str(64 << 20)}
    yield env
    keys = master.gauge("master_key_count")
    storage.stop()
    master.stop()
    assert keys > 0


@pytest.fixture(scope="module")
def baseline(tiny_model):
    prompts = PROMPTS + PREEMPT_PROMPTS
    off = run(tiny_model, prompts, {"enable_prefix_caching": False, "max_num_batched_tokens": MAX_BATCHED}, {})
    assert off.lines == []
    outputs = off.outputs[0]
    assert len({tuple(o) for o in outputs}) > 1, "the model ignores its prompt; this test could not fail"
    return {tuple(p): (outputs[i], off.logprobs[0][i]) for i, p in enumerate(prompts)}


def test_vllm_connector_repeats_and_shared_prefix_with_chunked_prefill_on_mooncake(tiny_model, baseline, mooncake):
    """vLLM's own LMCacheConnectorV1, its prefix cache off: every repeat is loaded from LMCache,
    here from Mooncake Store."""
    prompts = [P_LONG, P_SHARED_A, P_SHARED_B, [P_LONG, P_OTHER]]
    result = run(tiny_model, prompts, connector_kwargs(prefix_caching=False), mooncake, rounds=2)
    assert_same_as_baseline(result, prompts, baseline)
    lines = hits(result.lines)
    assert lines[:3] == [
        (1500, 0, 0, 0, 1500),  # three prefill chunks of 512, stored whole
        (1424, 0, 0, 0, 1424),
        (1424, 0, 1024, 1024, 400),  # only the shared prefix (4 chunks of 256) hits
    ]
    assert sorted(lines[3:5]) == [(1100, 0, 0, 0, 1100), (1500, 0, 1500, 1500, 0)]
    assert lines[5:8] == [(1500, 0, 1500, 1500, 0), (1424, 0, 1424, 1424, 0), (1424, 0, 1424, 1424, 0)]
    assert sorted(lines[8:]) == [(1100, 0, 1100, 1100, 0), (1500, 0, 1500, 1500, 0)]
    assert "Initializing latest dev LMCache connector" in result.log  # vLLM's shell, non-native mode
    assert_no_pins_left(result)


def test_wrapper_llm_with_vllm_prefix_cache_loads_the_rest_from_the_pool_in_the_background(tiny_model, baseline, pool):
    """`lmcache_vllm.vllm.LLM` with no KV transfer config: the wrapper turns the connector on; vLLM's
    own prefix cache serves what it still holds and LMCache loads only the rest, from the node
    pool, in the background (enable_async_loading: the pool is not this process's memory)."""
    prompts = [P_LONG, P_SHARED_A, P_SHARED_B]
    kwargs = {"enable_prefix_caching": True, "max_num_batched_tokens": MAX_BATCHED}
    env = {**pool, "LMCACHE_CHUNK_SIZE": "256", "LMCACHE_ENABLE_ASYNC_LOADING": "True"}
    result = run(tiny_model, prompts, kwargs, env, rounds=2, vllm_module="lmcache_vllm.vllm")
    assert_same_as_baseline(result, prompts, baseline)
    assert "lmcache_vllm: v1 engine selected, using KV connector LMCacheConnectorV1" in result.log
    assert hits(result.lines) == PREFIX_CACHE_ON_HITS  # as on vLLM 0.9.2
    done = re.findall(r"background load done, (\d+) leading tokens ready of (\d+) promised", result.log)
    assert sorted(done) == [("1424", "1424"), ("1424", "1424"), ("1500", "1500")]
    assert_no_pins_left(result)


def test_layerwise_loads_and_stores_per_layer_in_the_pool(tiny_model, baseline, pool):
    """use_layerwise on vLLM 0.32: its attention calls wait_for_layer_load / save_kv_layer around
    each layer (kv_transfer_utils.maybe_transfer_kv_layer); tokens and hits as the whole-chunk path,
    with the node pool as the only tier."""
    prompts = [P_LONG, P_SHARED_A, P_SHARED_B]
    kwargs = connector_kwargs(prefix_caching=False, extra={"lmcache.use_layerwise": True})
    result = run(tiny_model, prompts, kwargs, pool, rounds=2)
    assert_same_as_baseline(result, prompts, baseline)
    assert hits(result.lines) == [
        (1500, 0, 0, 0, 1500),
        (1424, 0, 0, 0, 1424),
        (1424, 0, 1024, 1024, 400),
        (1500, 0, 1500, 1500, 0),
        (1424, 0, 1424, 1424, 0),
        (1424, 0, 1424, 1424, 0),
    ]
    assert_no_pins_left(result)


def test_async_loading_from_disk_and_a_chunk_unreadable_after_the_lookup_is_recomputed(tiny_model, baseline, tmp_path):
    """enable_async_loading on vLLM 0.32 through lmcache_vllm: prefixes found only on disk load in
    the background (WAITING_FOR_REMOTE_KVS); a chunk that cannot be read after the lookup is
    reported as load-error blocks, which vLLM recomputes (kv_load_failure_policy=recompute)."""
    disk = {**ENV, "LMCACHE_LOCAL_DISK": str(tmp_path / "disk"), "LMCACHE_MAX_LOCAL_DISK_SIZE": "1"}
    writer = run(tiny_model, [P_SHARED_A, P_LONG], connector_kwargs(prefix_caching=False), disk)
    assert hits(writer.lines) == [(1424, 0, 0, 0, 1424), (1500, 0, 0, 0, 1500)]
    files = sorted((tmp_path / "disk").iterdir(), key=lambda f: f.stat().st_mtime_ns)
    assert len(files) == 12
    with open(files[6 + 2], "r+b") as f:  # P_LONG's third chunk: its payload no longer matches
        f.seek(-64, os.SEEK_END)
        f.write(bytes(64))
    kwargs = connector_kwargs(prefix_caching=False, extra={"lmcache.enable_async_loading": True})
    kwargs["kv_transfer_config"]["kv_load_failure_policy"] = "recompute"
    prompts = [P_LONG, P_SHARED_A]
    reader = run(tiny_model, prompts, kwargs, disk, vllm_module="lmcache_vllm.vllm")
    assert_same_as_baseline(reader, prompts, baseline)
    assert hits(reader.lines) == [(1500, 0, 1500, 512, 0), (1424, 0, 1424, 1424, 0)]
    done = re.findall(r"background load done, (\d+) leading tokens ready of (\d+) promised", reader.log)
    assert sorted(done) == [("1424", "1424"), ("512", "1500")]
    assert_no_pins_left(reader)


def test_preemption_matches_cache_off_and_resumed_requests_load_their_own_stores(tiny_model, baseline):
    """vLLM 0.32 reports a resumed request in `resumed_req_ids`; it must look up again and load its
    own earlier store like on 0.9.2."""
    check_preemption(tiny_model, baseline)


def test_kv_events_through_vllms_publisher_stored_removed_and_none_for_a_request_that_skips_the_cache(
        tiny_model, baseline):
    check_kv_events(tiny_model, baseline, P_SHARED_A, ENV, through_vllm=True)
