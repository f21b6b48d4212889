"""A bounded soak of the `lm://` server: many clients, idle and drip-feeding sockets, an RSS bound.

    .venv/bin/python scripts/bench/soak_server.py [--duration 60 --clients 200 --idle 50 --drip 10]

Starts `python -m lmcache.server` as its own process with small limits, then for `--duration`
seconds runs `--clients` client threads (one `LMServerConnector` each) doing mixed puts and gets
of self-checking values on private and shared keys (plus now and then a put over the frame
limit, which must come back refused), while `--idle` sockets connect and say nothing and
`--drip` sockets feed a PUT one byte at a time; both reconnect whenever the server closes them.
The server's RSS is sampled throughout.

The run passes (exit 0) when every get returned the bytes that were put under that key or a
miss, no client call failed, every client was served, and the server's peak RSS stayed under
the bound: its RSS at start + `--max-size-mb` x 1.25 (per-entry overhead) + the pending budget
(2 x `--max-frame-mb`) + 1 MiB per connection slot (thread stacks and buffers). It prints one
JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from lmcache.experimental.remote.connector import RemoteUnavailableError  # noqa: E402
from lmcache.experimental.remote.lm_connector import LMServerConnector  # noqa: E402
from lmcache.server.protocol import Op, Status, pack_header  # noqa: E402

MIB = 1 << 20
# What the server process gets; the soak's own flags scale the workload, not the server.
MAX_CONNECTIONS = 256
_STAMP = struct.Struct("<HQ")  # key length, seed


@dataclass
class SoakReport:
    """The figures of one soak run (all counts summed over clients)."""

    duration_s: float
    clients: int
    clients_served: int = 0  # clients with at least one acknowledged put and one answered get
    puts_ok: int = 0
    puts_refused: int = 0  # busy or over the store
    oversize_refused: int = 0  # puts over the frame limit, all of which must be refused
    gets_correct: int = 0
    gets_miss: int = 0
    gets_wrong: int = 0
    client_errors: int = 0
    idle_reconnects: int = 0
    drip_reconnects: int = 0
    rss_start_bytes: int = 0
    rss_peak_bytes: int = 0
    rss_bound_bytes: int = 0
    server_info: dict = field(default_factory=dict)
    errors: list = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return (
            self.gets_wrong == 0
            and self.client_errors == 0
            and self.clients_served == self.clients
            and self.rss_peak_bytes < self.rss_bound_bytes
        )


def make_value(key: str, seed: int, size: int) -> bytes:
    """A value that proves which key and which write it came from."""
    raw = key.encode()
    return _STAMP.pack(len(raw), seed) + raw + random.Random(seed).randbytes(size)


def check_value(key: str, value: bytes) -> bool:
    """True when `value` is exactly some `make_value(key, ...)`."""
    if len(value) < _STAMP.size:
        return False
    key_len, seed = _STAMP.unpack_from(value)
    raw = key.encode()
    if key_len != len(raw) or value[_STAMP.size : _STAMP.size + key_len] != raw:
        return False
    body = value[_STAMP.size + key_len :]
    return body == random.Random(seed).randbytes(len(body))


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    port: int, max_size_mb: int, max_frame_mb: int, frame_timeout_s: float, idle_timeout_s: float, log: Path
) -> subprocess.Popen:
    args = [
        sys.executable, "-m", "lmcache.server", "127.0.0.1", str(port),
        "--max-size-gb", str(max_size_mb / 1024),
        "--max-frame-mb", str(max_frame_mb),
        "--max-connections", str(MAX_CONNECTIONS),
        "--frame-timeout", str(frame_timeout_s),
        "--idle-timeout", str(idle_timeout_s),
    ]  # fmt: skip
    with open(log, "ab") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=out, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"lm:// server exited with {proc.returncode}; see {log}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"lm:// server did not listen on {port}")


class _Tally:
    """Counters shared by the client threads."""

    def __init__(self, report: SoakReport) -> None:
        self.report = report
        self.lock = threading.Lock()

    def add(self, **counts: int) -> None:
        with self.lock:
            for name, n in counts.items():
                setattr(self.report, name, getattr(self.report, name) + n)

    def error(self, text: str) -> None:
        with self.lock:
            self.report.client_errors += 1
            if len(self.report.errors) < 20:
                self.report.errors.append(text)


def client_loop(port: int, n: int, stop: threading.Event, tally: _Tally, frame_limit: int) -> None:
    rng = random.Random(n)
    conn = LMServerConnector("127.0.0.1", port, timeout=30, lookup_timeout=10, pool_size=1)
    served_put = served_get = False
    try:
        while not stop.is_set():
            shared = rng.random() < 0.3
            key = f"shared-{rng.randrange(64)}" if shared else f"c{n}-{rng.randrange(16)}"
            roll = rng.random()
            try:
                if roll < 0.01:
                    ok = conn.put(key, make_value(key, rng.getrandbits(63), frame_limit + 1))
                    if ok:
                        tally.error(f"client {n}: a put over the frame limit was acknowledged")
                    tally.add(oversize_refused=0 if ok else 1)
                elif roll < 0.5:
                    ok = conn.put(key, make_value(key, rng.getrandbits(63), rng.randrange(1024, 256 * 1024)))
                    served_put |= ok
                    tally.add(puts_ok=int(ok), puts_refused=int(not ok))
                else:
                    got = conn.get(key)
                    served_get = True
                    if got is None:
                        tally.add(gets_miss=1)
                    elif check_value(key, bytes(got)):
                        tally.add(gets_correct=1)
                    else:
                        tally.add(gets_wrong=1)
            except (RemoteUnavailableError, ValueError) as err:
                tally.error(f"client {n}: {err!r}")
    finally:
        conn.close()
        tally.add(clients_served=int(served_put and served_get))


def _keep_open(port: int, stop: threading.Event, first: bytes, drip: bool, tally: _Tally, counter: str) -> None:
    """One hostile socket: reconnect whenever the server closes it; drip one byte per 0.5 s."""
    while not stop.is_set():
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        except OSError:
            stop.wait(0.2)
            continue
        with sock:
            try:
                if first:
                    sock.sendall(first)
                while not stop.is_set():
                    if drip:
                        sock.send(b"x")
                    sock.settimeout(0.5)
                    try:
                        if not sock.recv(65536):
                            break  # closed by the server
                    except socket.timeout:
                        continue
            except OSError:
                pass
        tally.add(**{counter: 1})


def _sample_rss(pid: int, stop: threading.Event, report: SoakReport) -> None:
    while not stop.wait(0.2):
        try:
            report.rss_peak_bytes = max(report.rss_peak_bytes, rss_bytes(pid))
        except (OSError, RuntimeError):
            return


def run_soak(
    duration_s: float = 60.0,
    clients: int = 200,
    idle: int = 50,
    drip: int = 10,
    max_size_mb: int = 256,
    max_frame_mb: int = 4,
    frame_timeout_s: float = 5.0,
    idle_timeout_s: float = 10.0,
    log: Optional[Path] = None,
    progress: Callable[[str], None] = lambda _: None,
) -> SoakReport:
    """Run one soak against a fresh server process; the report says whether it passed."""
    port = _free_port()
    log = log if log is not None else Path("/tmp") / f"soak_server_{port}.log"
    proc = start_server(port, max_size_mb, max_frame_mb, frame_timeout_s, idle_timeout_s, log)
    report = SoakReport(duration_s=duration_s, clients=clients)
    tally = _Tally(report)
    stop, sampler_stop = threading.Event(), threading.Event()
    try:
        report.rss_start_bytes = report.rss_peak_bytes = rss_bytes(proc.pid)
        pending = 2 * max_frame_mb * MIB
        report.rss_bound_bytes = int(
            report.rss_start_bytes + max_size_mb * MIB * 1.25 + pending + MAX_CONNECTIONS * MIB
        )
        sampler = threading.Thread(target=_sample_rss, args=(proc.pid, sampler_stop, report), daemon=True)
        sampler.start()
        drip_header = pack_header(Op.PUT, Status.OK, 4, 2 * MIB) + b"drip"
        hostile = [
            threading.Thread(target=_keep_open, args=(port, stop, b"", False, tally, "idle_reconnects"), daemon=True)
            for _ in range(idle)
        ] + [
            threading.Thread(target=_keep_open, args=(port, stop, drip_header, True, tally, "drip_reconnects"), daemon=True)
            for _ in range(drip)
        ]
        for t in hostile:
            t.start()
        time.sleep(0.5)  # the hostile sockets are in before the clients start
        workers = [
            threading.Thread(target=client_loop, args=(port, n, stop, tally, max_frame_mb * MIB), daemon=True)
            for n in range(clients)
        ]
        for t in workers:
            t.start()
        progress(f"{clients} clients, {idle} idle and {drip} drip-feeding sockets on port {port} for {duration_s:.0f} s")
        stop.wait(duration_s)
        stop.set()
        for t in workers + hostile:
            t.join(timeout=60)
        info_conn = LMServerConnector("127.0.0.1", port, timeout=10, lookup_timeout=10)
        report.server_info = info_conn.info()
        info_conn.close()
        sampler_stop.set()
        sampler.join()
        report.rss_peak_bytes = max(report.rss_peak_bytes, rss_bytes(proc.pid))
    finally:
        stop.set()
        sampler_stop.set()
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--idle", type=int, default=50, help="sockets that connect and say nothing")
    parser.add_argument("--drip", type=int, default=10, help="sockets that feed a PUT one byte per 0.5 s")
    parser.add_argument("--max-size-mb", type=int, default=256, help="the server's --max-size-gb, in MiB")
    parser.add_argument("--max-frame-mb", type=int, default=4, help="the server's --max-frame-mb")
    parser.add_argument("--frame-timeout", type=float, default=5.0, help="the server's --frame-timeout")
    parser.add_argument("--idle-timeout", type=float, default=10.0, help="the server's --idle-timeout")
    args = parser.parse_args()
    logging.getLogger("lmcache").setLevel(logging.ERROR)  # the expected refusals, once per client
    report = run_soak(
        args.duration, args.clients, args.idle, args.drip, args.max_size_mb, args.max_frame_mb,
        args.frame_timeout, args.idle_timeout, progress=lambda text: print(text, file=sys.stderr),
    )  # fmt: skip
    print(json.dumps({**asdict(report), "passed": report.passed}, indent=1))
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
