"""The node pool's soak (issue 31): N vLLM instances sharing a small, full, evicting pool for 20 minutes.

    .venv/bin/python scripts/bench/soak_pool.py    # 2 instances, 20 minutes (about 22 with startup)
    .venv/bin/python scripts/bench/soak_pool.py --quick    # tiny model, 2 minutes: a smoke run

Upstream's users report leaks and hit rates that decay to zero after hours of serving; this run
looks for both. It starts the node pool (`python -m lmcache.server --unix-socket`) with an arena
small enough to be full and evicting within the warm-up, and N `lmcache_vllm serve` instances on
it with no private CPU tier (`bench_multi_instance.start_shared` / `start_instances`). `--clients`
clients then send, until `--duration`, to seeded random instances (`route`), the `schedule`: each of a
FIXED set of prompts in turn, with `--fresh-per-fixed` never-seen prompts after each one (the churn
that keeps the pool evicting). The fixed set and the fresh prompts between two visits of a fixed
prompt fit in the arena, so an LRU pool keeps the fixed set: its hit rate should hold steady.

Measured, on the run's clock (0 = first request):
- every `--sample-s` seconds, the RSS (and its anon / file / shmem parts) of every process of the
  server's and each instance's session (API server, engine core, helpers), the server's `INFO`
  (`--metrics-port`: entries, evictions, leases) and the load average;
- the fixed set's hit rate per `--window-s` window after `--warmup-s`: LMCache hit tokens over
  prompt tokens, from each instance's per-request log lines (`request_log`);
- at the end, once the clients are done: the server's leases and reservations, polled until 0.

Targets: the pool evicting by the end of the warm-up and in every window after;
every process's own memory (RSS less its shared pages) within 5% of its first sample after the
warm-up, and its shared pages no more than the arena (an instance's RSS also counts each arena
page it has touched, so its whole RSS rises until it has touched the whole arena; that RSS is
reported too); no lease or reservation at idle; the fixed set's hit rate in the last window
within 0.05 of the first (and above 0); every request answered (`soak_pool_report.py`). Writes
`--json` (default bench/results/soak-pool-<timestamp>.json) and exits 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import random
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # make_tiny_model

from bench_multi_instance import server_info, start_instances, start_shared  # noqa: E402
from bench_serving import add_model_args, apply_quick, model_spec, run_header, shown  # noqa: E402
from bench_serving_client import RequestFailed, stream_chat  # noqa: E402
from bench_serving_servers import (  # noqa: E402
    POOL_KIND, ManagedProcess, ServerSettings, describe, stop_all, stop_servers_on_sigterm,
)
from make_tiny_model import make_tiny_model  # noqa: E402
from multi_round_qa import QASizes, warm_up, words  # noqa: E402
from soak_pool_report import (  # noqa: E402
    SoakRecord, counter_delta, print_report, process_memory, soak_targets, window_hit_rates,
)

from lmcache.integration.vllm.request_log import parse_request_lines  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = "lmcache-soak-pool/1"
# --quick: the test suite's tiny model, short prompts, a 10 MB arena, 2 minutes, vLLM eager.
QUICK = dict(model_dir=".cache/tiny-model", hidden=128, layers=4, heads=4, kv_heads=2, max_position=4096,
             fixed_words=300, fresh_words=300, arena_gb=0.01, duration=120, warmup_s=40, window_s=20, sample_s=5)


@dataclass(frozen=True)
class SoakSizes:
    """The workload: what is sent, how often, by how many clients."""

    seed: int = 0
    fixed_prompts: int = 4  # the repeated set whose hit rate is watched
    fixed_words: int = 700  # about one token a word (`make_tiny_model.WORDS`)
    fresh_words: int = 700
    fresh_per_fixed: int = 1  # never-seen prompts sent after each fixed one
    clients: int = 3  # requests in flight at once
    max_tokens: int = 8

    def validate(self) -> None:
        for name, value in self.__dict__.items():
            if name != "seed" and value <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")


def schedule(sizes: SoakSizes) -> Iterator[tuple[str, int]]:
    """("fixed", k) and ("fresh", i) forever: each fixed prompt in turn, `fresh_per_fixed` fresh
    ones (numbered from 0, never repeated) after each."""
    fresh = itertools.count()
    for k in itertools.cycle(range(sizes.fixed_prompts)):
        yield "fixed", k
        for _ in range(sizes.fresh_per_fixed):
            yield "fresh", next(fresh)


def prompt_text(sizes: SoakSizes, kind: str, index: int) -> str:
    return words(sizes.fixed_words if kind == "fixed" else sizes.fresh_words, sizes.seed, kind, index)


def route(sizes: SoakSizes, n: int, instances: int) -> int:
    """The instance request `n` goes to: drawn from a generator seeded by the seed and `n`. Not
    round-robin: with a schedule of period 2 on 2 instances, round-robin would send every fixed
    prompt to one instance and every fresh one to the other."""
    return random.Random(f"{sizes.seed}/route/{n}").randrange(instances)


async def drive(urls: Sequence[str], model: str, sizes: SoakSizes, clock_zero: float, until_s: float,
                on_done: Callable[[SoakRecord], None]) -> list[SoakRecord]:
    """`sizes.clients` clients take the schedule's next prompt until `until_s` on the run's clock,
    each sent to the instance `route` names."""
    items = enumerate(schedule(sizes))
    records: list[SoakRecord] = []
    timeout = aiohttp.ClientTimeout(total=None, sock_read=900)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async def client() -> None:
            while time.perf_counter() - clock_zero < until_s:
                n, (kind, index) = next(items)
                header_id = f"soak-{kind}{index}-n{n}"
                instance = route(sizes, n, len(urls))
                messages = [{"role": "user", "content": prompt_text(sizes, kind, index)}]
                start = time.perf_counter() - clock_zero
                try:
                    comp = await stream_chat(session, urls[instance], model, messages, sizes.max_tokens, header_id,
                                             clock_zero)
                    rec = SoakRecord(kind, index, header_id, comp.request_id, instance, comp.prompt_tokens,
                                     comp.ttft_s, comp.start_s)
                except (RequestFailed, aiohttp.ClientError, asyncio.TimeoutError) as err:
                    rec = SoakRecord(kind, index, header_id, "", instance, 0, 0.0, start,
                                     f"{type(err).__name__}: {err}")
                records.append(rec)
                on_done(rec)

        await asyncio.gather(*(client() for _ in range(sizes.clients)))
    return records


# ---- sampling ----

def session_pids(sessions: Sequence[int]) -> dict[int, tuple[int, str]]:
    """pid -> (session, command name) of every live process in `sessions`."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                text = f.read()
        except OSError:
            continue
        comm, after = text[text.index("(") + 1 : text.rindex(")")], text.rsplit(")", 1)[1].split()
        if int(after[3]) in sessions:
            out[int(entry)] = int(after[3]), comm
    return out


