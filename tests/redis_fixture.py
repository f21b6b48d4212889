"""Real servers for remote-tier tests: `redis-server` (single, a three-master cluster, a master
with a replica watched by three `redis-sentinel`s) and ours.

`redis-server` and `redis-sentinel` come from Debian's packages; when one is missing,
`ensure_debian_binary()` installs it with apt-get (the test machines run as root), so a fresh
machine's `make test` gets them. Every server binds 127.0.0.1 on a free port and keeps nothing
on disk beyond its temporary directory.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import pytest
import redis

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A TCP port nobody listens on right now (loopback)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_cluster_port() -> int:
    """A free port whose cluster-bus port (port + 10000) is valid and free as well."""
    for _ in range(200):
        port = free_port()
        if port + 10000 > 65535:
            continue
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair (port, port + 10000) for a cluster node")


def apt_install(package: str, why: str) -> None:
    """Install Debian's `package` (the test machines run as root; elsewhere the test skips)."""
    if os.geteuid() != 0:
        pytest.skip(f"{why} and installing {package} needs root")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env, capture_output=True)
    subprocess.run(["apt-get", "install", "-y", "-qq", package], check=True, env=env, capture_output=True)


def ensure_debian_binary(binary: str, package: str, also: Sequence[str] = ()) -> str:
    """Path of `binary` (and `also` on PATH), installing Debian's `package` when missing."""
    found = shutil.which(binary)
    if found and all(shutil.which(b) for b in also):
        return found
    apt_install(package, why=f"{binary} is not installed")
    found = shutil.which(binary)
    if not found:
        raise RuntimeError(f"apt-get installed {package} but {binary} is not on PATH")
    return found


def ensure_redis_installed() -> str:
    """Path of `redis-server`, installing Debian's package when it is missing."""
    return ensure_debian_binary("redis-server", "redis-server", also=("redis-cli",))


def wait_port(port: int, proc: subprocess.Popen, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} before listening")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on port {port} within {timeout} s")


def stop_process(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@dataclass
class RedisServer:
    """One `redis-server` process on 127.0.0.1."""

    workdir: Path
    extra_args: Sequence[str] = ()
    port: int = field(default_factory=free_port)
    proc: Optional[subprocess.Popen] = None

    def start(self) -> "RedisServer":
        binary = ensure_redis_installed()
        self.workdir.mkdir(parents=True, exist_ok=True)
        args = [
            binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.workdir),
            "--logfile", str(self.workdir / "redis.log"),
            *self.extra_args,
        ]  # fmt: skip
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_port(self.port, self.proc, f"redis-server on port {self.port}")
        except RuntimeError as err:
            log = self.workdir / "redis.log"
            tail = log.read_text()[-2000:] if log.exists() else "(no log)"
            raise RuntimeError(f"{err}; its log ends with:\n{tail}") from None
        return self

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"


