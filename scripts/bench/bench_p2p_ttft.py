"""A peer-to-peer hit's TTFT through real vLLM, against a local CPU-tier hit (issue 42).

    sudo .venv/bin/python scripts/bench/bench_p2p_ttft.py [--rate 10gbit] [--prompts 8] [--prompt-tokens 3000]
                                                          [--json bench/results/p2p-ttft-20261129-10g.json]
    sudo .venv/bin/python scripts/bench/bench_p2p_ttft.py --quick   # tiny model, 2 prompts of 512 tokens, eager

Two "machines" (`bench_p2p.two_machines`: network namespaces on one switch, 198.18.0.1 and
198.18.0.2, links `tc ... tbf`-shaped at `--rate`), each running a vLLM server with our cache in the CPU tier
(`lmcache_vllm serve`, or `--door v1`), peer-to-peer on (`enable_p2p`, a peer token), the lookup
Redis with a password on machine A. A client per machine (this script's `--role client`, in the
machine's namespace) talks to its server on the namespace's loopback. After a warm-up prompt,
each of `--prompts` distinct prompts is:
- sent to A once: computed and stored (its TTFT is the miss reference), and recorded in Redis;
- after vLLM's own prefix cache on A is reset, sent to A again (a local CPU-tier hit) and to B
  (a P2P hit: B holds nothing, reads every chunk from A's peer server), in alternating order from
  prompt to prompt. B's first send is the one measured (a second would be local).
Each measured request's log line (hit and loaded tokens) is checked: medians are of full hits
only. The target: median P2P-hit TTFT <= 1.5x median local-hit TTFT. The JSON also gives the
link's floor (the prompt's KV bytes over the link's rate, the least a P2P hit adds to a local one)
and the ratio a P2P hit would have at that floor. Needs root.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_p2p import A_ADDR, B_ADDR, Machines, rate_arg, start_on, two_machines  # noqa: E402 (stdlib only: the roles stay light)
from netns_machines import gbit_of  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = "lmcache-bench-p2p-ttft/1"
TARGET_RATIO = 1.5  # issue 42: a P2P hit's TTFT within 1.5x of a local CPU-tier hit
KINDS = ("miss", "local", "p2p")
REDIS_PORT, PEER_PORT, HTTP_PORT = 6390, 8200, 8000
RECORD_WAIT_S = 60.0
QUICK = dict(model_dir=".cache/tiny-model", prompts=2, prompt_tokens=512, max_model_len=1024)


@dataclass(frozen=True)
class Measurement:
    """One timed request."""

    prompt: int  # the prompt's index (-1: the warm-up, not summarized)
    kind: str  # "miss" (A computes it), "local" (A's CPU tier), "p2p" (B reads A's)
    ttft_s: float
    request_id: str  # vLLM's engine request id, as our log lines name it
    prompt_tokens: int
    lmcache_hit_tokens: int = -1  # from the server's log line; -1: no line found
    loaded_tokens: int = -1

    @property
    def full_hit(self) -> bool:
        """The whole prompt loaded from our cache (vLLM computes at most its last token)."""
        return self.loaded_tokens >= self.prompt_tokens - 1


def summarize(measured: Sequence[Measurement], target: float = TARGET_RATIO) -> dict:
    """Median TTFT per kind (hits: full hits only), the ratio P2P / local of the medians, each
    prompt's own ratio, and the target's verdict."""
    measured = [m for m in measured if m.prompt >= 0]
    counted = {kind: [m for m in measured if m.kind == kind and (kind == "miss" or m.full_hit)] for kind in KINDS}
    medians = {kind: statistics.median(m.ttft_s for m in ms) if ms else None for kind, ms in counted.items()}
    local = {m.prompt: m.ttft_s for m in counted["local"]}
    pairs = [m.ttft_s / local[m.prompt] for m in counted["p2p"] if m.prompt in local]
    ratio = medians["p2p"] / medians["local"] if medians["p2p"] and medians["local"] else None
    return {
        "median_ttft_s": medians,
        "counted": {kind: len(ms) for kind, ms in counted.items()},
        "not_full_hits": [m.request_id for m in measured if m.kind != "miss" and not m.full_hit],
        "ratio_p2p_local": ratio,
        "ratio_miss_local": medians["miss"] / medians["local"] if medians["miss"] and medians["local"] else None,
        "pair_ratios": pairs,
        "median_pair_ratio": statistics.median(pairs) if pairs else None,
        "target": {"rule": f"median P2P-hit TTFT / median local CPU-tier hit TTFT <= {target}",
                   "met": ratio is not None and ratio <= target},
    }


def link_floor_s(kv_bytes: int, rate: str) -> Optional[float]:
    """Seconds `kv_bytes` take at a tc rate (`10gbit`, `500mbit`); None for an unshaped link."""
    gbit = gbit_of(rate)
    return None if gbit is None else kv_bytes * 8 / (gbit * 1e9)


# --- the client, in a machine's namespace -------------------------------------------------------


def client(port: int, model: str) -> None:
    """Serve the driver's requests, one JSON line in and one out, against the server on `port`."""
    import aiohttp
    from bench_serving_client import reset_prefix_cache, stream_completion

    async def serve() -> None:
        base = f"http://127.0.0.1:{port}"
        loop = asyncio.get_running_loop()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            while line := await loop.run_in_executor(None, sys.stdin.readline):
                ask = json.loads(line)
                try:
                    if ask["op"] == "health":
                        async with session.get(f"{base}/health", timeout=aiohttp.ClientTimeout(total=2)) as resp:
                            answer = {"ok": resp.status == 200}
                    elif ask["op"] == "reset":
                        await reset_prefix_cache(session, base)
                        answer = {}
                    else:
                        done = await stream_completion(session, base, model, ask["prompt"], ask["max_tokens"],
                                                       ask["id"], time.perf_counter())
                        answer = {"ttft_s": done.ttft_s, "request_id": done.request_id}
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as err:
                    answer = {"ok": False} if ask["op"] == "health" else {"error": repr(err)}
                except Exception as err:  # RequestFailed and the like: the driver reports it
                    answer = {"error": repr(err)}
                print(json.dumps(answer), flush=True)

    asyncio.run(serve())


