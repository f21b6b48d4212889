"""Two simulated machines for the peer-to-peer tests (`test_p2p.py`, `test_p2p_e2e.py`): Linux
network namespaces on one switch (`scripts/netns_machines.py`), 198.18.0.1 (machine A) and
198.18.0.2 (machine B), from the benchmarking range and used only inside the namespaces made here,
and the lookup Redis in machine A on its address, with a password (as Redis beyond loopback must
have). Nothing leaves the machine; the namespaces (and their veth ends) are removed at the end
whatever happened. Not root: the tests that use them are skipped with the reason.
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest
from redis_fixture import ensure_redis_installed, free_port, stop_process

from netns_machines import Machines as NetMachines
from netns_machines import NetPlan, in_netns, root_missing

__all__ = ["A_ADDRESS", "B_ADDRESS", "Machines", "in_netns", "two_machines"]

A_ADDRESS, B_ADDRESS = "198.18.0.1", "198.18.0.2"
REDIS_PASSWORD = "redis-pw"


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
    why = root_missing("this test")
    if why:
        pytest.skip(why)
    redis_server = ensure_redis_installed()
    with NetMachines(NetPlan.make("lmcp", ["a", "b"])) as made:
        assert (made.address("a"), made.address("b")) == (A_ADDRESS, B_ADDRESS)
        redis = None
        try:
            port = free_port()
            redis = subprocess.Popen(
                made.argv("a", [redis_server, "--bind", A_ADDRESS, "--port", str(port), "--requirepass",
                                REDIS_PASSWORD, "--save", "", "--appendonly", "no", "--dir", str(tmp_path)]),
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            machines = Machines(made.namespace("a"), made.namespace("b"), port, redis)
            deadline = time.monotonic() + 10
            while machines.redis_cli("ping").strip() != "PONG":
                if redis.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the lookup Redis in {machines.a} did not answer (exit code {redis.poll()})")
                time.sleep(0.02)
            yield machines
        finally:
            if redis is not None:
                stop_process(redis)