def memory_kib(pid: int) -> Optional[tuple[int, int, int, int]]:
    """(VmRSS, RssAnon, RssFile, RssShmem) in KiB, None once the process is gone."""
    wanted = ("VmRSS:", "RssAnon:", "RssFile:", "RssShmem:")
    found = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(wanted):
                    name, value = line.split()[:2]
                    found[name] = int(value)
    except OSError:
        return None
    return tuple(found.get(name, 0) for name in wanted) if "VmRSS:" in found else None


def command_line(pid: int, limit: int = 160) -> str:
    """The start of a process's command line (which of vLLM's processes it is)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:limit]
    except OSError:
        return ""


SERVER_FIELDS = ("entries", "bytes_used", "evictions", "puts", "hits", "misses", "pool_clients", "pool_leases",
                 "pool_reservations")


class Sampler:
    """Every `period_s`: each session process's memory, the server's INFO, the load average."""

    def __init__(self, sessions: dict[int, str], metrics_port: int, clock_zero: float, period_s: float) -> None:
        self.sessions, self.metrics_port, self.clock_zero, self.period_s = sessions, metrics_port, clock_zero, period_s
        self.rss: dict[str, dict] = {}  # "<role> <comm> <pid>" -> {role, comm, pid, samples: [[t, kib x 4]]}
        self.server: list[dict] = []  # {"t", field: value, "load1"}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-sampler", daemon=True)

    def now(self) -> float:
        return round(time.perf_counter() - self.clock_zero, 1)

    def sample(self) -> None:
        t = self.now()
        for pid, (session, comm) in session_pids(list(self.sessions)).items():
            mem = memory_kib(pid)
            if mem is None:
                continue
            role = self.sessions[session]
            series = self.rss.get(f"{role} {comm} {pid}")
            if series is None:
                series = self.rss[f"{role} {comm} {pid}"] = {"role": role, "comm": comm, "pid": pid,
                                                             "cmdline": command_line(pid), "samples": []}
            series["samples"].append([t, *mem])
        info = server_info(self.metrics_port)
        self.server.append({"t": t, **{k: info.get(k) for k in SERVER_FIELDS}, "load1": os.getloadavg()[0]})

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.sample()
            except (OSError, ValueError) as err:  # a process ending mid-read; the server going away
                print(f"soak_pool: sample at {self.now()} s: {err}", file=sys.stderr)

    def start(self) -> None:
        self.sample()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)


def wait_idle(metrics_port: int, timeout_s: float) -> dict:
    """Poll the server until it reports no lease and no reservation (or `timeout_s` passes)."""
    started = time.monotonic()
    while True:
        info = server_info(metrics_port)
        held = info.get("pool_leases", 0) + info.get("pool_reservations", 0)
        if held == 0 or time.monotonic() - started > timeout_s:
            return {"waited_s": round(time.monotonic() - started, 1), "pool_leases": info.get("pool_leases"),
                    "pool_reservations": info.get("pool_reservations"), "info": info}
        time.sleep(1.0)


# ---- the run ----

def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--instances", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="tiny model, short prompts, 2 minutes, eager")
    p.add_argument("--duration", type=float, default=1200, help="seconds of requests, warm-up included")
    p.add_argument("--warmup-s", type=float, default=240, help="seconds before RSS and hit rates are compared")
    p.add_argument("--window-s", type=float, default=60, help="hit-rate window")
    p.add_argument("--sample-s", type=float, default=10, help="RSS and server sampling period")
    p.add_argument("--idle-timeout", type=float, default=60, help="how long to wait for the leases to go at the end")
    p.add_argument("--arena-gb", type=float, default=0.25, help="the pool's --max-size-gb: small, to be full")
    p.add_argument("--model-dir", default=".cache/bench-model")
    add_model_args(p)
    for name, value in SoakSizes().__dict__.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=value)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--engine-kv-tokens", type=int, default=2048, help="vLLM's own KV space per instance")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--staging-gb", type=float, default=0.5, help="each instance's host memory (no CPU tier)")
    p.add_argument("--json", default=None, help="default bench/results/soak-pool-<timestamp>.json")
    p.add_argument("--startup-timeout", type=float, default=900)
    args = p.parse_args(argv)
    if args.quick:
        apply_quick(args, argv, QUICK)
    return args


def log_hits(instances: Sequence[ManagedProcess]) -> dict[str, int]:
    """Request id -> LMCache hit tokens, from every instance's per-request log lines."""
    return {line.req_id: line.stats.lmcache_hit_tokens
            for proc in instances for line in parse_request_lines(proc.spec.log_path.read_text(errors="replace"))}


