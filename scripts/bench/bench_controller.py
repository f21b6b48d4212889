"""Controller benchmark: `/lookup` latency over HTTP with 100k chunks indexed (issue 41).

    .venv/bin/python scripts/bench/bench_controller.py            # 100k chunks, 1000 lookups per case (~1-2 min)
    .venv/bin/python scripts/bench/bench_controller.py --quick    # 400 chunks, 20 lookups per case (seconds)

Starts a real `lmcache_controller` (`python -m lmcache.controller`, free ports), fills its index
through the workers' real wire: `--instances` simulated workers, each on its own ZeroMQ PUSH
socket, send what `ControllerClient` sends (`Register`, a `Snapshot`, then `Batch`es of at most
`OPS_PER_MESSAGE` admits; `messages.py`) for prompts of `--prompt-tokens` random tokens, hashed as
the instances hash them, until `--chunks` chunks are held. Then it times `/lookup` from a real
HTTP client (a new connection per request, as the server speaks HTTP/1.0) for prompts of ~1k and
~6.4k tokens, each a hit (a held prompt's prefix: the answer must name its instance and the whole
length) and a miss (fresh tokens: the answer must be empty), and writes
`bench/results/controller-<timestamp>.json` with p50/p99/max per case and the target (p99 <= 5 ms
with 100k chunks indexed), printed as MET/MISSED. Exit code 1 when an answer was wrong.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import numpy as np
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench_serving import ROOT, machine_header  # noqa: E402

from lmcache.controller.messages import ADMIT, Batch, Operation, Register, Snapshot, encode  # noqa: E402
from lmcache.controller.worker import OPS_PER_MESSAGE  # noqa: E402
from lmcache.experimental.token_database import prefix_chunk_hashes  # noqa: E402

SCHEMA = "controller-bench/1"
CHUNK = 256
TARGET_P99_MS = 5.0
TARGET_CHUNKS = 100_000
LOOKUP_SIZES = (1024, 6400)  # ~1k and ~6.4k tokens
# The simulated workers heartbeat never: a period this long keeps them registered for the run.
HEARTBEAT_S = 3600.0
STARTUP_TIMEOUT_S = 30.0
FILL_TIMEOUT_S = 300.0


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="400 chunks, 20 lookups per case")
    p.add_argument("--chunks", type=int, default=TARGET_CHUNKS, help="chunks indexed, over all instances")
    p.add_argument("--instances", type=int, default=4, help="simulated instances (one worker each)")
    p.add_argument("--prompt-tokens", type=int, default=6400, help="tokens per held prompt (whole chunks)")
    p.add_argument("--requests", type=int, default=1000, help="timed lookups per case")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="bench/results")
    args = p.parse_args(argv)
    if args.quick:
        args.chunks, args.requests = 400, 20
    if args.prompt_tokens % CHUNK or args.prompt_tokens < max(LOOKUP_SIZES):
        p.error(f"--prompt-tokens: a multiple of {CHUNK}, at least {max(LOOKUP_SIZES)}")
    return args


class ControllerProcess:
    """`lmcache_controller` on free ports, as a process of its own."""

    def __init__(self, log_path: Path) -> None:
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lmcache.controller", "--port", "0", "--monitor-ports", '{"pull": 0, "reply": 0}'],
            stdout=subprocess.PIPE, stderr=self._log, text=True, cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)})
        line = self.proc.stdout.readline()  # "... HTTP on http://HOST:PORT, workers' pull/reply ports (P, R)"
        if "HTTP on" not in line:
            self.stop()
            raise RuntimeError(f"lmcache_controller did not start: {line!r} (its log: {log_path})")
        self.http_port = int(line.split("HTTP on http://")[1].split(",")[0].rsplit(":", 1)[1])
        self.pull_port = int(line.rsplit("(", 1)[1].split(",")[0])

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def lookup(port: int, tokens: List[int]) -> Tuple[float, dict]:
    """One `/lookup` on a new connection: (seconds from connect to the whole answer, the answer)."""
    body = json.dumps({"tokens": tokens})
    started = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("POST", "/lookup", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        answer = json.loads(response.read())
    finally:
        conn.close()
    elapsed = time.perf_counter() - started
    if response.status != 200:
        raise RuntimeError(f"/lookup answered {response.status}: {answer}")
    return elapsed, answer


class SimulatedWorker:
    """One instance's worker as the controller sees it: a PUSH socket sending what `ControllerClient` sends."""

    def __init__(self, instance_id: str, pull_port: int) -> None:
        self.who = {"instance_id": instance_id, "worker_id": 0, "boot_id": uuid.uuid4().hex}
        self.sock = zmq.Context.instance().socket(zmq.PUSH)
        self.sock.connect(f"tcp://127.0.0.1:{pull_port}")
        self.seq = 1

    def register(self) -> None:
        self.sock.send(encode(Register(**self.who, world_size=1, fmt="vllm", model_name="bench/model",
                                       chunk_size=CHUNK, heartbeat_s=HEARTBEAT_S)))
        self.sock.send(encode(Snapshot(**self.who, next_seq=self.seq, holdings={})))

    def admit(self, hashes: Sequence[str]) -> None:
        """`hashes` admitted by the CPU tier ("Hot"), in batches of at most `OPS_PER_MESSAGE`."""
        for start in range(0, len(hashes), OPS_PER_MESSAGE):
            ops = [Operation(ADMIT, "Hot", h, self.seq + i) for i, h in enumerate(hashes[start:start + OPS_PER_MESSAGE])]
            self.sock.send(encode(Batch(**self.who, first_seq=self.seq, next_seq=self.seq + len(ops), operations=ops)))
            self.seq += len(ops)

    def close(self) -> None:
        self.sock.close(linger=5000)


