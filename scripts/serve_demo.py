"""`make serve`: LMCache in front of a real vLLM server, seen from an HTTP client.

1. builds the tiny model into `.cache/tiny-model` when it is not there yet (`make_tiny_model`);
2. starts `lmcache_vllm serve` on it with LMCache's CPU tier on (and a disk tier with `--disk`);
3. sends the same long completion request twice over HTTP (streaming, greedy) and measures each
   time to first token (TTFT);
4. reads the LMCache hit tokens of each request from the server's log (the v0 door's and the v1
   door's per-request lines);
5. reads LMCache's `lmcache:` metrics from the server's `/metrics` (and writes them to
   `--metrics-json`);
6. stops the server like Ctrl-C does (SIGINT to its process group) and waits for a clean exit,
   which closes the engine and flushes the disk tier.

    python scripts/serve_demo.py [--engine v1|v0] [--prompt-tokens 2000] [--disk DIR] [--log FILE]

Exit status 0 when the second request hit LMCache for (almost) its whole prompt and the server
stopped cleanly; 1 otherwise. With the v1 engine (vLLM's default) the demo turns vLLM's own prefix
cache off, so the repeat is served by LMCache rather than by vLLM's in-memory blocks.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from make_tiny_model import TinyModelSpec, make_tiny_model  # noqa: E402

from lmcache.experimental.metrics import lmcache_samples  # noqa: E402
from lmcache.integration.vllm.request_log import parse_request_lines, parse_v0_step_lines  # noqa: E402

MODEL_DIR = ROOT / ".cache" / "tiny-model"
CPU_TIER_USAGE = 'lmcache:local_cache_usage{tier="Hot"}'
ENGINE_CLOSED = "LMCache v0 door: engine closed"
# What a starting server is doing, by the first log line of each phase (vLLM's and ours).
START_PHASES = (
    ("vLLM API server version", "vLLM is imported; reading the model's configuration"),
    ("LLM engine (v0.9.2) with config", "starting the engine: loading the model, sizing the KV cache"),
    ("created LMCache engine", "LMCache engine created"),
    ("LMCache v0 door: engine ready", "LMCache engine created"),
    ("Warming up model for the compilation",
     "compiling the model with torch.compile (v1 engine); the first start on a machine also builds "
     "C++ kernels, which takes about a minute on 2 cores, later starts reuse them"),
    ("Starting vLLM API server", "engine ready; the HTTP server is starting"),
)


@dataclass
class RequestResult:
    ttft_s: float
    total_s: float
    text: str
    prompt_tokens: int
    hit_tokens: Optional[int]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_env(engine: str, disk: Optional[Path]) -> dict:
    """The server's environment: LMCache's CPU tier (and disk tier), vLLM's CPU KV space."""
    env = dict(os.environ)
    env.update(
        {
            "VLLM_USE_V1": "1" if engine == "v1" else "0",
            "LMCACHE_CHUNK_SIZE": env.get("LMCACHE_CHUNK_SIZE", "256"),
            "LMCACHE_LOCAL_CPU": "true",
            "LMCACHE_MAX_LOCAL_CPU_SIZE": env.get("LMCACHE_MAX_LOCAL_CPU_SIZE", "1"),
            "VLLM_CPU_KVCACHE_SPACE": env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            "VLLM_NO_USAGE_STATS": "1",
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
    )
    if disk is not None:
        env["LMCACHE_LOCAL_DISK"] = f"file://{disk}"
        env["LMCACHE_MAX_LOCAL_DISK_SIZE"] = env.get("LMCACHE_MAX_LOCAL_DISK_SIZE", "2")
    return env


def server_command(model: Path, port: int, engine: str) -> List[str]:
    cli = Path(sys.executable).parent / "lmcache_vllm"
    cmd = [str(cli), "serve", str(model), "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "float32", "--max-model-len", "4096", "--seed", "0"]
    if engine == "v1":
        cmd.append("--no-enable-prefix-caching")
    return cmd


def report_phases(log: Path, seen: set, started: float) -> None:
    """Print each start phase the server's log has reached since the last call, once."""
    text = log.read_text(errors="replace")
    for marker, what in START_PHASES:
        if what not in seen and marker in text:
            seen.add(what)
            print(f"  {time.monotonic() - started:5.1f} s  {what}", flush=True)


def wait_healthy(proc: subprocess.Popen, port: int, log: Path, timeout_s: float) -> None:
    """Wait for /health, saying what the server is doing meanwhile (its start takes a while)."""
    started = time.monotonic()
    deadline = started + timeout_s
    seen: set = set()
    while time.monotonic() < deadline:
        report_phases(log, seen, started)
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} while starting; log tail:\n{tail(log)}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"the server did not become healthy within {timeout_s:.0f} s; log tail:\n{tail(log)}")


def tail(log: Path, lines: int = 40) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def hit_lines(log: Path) -> List[tuple]:
    """(prompt tokens, LMCache hit tokens) per request, in log order: the v0 door's line for a
    prompt's first step, or the v1 door's per-request line (a server runs one of them)."""
    text = log.read_text(errors="replace")
    v0 = [(s.query_tokens, s.loaded_tokens) for s in parse_v0_step_lines(text) if not s.context_tokens]
    v1 = [(r.stats.prompt_tokens, r.stats.lmcache_hit_tokens) for r in parse_request_lines(text)]
    return v0 + v1


