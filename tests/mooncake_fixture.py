"""A real Mooncake Store for tests: `mooncake_master` on a free loopback port (restartable on the
same port, killable with SIGKILL) and `mooncake_client` as a storage process that only lends a
segment, so values outlive the engines that stored them.

Their command lines are `scripts/mooncake_store.py`'s (the benchmarks start the same store).
Both come with the `mooncake-transfer-engine-non-cuda` wheel (`make setup` installs it); its
`store.so` links Debian's `libibverbs1`, installed here with apt when missing, as
`redis_fixture` does for `redis-server`.
"""

from __future__ import annotations

import ctypes.util
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pytest

import mooncake_store
from redis_fixture import ListeningProcess, apt_install, free_port


def ensure_mooncake() -> None:
    """Mooncake's client importable: libibverbs1 installed with apt if missing, the wheel required."""
    if ctypes.util.find_library("ibverbs") is None:
        apt_install("libibverbs1", why="Mooncake's store.so links libibverbs.so.1, which is missing")
    why = mooncake_store.missing()
    if why is not None:
        raise RuntimeError(why)


@dataclass
class MooncakeMaster(ListeningProcess):
    """One `mooncake_master` on 127.0.0.1 (its metrics port on a free loopback port too); `kill`
    loses every key's metadata, like a crash."""

    what = "mooncake_master"
    log_path: Path
    port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    proc: Optional[subprocess.Popen] = None

    def argv(self) -> list[str]:
        return mooncake_store.master_argv(self.port, self.metrics_port)

    def gauge(self, name: str) -> float:
        """One sample of the master's /metrics: `master_total_capacity_bytes` (what mounted segments
        lend the pool: 0 after a restart until the storage process re-mounts on its own),
        `master_key_count`, ...; 0 while the metrics do not answer yet."""
        try:
            return mooncake_store.master_gauge(self.metrics_port, name)
        except OSError:
            return 0.0

    def start(self) -> "MooncakeMaster":
        ensure_mooncake()
        return super().start()

    @property
    def url(self) -> str:
        return mooncake_store.url(self.port)


@dataclass
class MooncakeStorage(ListeningProcess):
    """`mooncake_client`: a process that only lends `segment` to the master's pool; `kill` takes
    the segment and every value in it out of the pool, unannounced."""

    what = "mooncake_client"
    master: MooncakeMaster
    log_path: Path
    segment: str = "128MB"
    port: int = field(default_factory=free_port)
    proc: Optional[subprocess.Popen] = None

    def argv(self) -> list[str]:
        return mooncake_store.storage_argv(self.master.port, self.port, self.segment)


@pytest.fixture
def mooncake_master(tmp_path: Path):
    master = MooncakeMaster(tmp_path / "mooncake_master.log").start()
    yield master
    master.stop()
