"""Faults a client causes, over HTTP on one `lmcache_vllm serve` (v1 engine; both vLLM lines:
`tests/test_client_faults.py`, `tests/latest/test_latest_client_faults.py`): clients that drop
their connection during a prefill, while their prefix loads in the background from the slow
remote tier, and while they decode a CPU-tier hit loaded layer by layer. Afterwards the server
answers a normal request as it did before the faults, and at idle nothing is held: no pin, no
background load or release, no queued store, no tracked request (the status API's `/held`),
nothing pending on the `lm://` server.

One server holds every tier: a CPU tier, a disk tier and a remote tier that answers each read late
(`--delay-ms`), with `use_layerwise` and `enable_async_loading` on; the remote tier is an `lm://`
server on vLLM 0.9.2 and the same server's node pool (`lm+shm://`, whose leases and reservations
must be 0 at idle) on vLLM 0.32. A prompt is left in a
lower tier only by clearing the tiers above it through the status API. vLLM prefills 64 tokens a
step, so a long prompt's prefill spans many steps for a disconnect to land in.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import sys
import time
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import pytest
from conftest import ROOT, random_prompt
from redis_fixture import LMServerProcess
from request_kinds import Kind, healthy, send, wait_for_lines

sys.path.insert(0, str(ROOT / "scripts" / "bench"))
from bench_serving_servers import ManagedProcess, ServerSettings, free_port, launch, server_launch  # noqa: E402

from lmcache.integration.vllm.request_log import parse_request_lines  # noqa: E402

CHUNK = 256
TOKEN = "client-faults-token"
GET_DELAY_MS = 250  # per chunk: a 6-chunk remote load takes 1.5 s, long enough to drop a client in
PROMPT = random_prompt(1500, seed=400)  # loaded from each tier in turn
# Never cached: its client drops mid-prefill. Its 60 steps give the poll of `/held` time to see the
# first store on a busy machine (at 1800 tokens, 29 steps, a CI run saw the prefill end unseen).
PREFILL_PROMPT = random_prompt(3800, seed=401)
PROMPT_CHUNKS = -(-len(PROMPT) // CHUNK)  # the trailing partial chunk is stored too
IDLE = {
    "engine": {"live_pins": 0, "pinned_requests": 0},
    "v1 worker": {"queued_stores": 0, "request_counters": 0, "running_loads": 0, "unreported_loads": 0,
                  "load_results": 0, "load_jobs": 0, "releasing_requests": 0},
}
IDLE_SCHEDULER = {"tracked_requests": 0, "awaiting_background_loads": 0, "background_loads_tried": 0,
                  "unsent_loads_and_releases": 0}
NORMAL = Kind("normal", "/v1/completions", {"prompt": PROMPT, "max_tokens": 16, "temperature": 0.0})


class DroppableRequest:
    """A streamed completion on a connection of its own, which the test closes when it chooses."""

    def __init__(self, port: int, model: str, prompt: list[int], max_tokens: int) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True}
        self.conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})

    def first_event(self) -> str:
        """The first server-sent event (the first token: the prefill is over)."""
        response = self.conn.getresponse()
        assert response.status == 200, response.read()[:300]
        while True:
            line = response.readline().decode()
            if line.startswith("data: "):
                return line

    def drop(self) -> None:
        self.conn.close()


def status(port: int, path: str, token: Optional[str] = None) -> Any:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method="POST" if token else "GET",
                                     data=b"" if token else None)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=10) as resp:
        return json.loads(resp.read())


def wait_for(probe: Callable[[], Any], ok: Callable[[Any], bool], what: str, timeout_s: float = 30.0) -> Any:
    """Poll `probe()` until `ok` of its value; fail naming `what` and the last value."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if ok(value):
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout_s:.0f} s; last {value}")
        time.sleep(0.05)


def nothing_held(held: dict) -> bool:
    return all(count == 0 for part in held.values() for count in part.values())


@dataclass(frozen=True)
class FaultServer:
    """The server under test, its status API's port and the `lm://` server behind it."""

    proc: ManagedProcess
    port: int
    api_port: int
    remote: LMServerProcess
    model: str


