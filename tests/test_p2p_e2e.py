"""Peer-to-peer sharing through real vLLM: two vLLM 0.9.2 engines (v1, the tiny float32 model),
each on a machine of its own (a network namespace, tests/netns_fixture.py), the lookup Redis with
a password on machine A, the peer servers' token in `LMCACHE_P2P_TOKEN`. tests/test_p2p.py shows
that the P2P tier reads a peer's exact bytes and turns each fault into a miss; this shows vLLM
serving with them: the v1 door promises vLLM only what its pinned lookup read from the peer, and
the loaded KV gives the same answer as computing it.

Instance A computes two prompts from scratch (so its greedy tokens and logprobs are the cache-off
reference), stores and records them, and then waits, serving, while instance B - which has
nothing of its own - sends the same two prompts:
- the first: B's request line shows all of it found and loaded (its last, partial chunk too),
  every chunk read from A's peer server, and B answers as A did: the same tokens, logprobs within
  float32 noise (they come out equal; a chunk scaled by 0.5 in flight moved them by 0.08 and
  changed the tokens);
- the second, with A hung (every process of A's engine stopped; its records and live key still
  name it): B's lookup finds A as the holder, A's peer server never answers, the read times out
  (2 s) and the hit is dropped before vLLM is promised it: B loads nothing, says why in its log,
  computes the prompt and still answers as A did.
The two engines start together; B waits at a gate until A's chunks are recorded, A at one after
its prompts until B is done. The other faults (a killed peer, a stale record, a corrupt chunk,
Redis down, no token) are each in tests/test_p2p.py, with real engines but without vLLM.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
from conftest import random_prompt, run_vllm_job
from helpers import logprobs_of
from netns_fixture import A_ADDRESS, B_ADDRESS, Machines, two_machines  # noqa: F401 (fixture)

from lmcache.experimental.p2p.records import CHUNK_PREFIX
from lmcache.integration.vllm.request_log import parse_request_lines

pytestmark = pytest.mark.vllm

CHUNK = 256
SHARED = random_prompt(3 * CHUNK + 50, seed=61)  # B loads all of it from A: three whole chunks and a partial one
HUNG = random_prompt(2 * CHUNK + 44, seed=62)  # B finds it recorded while A hangs: a miss
PEER_PORT = 8200
LOGPROB_TOLERANCE = 1e-3
WAIT_S = 120  # for the other engine at a gate: its start, on a busy machine


def engine_group(machines: Machines) -> int:
    """The process group of A's vLLM job (a session of its own: run_vllm_job starts it so), every
    process of machine A but its Redis (started in this process's group)."""
    pids = subprocess.run(["ip", "netns", "pids", machines.a], capture_output=True, text=True).stdout.split()
    groups = {os.getpgid(int(pid)) for pid in pids} - {os.getpgrp()}
    assert len(groups) == 1, f"machine A runs other process groups than its engine's: {groups}"
    return groups.pop()


def wait_for_other(event: threading.Event, other: Future, what: str) -> None:
    """Wait for `event`; the other job ending first (it failed) raises its failure instead."""
    for _ in range(WAIT_S * 10):
        if event.wait(0.1):
            return
        if other.done():
            other.result()
            raise AssertionError(f"the other engine exited before {what}")
    raise AssertionError(f"not within {WAIT_S} s: {what}")


def test_an_instance_on_another_machine_loads_everything_a_peer_stored_and_answers_alike(
        tiny_model, two_machines: Machines) -> None:
    recorded, b_done = threading.Event(), threading.Event()
    jobs: dict = {}
    hung: list = []  # A's engine's process group, while it is stopped

    def spec(prompts: list, gate_before: list) -> dict:
        return {
            "model": tiny_model,
            "prompts": prompts,
            "max_tokens": 4,
            "logprobs": True,
            "gate_before": gate_before,
            "llm_kwargs": {"kv_transfer_config": {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both",
                                                  "kv_connector_extra_config": {"lmcache.chunk_size": CHUNK}}},
        }

    def env(address: str) -> dict:
        return {"VLLM_USE_V1": "1", "LMCACHE_LOG_LEVEL": "INFO", "LMCACHE_MAX_LOCAL_CPU_SIZE": "0.25",
                "LMCACHE_ENABLE_P2P": "true", "LMCACHE_LOOKUP_URL": two_machines.lookup_url,
                "LMCACHE_DISTRIBUTED_URL": f"{address}:{PEER_PORT}", "LMCACHE_P2P_TOKEN": "s3cret-p2p-token"}

    def a_at_gate(index: int, stderr) -> None:  # after both prompts: A serves until B is done
        chunks = sum(math.ceil(len(p) / CHUNK) for p in (SHARED, HUNG))

        def records() -> list:
            return two_machines.redis_cli("--scan", "--pattern", CHUNK_PREFIX + "*").split()

        deadline = time.monotonic() + 30
        while len(records()) != chunks and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(records()) == chunks, f"A's {chunks} chunks not recorded: {records()}"
        recorded.set()
        wait_for_other(b_done, jobs["b"], "B's requests")

    def b_at_gate(index: int, stderr) -> None:
        if index == 0:
            wait_for_other(recorded, jobs["a"], "A's chunks recorded")
        else:
            hung.append(engine_group(two_machines))
            os.killpg(hung[0], signal.SIGSTOP)

    def run_a():
        return run_vllm_job(spec([SHARED, HUNG], [2]), env=env(A_ADDRESS), at_gate=a_at_gate, netns=two_machines.a)

    def run_b():
        try:
            return run_vllm_job(spec([SHARED, HUNG], [0, 1]), env=env(B_ADDRESS), at_gate=b_at_gate,
                                netns=two_machines.b)
        finally:
            if hung:
                with contextlib.suppress(ProcessLookupError):  # gone: its job was killed (timed out)
                    os.killpg(hung.pop(), signal.SIGCONT)
            b_done.set()

    with ThreadPoolExecutor(2) as pool:
        jobs["a"] = pool.submit(run_a)
        jobs["b"] = pool.submit(run_b)
        a, b = jobs["a"].result(), jobs["b"].result()

    hits = [(line.stats.lmcache_hit_tokens, line.counters.loaded_tokens) for line in parse_request_lines(b.log)]
    assert hits == [(len(SHARED), len(SHARED)), (0, 0)]
    assert f"peer {A_ADDRESS}:{PEER_PORT} could not be read" in b.log  # the second one's miss: A hung
    assert b.outputs == a.outputs
    got, want = logprobs_of(b)[0], logprobs_of(a)[0]
    for prompt, (g, w) in enumerate(zip(got, want)):
        diff = max(abs(x - y) for x, y in zip(g, w))
        assert diff <= LOGPROB_TOLERANCE, f"prompt {prompt}: logprobs differ by {diff}"