def run(args: argparse.Namespace, sizes: SoakSizes, settings: ServerSettings, log_dir: Path) -> dict:
    """Start the pool and the instances, drive them, sample, stop them; the measured parts."""
    running: list[ManagedProcess] = []
    try:
        _, metrics_port, [server_spec] = start_shared(POOL_KIND, settings, log_dir, running)
        urls, instances = start_instances(POOL_KIND, args.instances, settings, log_dir, None, running,
                                          args.startup_timeout)
        clock_zero = time.perf_counter()
        asyncio.run(warm_up(urls, args.model_dir, QASizes(seed=sizes.seed), clock_zero))
        roles = {running[0].pid: "server", **{p.pid: f"instance-{i}" for i, p in enumerate(instances)}}
        clock_zero = time.perf_counter()
        sampler = Sampler(roles, metrics_port, clock_zero, args.sample_s)
        sampler.start()

        def done(rec: SoakRecord) -> None:
            print(f"  {rec.start_s:7.1f} s {rec.kind} {rec.prompt} on {rec.instance}: {rec.prompt_tokens} tokens, "
                  f"TTFT {rec.ttft_s:.3f} s {rec.error}", file=sys.stderr, flush=True)

        try:
            records = asyncio.run(drive(urls, args.model_dir, sizes, clock_zero, args.duration, done))
            drive_s = time.perf_counter() - clock_zero
            idle = wait_idle(metrics_port, args.idle_timeout)
            sampler.sample()  # the memory at idle, last in every series
        finally:
            sampler.stop()
        hits = log_hits(instances)
        return {"records": records, "hits": hits, "idle": idle, "rss": sampler.rss, "server": sampler.server,
                "drive_s": drive_s, "processes": [{"role": "server", **describe(server_spec)}] + [
                    {"role": f"instance-{i}", **describe(p.spec), "ready_s": p.ready_s}
                    for i, p in enumerate(instances)]}
    finally:
        stop_all(running)