@dataclass
class RedisCluster:
    """Three masters on 127.0.0.1 joined with `redis-cli --cluster create`, no replicas."""

    workdir: Path
    nodes: list[RedisServer] = field(default_factory=list)

    def start(self) -> "RedisCluster":
        ensure_redis_installed()
        for i in range(3):
            node_dir = self.workdir / f"node{i}"
            self.nodes.append(
                RedisServer(
                    node_dir,
                    port=free_cluster_port(),
                    extra_args=(
                        "--cluster-enabled", "yes",
                        "--cluster-config-file", str(node_dir / "nodes.conf"),
                        "--cluster-node-timeout", "2000",
                    ),
                ).start()
            )  # fmt: skip
        addresses = [f"127.0.0.1:{n.port}" for n in self.nodes]
        subprocess.run(
            ["redis-cli", "--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=60,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            states = [
                subprocess.run(
                    ["redis-cli", "-p", str(n.port), "cluster", "info"], capture_output=True, text=True
                ).stdout
                for n in self.nodes
            ]
            if all("cluster_state:ok" in s for s in states):
                return self
            time.sleep(0.1)
        raise RuntimeError("redis cluster did not reach cluster_state:ok within 30 s")

    def flush_all(self) -> None:
        """Empty every master (the cluster fixture is shared by a module's tests)."""
        for node in self.nodes:
            subprocess.run(["redis-cli", "-p", str(node.port), "flushall"], check=True, capture_output=True)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    @property
    def url(self) -> str:
        return "redis-cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)


SENTINEL_SERVICE = "lmcache-test"


def _wait_until(cond: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if cond():
                return
        except redis.RedisError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")


@dataclass
class RedisSentinelSet:
    """A master and one replica (`redis-server`) watched by three `redis-sentinel` processes
    (quorum 2), tuned to fail over within seconds: a master is down after 500 ms."""

    workdir: Path
    master: Optional[RedisServer] = None
    replica: Optional[RedisServer] = None
    sentinel_ports: list[int] = field(default_factory=list)
    sentinels: list[subprocess.Popen] = field(default_factory=list)

    def start(self) -> "RedisSentinelSet":
        binary = ensure_debian_binary("redis-sentinel", "redis-sentinel")
        self.master = RedisServer(self.workdir / "master").start()
        self.replica = RedisServer(
            self.workdir / "replica", extra_args=("--replicaof", "127.0.0.1", str(self.master.port))
        ).start()
        replica = redis.Redis(port=self.replica.port)
        _wait_until(lambda: replica.info("replication")["master_link_status"] == "up", "the replica to sync")
        # Started after the replica synced, so the Sentinels' first INFO of the master lists it.
        for i in range(3):
            port = free_port()
            conf = self.workdir / f"sentinel{i}.conf"
            conf.write_text(
                f"port {port}\nbind 127.0.0.1\ndaemonize no\ndir {self.workdir}\n"
                f"logfile {self.workdir / f'sentinel{i}.log'}\n"
                f"sentinel monitor {SENTINEL_SERVICE} 127.0.0.1 {self.master.port} 2\n"
                f"sentinel down-after-milliseconds {SENTINEL_SERVICE} 500\n"
                f"sentinel failover-timeout {SENTINEL_SERVICE} 3000\n"
            )
            proc = subprocess.Popen([binary, str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            self.sentinels.append(proc)
            self.sentinel_ports.append(port)
            wait_port(port, proc, f"redis-sentinel on port {port}")

        def ready() -> bool:
            states = [redis.Redis(port=p).sentinel_master(SENTINEL_SERVICE) for p in self.sentinel_ports]
            return all(s["num-other-sentinels"] == 2 and s["num-slaves"] == 1 for s in states)

        _wait_until(ready, "the Sentinels to see each other and the replica")
        return self

    def master_port(self) -> int:
        """The master's port as the first Sentinel reports it."""
        _, port = redis.Redis(port=self.sentinel_ports[0]).sentinel_get_master_addr_by_name(SENTINEL_SERVICE)
        return int(port)

    def kill_master(self) -> None:
        """SIGKILL the master: a crash, nothing closed or handed over."""
        assert self.master is not None and self.master.proc is not None
        self.master.proc.kill()
        self.master.proc.wait()

    def wait_for_failover(self, timeout: float = 30.0) -> None:
        """Return once every Sentinel names the replica as master and the replica agrees."""
        assert self.replica is not None
        replica_port = self.replica.port

        def promoted() -> bool:
            return all(
                int(redis.Redis(port=p).sentinel_get_master_addr_by_name(SENTINEL_SERVICE)[1]) == replica_port
                for p in self.sentinel_ports
            ) and redis.Redis(port=replica_port).info("replication")["role"] == "master"

        _wait_until(promoted, "the Sentinels to promote the replica", timeout)

    def url(self, with_service: bool = True) -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        return f"redis-sentinel://{hosts}" + (f"/{SENTINEL_SERVICE}" if with_service else "")

    def stop(self) -> None:
        for proc in self.sentinels:
            stop_process(proc)
        for server in (self.replica, self.master):
            if server is not None:
                server.stop()


class ListeningProcess:
    """A server process for tests on a loopback port: started with its output in `log_path`,
    ready once the port accepts, killed like a crash or stopped."""

    what = "server"
    port: int
    log_path: Optional[Path]
    proc: Optional[subprocess.Popen]

    def argv(self) -> list[str]:
        raise NotImplementedError

    def env(self) -> Optional[dict[str, str]]:
        return None  # the test's own

    def start(self):
        log = open(self.log_path, "ab") if self.log_path is not None else subprocess.DEVNULL
        self.proc = subprocess.Popen(self.argv(), stdout=log, stderr=log, env=self.env())
        wait_port(self.port, self.proc, f"{self.what} on port {self.port}")
        return self

    def kill(self) -> None:
        """SIGKILL: the process dies without closing anything, like a crash."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)


@dataclass
class LMServerProcess(ListeningProcess):
    """Our `lm://` server as a separate process (`python -m lmcache.server`), restartable."""

    what = "lm:// server"

    extra_args: Sequence[str] = ()
    port: int = field(default_factory=free_port)
    log_path: Optional[Path] = None
    proc: Optional[subprocess.Popen] = None
    # Also serve the node pool on this unix socket (`pool_url`).
    unix_socket: Optional[Path] = None

    def argv(self) -> list[str]:
        pool = () if self.unix_socket is None else ("--unix-socket", str(self.unix_socket))
        return [sys.executable, "-m", "lmcache.server", "127.0.0.1", str(self.port), *pool, *self.extra_args]

    def env(self) -> dict[str, str]:
        return {**os.environ, "PYTHONPATH": str(ROOT)}

    @property
    def url(self) -> str:
        return f"lm://127.0.0.1:{self.port}"

    @property
    def pool_url(self) -> str:
        assert self.unix_socket is not None
        return f"lm+shm://{self.unix_socket}"

    def info(self) -> dict:
        """The server's `INFO` (entries, leases, reservations, ...), asked over TCP."""
        from lmcache.experimental.remote.lm_connector import LMServerConnector

        tcp = LMServerConnector("127.0.0.1", self.port)
        try:
            return tcp.info()
        finally:
            tcp.close()


@dataclass
class LMCacheCommandServer(LMServerProcess):
    """The same server started as upstream's docs start theirs: `lmcache server --port PORT`
    (`python -m lmcache.cli`), its node pool's socket under `runtime_dir` (`LMCACHE_RUNTIME_DIR`)."""

    runtime_dir: Optional[Path] = None

    what = "lmcache server"

    def argv(self) -> list[str]:
        return [sys.executable, "-m", "lmcache.cli", "server", "--port", str(self.port), *self.extra_args]

    def env(self) -> dict[str, str]:
        env = super().env()
        if self.runtime_dir is not None:
            env["LMCACHE_RUNTIME_DIR"] = str(self.runtime_dir)
        return env


@pytest.fixture
def pool(tmp_path: Path):
    """An `lm://` server with a 1 MiB node pool on a unix socket."""
    server = LMServerProcess(
        ["--max-size-gb", str(1 / 1024)], log_path=tmp_path / "server.log", unix_socket=tmp_path / "pool.sock"
    ).start()
    yield server
    server.stop()


@pytest.fixture
def redis_server(tmp_path: Path):
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory):
    cluster = RedisCluster(tmp_path_factory.mktemp("redis-cluster")).start()
    yield cluster
    cluster.stop()


@pytest.fixture
def redis_sentinels(tmp_path: Path):
    sentinels = RedisSentinelSet(tmp_path / "sentinel").start()
    yield sentinels
    sentinels.stop()


@pytest.fixture
def lm_server_process(tmp_path: Path):
    server = LMServerProcess(log_path=tmp_path / "lm_server.log").start()
    yield server
    server.stop()


@pytest.fixture
def lmcache_log(caplog: pytest.LogCaptureFixture):
    """caplog that also sees lmcache's loggers (they do not propagate to the root logger)."""
    top = logging.getLogger("lmcache")
    top.addHandler(caplog.handler)
    caplog.set_level(logging.DEBUG, logger="lmcache")
    yield caplog
    top.removeHandler(caplog.handler)