class Client:
    """The driver's end of a client process in a namespace."""

    def __init__(self, machines: Machines, machine: str, port: int, model: str) -> None:
        self.proc = start_on(machines, machine, sys.executable, str(Path(__file__).resolve()), "--role", "client",
                             "--port", str(port), "--model-dir", model,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(self, op: str, **fields) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {op} client exited (code {self.proc.wait()})")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"{op}: {answer['error']}")
        return answer

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# --- the driver ---------------------------------------------------------------------------------


def kv_bytes_per_token(model_dir: Path) -> int:
    """K and V of one token over all layers, from the model's config (float32: the servers' dtype)."""
    from bench_serving_servers import float32_kv_bytes_per_token

    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return float32_kv_bytes_per_token(cfg["num_hidden_layers"], cfg["num_key_value_heads"], head_dim)


def redacted(env: Dict[str, str], secrets_: Sequence[str]) -> Dict[str, str]:
    """`env` with every secret replaced, for the results file."""
    out = {}
    for key, value in sorted(env.items()):
        for secret in secrets_:
            value = value.replace(secret, "***")
        out[key] = value
    return out


class Run:
    """The servers, clients and Redis of one run, on two machines; `close` stops them all."""

    def __init__(self, args: argparse.Namespace, machines: Machines, log_dir: Path) -> None:
        self.args, self.machines, self.log_dir = args, machines, log_dir
        self.password, self.token = secrets.token_hex(16), secrets.token_hex(16)
        self.processes: list = []  # ManagedProcess, in start order
        self.servers: dict = {}  # "A"/"B" -> its ManagedProcess
        self.clients: List[Client] = []
        self.launched: dict = {}  # what went into the results file about each server

    def start(self) -> None:
        from bench_serving_servers import LaunchSpec, ServerSettings, launch, server_launch, tier_gb_for

        args, machines, log_dir = self.args, self.machines, self.log_dir
        self.processes.append(launch(LaunchSpec(
            "redis", machines.argv("a", ["redis-server", "--bind", A_ADDR,
                      "--port", str(REDIS_PORT), "--requirepass", self.password, "--save", "",
                      "--appendonly", "no", "--dir", str(log_dir)]), {}, log_dir / "redis.log"), ROOT))
        tokens = (args.prompts + 1) * args.prompt_tokens
        tier_gb = tier_gb_for(tokens * kv_bytes_per_token(Path(args.model_dir)))
        settings = ServerSettings(
            model=args.model_dir, max_model_len=args.max_model_len, block_size=128,
            num_kv_blocks=math.ceil(args.max_model_len / 128) + 1, chunk_size=args.chunk_size,
            cpu_tier_gb=tier_gb, disk_tier_gb=0, remote_tier_gb=0, disk_dir=str(log_dir / "unused-disk"),
            door=args.door, extra_vllm_args=("--enforce-eager",) if args.quick else ())
        for name, machine, addr in (("A", "a", A_ADDR), ("B", "b", B_ADDR)):
            spec = server_launch("lmcache-cpu", settings, HTTP_PORT, log_dir / f"server-{name}.log")
            spec.argv[:] = machines.argv(machine, spec.argv)
            spec.env.update(LMCACHE_ENABLE_P2P="true", LMCACHE_DISTRIBUTED_URL=f"{addr}:{PEER_PORT}",
                            LMCACHE_LOOKUP_URL=f"redis://:{self.password}@{A_ADDR}:{REDIS_PORT}",
                            LMCACHE_P2P_TOKEN=self.token, PYTHONPATH=str(ROOT))
            spec.health_url = None  # on the namespace's loopback: its client asks
            self.servers[name] = launch(spec, ROOT)
            self.processes.append(self.servers[name])
            self.launched[name] = {"argv": spec.argv, "env": redacted(spec.env, (self.password, self.token)),
                                   "log": str(spec.log_path)}
        self.clients = [Client(machines, machine, HTTP_PORT, args.model_dir) for machine in ("a", "b")]
        self.a, self.b = self.clients

    def wait_ready(self, timeout_s: float) -> Dict[str, float]:
        deadline, ready = time.monotonic() + timeout_s, {}
        for name, client in (("A", self.a), ("B", self.b)):
            server = self.servers[name]
            while not client.ask("health")["ok"]:
                server.check_alive()
                if time.monotonic() > deadline:
                    raise RuntimeError(f"server {name} not healthy within {timeout_s:.0f} s: {server.log_tail()}")
                time.sleep(1.0)
            ready[name] = round(time.monotonic() - server.started_at, 1)
        return ready

    def records(self) -> int:
        """How many chunks the lookup Redis has a record of."""
        out = self.machines.run("a", ["redis-cli", "-h", A_ADDR, "-p", str(REDIS_PORT), "-a", self.password,
                                      "--no-auth-warning", "--scan", "--pattern", "lmcache:p2p:chunk:*"],
                                capture_output=True, text=True).stdout
        return len(out.split())

    def close(self) -> None:
        from bench_serving_servers import stop_all

        for client in self.clients:
            client.close()
        stop_all(self.processes)


def send(client: Client, prompt: Sequence[int], index: int, kind: str, max_tokens: int) -> Measurement:
    header = f"p{index}-{kind}" if index >= 0 else f"warmup-{kind}"
    got = client.ask("complete", prompt=list(prompt), max_tokens=max_tokens, id=header)
    return Measurement(index, kind, got["ttft_s"], got["request_id"], len(prompt))


def measure(run: Run, prompts: List[Sequence[int]], chunk_size: int, max_tokens: int) -> List[Measurement]:
    """The warm-up (index -1) and then every prompt: A computes it, then A's and B's hits in turn."""
    measured: List[Measurement] = []
    expected = 0
    for index, prompt in enumerate(prompts, start=-1):
        measured.append(send(run.a, prompt, index, "miss", max_tokens))
        expected += math.ceil(len(prompt) / chunk_size)
        deadline = time.monotonic() + RECORD_WAIT_S
        while run.records() < expected:  # B looks up only what A has recorded
            if time.monotonic() > deadline:
                raise RuntimeError(f"A's records: {run.records()} chunks, {expected} expected")
            time.sleep(0.05)
        run.a.ask("reset")  # A's next send must come from our CPU tier, not vLLM's own cache
        order = (("local", run.a), ("p2p", run.b)) if index % 2 == 0 else (("p2p", run.b), ("local", run.a))
        for kind, client in order:
            measured.append(send(client, prompt, index, kind, max_tokens))
        print(f"prompt {index}: " + ", ".join(f"{m.kind} {m.ttft_s * 1e3:.1f} ms" for m in measured[-3:]),
              flush=True)
    return measured


def with_log_lines(measured: List[Measurement], logs: Dict[str, str]) -> List[Measurement]:
    """Each measurement with its request's hit and loaded tokens from its server's log."""
    from dataclasses import replace

    from lmcache.integration.vllm.request_log import parse_request_lines

    lines = {line.req_id: line for text in logs.values() for line in parse_request_lines(text)}
    out = []
    for m in measured:
        line = lines.get(m.request_id)
        out.append(m if line is None else replace(m, lmcache_hit_tokens=line.stats.lmcache_hit_tokens,
                                                  loaded_tokens=line.counters.loaded_tokens))
    return out


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=rate_arg, default="10gbit", help="tbf rate of the link (tc syntax), or none")
    parser.add_argument("--prompts", type=int, default=8, help="distinct measured prompts (after one warm-up)")
    parser.add_argument("--prompt-tokens", type=int, default=3000)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--model-dir", default=".cache/bench-model")
    parser.add_argument("--door", choices=("wrapper", "v1"), default="wrapper")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="tiny model, 2 prompts of 512 tokens, eager")
    parser.add_argument("--startup-timeout", type=float, default=900)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--role", choices=["client"], help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if args.role == "client":
        client(args.port, args.model_dir)
        return 0
    if args.quick:
        for key, value in QUICK.items():
            if f"--{key.replace('_', '-')}" not in argv:
                setattr(args, key, value)
    if os.geteuid() != 0:
        sys.exit("bench_p2p_ttft needs root: it makes network namespaces (ip netns) and shapes their link (tc)")
    from bench_serving import machine_header
    from bench_serving_servers import stop_servers_on_sigterm
    from bench_serving_workloads import token_ids

    stop_servers_on_sigterm()
    started, load_before = time.time(), os.getloadavg()
    vocab = json.loads((Path(args.model_dir) / "config.json").read_text())["vocab_size"]
    prompts = [token_ids(args.prompt_tokens, vocab, args.seed, "p2p-ttft", i) for i in range(args.prompts + 1)]
    log_dir = Path(tempfile.mkdtemp(prefix="bench-p2p-ttft-"))
    machines = two_machines(args.rate)
    run = Run(args, machines, log_dir)
    try:
        run.start()
        ready = run.wait_ready(args.startup_timeout)
        measured = measure(run, prompts, args.chunk_size, args.max_tokens)
        logs = {name: proc.spec.log_path.read_text(errors="replace") for name, proc in run.servers.items()}
        launched = run.launched
    finally:
        run.close()
        machines.close()
    measured = with_log_lines(measured, logs)
    kv_bytes = args.prompt_tokens * kv_bytes_per_token(Path(args.model_dir))
    summary = summarize(measured)
    floor = link_floor_s(kv_bytes, args.rate)
    result = {
        **machine_header(SCHEMA, started, argv, load_before, "scripts/bench/bench_p2p_ttft.py"),
        "rate": args.rate, "model_dir": args.model_dir, "prompt_tokens": args.prompt_tokens,
        "prompts": args.prompts, "door": args.door, "kv_bytes_per_prompt": kv_bytes,
        "link_floor_s": floor,
        # The ratio a P2P hit would have if it cost a local hit plus the prompt's bytes at the link's rate.
        "ratio_at_link_floor": (1 + floor / summary["median_ttft_s"]["local"])
        if floor and summary["median_ttft_s"]["local"] else None,
        "servers_ready_s": ready, "servers": launched, "logs": str(log_dir),
        **summary,
        "measurements": [m.__dict__ for m in measured],
    }
    med = summary["median_ttft_s"]
    print(json.dumps({k: result[k] for k in ("median_ttft_s", "counted", "not_full_hits", "ratio_p2p_local",
                                              "pair_ratios", "link_floor_s", "ratio_at_link_floor")}, indent=1))
    shown = " / ".join(f"{k} {med[k] * 1e3:.1f} ms" if med[k] else f"{k} -" for k in KINDS)
    ratio = summary["ratio_p2p_local"]
    print(f"median TTFT {shown}; target P2P / local <= {TARGET_RATIO}: "
          f"{'MET' if summary['target']['met'] else 'MISSED'} ({ratio if ratio is None else round(ratio, 3)})")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json}")
    return 0 if not summary["not_full_hits"] else 1


if __name__ == "__main__":
    sys.exit(main())