def fill(port: int, pull_port: int, args: argparse.Namespace, rng: np.random.Generator) -> Dict[str, List[List[int]]]:
    """Index `args.chunks` chunks as held prompts spread over the instances; their prompts by instance."""
    per_prompt = args.prompt_tokens // CHUNK
    num_prompts = -(-args.chunks // per_prompt)
    workers = [SimulatedWorker(f"bench-{i}", pull_port) for i in range(args.instances)]
    held: Dict[str, List[List[int]]] = {w.who["instance_id"]: [] for w in workers}
    for w in workers:
        w.register()
    time.sleep(0.2)  # registrations first: the PULL socket interleaves senders' messages
    left = args.chunks
    for p in range(num_prompts):
        worker = workers[p % len(workers)]
        tokens = rng.integers(0, 32000, args.prompt_tokens).tolist()
        hashes = [h for _, h in prefix_chunk_hashes(tokens, CHUNK)][:left]
        left -= len(hashes)
        worker.admit(hashes)
        if len(hashes) == per_prompt:
            held[worker.who["instance_id"]].append(tokens)
    for w in workers:
        w.close()
    deadline = time.monotonic() + FILL_TIMEOUT_S
    for instance_id, prompts in held.items():  # each worker's last batch applied: all of it was
        while lookup(port, prompts[-1])[1]["layout_info"].get(instance_id, [None, 0])[1] != args.prompt_tokens:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{instance_id}'s holdings did not reach the controller in {FILL_TIMEOUT_S:.0f} s")
            time.sleep(0.05)
    return held


def time_case(port: int, prompts: List[Tuple[List[int], str]], size: int) -> Tuple[dict, int]:
    """Lookups of `prompts` (tokens, the instance that must answer, or "" for a miss): the latency
    summary in ms and the number of wrong answers."""
    seconds, wrong = [], 0
    for tokens, instance_id in prompts:
        elapsed, answer = lookup(port, tokens)
        seconds.append(elapsed)
        layout = answer["layout_info"]
        right = layout.get(instance_id, [None, 0])[1] == size if instance_id else layout == {}
        wrong += not right
    ms = np.array(seconds) * 1000
    summary = {"tokens": size, "requests": len(ms), "p50_ms": round(float(np.percentile(ms, 50)), 3),
               "p99_ms": round(float(np.percentile(ms, 99)), 3), "max_ms": round(float(ms.max()), 3),
               "mean_ms": round(float(ms.mean()), 3), "wrong_answers": wrong}
    return summary, wrong


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    started, load_before = time.time(), os.getloadavg()
    out_dir = ROOT / args.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(started))
    rng = np.random.default_rng(args.seed)
    log_dir = tempfile.mkdtemp(prefix="bench-controller-")
    controller = ControllerProcess(Path(log_dir) / "controller.log")
    try:
        fill_started = time.perf_counter()
        held = fill(controller.http_port, controller.pull_port, args, rng)
        fill_s = time.perf_counter() - fill_started
        prompts = [(tokens, instance_id) for instance_id, ps in held.items() for tokens in ps]
        cases, wrong = {}, 0
        for size in LOOKUP_SIZES:
            picks = rng.integers(0, len(prompts), args.requests)
            hits = [(prompts[i][0][:size], prompts[i][1]) for i in picks]
            misses = [(rng.integers(0, 32000, size).tolist(), "") for _ in range(args.requests)]
            for kind, case in (("hit", hits), ("miss", misses)):
                cases[f"{size}-{kind}"], bad = time_case(controller.http_port, case, size)
                wrong += bad
    finally:
        controller.stop()
    shutil.rmtree(log_dir)  # kept when the run failed: the controller's log
    worst = max(c["p99_ms"] for c in cases.values())
    met = worst <= TARGET_P99_MS and args.chunks >= TARGET_CHUNKS
    result = {
        **machine_header(SCHEMA, started, argv, load_before, "scripts/bench/bench_controller.py"),
        "setup": {"chunks": args.chunks, "instances": args.instances, "chunk_size": CHUNK,
                  "prompt_tokens": args.prompt_tokens, "fill_s": round(fill_s, 2)},
        "cases": cases,
        "target": {"what": f"/lookup p99 <= {TARGET_P99_MS} ms with {TARGET_CHUNKS} chunks indexed",
                   "worst_p99_ms": worst, "met": met},
    }
    path = out_dir / f"controller-{stamp}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{args.chunks} chunks on {args.instances} instances (filled in {fill_s:.1f} s)")
    for name, c in cases.items():
        wrong_note = f", {c['wrong_answers']} WRONG" if c["wrong_answers"] else ""
        print(f"  /lookup {name:>10}: p50 {c['p50_ms']:.2f} ms, p99 {c['p99_ms']:.2f} ms, max {c['max_ms']:.2f} ms"
              f"{wrong_note}")
    print(f"target {result['target']['what']}: {'MET' if met else 'MISSED'} (worst p99 {worst:.2f} ms)")
    print(f"wrote {path}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
