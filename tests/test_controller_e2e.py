"""What each instance caches, seen from outside: two real vLLM 0.9.2 engines (v1), each its own
instance, report to one controller in this process and publish KV events, each to a subscriber
here that builds an index from them. Both engines pause together at gates between prompts, so
the test asks while they run:
- stored: `/lookup` names the instance that stored a prompt, with its whole length, and not the
  other one; the events index holds the prompt's whole chunks under that instance alone;
- evicted: after a second prompt pushed the first out of the small CPU tier, `/lookup` and the
  events index both say the first is gone;
- restarted: a new controller on the same ports answers the same within about one heartbeat;
- true: after the last gate, each instance's own per-request log lines show it finding and
  loading what `/lookup` promised: two whole chunks of a third prompt, none of the re-sent first;
- at exit every worker deregisters.
A lost batch is resynced in tests/test_controller.py and tests/test_controller_worker.py."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import zmq
from conftest import random_prompt, run_vllm_job
from helpers import post_json
from redis_fixture import free_port
from tier_helpers import wait_for

from lmcache.controller.server import Controller, ControllerSettings
from lmcache.experimental.token_database import prefix_chunk_hashes
from lmcache.integration.vllm.request_log import parse_request_lines

pytestmark = pytest.mark.vllm

CHUNK = 256
BEAT_S = 1
# A CPU tier of ~1.6 MB, 3 chunks of the tiny model (2 KiB a token): a prompt of two chunks and a
# tail fits, and the next one pushes its chunks out.
CPU_GB = "0.0015"
# Per instance: the first prompt, the second that evicts it, the third sharing the second's first
# two chunks (a hit of whole chunks, short of the prompt's length).
PROMPTS = {}
for name, seed in (("vllm-a", 11), ("vllm-b", 21)):
    second = random_prompt(600, seed=seed + 1)
    PROMPTS[name] = (random_prompt(600, seed=seed), second, second[:2 * CHUNK] + random_prompt(40, seed=seed + 2))


def block_hashes(tokens: list) -> list:
    """The KV events' hash of each whole chunk of `tokens` (the first 8 bytes of its prefix hash)."""
    return [int(h[:16], 16) for end, h in prefix_chunk_hashes(tokens, CHUNK) if end % CHUNK == 0]


class EventsIndex:
    """The chunks one instance holds by its KV events (`BlockStored` adds, `BlockRemoved` removes),
    kept by a thread from a SUB socket the instance's publisher connects to."""

    def __init__(self) -> None:
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self._sub = zmq.Context.instance().socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.bind(self.endpoint)
        self._held: set = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._receive, daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        """vLLM's event classes are imported here, beside the engines' start: ~5 s that would come first."""
        import msgspec
        from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

        decode = msgspec.msgpack.Decoder(type=KVEventBatch).decode
        while not self._stop.is_set():
            if not self._sub.poll(100):
                continue
            _, _, payload = self._sub.recv_multipart()
            with self._lock:
                for event in decode(payload).events:
                    if isinstance(event, BlockStored):
                        self._held.update(event.block_hashes)
                    elif isinstance(event, BlockRemoved):
                        self._held.difference_update(event.block_hashes)

    def prefix(self, tokens: list) -> int:
        """Tokens of the longest prefix of `tokens` whose chunks are all held."""
        with self._lock:
            held = 0
            for block in block_hashes(tokens):
                if block not in self._held:
                    break
                held += CHUNK
            return held

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sub.close(linger=0)


