"""Two engines in two processes share one remote store: the second hits what the first stored.

Runs for our lm:// server (as its own process), a real Redis, a three-master Redis Cluster and
Mooncake Store (a master plus a storage process lending the segment; the engines are pure
clients, so what the first stored outlives it); bit-exact with the naive serde, within
cachegen's error bound with cachegen.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest
from mooncake_fixture import MooncakeMaster, MooncakeStorage
from redis_fixture import LMServerProcess, RedisServer, redis_cluster  # noqa: F401

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


# What the engine processes add to a job: Mooncake clients that lend no memory, with a receive
# buffer of a test's size (other URLs ignore the mooncake_* fields).
POOL_CLIENT = {"mooncake_global_segment_size": 0, "mooncake_local_buffer_size": 16 << 20}


def _run(job: dict) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{TESTS}", "OMP_NUM_THREADS": "2"}
    proc = subprocess.run(
        [sys.executable, str(TESTS / "remote_engine_job.py"), json.dumps({"config": POOL_CLIENT, **job})],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(params=["lm", "redis", "redis-cluster", "mooncake"])
def url(request, tmp_path) -> Iterator[str]:
    if request.param == "mooncake":
        master = MooncakeMaster(tmp_path / "master.log").start()
        storage = MooncakeStorage(master, tmp_path / "storage.log").start()
        yield master.url
        storage.stop()
        master.stop()
        return
    if request.param == "lm":
        server = LMServerProcess(log_path=tmp_path / "lm.log").start()
    elif request.param == "redis":
        server = RedisServer(tmp_path / "redis").start()
    else:
        cluster = request.getfixturevalue("redis_cluster")
        cluster.flush_all()
        yield cluster.url
        return
    yield server.url
    server.stop()


@pytest.mark.parametrize("serde", ["naive", "cachegen"])
def test_second_process_hits_what_the_first_stored(url: str, serde: str) -> None:
    stored = _run({"role": "store", "url": url, "serde": serde})
    assert stored["puts_acknowledged"] == 4  # three full chunks and the partial one
    assert stored["puts_lost"] == 0 and stored["puts_refused"] == 0
    got = _run({"role": "retrieve", "url": url, "serde": serde})
    assert got["lookup"] == 56 and got["retrieved"] == 56 and got["remote_hits"] == 4
    if serde == "naive":
        assert got["exact"]
    else:
        # 8-bit keys / 6-bit values per channel over a chunk of N(0, 1) data: far below 10%.
        assert not got["exact"] and got["max_abs_err"] < 0.1 * got["max_abs_value"]


def test_other_serde_does_not_hit(tmp_path) -> None:
    server = LMServerProcess(log_path=tmp_path / "lm.log").start()
    try:
        _run({"role": "store", "url": server.url, "serde": "cachegen"})
        got = _run({"role": "retrieve", "url": server.url, "serde": "naive"})
        # Lookup sees the keys, but the chunk is rejected when read: nothing lossy is loaded.
        assert got["retrieved"] == 0 and got["remote_hits"] == 0
    finally:
        server.stop()
