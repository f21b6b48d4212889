"""The remote tier through real vLLM (v1 engine, tiny float32 model, vLLM's own LMCacheConnectorV1).

Instance A (one process) serves a long prompt and stores it in an `lm://` server; instance B (a new
process: empty CPU tier, same remote URL) hits it and must generate what cache-off generates. The
same through the node pool (`lm+shm://`, the server's arena in shared memory) with no private CPU
tier, one copy of each chunk on the machine: A stores and reloads layer by layer, B (through
`lmcache_vllm`) loads in the background. The same through Mooncake Store: a master and a
storage process hold the pool, the instances lend it no memory, so A's chunks outlive A; there A
stores through the v0 door, B loads layer-wise and in the background, and B's engine serves on
through a master killed and restarted between its requests. With
`cachegen` the KV is lossy by design: B still hits, and the agreement with cache-off is reported.
A server that dies under a running instance costs nothing but the hits: same output, the log says why.

The reference is each test's instance A: it hits nothing, so it computes every token as a cache-off
engine does (storing only reads the KV caches; test_v1_e2e checks that against a cache-off engine).
"""

from __future__ import annotations

import json
import re
import time
from typing import Callable

import pytest
from conftest import random_prompt, run_vllm_job
from helpers import door_steps, logprobs_of
from mooncake_fixture import MooncakeMaster, MooncakeStorage
from redis_fixture import LMServerProcess
from tier_helpers import wait_for

from lmcache.experimental.remote.lm_connector import LMServerConnector
from lmcache.integration.vllm.request_log import parse_request_lines

pytestmark = pytest.mark.vllm

CHUNK = 256
MAX_TOKENS = 12
MAX_BATCHED = 512
LOGPROB_TOLERANCE = 1e-3
PROMPT = random_prompt(1500, seed=31)
OUTAGE_S = 6.0  # how long the Mooncake master stays dead at least: the tier's backoff reaches 3.2 s

ASYNC_DONE_RE = re.compile(r"background load done, (\d+) leading tokens ready of (\d+) promised")

LMCACHE_ENV = {"VLLM_USE_V1": "1", "LMCACHE_MAX_LOCAL_CPU_SIZE": "0.25", "LMCACHE_LOG_LEVEL": "INFO"}


V1_LLM_KWARGS = {
    "enable_prefix_caching": False,
    "max_num_batched_tokens": MAX_BATCHED,
    "kv_transfer_config": {
        "kv_connector": "LMCacheConnectorV1",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"lmcache.chunk_size": CHUNK},
    },
}


def _run(model: str, env: dict, rounds: int = 1, vllm_module: str = "vllm") -> tuple[list[tuple], list[tuple], str]:
    """([(greedy tokens, their logprobs)] per round, per-request (hit, loaded, stored), log) for
    PROMPT sent once per round."""
    job = {"model": model, "prompts": [PROMPT], "max_tokens": MAX_TOKENS, "logprobs": True,
           "llm_kwargs": V1_LLM_KWARGS, "rounds": rounds, "vllm_module": vllm_module}
    result = run_vllm_job(job, env={**LMCACHE_ENV, **env})
    payload = [ln for ln in result.log.splitlines() if ln.startswith("RESULT ")][-1]
    logprobs = json.loads(payload[len("RESULT ") :])["logprobs"]
    lines = [
        (line.stats.lmcache_hit_tokens, line.counters.loaded_tokens, line.counters.stored_tokens)
        for line in parse_request_lines(result.log)
    ]
    runs = [(result.outputs[r][0], logprobs[r][0]) for r in range(rounds)]
    return runs, lines, result.log


def assert_as_computed(a: tuple[list[int], list[float]], *runs: tuple[list[int], list[float]]) -> None:
    """Each run's greedy tokens equal instance A's, its logprobs within float32 noise."""
    for tokens, logprobs in runs:
        assert tokens == a[0]
        assert max(abs(x - y) for x, y in zip(logprobs, a[1])) <= LOGPROB_TOLERANCE


