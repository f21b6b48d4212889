"""Where the multi-instance benchmark's processes run: all on loopback, or on simulated machines.

    .venv/bin/python scripts/bench/bench_serving.py --multi-instance 3 --link-gbit 10 \\
        --kinds lmcache-cpu,lmcache-p2p,lmcache-mooncake,lmcache-redis     # as root (issue 42)

With `--link-gbit G` every vLLM instance runs on a "machine" of its own and the shared store on
another (`scripts/netns_machines.py`: network namespaces on one switch, each link shaped to G
Gbit/s both ways by `tc tbf`), while the proxy and the client stay in the root namespace:

    root namespace (proxy, client; 198.18.0.254, unshaped) --- switch --- store (198.18.0.1)
                                                                  |------ m0 (198.18.0.2): instance 0
                                                                  |------ m1 (198.18.0.3): instance 1 ...

The store machine runs what a kind shares: the Redis of `lmcache-redis`, Mooncake's master and
storage process, or the lookup Redis of the peer-to-peer kinds. Servers bind to their machine's
address, not loopback, so the Redis has a password and the peer servers a token (`Secrets`);
neither is written to the results (`describe` masks them). Without `--link-gbit` everything runs
here on 127.0.0.1 (`Placement()`), as before, with the same password and token.
"""

from __future__ import annotations

import secrets
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: netns_machines

from bench_serving_servers import LaunchSpec  # noqa: E402
from netns_machines import Machines, NetPlan  # noqa: E402

STORE = "store"


def machine_names(instances: int) -> list[str]:
    """The store machine first (198.18.0.1), then one machine per instance."""
    return [STORE, *(f"m{i}" for i in range(instances))]


def machine_plan(instances: int, gbit: float) -> NetPlan:
    return NetPlan.make("lmmi", machine_names(instances), gbit=gbit, root_link=True)


class Placement:
    """Instance i on machine `m{i}`, the shared store on `store`; without machines, all here on 127.0.0.1."""

    def __init__(self, machines: Optional[Machines] = None) -> None:
        self.machines = machines

    def _host(self, machine: str) -> str:
        return self.machines.address(machine) if self.machines else "127.0.0.1"

    def _on(self, machine: str, spec: LaunchSpec) -> LaunchSpec:
        return replace(spec, argv=self.machines.argv(machine, spec.argv)) if self.machines else spec

    @property
    def store_host(self) -> str:
        return self._host(STORE)

    def instance_host(self, i: int) -> str:
        return self._host(f"m{i}")

    def on_store(self, spec: LaunchSpec) -> LaunchSpec:
        """`spec` run on the store machine."""
        return self._on(STORE, spec)

    def on_instance(self, i: int, spec: LaunchSpec) -> LaunchSpec:
        return self._on(f"m{i}", spec)

    def describe(self) -> Optional[dict]:
        """The machines for the results file (None: one machine, loopback)."""
        return self.machines.plan.describe() if self.machines else None


@dataclass(frozen=True)
class Secrets:
    """One run's Redis password and peer-server token (in a file only the owner reads)."""

    redis_password: str
    p2p_token_file: str

    @classmethod
    def make(cls, directory: Path) -> "Secrets":
        directory.mkdir(parents=True, exist_ok=True)
        token = directory / "p2p-token"
        token.touch(mode=0o600)
        token.write_text(secrets.token_urlsafe(24))
        return cls(secrets.token_urlsafe(16), str(token))
