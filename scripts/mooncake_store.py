"""A Mooncake Store on this machine, as the tests and benchmarks start one: `mooncake_master` on a
loopback port and `mooncake_client` as a storage process that only lends the pool a segment, so
values outlive the clients that stored them (a vLLM instance then joins as a pure client).

Only the command lines and the check that the client imports live here; starting, waiting and
stopping stay with each caller's own process helper (`tests/mooncake_fixture.py`,
`scripts/bench/bench_remote.py`, `scripts/bench/bench_serving_servers.py`). Both binaries come
with the `mooncake-transfer-engine-non-cuda` wheel (`make setup`), beside the venv's python.
"""

from __future__ import annotations

import ctypes.util
import socket
import sys
import urllib.request
from pathlib import Path
from typing import Optional

BIN = Path(sys.executable).parent


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def missing() -> Optional[str]:
    """Why Mooncake's client cannot run here (None: it can): Debian's libibverbs1, which its
    `store.so` links, or the wheel itself."""
    if ctypes.util.find_library("ibverbs") is None:
        return "Mooncake's store.so links libibverbs.so.1, which is missing (apt-get install libibverbs1)"
    try:
        import mooncake.store  # noqa: F401
    except ImportError as err:
        return f"Mooncake's client does not import ({err}): run `make setup`"
    if not (BIN / "mooncake_master").exists():
        return f"no mooncake_master beside {sys.executable}: run `make setup`"
    return None


def master_argv(port: int, metrics_port: Optional[int] = None, host: str = "127.0.0.1") -> list[str]:
    """`mooncake_master` on `host`:`port` (loopback by default), its metrics there too (default
    port: a free one)."""
    return [str(BIN / "mooncake_master"), f"--rpc_port={port}", f"--rpc_address={host}",
            f"--metrics_port={metrics_port or free_port()}", f"--metrics_host={host}"]


def storage_argv(master_port: int, port: int, segment: str = "128MB", host: str = "127.0.0.1") -> list[str]:
    """`mooncake_client` lending `segment` (bytes, or like '512MB') to the pool of the master on
    `host`:`master_port` over TCP, listening on `host`:`port`; it stores nothing itself."""
    return [str(BIN / "mooncake_client"), f"--global_segment_size={segment}", f"--host={host}",
            f"--master_server_address={host}:{master_port}", "--metadata_server=P2PHANDSHAKE",
            f"--port={port}", "--protocol=tcp"]


def url(master_port: int, host: str = "127.0.0.1") -> str:
    """The `remote_url` of the master on `host`:`master_port`."""
    return f"mooncakestore://{host}:{master_port}"


def master_gauge(metrics_port: int, name: str) -> float:
    """One sample of the master's /metrics on 127.0.0.1:`metrics_port` (e.g.
    `master_total_capacity_bytes`: what the clients' segments lend the pool now); 0 when absent."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line.split(" ", 1)[0] == name:
                return float(line.split()[1])
    return 0.0