def test_second_instance_hits_the_first_ones_chunks_and_a_dead_server_costs_nothing(tiny_model, tmp_path):
    # A stores PROMPT; B (a new process with no CPU tier of its own) loads all of it from lm://,
    # then serves it again after the server was killed: computed as A did, the log says why.
    server = LMServerProcess(log_path=tmp_path / "server.log").start()
    env = {"LMCACHE_REMOTE_URL": server.url, "LMCACHE_REMOTE_SERDE": "naive"}
    job = {"model": tiny_model, "prompts": [PROMPT] * 2, "max_tokens": MAX_TOKENS, "logprobs": True,
           "llm_kwargs": V1_LLM_KWARGS, "gate_before": [1]}
    try:
        (a,), lines_a, _ = _run(tiny_model, env)
        b = run_vllm_job(job, env={**LMCACHE_ENV, **env, "LMCACHE_LOCAL_CPU": "False"},
                         at_gate=lambda index, log: server.kill())
    finally:
        server.stop()
    lines_b = [(ln.stats.lmcache_hit_tokens, ln.counters.loaded_tokens) for ln in parse_request_lines(b.log)]
    assert lines_a == [(0, 0, 1500)]  # (hit, loaded, stored): A computed and stored everything
    assert lines_b == [(1500, 1500), (0, 0)]  # every chunk came from lm://; then no hit, no failure
    assert "is down" in b.log and "requests recompute" in b.log
    assert_as_computed(a, *zip(b.outputs[0], logprobs_of(b)[0]))