def complete(port: int, model: Path, prompt: Sequence[int], max_tokens: int) -> tuple:
    """One streaming greedy completion; (TTFT, total seconds, text)."""
    body = json.dumps(
        {"model": str(model), "prompt": list(prompt), "max_tokens": max_tokens, "temperature": 0.0,
         "stream": True, "ignore_eos": True}
    ).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    start = time.perf_counter()
    ttft = None
    text = []
    with urllib.request.urlopen(request, timeout=300) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data:"):])
            piece = chunk["choices"][0].get("text", "")
            if ttft is None:
                ttft = time.perf_counter() - start
            text.append(piece)
    total = time.perf_counter() - start
    return (ttft if ttft is not None else total), total, "".join(text)


def request_with_hits(port: int, model: Path, prompt: Sequence[int], log: Path, max_tokens: int) -> RequestResult:
    before = len(hit_lines(log))
    ttft, total, text = complete(port, model, prompt, max_tokens)
    hit: Optional[int] = None
    deadline = time.monotonic() + 10.0
    while time.monotonic() < deadline:
        lines = hit_lines(log)[before:]
        if lines:
            hit = max(h for _, h in lines)
            break
        time.sleep(0.2)
    return RequestResult(ttft, total, text, len(prompt), hit)


def scrape_lmcache_metrics(port: int) -> Dict[str, float]:
    """The `lmcache:` samples on the server's `/metrics` (summed over workers)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as resp:
        return lmcache_samples(resp.read().decode())


def stop(proc: subprocess.Popen, timeout_s: float) -> Optional[int]:
    """Ctrl-C for the server's process group; its exit code, or None if it had to be killed."""
    os.killpg(proc.pid, signal.SIGINT)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return None


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", choices=("v1", "v0"), default="v1", help="vLLM engine (v1 is vLLM's default)")
    p.add_argument("--prompt-tokens", type=int, default=2000, help="length of the repeated prompt")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--disk", type=Path, default=None, help="also keep chunks in this directory (disk tier)")
    p.add_argument("--log", type=Path, default=ROOT / ".cache" / "serve_demo.log", help="server log file")
    p.add_argument("--model", type=Path, default=MODEL_DIR)
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--metrics-json", type=Path, default=None, help="write the scraped lmcache: metrics here")
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.prompt_tokens < 1 or args.prompt_tokens > 4000:
        raise SystemExit(f"--prompt-tokens {args.prompt_tokens}: must be in [1, 4000] (max model length 4096)")
    print(f"model: {args.model} (building it if needed)", flush=True)
    make_tiny_model(args.model, TinyModelSpec())
    if args.disk is not None:
        args.disk.mkdir(parents=True, exist_ok=True)
    args.log.parent.mkdir(parents=True, exist_ok=True)
    port = free_port()
    cmd = server_command(args.model, port, args.engine)
    print(f"starting ({args.engine} engine, log {args.log}): {' '.join(cmd)}", flush=True)
    print("  (importing vLLM and torch takes 10-20 s on 2 cores)", flush=True)
    with open(args.log, "w") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, cwd=str(ROOT),
                                env=server_env(args.engine, args.disk), start_new_session=True)
    results: List[RequestResult] = []
    try:
        started = time.monotonic()
        wait_healthy(proc, port, args.log, args.start_timeout)
        print(f"server ready on port {port} after {time.monotonic() - started:.1f} s", flush=True)
        rng = random.Random(2024)
        prompt = [rng.randrange(4, 1024) for _ in range(args.prompt_tokens)]
        for label in ("first (cold)", "second (repeat)"):
            result = request_with_hits(port, args.model, prompt, args.log, args.max_tokens)
            results.append(result)
            hit = "unknown" if result.hit_tokens is None else f"{result.hit_tokens}/{result.prompt_tokens}"
            print(f"{label:16s} TTFT {result.ttft_s * 1000:8.1f} ms   total {result.total_s * 1000:8.1f} ms"
                  f"   LMCache hit tokens {hit}", flush=True)
        metrics = scrape_lmcache_metrics(port)
        print(f"/metrics: lmcache:num_hit_tokens {metrics.get('lmcache:num_hit_tokens_total', 0):.0f}, "
              f"lmcache:num_stored_tokens {metrics.get('lmcache:num_stored_tokens_total', 0):.0f}, "
              f"CPU tier {metrics.get(CPU_TIER_USAGE, 0):.0f} bytes", flush=True)
        if args.metrics_json is not None:
            args.metrics_json.write_text(json.dumps(metrics, indent=1, sort_keys=True))
    finally:
        if proc.poll() is None:
            code = stop(proc, timeout_s=120.0)
        else:
            code = proc.returncode
    clean = code == 0
    print(f"server stopped {'cleanly' if clean else 'UNCLEANLY'} (exit code {code})", flush=True)
    if len(results) < 2:
        return 1
    first, second = results
    same_text = first.text == second.text
    print(f"same completion text both times: {same_text}")
    if second.ttft_s > 0:
        print(f"TTFT cold / repeat: {first.ttft_s / second.ttft_s:.2f}x")
    ok = (
        clean
        and same_text
        and second.hit_tokens is not None
        and second.hit_tokens >= second.prompt_tokens - 1
    )
    if not ok:
        print(f"server log tail:\n{tail(args.log)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