def test_two_instances_lookup_and_events_agree_with_their_tiers_through_eviction_and_a_controller_restart(
        tiny_model) -> None:
    # Silent workers are dropped only after a minute: a worker gone by the end deregistered itself.
    settings = ControllerSettings(port=0, pull_port=free_port(), reply_port=free_port(), missed_heartbeats=60)
    controller = Controller(settings).start()
    events = {name: EventsIndex() for name in PROMPTS}
    meet = threading.Barrier(3, timeout=300)  # the two jobs at a gate, and this thread

    def job(name: str):
        env = {
            "VLLM_USE_V1": "1", "LMCACHE_LOG_LEVEL": "INFO", "LMCACHE_MAX_LOCAL_CPU_SIZE": CPU_GB,
            "LMCACHE_ENABLE_CONTROLLER": "true", "LMCACHE_LMCACHE_INSTANCE_ID": name,
            "LMCACHE_CONTROLLER_PULL_URL": f"127.0.0.1:{settings.pull_port}",
            "LMCACHE_CONTROLLER_REPLY_URL": f"127.0.0.1:{settings.reply_port}",
            "LMCACHE_LMCACHE_WORKER_HEARTBEAT_TIME": str(BEAT_S),
            "LMCACHE_ENABLE_KV_EVENTS": "true", "LMCACHE_KV_EVENTS_ENDPOINT": events[name].endpoint,
        }
        first, second, third = PROMPTS[name]
        spec = {
            "model": tiny_model,
            "prompts": [first, second, third, first],
            "max_tokens": 2,
            "llm_kwargs": {
                "enable_prefix_caching": False,
                "max_num_batched_tokens": 512,
                "kv_transfer_config": {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both",
                                       "kv_connector_extra_config": {"lmcache.chunk_size": CHUNK}},
            },
            "gate_before": [1, 2],
        }

        def at_gate(index: int, stderr) -> None:  # wait here while this thread checks, both jobs paused
            meet.wait()
            meet.wait()

        try:
            return run_vllm_job(spec, env=env, at_gate=at_gate)
        finally:
            meet.abort()  # a job that ends early (it failed) wakes the others instead of leaving them waiting

    def gate() -> None:
        """Meet both jobs at a gate; a broken meeting raises the failure of the job that broke it."""
        try:
            meet.wait()
        except threading.BrokenBarrierError:
            for done in [j for j in jobs.values() if j.done()]:
                done.result()
            raise

    def seen() -> dict:
        """Per prompt, what `/lookup` and the events indexes say of it."""
        url = "http://%s:%d/lookup" % controller.http_address
        answer = {}
        for name, prompts in PROMPTS.items():
            for i, tokens in enumerate(prompts):
                status, body = post_json(url, {"tokens": tokens})
                assert status == 200, body
                by_events = {n: index.prefix(tokens) for n, index in events.items()}
                answer[f"{name} {i}"] = (body["layout_info"], {n: held for n, held in by_events.items() if held})
        return answer

    def resyncs() -> dict:
        """Per instance, its workers' (stale, snapshots applied) as the controller has them."""
        return {name: [(w.stale, w.resyncs) for w in controller.index.workers(name)] for name in PROMPTS}

    def expect(held: dict) -> dict:
        """What `seen` must say when each instance holds `held[i]` tokens of its prompt i."""
        return {f"{name} {i}": ({name: ["Hot", held[i]]}, {name: held[i] - held[i] % CHUNK}) if held[i] else ({}, {})
                for name in PROMPTS for i in range(3)}

    pool = ThreadPoolExecutor(2)
    jobs = {name: pool.submit(job, name) for name in PROMPTS}
    try:
        gate()  # each stored its first prompt, whole (the third shares nothing with it)
        stored = expect({0: 600, 1: 0, 2: 0})
        wait_for(lambda: seen() == stored, timeout=30)
        assert seen() == stored
        gate()
        gate()  # each stored its second prompt, which pushed the first out; the third would hit two chunks
        evicted = expect({0: 0, 1: 600, 2: 2 * CHUNK})
        wait_for(lambda: seen() == evicted, timeout=30)
        assert seen() == evicted
        assert resyncs() == {name: [(False, 1)] for name in PROMPTS}  # no gap: the one snapshot after registering
        controller.close()
        controller = Controller(settings).start()  # the workers' next heartbeats register them again
        assert wait_for(lambda: seen() == evicted, timeout=BEAT_S + 2), seen()
        assert resyncs() == {name: [(False, 1)] for name in PROMPTS}
        gate()
    except BaseException:
        meet.abort()
        raise
    finally:
        pool.shutdown()
        for index in events.values():
            index.close()
    try:
        for name, job_done in jobs.items():
            lines = parse_request_lines(job_done.result().log)
            # The third prompt finds and loads the two chunks `/lookup` promised; the re-sent first one, none.
            hits = [(line.stats.lmcache_hit_tokens, line.counters.loaded_tokens) for line in lines]
            assert hits == [(0, 0), (0, 0), (2 * CHUNK, 2 * CHUNK), (0, 0)], name
        assert wait_for(lambda: all(controller.index.workers(name) == [] for name in PROMPTS), timeout=10)
    finally:
        controller.close()