def test_second_instance_hits_through_the_node_pool_with_no_private_tier(tiny_model, tmp_path):
    # A stores layer by layer (save_kv_layer) into the pool, then loads its repeat layer by layer
    # (wait_for_layer_load) from it; B, through lmcache_vllm (whose shell passes "load in the
    # background" to vLLM), finds the prompt only in the pool and loads it in the background.
    server = LMServerProcess(log_path=tmp_path / "server.log", unix_socket=tmp_path / "pool.sock").start()
    env = {"LMCACHE_REMOTE_URL": server.pool_url, "LMCACHE_REMOTE_SERDE": "naive", "LMCACHE_LOCAL_CPU": "False",
           "LMCACHE_USE_LAYERWISE": "True"}
    try:
        (a, a_again), lines_a, _ = _run(tiny_model, env, rounds=2)
        (b,), lines_b, log_b = _run(tiny_model, {**env, "LMCACHE_ENABLE_ASYNC_LOADING": "True"},
                                    vllm_module="lmcache_vllm.vllm")
        tcp = LMServerConnector("127.0.0.1", server.port)
        info = tcp.info()
        tcp.close()
    finally:
        server.stop()
    assert lines_a == [(0, 0, 1500), (1500, 1500, 0)] and lines_b == [(1500, 1500, 0)]
    assert ASYNC_DONE_RE.findall(log_b) == [("1500", "1500")]
    assert info["entries"] == -(-1500 // CHUNK) and info["pool_leases"] == 0 and info["pool_reservations"] == 0
    assert_as_computed(a, a_again, b)


def test_mooncake_v0_store_v1_layerwise_async_hits_and_a_master_killed_mid_run(tiny_model, tmp_path):
    # A master and a storage process hold the pool; the instances lend it no memory and keep no
    # CPU tier. A stores PROMPT through the v0 door and exits; B (v1 door through lmcache_vllm,
    # layer-wise, async loading) hits all of it. Then, in B's engine, the master is SIGKILLed
    # (prompt 1 is computed, the tier says once that it is down) and restarted (it forgot every
    # key; the storage process re-mounts its segment on its own, B's tier comes back by itself):
    # prompt 2 stores PROMPT again and prompt 3 hits it.
    master = MooncakeMaster(tmp_path / "master.log").start()
    storage = MooncakeStorage(master, tmp_path / "storage.log").start()
    env = {**LMCACHE_ENV, "LMCACHE_REMOTE_URL": master.url, "LMCACHE_REMOTE_SERDE": "naive",
           "LMCACHE_LOCAL_CPU": "False", "LMCACHE_MOONCAKE_GLOBAL_SEGMENT_SIZE": "0",
           "LMCACHE_MOONCAKE_LOCAL_BUFFER_SIZE": str(64 << 20)}
    job = {"model": tiny_model, "max_tokens": MAX_TOKENS, "logprobs": True}
    v0 = {"VLLM_USE_V1": "0", "LMCACHE_CHUNK_SIZE": str(CHUNK)}
    modes = {"LMCACHE_USE_LAYERWISE": "True", "LMCACHE_ENABLE_ASYNC_LOADING": "True"}
    outage: dict[str, float] = {}

    def at_gate(index: int, log: Callable[[], str]) -> None:
        if index == 1:
            master.kill()
            outage["killed"] = time.monotonic()
        elif index == 2:
            time.sleep(OUTAGE_S)  # the tier probes with backoff meanwhile
            master.start()  # same port
            assert wait_for(lambda: master.gauge("master_total_capacity_bytes") > 0, timeout=30), \
                "the storage process did not re-mount"
            assert wait_for(lambda: "is back" in log(), timeout=30), "B's tier did not come back"
            outage["back"] = time.monotonic()
        else:  # prompt 2's chunks are in the store, not only in the tier's put queue
            assert wait_for(lambda: master.gauge("master_key_count") == 6, timeout=30)

    try:
        a = run_vllm_job({**job, "prompts": [PROMPT], "vllm_module": "lmcache_vllm.vllm"}, env={**env, **v0})
        # A's six chunks are in the store before B starts (else a miss below is A's, not B's).
        assert wait_for(lambda: master.gauge("master_key_count") == 6, timeout=10), \
            [ln for ln in a.log.splitlines() if "remote tier" in ln]
        b = run_vllm_job({**job, "prompts": [PROMPT] * 4, "gate_before": [1, 2, 3], "vllm_module": "lmcache_vllm.vllm",
                          "llm_kwargs": V1_LLM_KWARGS}, env={**env, **modes}, at_gate=at_gate)
    finally:
        storage.stop()
        master.stop()
    (tmp_path / "a.log").write_text(a.log)  # for a failure's post-mortem
    (tmp_path / "b.log").write_text(b.log)
    assert door_steps(a.log) == [(1500, 0, 1500)]  # A computed everything (and stored it)
    lines_b = [(ln.stats.lmcache_hit_tokens, ln.counters.loaded_tokens, ln.counters.stored_tokens)
               for ln in parse_request_lines(b.log)]
    print(f"Mooncake master down {outage['back'] - outage['killed']:.1f} s; "
          f"{b.log.count('master_client.cpp')} failed Mooncake calls in B's log")
    assert lines_b[0] == (1500, 1500, 0), [ln for ln in b.log.splitlines() if "remote tier" in ln]  # A's chunks
    assert lines_b[1] == (0, 0, 1500)  # the master gone: computed; the tier drops its puts (below)
    assert lines_b[2:] == [(0, 0, 1500), (1500, 1500, 0)]  # back, empty: stored again, then a hit
    assert sorted(ASYNC_DONE_RE.findall(b.log)) == [("1500", "1500")] * 2  # both hits loaded in the background
    assert b.log.count("is down") == 1 and b.log.count("is back") == 1
    # prompt 0's and 3's hits; 3's come from the put queue where its puts were still in flight
    assert "6 puts acknowledged, 0 refused, 0 lost, 6 dropped; 12 hits" in b.log, \
        [ln for ln in b.log.splitlines() if "closed:" in ln]
    # Probes back off while the master is gone (0.2 s doubling to 10 s): a few failed calls, no hot loop.
    assert b.log.count("master_client.cpp") <= 10
    logprobs_a, logprobs_b = logprobs_of(a)[0], logprobs_of(b)[0]
    assert_as_computed((a.outputs[0][0], logprobs_a[0]), *zip(b.outputs[0], logprobs_b))


def test_cachegen_through_vllm_hits_and_reports_agreement(tiny_model, tmp_path):
    # A server with a token: instance A has it in the URL, B in LMCACHE_REMOTE_TOKEN.
    token = "vllm-tok-93xq"
    (tmp_path / "token").write_text(token)
    server = LMServerProcess(["--token-file", str(tmp_path / "token")], log_path=tmp_path / "server.log").start()
    url_a = server.url.replace("lm://", f"lm://:{token}@")
    env = {"LMCACHE_REMOTE_SERDE": "cachegen"}
    try:
        ((tokens_a, _),), lines_a, log_a = _run(tiny_model, {**env, "LMCACHE_REMOTE_URL": url_a})
        ((tokens_b, _),), lines_b, log_b = _run(
            tiny_model, {**env, "LMCACHE_REMOTE_URL": server.url, "LMCACHE_REMOTE_TOKEN": token})
    finally:
        server.stop()
    assert lines_a == [(0, 0, 1500)] and lines_b == [(1500, 1500, 0)]
    assert token not in log_a + log_b + (tmp_path / "server.log").read_text()
    same = sum(a == b for a, b in zip(tokens_b, tokens_a))
    print(f"cachegen through vLLM: {same}/{MAX_TOKENS} greedy tokens equal to cache-off")
    # Lossy by design; the first token comes from the last prompt position, computed on loaded KV.
    assert same >= MAX_TOKENS // 2
