"""The lm:// server over real sockets: operations, LRU bound, concurrency, hostile peers, the CLI."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import threading
import time

import pytest
from redis_fixture import LMServerProcess, free_port, lmcache_log  # noqa: F401

from lmcache.experimental.remote.lm_connector import PIPELINE_WINDOW, LMServerConnector
from lmcache.server import LMCacheServer, ServerConfig
from lmcache.server.__main__ import _parse_args
from lmcache.server.protocol import (
    HARD_MAX_PAYLOAD_BYTES,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    PROTOCOL_VERSION,
    Op,
    Status,
    pack_header,
    parse_header,
    recv_exact,
)


@pytest.fixture
def server():
    srv = LMCacheServer(ServerConfig(port=0, max_size_bytes=64 << 20, max_payload_bytes=16 << 20, frame_timeout_s=1.0))
    srv.start_in_thread()
    yield srv
    srv.shutdown()


@pytest.fixture
def client(server: LMCacheServer):
    host, port = server.address
    conn = LMServerConnector(host, port, timeout=10, lookup_timeout=5)
    yield conn
    conn.close()


def _raw_conn(server: LMCacheServer) -> socket.socket:
    sock = socket.create_connection(server.address, timeout=5)
    return sock


def _closed_by_peer(sock: socket.socket) -> bool:
    """Drain what the server sent; True once it has closed the connection."""
    sock.settimeout(5)
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    return True


def test_put_get_exists_delete(client: LMServerConnector) -> None:
    value = os.urandom(3 << 20)
    assert client.put("vllm@m@1@0@ab", value)
    assert bytes(client.get("vllm@m@1@0@ab")) == value
    assert client.exists("vllm@m@1@0@ab") and not client.exists("vllm@m@1@0@cd")
    assert client.get("vllm@m@1@0@cd") is None
    assert client.delete("vllm@m@1@0@ab") and not client.delete("vllm@m@1@0@ab")
    assert not client.exists("vllm@m@1@0@ab")


def test_batches_longer_than_the_pipeline_window_keep_order(client: LMServerConnector) -> None:
    n = PIPELINE_WINDOW * 2 + 5
    items = [(f"key{i}", os.urandom(1000 + i)) for i in range(n)]
    assert client.batched_put(items) == [True] * n
    keys = [k for k, _ in items] + ["missing"]
    got = client.batched_get(keys)
    assert [bytes(g) for g in got[:-1]] == [v for _, v in items] and got[-1] is None
    assert client.batched_exists(keys) == [True] * n + [False]


def test_lru_bound_evicts_and_oversize_put_is_refused_but_connection_survives() -> None:
    srv = LMCacheServer(ServerConfig(port=0, max_size_bytes=1 << 20))
    host, port = srv.start_in_thread()
    try:
        conn = LMServerConnector(host, port)
        for i in range(4):
            assert conn.put(f"k{i}", bytes(300_000))
        assert not conn.exists("k0") and conn.exists("k3")
        assert not conn.put("huge", bytes(2 << 20))  # acknowledged as refused, not lost
        assert conn.exists("k3")
        info = conn.info()
        assert info["evictions"] >= 1 and info["refused_puts"] == 1 and info["bytes_used"] <= 1 << 20
        conn.close()
    finally:
        srv.shutdown()


def test_client_refuses_payload_over_its_frame_limit(server: LMCacheServer) -> None:
    conn = LMServerConnector(*server.address, max_payload_bytes=1000)
    assert conn.batched_put([("small", b"x" * 10), ("big", b"x" * 1001)]) == [True, False]
    assert conn.exists("small") and not conn.exists("big")
    conn.close()


def test_many_concurrent_clients(server: LMCacheServer) -> None:
    errors: list[str] = []

    def worker(n: int) -> None:
        conn = LMServerConnector(*server.address)
        rng = random.Random(n)
        for i in range(20):
            key, value = f"c{n}-{i}", rng.randbytes(rng.randrange(1, 200_000))
            if not conn.put(key, value) or bytes(conn.get(key)) != value:
                errors.append(key)
        conn.close()

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def _send_and_expect_error(server: LMCacheServer, data: bytes) -> str:
    sock = _raw_conn(server)
    sock.sendall(data)
    header = parse_header(recv_exact(sock, HEADER_SIZE, "reply"), 1 << 20, is_request=False)
    assert header.op == Op.ERROR and header.status == Status.BAD_REQUEST
    reason = bytes(recv_exact(sock, header.payload_len, "reason")).decode()
    assert _closed_by_peer(sock)
    sock.close()
    return reason


def test_malformed_frames_close_only_that_connection(server, client, lmcache_log) -> None:  # noqa: F811
    assert client.put("keep", b"value")
    reason = _send_and_expect_error(server, b"GARBAGE-GARBAGE-GARBAGE-")
    assert "bad magic" in reason
    over_hard_limit = HEADER.pack(MAGIC, PROTOCOL_VERSION, int(Op.PUT), 0, 3, HARD_MAX_PAYLOAD_BYTES + 1)
    reason = _send_and_expect_error(server, over_hard_limit + b"abc")
    assert "frame limit" in reason
    assert "bad magic" in lmcache_log.text and "frame limit" in lmcache_log.text
    assert bytes(client.get("keep")) == b"value"
    assert server.info()["protocol_errors"] == 2


def test_truncated_and_stalled_frames_are_dropped(server, client, lmcache_log) -> None:  # noqa: F811
    sock = _raw_conn(server)
    sock.sendall(pack_header(Op.PUT, Status.OK, 3, 1000) + b"abc" + b"x" * 10)
    sock.close()
    stalled = _raw_conn(server)
    stalled.sendall(pack_header(Op.GET, Status.OK, 3, 0)[:7])
    assert _closed_by_peer(stalled)  # frame_timeout_s=1.0 closes it
    stalled.close()
    deadline = time.monotonic() + 10
    while server.info()["protocol_errors"] < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "connection closed after 10 of 1000 bytes of the payload" in lmcache_log.text
    assert "frame stalled" in lmcache_log.text
    assert client.put("after", b"ok") and bytes(client.get("after")) == b"ok"


def test_fuzzed_frames_never_stop_the_server(server: LMCacheServer, client: LMServerConnector) -> None:
    rng = random.Random(1234)
    value = rng.randbytes(5000)
    assert client.put("canary", value)
    valid = pack_header(Op.PUT, Status.OK, 4, 16) + b"fuzz" + bytes(16)
    for i in range(300):
        kind = i % 4
        if kind == 0:
            data = rng.randbytes(rng.randrange(1, 64))
        elif kind == 1:
            data = valid[: rng.randrange(1, len(valid))]
        elif kind == 2:
            mutated = bytearray(valid)
            for _ in range(rng.randrange(1, 4)):
                mutated[rng.randrange(HEADER_SIZE)] = rng.randrange(256)
            data = bytes(mutated)
        else:
            data = MAGIC + rng.randbytes(HEADER_SIZE - 4 + rng.randrange(0, 40))
        sock = _raw_conn(server)
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
            sock.settimeout(5)
            while sock.recv(65536):
                pass
        except OSError:
            pass
        finally:
            sock.close()
        if i % 50 == 0:
            assert bytes(client.get("canary")) == value
    assert bytes(client.get("canary")) == value
    assert client.put("after-fuzz", b"x") and client.exists("after-fuzz")
    assert server.info()["protocol_errors"] > 100


def test_black_hole_server_times_out_instead_of_hanging() -> None:
    from lmcache.experimental.remote.connector import RemoteUnavailableError

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)  # accepts (kernel backlog) and never answers
    conn = LMServerConnector("127.0.0.1", listener.getsockname()[1], timeout=0.5, lookup_timeout=0.3)
    with pytest.raises(RemoteUnavailableError, match="did not answer"):
        conn.exists("k")
    with pytest.raises(RemoteUnavailableError, match="did not answer"):
        conn.get("k")
    conn.close()
    listener.close()


def test_dead_server_raises_unavailable_and_restart_is_transparent(tmp_path) -> None:
    from lmcache.experimental.remote.connector import RemoteUnavailableError

    proc = LMServerProcess(log_path=tmp_path / "server.log").start()
    conn = LMServerConnector("127.0.0.1", proc.port, timeout=5, lookup_timeout=2)
    try:
        assert conn.put("k", b"v1")
        proc.kill()
        with pytest.raises(RemoteUnavailableError):
            conn.exists("k")
        proc.start()  # same port, empty store; pooled connections are stale
        assert conn.put("k", b"v2") and bytes(conn.get("k")) == b"v2"
    finally:
        conn.close()
        proc.stop()


def test_cli_defaults_to_loopback_and_validates_arguments(tmp_path) -> None:
    config = _parse_args(["5555"])
    assert (config.host, config.port) == ("127.0.0.1", 5555)
    config = _parse_args(["0.0.0.0", "6000", "--max-size-gb", "0.5", "--no-auth"])
    assert config.host == "0.0.0.0" and config.max_size_bytes == 512 * 1024**2
    for bad in (["0.0.0.0", "6000"], ["a", "b", "c"], ["notaport"], ["1", "--max-size-gb", "0"], ["1", "--max-frame-mb", "99999"]):
        with pytest.raises(SystemExit):
            _parse_args(bad)
    port = free_port()
    log = tmp_path / "cli.log"
    proc = LMServerProcess(port=port, log_path=log).start()
    try:
        conn = LMServerConnector("127.0.0.1", port)
        assert conn.put("k", b"v") and bytes(conn.get("k")) == b"v"
        conn.close()
    finally:
        proc.stop()
    assert f"listening on 127.0.0.1:{port}" in log.read_text()


def test_cli_takes_the_old_device_argument(capsys) -> None:
    # The old server's form: `lmcache_server HOST PORT [DEVICE]`.
    config = _parse_args(["localhost", "65431", "cpu"])
    assert (config.host, config.port) == ("localhost", 65431)
    for device in ("cuda", "file:///tmp/x"):
        with pytest.raises(SystemExit):
            _parse_args(["localhost", "65431", device])
        assert f"DEVICE {device!r} is not supported" in capsys.readouterr().err


def test_console_script_runs() -> None:
    exe = os.path.join(os.path.dirname(sys.executable), "lmcache_server")
    if not os.path.exists(exe):
        pytest.skip("lmcache_server console script not installed (pip install -e . not run)")
    out = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--max-size-gb" in out.stdout


def test_delay_ms_holds_every_get_and_only_that_connection(capsys) -> None:
    # `--delay-ms`: the slow remote tier of the serving benchmark's interference workload.
    assert _parse_args(["1", "--delay-ms", "250"]).get_delay_s == 0.25
    assert _parse_args(["1"]).get_delay_s == 0.0
    for bad in ("-1", "60001", "nan"):
        with pytest.raises(SystemExit):
            _parse_args(["1", "--delay-ms", bad])
        assert "--delay-ms must be in 0..60000" in capsys.readouterr().err
    with pytest.raises(ValueError, match="get_delay_s"):
        ServerConfig(get_delay_s=61)
    srv = LMCacheServer(ServerConfig(port=0, get_delay_s=0.4))
    srv.start_in_thread()
    slow = LMServerConnector(*srv.address, timeout=10, lookup_timeout=5)
    other = LMServerConnector(*srv.address, timeout=10, lookup_timeout=5)
    try:
        assert slow.put("k", b"v")
        order = []
        started = time.monotonic()
        reader = threading.Thread(target=lambda: order.append(("get", bytes(slow.get("k")), time.monotonic() - started)))
        reader.start()
        time.sleep(0.1)
        assert other.exists("k")  # another connection's lookup is answered while the GET is held
        order.append(("exists",))
        reader.join()
        assert order[0] == ("exists",) and order[1][:2] == ("get", b"v") and order[1][2] >= 0.4
    finally:
        slow.close()
        other.close()
        srv.shutdown()
