"""Two simulated machines for the peer-to-peer tests (`test_p2p.py`, `test_p2p_e2e.py`): Linux
network namespaces joined by a veth pair, 198.18.0.1 (machine A) and 198.18.0.2 (machine B), from
the benchmarking range and used only inside the namespaces made here, and the lookup Redis in
machine A on its address, with a password (as Redis beyond loopback must have). Nothing leaves
the machine; the namespaces (and their veth ends) are removed at the end whatever happened. Not
root: the tests that use them are skipped with the reason.
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest
from redis_fixture import ensure_redis_installed, free_port, stop_process

A_ADDRESS, B_ADDRESS = "198.18.0.1", "198.18.0.2"
REDIS_PASSWORD = "redis-pw"


def in_netns(ns: str) -> list:
    """The command prefix that runs a command inside network namespace `ns` ("": none)."""
    return ["ip", "netns", "exec", ns] if ns else []


@dataclass(frozen=True)
class Machines:
    a: str  # machine A's namespace (it runs the lookup Redis)
    b: str
    redis_port: int
    redis: subprocess.Popen  # run inside namespace a

    @property
    def lookup_url(self) -> str:
        """The `lookup_url` both machines reach Redis at."""
        return f"redis://:{REDIS_PASSWORD}@{A_ADDRESS}:{self.redis_port}"

    def redis_cli(self, *args: str) -> str:
        """`redis-cli` against the lookup Redis, run inside machine A (the only place it is reachable)."""
        cmd = [*in_netns(self.a), "redis-cli", "-h", A_ADDRESS, "-p", str(self.redis_port),
               "-a", REDIS_PASSWORD, "--no-auth-warning", *args]
        return subprocess.run(cmd, capture_output=True, text=True).stdout


@pytest.fixture
def two_machines(tmp_path: Path) -> Iterator[Machines]:
    if os.geteuid() != 0:
        pytest.skip("making network namespaces (ip netns) needs root")
    redis_server = ensure_redis_installed()
    tag = f"lmcp{os.getpid() % 100000}"
    names = (f"{tag}a", f"{tag}b")
    ends = (f"{tag}x", f"{tag}y")

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True)

    redis = None
    try:
        for ns in names:
            ip("netns", "add", ns)
        ip("link", "add", ends[0], "type", "veth", "peer", "name", ends[1])
        for ns, end, address in zip(names, ends, (A_ADDRESS, B_ADDRESS)):
            ip("link", "set", end, "netns", ns)
            ip("-n", ns, "addr", "add", f"{address}/30", "dev", end)
            ip("-n", ns, "link", "set", end, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        port = free_port()
        redis = subprocess.Popen(
            [*in_netns(names[0]), redis_server, "--bind", A_ADDRESS, "--port", str(port),
             "--requirepass", REDIS_PASSWORD, "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        machines = Machines(names[0], names[1], port, redis)
        deadline = time.monotonic() + 10
        while machines.redis_cli("ping").strip() != "PONG":
            if redis.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the lookup Redis in {names[0]} did not answer (exit code {redis.poll()})")
            time.sleep(0.02)
        yield machines
    finally:
        if redis is not None:
            stop_process(redis)
        for ns in names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)  # takes its veth end along