def summarize(args: argparse.Namespace, measured: dict) -> dict:
    records, server = measured["records"], measured["server"]
    windows = window_hit_rates(records, measured["hits"], args.warmup_s, args.window_s,
                               int((args.duration - args.warmup_s) // args.window_s))
    for row in windows:
        row["evictions"] = counter_delta(server, "evictions", row["start_s"], row["end_s"])
    after_warmup = [s for s in server if s["t"] >= args.warmup_s]
    evictions_by_warmup = after_warmup[0]["evictions"] if after_warmup else None
    memory = {name: process_memory(series["samples"], args.warmup_s) for name, series in measured["rss"].items()}
    failed = [r for r in records if r.error]
    tgt = soak_targets(evictions_by_warmup, [w["evictions"] for w in windows], memory, args.arena_gb * 2**20,
                       measured["idle"], windows, len(failed))
    by_kind = {kind: sum(1 for r in records if r.kind == kind) for kind in ("fixed", "fresh")}
    return {
        "drive_s": round(measured["drive_s"], 1),
        "requests": {**by_kind, "failed": len(failed), "failures": [r.error for r in failed[:20]],
                     "logged": sum(1 for r in records if r.request_id in measured["hits"])},
        "windows": windows,
        "evictions_by_warmup": evictions_by_warmup,
        "idle": measured["idle"],
        "memory": memory,
        "targets": tgt,
        "passed": all(t["met"] for t in tgt),
    }


def main(argv: list[str]) -> int:
    stop_servers_on_sigterm()
    args = parse_args(argv)
    os.chdir(ROOT)
    spec = model_spec(args)
    sizes = SoakSizes(**{k: getattr(args, k) for k in SoakSizes().__dict__})
    try:
        spec.validate()
        sizes.validate()
        if args.instances < 1:
            raise ValueError(f"--instances must be positive, got {args.instances}")
        if not 0 <= args.warmup_s < args.duration - args.window_s + 1e-9:
            raise ValueError(f"--warmup-s {args.warmup_s} leaves no --window-s {args.window_s} window "
                             f"in --duration {args.duration}")
        if max(sizes.fixed_words, sizes.fresh_words) + 16 + sizes.max_tokens > args.max_model_len:
            raise ValueError(f"prompts of {max(sizes.fixed_words, sizes.fresh_words)} words do not fit "
                             f"--max-model-len {args.max_model_len}")
    except ValueError as err:
        raise SystemExit(f"soak_pool: {err}")
    stamp = time.strftime("%Y%m%d-%H%M")
    json_path = ROOT / (args.json or f"bench/results/soak-pool-{stamp}.json")
    json_path.parent.mkdir(parents=True, exist_ok=True)
    log_dir = ROOT / ".cache" / "bench-logs" / f"soak-pool-{stamp}-{os.getpid()}"
    print(f"soak_pool: building the model in {args.model_dir} ({spec})", file=sys.stderr)
    weights = make_tiny_model(ROOT / args.model_dir, spec)
    blocks = math.ceil(max(args.engine_kv_tokens, args.max_model_len) / args.block_size)
    load_before = os.getloadavg()
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="lmcache-soak-pool-") as sock_dir:
        settings = ServerSettings(
            model=args.model_dir, max_model_len=args.max_model_len, block_size=args.block_size,
            num_kv_blocks=blocks, chunk_size=args.chunk_size, cpu_tier_gb=args.staging_gb, disk_tier_gb=0.0,
            remote_tier_gb=args.arena_gb, disk_dir=str(log_dir / "unused-disk"),
            extra_vllm_args=("--enforce-eager",) if args.quick else (),
            pool_socket=str(Path(sock_dir) / "pool.sock"),
        )
        print(f"soak_pool: the pool ({args.arena_gb:g} GB) and {args.instances} instances, "
              f"{args.duration:.0f} s of requests", file=sys.stderr, flush=True)
        measured = run(args, sizes, settings, log_dir)
    summary = summarize(args, measured)
    result = {
        **run_header(SCHEMA, started, argv, load_before, args.model_dir, spec, weights, "scripts/bench/soak_pool.py"),
        "config": {"instances": args.instances, "duration_s": args.duration, "warmup_s": args.warmup_s,
                   "window_s": args.window_s, "sample_s": args.sample_s, "arena_gb": args.arena_gb,
                   "sizes": asdict(sizes), "settings": asdict(replace(settings, pool_socket="<temporary>"))},
        "processes": measured["processes"],
        "summary": summary,
        "server_series": measured["server"],
        "rss_series": measured["rss"],
        "rss_columns": ["t_s", "vm_rss_kib", "rss_anon_kib", "rss_file_kib", "rss_shmem_kib"],
        "requests": [asdict(r) for r in measured["records"]],
    }
    json_path.write_text(json.dumps(result, indent=1) + "\n")
    print_report(summary)
    print(f"soak_pool: {'PASSED' if summary['passed'] else 'FAILED'}; wrote {shown(json_path)} in "
          f"{result['duration_s']:.0f} s (logs in {shown(log_dir)})")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
