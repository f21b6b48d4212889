"""Real servers for remote-tier tests: `redis-server` (single and a three-master cluster) and ours.

`redis-server` comes from Debian's package; when it is missing, `ensure_redis_installed()`
installs it with apt-get (the test machines run as root). Every server binds 127.0.0.1 on a
free port and keeps nothing on disk beyond its temporary directory.
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
from typing import Optional, Sequence

import pytest

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


def ensure_redis_installed() -> str:
    """Path of `redis-server`, installing Debian's package when it is missing."""
    found = shutil.which("redis-server")
    if found and shutil.which("redis-cli"):
        return found
    if os.geteuid() != 0:
        pytest.skip("redis-server is not installed and installing it needs root")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env, capture_output=True)
    subprocess.run(
        ["apt-get", "install", "-y", "-qq", "redis-server"], check=True, env=env, capture_output=True
    )
    found = shutil.which("redis-server")
    if not found:
        raise RuntimeError("apt-get installed redis-server but it is not on PATH")
    return found


def _wait_port(port: int, proc: subprocess.Popen, what: str, timeout: float = 20.0) -> None:
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


def _stop(proc: subprocess.Popen) -> None:
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
            _wait_port(self.port, self.proc, f"redis-server on port {self.port}")
        except RuntimeError as err:
            log = self.workdir / "redis.log"
            tail = log.read_text()[-2000:] if log.exists() else "(no log)"
            raise RuntimeError(f"{err}; its log ends with:\n{tail}") from None
        return self

    def stop(self) -> None:
        if self.proc is not None:
            _stop(self.proc)

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


@dataclass
class LMServerProcess:
    """Our `lm://` server as a separate process (`python -m lmcache.server`), restartable."""

    extra_args: Sequence[str] = ()
    port: int = field(default_factory=free_port)
    log_path: Optional[Path] = None
    proc: Optional[subprocess.Popen] = None

    def start(self) -> "LMServerProcess":
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        log = open(self.log_path, "ab") if self.log_path is not None else subprocess.DEVNULL
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "lmcache.server", "127.0.0.1", str(self.port), *self.extra_args],
            stdout=log,
            stderr=log,
            env=env,
        )
        _wait_port(self.port, self.proc, f"lm:// server on port {self.port}")
        return self

    def kill(self) -> None:
        """SIGKILL: the server dies without closing anything, like a crash."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None:
            _stop(self.proc)

    @property
    def url(self) -> str:
        return f"lm://127.0.0.1:{self.port}"


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
