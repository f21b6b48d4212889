"""The `lmcache_server` process against hostile peers: idle sockets, drip-fed frames, half-sent
payloads; what they may hold (connections, time, memory) is bounded and a well-behaved client
keeps being served."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from contextlib import ExitStack

import pytest
from redis_fixture import ROOT, LMServerProcess

from lmcache.experimental.remote.lm_connector import LMServerConnector
from lmcache.server.__main__ import _parse_args
from lmcache.server.protocol import Op, Status, pack_header

MIB = 1 << 20


@pytest.fixture
def start_server(tmp_path):
    with ExitStack() as stack:

        def start(*args: str) -> LMServerProcess:
            server = LMServerProcess(extra_args=args, log_path=tmp_path / "server.log").start()
            stack.callback(server.stop)
            return server

        yield start


def _client(server: LMServerProcess) -> LMServerConnector:
    return LMServerConnector("127.0.0.1", server.port, timeout=5, lookup_timeout=5)


def _served(server: LMServerProcess, key: str) -> bool:
    conn = _client(server)
    try:
        value = key.encode() * 1000
        return conn.put(key, value) and bytes(conn.get(key)) == value
    finally:
        conn.close()


def _open(server: LMServerProcess, n: int, first_bytes: bytes = b"") -> list[socket.socket]:
    socks = []
    for _ in range(n):
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        if first_bytes:
            sock.sendall(first_bytes)
        socks.append(sock)
    return socks


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """True once the server closed `sock` (EOF or reset) within `seconds`."""
    sock.settimeout(seconds)
    try:
        while sock.recv(65536):
            pass
    except socket.timeout:
        return False
    except ConnectionResetError:
        pass
    return True


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def test_300_idle_sockets_never_lock_a_client_out(start_server) -> None:
    server = start_server()  # default --max-connections 256
    idle = _open(server, 300)
    try:
        for i in range(5):
            assert _served(server, f"after-idle-{i}")
        info = _client(server).info()
        assert info["reaped_connections"] >= 300 - 256 and info["connections"] <= 256
    finally:
        for sock in idle:
            sock.close()


def test_300_drip_feeding_sockets_never_lock_a_client_out(start_server) -> None:
    server = start_server("--frame-timeout", "30")
    header = pack_header(Op.PUT, Status.OK, 3, 16 * MIB) + b"key"
    drips = _open(server, 300, first_bytes=header)
    try:
        for round_ in range(3):
            for sock in drips:
                try:
                    sock.send(b"x")
                except OSError:
                    pass  # closed to make room: that is the point
            assert _served(server, f"after-drip-{round_}")
    finally:
        for sock in drips:
            sock.close()


def test_a_frame_has_a_deadline_from_its_first_byte_not_between_bytes(start_server) -> None:
    server = start_server("--frame-timeout", "1.5")
    sock = _open(server, 1, first_bytes=pack_header(Op.PUT, Status.OK, 3, 1000) + b"key")[0]
    started = time.monotonic()
    sock.settimeout(0.5)
    closed = False
    while time.monotonic() - started < 10 and not closed:
        try:
            sock.send(b"x")  # a byte every 0.3 s: never a gap as long as the timeout
            time.sleep(0.3)
            closed = _closed_within(sock, 0.01)
        except OSError:
            closed = True
    assert closed and time.monotonic() - started < 4, "a drip-fed frame outlived its deadline"
    sock.close()
    assert _served(server, "after-deadline")
    assert _client(server).info()["frame_timeouts"] == 1


def test_an_idle_connection_is_closed_and_the_client_reconnects(start_server) -> None:
    server = start_server("--idle-timeout", "0.5")
    sock = _open(server, 1)[0]
    assert _closed_within(sock, 5)
    sock.close()
    conn = _client(server)
    assert conn.put("k", b"v")
    time.sleep(1.0)  # its pooled connection is closed by the server meanwhile
    assert bytes(conn.get("k")) == b"v"  # retried once on a fresh connection
    assert conn.info()["idle_timeouts"] >= 2
    conn.close()


def test_half_sent_payloads_hold_no_more_than_the_pending_budget(start_server) -> None:
    """The issue's case: 40 PUTs of 16 MiB stalled half-way held ~690 MB. With a 64 MiB budget
    the server holds at most that, refuses (and drains) the rest, and still serves."""
    server = start_server("--max-frame-mb", "16", "--max-pending-mb", "64", "--frame-timeout", "20")
    assert server.proc is not None
    before = _rss_bytes(server.proc.pid)
    header = pack_header(Op.PUT, Status.OK, 3, 16 * MIB) + b"key"
    stalled = _open(server, 40, first_bytes=header)
    try:
        for sock in stalled:
            sock.sendall(bytes(8 * MIB))
        time.sleep(0.5)
        conn = _client(server)
        info = conn.info()
        assert info["pending_bytes"] <= 64 * MIB and info["refused_busy"] >= 1
        grown = _rss_bytes(server.proc.pid) - before
        assert grown < 64 * MIB + 48 * MIB, f"server RSS grew by {grown >> 20} MiB"
        assert not conn.put("while-full", bytes(MIB))  # the budget is held: refused, not down
        assert conn.exists("nothing") is False and conn.info()["refused_busy"] >= 2  # still serving
    finally:
        for sock in stalled:
            sock.close()
    time.sleep(0.3)
    assert conn.put("after", bytes(MIB)) and conn.info()["pending_bytes"] == 0
    conn.close()


def test_limit_flags_are_validated_and_documented() -> None:
    config = _parse_args(["1", "--idle-timeout", "5", "--frame-timeout", "2", "--max-pending-mb", "3000"])
    assert (config.idle_timeout_s, config.frame_timeout_s, config.max_pending_bytes) == (5, 2, 3000 * MIB)
    assert _parse_args(["1", "--max-frame-mb", "8"]).max_pending_bytes == 16 * MIB  # twice the frame
    for bad in (["1", "--idle-timeout", "0"], ["1", "--frame-timeout", "-1"], ["1", "--max-connections", "0"],
                ["1", "--max-frame-mb", "8", "--max-pending-mb", "4"]):
        with pytest.raises(SystemExit):
            _parse_args(bad)
    out = subprocess.run([sys.executable, "-m", "lmcache.server", "--help"], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    for flag in ("--idle-timeout", "--frame-timeout", "--max-pending-mb", "--max-connections", "--max-frame-mb"):
        assert flag in out.stdout
    deployment = (ROOT / "docs" / "deployment.md").read_text()
    for flag in ("--idle-timeout", "--frame-timeout", "--max-pending-mb", "--max-connections", "--max-frame-mb"):
        assert flag in deployment, f"docs/deployment.md does not document {flag}"
