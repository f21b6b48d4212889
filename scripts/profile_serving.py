"""Where a server's CPU time goes when nothing is reused: py-spy over a real vLLM server (issue 12).

    .venv/bin/python scripts/profile_serving.py --servers vllm,lmcache-disk --requests 4

Starts each server kind of `bench_serving_servers` (vLLM alone, `lmcache_vllm serve` with one
tier) under `py-spy record --subprocesses` (the API server, the engine core and its threads), sends
it the same unique prompts one after another, stops it, and summarises the samples: per process,
the share of active samples with an `lmcache` frame on the stack, and the `lmcache` functions that
take most of them (inclusive). Raw stacks, logs and the summary go to `bench/results/profile-<ts>/`
(commit the summary only).
py-spy samples active threads only, so the shares are of CPU time, not wall time.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import shutil
import signal
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_serving import BENCH_MODEL  # noqa: E402
from bench_serving_servers import ServerSettings, free_port, launch, server_launch  # noqa: E402
from make_tiny_model import make_tiny_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def complete(port: int, model: str, prompt: list[int], max_tokens: int) -> None:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=600) as resp:
        resp.read()


def summarize(raw: Path, top: int) -> dict:
    """Per process: active samples, samples with an lmcache frame, top lmcache functions."""
    per_process: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        process = frames[0].split(" (")[0] if frames[0].startswith("process") else "?"
        samples = int(count)
        stats = per_process[process]
        stats["samples"] += samples
        ours = [f for f in frames if "lmcache" in f]
        if ours:
            stats["lmcache_samples"] += samples
            for name in dict.fromkeys(f.split(" (")[0] for f in ours):
                stats["fn:" + name] += samples
    out = {}
    for process, stats in per_process.items():
        fns = sorted(((k[3:], v) for k, v in stats.items() if k.startswith("fn:")), key=lambda kv: -kv[1])[:top]
        total = stats["samples"] or 1
        out[process] = {
            "samples": stats["samples"],
            "lmcache_share": round(stats["lmcache_samples"] / total, 4),
            "top_lmcache_functions": [(name, round(n / total, 4)) for name, n in fns],
        }
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", default="vllm,lmcache-cpu,lmcache-disk")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rate", type=int, default=25, help="py-spy samples per second")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--model-dir", default=".cache/bench-model")
    args = p.parse_args()

    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    model = str(ROOT / args.model_dir)
    make_tiny_model(Path(model), BENCH_MODEL)
    out_dir = ROOT / "bench" / "results" / f"profile-{time.strftime('%Y%m%d-%H%M%S')}"
    out_dir.mkdir(parents=True)
    settings = ServerSettings(
        model=model, max_model_len=4096, block_size=128, num_kv_blocks=40, chunk_size=256,
        cpu_tier_gb=2.0, disk_tier_gb=4.0, remote_tier_gb=2.0, disk_dir=str(ROOT / ".cache" / "profile-disk"),
    )
    shutil.rmtree(settings.disk_dir, ignore_errors=True)
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 30000) for _ in range(args.prompt_tokens)] for _ in range(args.requests + 1)]
    report = {"args": vars(args), "servers": {}}
    for kind in args.servers.split(","):
        port = free_port()
        spec = server_launch(kind, settings, port, out_dir / f"{kind}.log")
        raw = out_dir / f"{kind}.raw.txt"
        spec.argv = [py_spy, "record", "--subprocesses", "--rate", str(args.rate), "--format", "raw",
                     "-o", str(raw), "--", *spec.argv]
        proc = launch(spec, ROOT)
        try:
            proc.wait_healthy(900)
            complete(port, model, prompts[0], 2)  # warm-up, not timed
            started = time.monotonic()
            for prompt in prompts[1:]:
                complete(port, model, prompt, args.max_tokens)
            elapsed = time.monotonic() - started
        finally:
            proc.popen.send_signal(signal.SIGINT)  # py-spy stops its child and writes the profile
            proc.popen.wait(timeout=300)
        report["servers"][kind] = {"seconds": round(elapsed, 2), "profile": summarize(raw, args.top)}
        print(kind, json.dumps(report["servers"][kind], indent=1), flush=True)
    (out_dir / "summary.json").write_text(json.dumps(report, indent=1))
    print("wrote", out_dir / "summary.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
