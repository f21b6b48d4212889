"""Multi-instance benchmark (issue 31): N vLLM instances on one machine behind a round-robin proxy.

    .venv/bin/python scripts/bench/bench_serving.py --multi-instance 2    # full run, 7-9 min here (2 or 3)
    .venv/bin/python scripts/bench/bench_serving.py --multi-instance 2 --quick    # tiny model, smoke check
    .venv/bin/python scripts/bench/bench_serving.py --multi-instance 3 --link-gbit 10    # on machines (root)

`--link-gbit G` (issue 42) puts each instance on a simulated machine of its own and the shared
store on another, on links of G Gbit/s (`bench_multi_machine.py`); its kinds default to
`lmcache-cpu`, `lmcache-p2p`, `lmcache-mooncake` and `lmcache-redis`.

Kinds, one after another, each on N fresh instances started side by side and sent the same seeded
multi-round QA (`multi_round_qa.py`) through `round_robin_proxy.py`:
- `vllm`: vLLM alone, each instance with its own prefix cache;
- `lmcache-cpu`: ours with a private CPU tier per instance;
- `lmcache-routed`: the same private tiers, each instance reporting to one `lmcache_controller`,
  and the proxy routing each request by the controller's `/lookup` to the instance holding its
  longest prefix (`kv_aware_router.py`, production-stack's `kvaware` rule), round robin otherwise.
  `--kv-aware-threshold` is 512 tokens, not production-stack's 2000: with this workload's ~2k-token
  prompts 2000 would send every request to the instance that served the first one (any match
  leaves under 2000 tokens to compute), so that N instances would be one; 512 sends a user's later
  turns (its history plus under two chunks) to its holder and spreads first turns round robin;
- `lmcache-routed-p2p`: the same, and the instances read each other's tiers peer to peer
  (`enable_p2p`, records in a Redis on loopback): a first turn routed round robin loads the
  shared system prompt from the instance that holds it;
- `lmcache-p2p`: private CPU tiers read peer to peer, round robin (no controller): a turn that
  lands on another instance than the user's last reads the history from the instance holding it;
- `lmcache-pool`: ours sharing the node pool (`lm+shm://`, no CPU tier: one copy per machine);
- `lmcache-remote`: ours sharing one `lm://` server over TCP (no CPU tier either);
- `lmcache-mooncake`: ours sharing one Mooncake Store (`mooncakestore://`): a `mooncake_master` and
  a `mooncake_client` lending the pool its segment; the instances lend none and keep no CPU tier;
- `lmcache-redis`: ours sharing one Redis (`redis://`, with a password), no CPU tier either.
vLLM's own KV space is a fixed, small number of blocks (as in `bench_serving.py`), too small to
keep every user's history, so what a kind's cache keeps between a user's turns is what counts.

Writes `bench/results/multi-instance-<timestamp>.json` + `.png`: per kind mean and p90 TTFT per
round and overall, throughput, the hit tokens each instance's `/metrics` counted, the memory the
cache held at the end (the instances' own tiers from `lmcache:local_cache_usage`, the shared
server's `lmcache_server:bytes_used`, the Mooncake master's `master_allocated_bytes` or Redis's
`used_memory`), the machines and their link rate (`settings.machines`), and the
issues' targets (`bench_multi_instance_report.py`).
Exit code 1 when any kind failed (the others are still reported).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, replace
from pathlib import Path
from typing import Optional

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # make_tiny_model

from bench_multi_instance_report import (  # noqa: E402
    KIND_LABELS, MOONCAKE_KIND, PRIVATE_KIND, ROUTED_KIND, ROUTED_P2P_KIND, instance_counters, plot, plot_title,
    store_gauges, summarize_kind, targets,
)
from bench_multi_machine import Placement, Secrets, machine_plan  # noqa: E402
from bench_serving import add_model_args, apply_quick, model_spec, run_header, shown  # noqa: E402
from bench_serving_client import RequestFailed, parse_prefix_counters  # noqa: E402
from bench_serving_servers import (  # noqa: E402
    P2P_KIND, POOL_KIND, REDIS_KIND, VLLM_KIND, CpuMeter, LaunchSpec, ManagedProcess, ServerError, ServerSettings,
    controller_env, controller_launch, describe, free_port, launch, mooncake_launches, p2p_env, redis_launch,
    redis_password_env, redis_url, remote_server_launch, server_launch, stop_all,
)
from kv_aware_router import KvAwareRouter  # noqa: E402
from make_tiny_model import make_tiny_model  # noqa: E402
from multi_round_qa import QARecord, QARunner, QASizes, next_turn_moves, qa_plan, run_plan, warm_up  # noqa: E402
from netns_machines import Machines, root_missing  # noqa: E402
from round_robin_proxy import ProxyThread  # noqa: E402

from lmcache.experimental.metrics import lmcache_samples  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = "lmcache-bench-multi-instance/1"
KINDS = (VLLM_KIND, PRIVATE_KIND, ROUTED_KIND, ROUTED_P2P_KIND, P2P_KIND, POOL_KIND, "lmcache-remote", MOONCAKE_KIND,
         REDIS_KIND)
DEFAULT_KINDS = (VLLM_KIND, PRIVATE_KIND, ROUTED_KIND, ROUTED_P2P_KIND, POOL_KIND, "lmcache-remote", MOONCAKE_KIND)
# With --link-gbit (issue 42): the kinds whose processes can live on machines of their own (the
# node pool is one machine's by definition; the controller and lm:// server stay loopback-only here).
MACHINE_KINDS = (VLLM_KIND, PRIVATE_KIND, P2P_KIND, MOONCAKE_KIND, REDIS_KIND)
DEFAULT_MACHINE_KINDS = (PRIVATE_KIND, P2P_KIND, MOONCAKE_KIND, REDIS_KIND)
ROUTED_KINDS = (ROUTED_KIND, ROUTED_P2P_KIND)
P2P_KINDS = (ROUTED_P2P_KIND, P2P_KIND)  # kinds whose instances read each other's tiers (a lookup Redis)
# Kinds with one cache store for all instances.
SHARED_KINDS = (POOL_KIND, "lmcache-remote", MOONCAKE_KIND, REDIS_KIND)
# The routed kind's instances: ids as each reports to the controller, in backend order.
ROUTED_INSTANCE = "bench-instance-{}"
FAILURES = (ServerError, RequestFailed, aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError)
# --quick: the test suite's tiny model, 3 users x 2 short rounds, vLLM eager.
QUICK = dict(model_dir=".cache/tiny-model", hidden=128, layers=4, heads=4, kv_heads=2, max_position=4096,
             users=3, rounds=2, system_words=300, context_words=300, question_words=16, answer_words=16,
             max_tokens=8, max_model_len=1024, engine_kv_tokens=1024)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--multi-instance", type=int, default=2, metavar="N", help="instances per kind")
    p.add_argument("--quick", action="store_true", help="tiny model, 3 users x 2 short rounds, eager")
    p.add_argument("--kinds", help=f"comma list of {', '.join(KINDS)} (default: {', '.join(DEFAULT_KINDS)}; "
                                   f"with --link-gbit: {', '.join(DEFAULT_MACHINE_KINDS)})")
    p.add_argument("--link-gbit", type=float, metavar="G",
                   help="each instance on a machine of its own, the shared store on another, links of G Gbit/s "
                        f"(network namespaces; needs root; kinds {', '.join(MACHINE_KINDS)}): bench_multi_machine.py")
    p.add_argument("--model-dir", default=".cache/bench-model")
    add_model_args(p)
    for name, value in QASizes().__dict__.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=value)
    p.add_argument("--max-model-len", type=int, default=3072)
    p.add_argument("--engine-kv-tokens", type=int, default=3072,
                   help="vLLM's own KV space per instance in tokens (rounded up to blocks; at least "
                        "--max-model-len): small, so vLLM alone cannot keep every user's history")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--chunk-size", type=int, default=256, help="LMCache chunk size in tokens")
    p.add_argument("--tier-gb", type=float, default=2.0,
                   help="each private CPU tier's size, and the shared server's")
    p.add_argument("--kv-aware-threshold", type=int, default=512,
                   help=f"{ROUTED_KIND}: route to the holder of the longest prefix when it leaves at most this "
                        "many tokens to compute (production-stack's kv_aware_threshold; see the docstring)")
    p.add_argument("--out-dir", default="bench/results")
    p.add_argument("--startup-timeout", type=float, default=900)
    args = p.parse_args(argv)
    if args.quick:
        apply_quick(args, argv, QUICK)
    return args


def scrape_text(url: str, timeout_s: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return resp.read().decode()


def server_info(metrics_port: int) -> dict[str, float]:
    """Every `INFO` field of the shared server, read from its `--metrics-port` page (counters
    without their `_total`)."""
    found = {}
    for line in scrape_text(f"http://127.0.0.1:{metrics_port}/metrics").splitlines():
        name, _, value = line.partition(" ")
        if name.startswith("lmcache_server:") and not name.endswith("_created"):
            found[name[len("lmcache_server:"):].removesuffix("_total")] = float(value)
    return found


def start_shared(kind: str, settings: ServerSettings, log_dir: Path, running: list[ManagedProcess],
                 placement: Placement, secrets: Secrets) -> tuple[Optional[int], Optional[int], list[LaunchSpec]]:
    """Start the cache store `kind`'s instances share, on the store machine (appended to
    `running`), and wait until it listens: (its lm://, Redis or Mooncake master's port, None for
    the node pool; its metrics port, None for Redis; how its processes were started: the server,
    or Mooncake's master and storage process)."""
    if kind == REDIS_KIND:
        port, spec = start_redis(log_dir / "redis-tier.log", running, placement, secrets.redis_password)
        return port, None, [spec]
    host = placement.store_host
    port = free_port() if kind != POOL_KIND else None
    metrics_port = free_port()
    if kind == MOONCAKE_KIND:
        storage_port = free_port()
        specs = [placement.on_store(s) for s in mooncake_launches(port, storage_port, settings, log_dir,
                                                                  metrics_port, host)]
        for spec, listens_on in zip(specs, (port, storage_port)):
            proc = launch(spec, ROOT)
            running.append(proc)
            proc.wait_listening(listens_on, 60, host)
        return port, metrics_port, specs
    spec = remote_server_launch(kind, port, settings, log_dir / f"server-{kind}.log", metrics_port)
    server = launch(spec, ROOT)
    running.append(server)
    server.wait_listening(metrics_port, 60)
    if kind == POOL_KIND:
        server.wait_socket(settings.pool_socket, 60)
    else:
        server.wait_listening(port, 60)
    return port, metrics_port, [spec]


def start_controller(log_dir: Path, running: list[ManagedProcess]) -> tuple[str, tuple[int, int], LaunchSpec]:
    """Start an `lmcache_controller` (appended to `running`) and wait until it answers: (its HTTP
    base URL, its (pull, reply) ports, how it was started)."""
    http, pull, reply = free_port(), free_port(), free_port()
    spec = controller_launch(http, pull, reply, log_dir / "controller.log")
    proc = launch(spec, ROOT)
    running.append(proc)
    for port in (http, pull, reply):
        proc.wait_listening(port, 60)
    return f"http://127.0.0.1:{http}", (pull, reply), spec


def start_redis(log_path: Path, running: list[ManagedProcess], placement: Placement,
                password: str) -> tuple[int, LaunchSpec]:
    """Start a Redis with `password` on the store machine (appended to `running`): (its port, how)."""
    port = free_port()
    spec = placement.on_store(redis_launch(port, log_path, placement.store_host, password))
    proc = launch(spec, ROOT)
    running.append(proc)
    proc.wait_listening(port, 60, placement.store_host)
    return port, spec


def redis_gauges(host: str, port: int, password: str) -> dict:
    """The Redis tier's `bytes_used` (its `used_memory`, a few MB of its own included) and `entries`."""
    import redis

    client = redis.Redis(host=host, port=port, password=password)
    try:
        return {"bytes_used": float(client.info("memory")["used_memory"]), "entries": float(client.dbsize())}
    finally:
        client.close()


def start_instances(kind: str, settings: ServerSettings, log_dir: Path, remote_port: Optional[int],
                    running: list[ManagedProcess], timeout_s: float, placement: Placement,
                    extra_env: list[dict[str, str]]) -> tuple[list[str], list[ManagedProcess]]:
    """Start one vLLM instance of `kind` per `extra_env` (its own settings: controller, P2P)
    side by side (startup is mostly compiling), instance i on machine i, appended to `running`,
    and wait until each is healthy: (their base URLs, their processes)."""
    urls, instances = [], []
    for i, env in enumerate(extra_env):
        port, host = free_port(), placement.instance_host(i)
        spec = server_launch(kind, settings, port, log_dir / f"{kind}-{i}.log", remote_port, host,
                             placement.store_host)
        spec.env.update(env)
        instances.append(launch(placement.on_instance(i, spec), ROOT))
        running.append(instances[-1])
        urls.append(f"http://{host}:{port}")
    for proc in instances:
        proc.wait_healthy(timeout_s)
    return urls, instances


class MultiBench:
    """One run: kinds one after another, N instances each behind a round-robin proxy."""

    def __init__(self, args: argparse.Namespace, settings: ServerSettings, sizes: QASizes, log_dir: Path,
                 placement: Placement) -> None:
        self.args, self.settings, self.sizes, self.log_dir = args, settings, sizes, log_dir
        self.placement = placement
        self.secrets = Secrets.make(log_dir)
        self.plan = qa_plan(sizes)
        self.clock_zero = time.perf_counter()
        self.records: list[QARecord] = []
        self.summary: dict[str, dict] = {}
        self.processes: dict[str, list[dict]] = {}
        self.errors: dict[str, str] = {}
        self.kind_wall_s: dict[str, float] = {}

    def _start_shared(self, kind: str, running: list[ManagedProcess]) -> tuple[Optional[int], Optional[int]]:
        """The cache store `kind`'s instances share: (its lm://, Redis or Mooncake master's port,
        or None; its metrics port)."""
        if kind not in SHARED_KINDS:
            return None, None
        port, metrics_port, specs = start_shared(kind, self.settings, self.log_dir, running, self.placement,
                                                 self.secrets)
        for spec in specs:
            self.processes.setdefault(kind, []).append({"role": "shared server", **describe(spec)})
        return port, metrics_port

    def _shared_gauges(self, kind: str, port: Optional[int], metrics_port: Optional[int]) -> Optional[dict]:
        """What the shared store held at the end (None: no shared store)."""
        if kind == REDIS_KIND:
            return redis_gauges(self.placement.store_host, port, self.secrets.redis_password)
        if metrics_port is None:
            return None
        return store_gauges(scrape_text(f"http://{self.placement.store_host}:{metrics_port}/metrics"))

    def _instance_env(self, kind: str, controller_ports: Optional[tuple[int, int]],
                      lookup_port: Optional[int]) -> list[dict[str, str]]:
        """Each instance's own settings: its controller id, its peer server's address, Redis's password."""
        envs: list[dict[str, str]] = [{} for _ in range(self.args.multi_instance)]
        for i, env in enumerate(envs):
            if controller_ports is not None:
                env.update(controller_env(ROUTED_INSTANCE.format(i), *controller_ports))
            if lookup_port is not None:
                lookup_url = redis_url(self.placement.store_host, lookup_port, self.secrets.redis_password)
                env.update(p2p_env(lookup_url, f"{self.placement.instance_host(i)}:{free_port()}",
                                   self.secrets.p2p_token_file))
            if kind == REDIS_KIND:
                env.update(redis_password_env(self.secrets.redis_password))
        return envs

    def run_kind(self, kind: str) -> None:
        started = time.monotonic()
        running: list[ManagedProcess] = []
        proxy: Optional[ProxyThread] = None
        router: Optional[KvAwareRouter] = None
        try:
            remote_port, metrics_port = self._start_shared(kind, running)
            controller_url, controller_ports, lookup_port = None, None, None
            if kind in ROUTED_KINDS:
                controller_url, controller_ports, spec = start_controller(self.log_dir, running)
                self.processes.setdefault(kind, []).append({"role": "controller", **describe(spec)})
            if kind in P2P_KINDS:
                lookup_port, spec = start_redis(self.log_dir / "redis-lookup.log", running, self.placement,
                                                self.secrets.redis_password)
                self.processes.setdefault(kind, []).append({"role": "p2p lookup", **describe(spec)})
            urls, instances = start_instances(kind, self.settings, self.log_dir, remote_port, running,
                                              self.args.startup_timeout, self.placement,
                                              self._instance_env(kind, controller_ports, lookup_port))
            for proc in instances:
                self.processes.setdefault(kind, []).append({"role": "instance", **describe(proc.spec),
                                                            "ready_s": proc.ready_s})
            warm = asyncio.run(warm_up(urls, self.args.model_dir, self.sizes, self.clock_zero))
            meter = CpuMeter({p.pid for p in running})
            if controller_url is not None:
                ids = [ROUTED_INSTANCE.format(i) for i in range(len(urls))]
                router = KvAwareRouter(controller_url, ids, self.args.model_dir, self.args.kv_aware_threshold)
            proxy = ProxyThread(urls, router=router)
            base = proxy.start()

            def done(rec: QARecord) -> None:
                print(f"  {kind} round {rec.round + 1} user {rec.user} on {rec.served_by}: "
                      f"{rec.prompt_tokens} tokens, TTFT {rec.ttft_s:.3f} s", file=sys.stderr, flush=True)

            runner = QARunner(kind, base, self.args.model_dir, self.clock_zero, self.sizes.concurrency, done)
            try:
                run_plan(runner, self.plan, self.sizes.max_tokens)
            finally:
                self.records.extend(runner.records)
            counters = []
            for url in urls:
                text = scrape_text(f"{url}/metrics")
                prefix = parse_prefix_counters(text)
                counters.append(instance_counters(lmcache_samples(text), prefix.hits, prefix.queries))
            shared = self._shared_gauges(kind, remote_port, metrics_port)
            self.summary[kind] = {**summarize_kind(runner.records, runner.wall_s, counters, shared),
                                  "warmup_ttft_s": warm, "cpu_while_measured": meter.read()}
            if router is not None:
                self.summary[kind]["routing"] = {"kv_aware_threshold": router.threshold, **asdict(router.stats)}
        except FAILURES as err:
            self.errors[kind] = f"{type(err).__name__}: {err}"
            print(f"bench_multi_instance: {kind} failed: {str(err)[:3000]}", file=sys.stderr)
        finally:
            if proxy is not None:
                proxy.stop()
            stop_all(running)
            self.kind_wall_s[kind] = time.monotonic() - started


def print_table(summary: dict, tgt: list) -> None:
    rounds = sorted({int(k) for s in summary.values() for k in s["rounds"]})
    head = " ".join(f"{'r' + str(r + 1) + ' mean/p90':>14}" for r in rounds)
    print(f"{'kind':20} {'mean':>7} {'p90':>7} {head} {'tok/s':>7} {'vLLM hit':>9} {'LMC hit':>9} {'MiB':>7}")
    for kind, s in summary.items():
        per = " ".join(f"{s['rounds'][str(r)]['ttft_mean_s']:>6.3f}/{s['rounds'][str(r)]['ttft_p90_s']:<7.3f}"
                       for r in rounds)
        print(f"{KIND_LABELS.get(kind, kind):20} {s['ttft_mean_s']:>7.3f} {s['ttft_p90_s']:>7.3f} {per} "
              f"{s['throughput_tok_s']:>7.0f} {s['vllm_prefix_hit_tokens']:>9.0f} {s['lmcache_hit_tokens']:>9.0f} "
              f"{s['memory']['total_bytes'] / 2**20:>7.1f}")
        cpu = s["cpu_while_measured"]
        print(f"{'':20} other programs used {100 * cpu['foreign_share']:.0f}% of the machine's CPU while it ran; "
              f"warm-up TTFT per instance " + ", ".join(f"{t:.2f}" for t in s["warmup_ttft_s"]) + " s")
    for t in tgt:
        measured = "not measured" if t["measured"] is None else f"{t['measured']:.3f}"
        verdict = {True: "MET", False: "MISSED", None: "n/a"}[t["met"]]
        print(f"target [{verdict}] {t['target']}: {measured} (want {t['rule']})")


def run_kinds(args: argparse.Namespace, kinds: list[str], sizes: QASizes, log_dir: Path, blocks: int,
              placement: Placement) -> tuple[MultiBench, ServerSettings, float, tuple[float, float, float]]:
    """Every kind, one after another: (the bench with their results, the servers' settings, the
    start time, the load average before)."""
    machines = placement.describe()
    where = f" on machines, links of {machines['link_gbit']:g} Gbit/s" if machines else ""
    with tempfile.TemporaryDirectory(prefix="lmcache-bench-pool-") as sock_dir:
        settings = ServerSettings(
            model=args.model_dir, max_model_len=args.max_model_len, block_size=args.block_size,
            num_kv_blocks=blocks, chunk_size=args.chunk_size, cpu_tier_gb=args.tier_gb, disk_tier_gb=args.tier_gb,
            remote_tier_gb=args.tier_gb, disk_dir=str(log_dir / "unused-disk"),
            extra_vllm_args=("--enforce-eager",) if args.quick else (),
            pool_socket=str(Path(sock_dir) / "pool.sock"),
        )
        load_before = os.getloadavg()
        started = time.time()
        bench = MultiBench(args, settings, sizes, log_dir, placement)
        for kind in kinds:
            print(f"bench_multi_instance: {kind} x {args.multi_instance}{where}", file=sys.stderr, flush=True)
            bench.run_kind(kind)
    return bench, settings, started, load_before


def chosen_kinds(args: argparse.Namespace) -> list[str]:
    """The kinds `--kinds` names, in `KINDS` order (ValueError: none, or one that cannot run on machines)."""
    allowed = MACHINE_KINDS if args.link_gbit is not None else KINDS
    default = DEFAULT_MACHINE_KINDS if args.link_gbit is not None else DEFAULT_KINDS
    names = {x.strip() for x in args.kinds.split(",") if x.strip()} if args.kinds else set(default)
    kinds = [k for k in KINDS if k in names]
    if not kinds or names - set(allowed):
        where = " with --link-gbit" if args.link_gbit is not None else ""
        raise ValueError(f"--kinds {args.kinds!r}: expected a comma list of {', '.join(allowed)}{where}")
    if args.link_gbit is not None and args.link_gbit <= 0:
        raise ValueError(f"--link-gbit must be positive, got {args.link_gbit}")
    return kinds


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    os.chdir(ROOT)
    spec = model_spec(args)
    sizes = QASizes(**{k: getattr(args, k) for k in QASizes().__dict__})
    try:
        kinds = chosen_kinds(args)
        spec.validate()
        sizes.validate()
        if args.multi_instance < 1:
            raise ValueError(f"--multi-instance must be positive, got {args.multi_instance}")
        # The template adds a few tokens per message; a word is about one token.
        longest = sizes.longest_prompt_words() + 4 * (2 + 2 * sizes.rounds) + sizes.max_tokens
        if longest > args.max_model_len:
            raise ValueError(f"the last round needs about {longest} tokens > --max-model-len {args.max_model_len}")
    except ValueError as err:
        raise SystemExit(f"bench_multi_instance: {err}")
    if args.link_gbit is not None and (why := root_missing("--link-gbit")):
        raise SystemExit(f"bench_multi_instance: {why}")
    if not next_turn_moves(sizes.users, args.multi_instance):
        print(f"bench_multi_instance: with {sizes.users} users on {args.multi_instance} instances a user's next "
              "turn lands on the same instance", file=sys.stderr)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out_dir = ROOT / args.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    log_dir = ROOT / ".cache" / "bench-logs" / f"multi-{stamp}-{os.getpid()}"
    print(f"bench_multi_instance: building the model in {args.model_dir} ({spec})", file=sys.stderr)
    weights = make_tiny_model(ROOT / args.model_dir, spec)
    blocks = math.ceil(max(args.engine_kv_tokens, args.max_model_len) / args.block_size)
    # Removed in `finally`, and at exit whatever happens (each kind stops its servers on them first).
    machines = Machines(machine_plan(args.multi_instance, args.link_gbit)) if args.link_gbit is not None else None
    try:
        bench, settings, started, load_before = run_kinds(args, kinds, sizes, log_dir, blocks, Placement(machines))
    finally:
        if machines is not None:
            machines.close()
    tgt = targets(bench.summary)
    result = {
        **run_header(SCHEMA, started, argv, load_before, args.model_dir, spec, weights),
        "instances": args.multi_instance,
        "settings": {**asdict(replace(settings, pool_socket="<temporary>")), "engine_kv_tokens": blocks * args.block_size,
                     "machines": bench.placement.describe()},
        "sizes": asdict(sizes),
        "kinds": kinds,
        "processes": bench.processes,
        "kind_wall_s": bench.kind_wall_s,
        "errors": bench.errors,
        "summary": bench.summary,
        "targets": tgt,
        "requests": [asdict(r) for r in bench.records],
    }
    json_path = out_dir / f"multi-instance-{stamp}.json"
    png_path = out_dir / f"multi-instance-{stamp}.png"
    json_path.write_text(json.dumps(result, indent=1) + "\n")
    if bench.summary:
        plot(bench.summary, plot_title(result), png_path)
    print_table(bench.summary, tgt)
    print(f"bench_multi_instance: wrote {shown(json_path)} and {shown(png_path)} in {result['duration_s']:.0f} s "
          f"(logs in {shown(log_dir)})")
    return 1 if bench.errors else 0