@contextlib.contextmanager
def fault_server(model: str, logs: Path, block_size: int, pool: bool) -> Iterator[FaultServer]:
    """Start the `lm://` server (with its node pool as the remote tier when `pool`) and the one vLLM
    server; stop both (Ctrl-C must end vLLM's cleanly)."""
    remote = LMServerProcess(["--max-size-gb", "0.25", "--delay-ms", str(GET_DELAY_MS)], log_path=logs / "lm-server.log",
                             unix_socket=logs / "pool.sock" if pool else None).start()
    settings = ServerSettings(
        model=model, max_model_len=4096, block_size=block_size, num_kv_blocks=8192 // block_size, chunk_size=CHUNK,
        cpu_tier_gb=0.25, disk_tier_gb=0.25, remote_tier_gb=0.25, disk_dir=str(logs / "disk"),
        extra_vllm_args=("--no-enable-prefix-caching", "--enforce-eager", "--max-num-batched-tokens", "64"),
    )
    port, api_port = free_port(), free_port()
    spec = server_launch("lmcache-remote-slow-async", settings, port, logs / "server.log", remote_port=remote.port)
    spec = replace(spec, env={
        **spec.env,
        "LMCACHE_LOCAL_CPU": "True",
        "LMCACHE_REMOTE_URL": remote.pool_url if pool else remote.url,
        "LMCACHE_LOCAL_DISK": f"file://{settings.disk_dir}",
        "LMCACHE_MAX_LOCAL_DISK_SIZE": "0.25",
        "LMCACHE_USE_LAYERWISE": "True",
        "LMCACHE_INTERNAL_API_SERVER_ENABLED": "True",
        "LMCACHE_INTERNAL_API_SERVER_PORT_START": str(api_port),
        "LMCACHE_INTERNAL_API_SERVER_TOKEN": TOKEN,
    })
    proc = launch(spec, ROOT)
    try:
        proc.wait_healthy(400)
        yield FaultServer(proc, port, api_port, remote, model)
    finally:
        code = proc.stop()
        remote.stop()
    assert code == 0, proc.log_tail()


def run_client_faults(server: FaultServer) -> None:
    """Drop a client at each moment, then check the server answers as before and holds nothing."""
    proc, port, api, remote, model = server.proc, server.port, server.api_port, server.remote, server.model
    # vLLM 0.9.2 runs the worker in the engine core, beside the scheduler; vLLM 0.32 in a process of its own.
    in_process_scheduler = "v1 scheduler" in status(api, "/held")
    before = send(port, model, NORMAL)
    assert before.status == 200
    wait_for(lambda: status(api, "/held"), nothing_held, "idle after a normal request")
    # The lower tiers' writers run at idle priority: the prompt must be in both before they are cleared.
    wait_for(lambda: status(api, "/usage")["tiers"],
             lambda tiers: all(tiers.get(name, {}).get("chunks_written", 0) >= PROMPT_CHUNKS
                               for name in ("LocalDiskBackend", "RemoteBackend")), "the prompt on disk and remote")

    # 1. During a prefill (64 tokens a step): dropped once its first chunk is being stored.
    client = DroppableRequest(port, model, PREFILL_PROMPT, max_tokens=32)
    wait_for(lambda: status(api, "/held")["v1 worker"]["request_counters"], bool, "the prefill's first store")
    client.drop()
    (line,) = wait_for(lambda: [ln for ln in parse_request_lines(proc.spec.log_path.read_text())
                                if ln.stats.prompt_tokens == len(PREFILL_PROMPT)], bool, "the aborted prefill's line")
    assert 0 < line.counters.stored_tokens < len(PREFILL_PROMPT), line  # it ended mid-prefill
    wait_for(lambda: status(api, "/held"), nothing_held, "idle after a prefill was dropped")

    # 2. During a background load from the slow remote tier (the CPU and disk tiers cleared).
    for tier in ("Hot", "LocalDiskBackend"):
        assert status(api, f"/clear?tier={tier}", TOKEN)["removed_chunks"] > 0
    client = DroppableRequest(port, model, PROMPT, max_tokens=16)
    wait_for(lambda: status(api, "/held")["v1 worker"]["running_loads"], bool, "the remote load starting")
    client.drop()
    held = wait_for(lambda: status(api, "/held")["v1 worker"], lambda w: w["releasing_requests"],
                    "the abort reaching the loader")
    assert held["running_loads"] == 1, held  # the abort came while the load still wrote
    wait_for(lambda: status(api, "/held"), nothing_held, "idle after a load was dropped")

    # 3. While decoding a CPU-tier hit (the aborted load promoted the prompt there), loaded layer by layer.
    client = DroppableRequest(port, model, PROMPT, max_tokens=2048 - len(PROMPT))
    client.first_event()
    client.drop()
    wait_for(lambda: status(api, "/held"), nothing_held, "idle after a decode was dropped")

    after = send(port, model, NORMAL)
    assert (after.status, after.choices) == (before.status, before.choices)
    assert healthy(port)
    (line,) = wait_for_lines(lambda: proc.spec.log_path.read_text(), after)
    assert line.counters.loaded_tokens > 0, line  # the answer after the faults came from the cache
    info = remote.info()
    assert (info["pending_bytes"], info["pool_leases"], info["pool_reservations"]) == (0, 0, 0), info
    assert info["hits"] >= PROMPT_CHUNKS and (info["pool_clients"] > 0) == (remote.unix_socket is not None), info
    held = status(api, "/held")
    assert held == {**IDLE, **({"v1 scheduler": IDLE_SCHEDULER} if in_process_scheduler else {})}, held
