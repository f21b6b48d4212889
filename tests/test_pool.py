"""The node pool (`lmcache_server --unix-socket`, clients at `lm+shm:///PATH`) with real processes.

The server runs as its own process; clients that must die mid-operation (`kill -9`) are child
processes speaking the pool's frames themselves. Checked: the socket is owner-only and takes the
token as `lm://` does, or with `--socket-group` that group's (a client of another user in it
connects and maps, one outside it cannot; run as root, which alone can start such a client); pool and TCP clients see the same entries; a half-written block is never
published; a lease pins its block (never reused while live) and dies with its client; a server
that dies and restarts is a miss, then a new arena, never wrong bytes; a corrupt value is a miss.
"""

from __future__ import annotations

import grp
import mmap
import os
import resource
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import key
from redis_fixture import LMServerProcess, lmcache_log, pool  # noqa: F401
from tier_helpers import (
    FAST_REMOTE,
    as_nobody,
    passable_dir,
    read_through_pool,
    remote_backend,
    remote_chunk,
    remote_cpu,
    wait_for,
)

from lmcache.experimental.config import RemoteUrl, parse_remote_url
from lmcache.experimental.remote import create_connector
from lmcache.experimental.remote.connector import RemoteAuthError, RemoteUnavailableError
from lmcache.experimental.remote.lm_connector import LMServerConnector
from lmcache.experimental.remote.pool_connector import PoolArena, map_arena
from lmcache.server import LMCacheServer, ServerConfig
from lmcache.server.pool_address import share_with_group
from lmcache.server.protocol import HEADER_SIZE, POOL_WORD, Op, Status, parse_header, recv_exact, send_frame

ROOT = Path(__file__).resolve().parent.parent
# One value of this size fits the 1 MiB store below, two do not: a held block shows at once.
BIG = 600_000

# A pool client that does one step per line of stdin and answers on stdout; the test kills it.
CHILD = r"""
import socket, struct, sys
import xxhash
from lmcache.experimental.remote.pool_connector import map_arena
from lmcache.server.pool_address import share_with_group
from lmcache.server.protocol import HEADER_SIZE, POOL_WORD, Op, Status, parse_header, recv_exact, send_frame

sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.connect(sys.argv[1])
arena = map_arena(sock, None)

def ask(op, key=b"", payload=None):
    send_frame(sock, op, key=key, payload=payload)
    head = parse_header(recv_exact(sock, HEADER_SIZE, "header"), 1 << 20, is_request=False)
    recv_exact(sock, head.key_len, "key")
    return head.status, bytes(recv_exact(sock, head.payload_len, "payload"))

for line in sys.stdin:
    cmd, name, *rest = line.split()
    if cmd == "reserve":  # reserve a block and fill half of it, never commit
        size = int(rest[0])
        status, payload = ask(Op.RESERVE, name.encode(), POOL_WORD.pack(size))
        block = arena.block(POOL_WORD.unpack(payload)[0], size)
        block[: size // 2] = b"\xab" * (size // 2)
        print(status.name, flush=True)
    elif cmd == "lease":  # lease a value and keep its bytes' digest
        status, payload = ask(Op.LEASE, name.encode())
        _, offset, length = struct.unpack("!QQQ", payload)
        view = arena.block(offset, length)
        digest = xxhash.xxh3_64_hexdigest(view)
        print(status.name, flush=True)
    elif cmd == "check":  # are the leased bytes still what they were?
        print(xxhash.xxh3_64_hexdigest(view) == digest, flush=True)
"""


class Child:
    """A pool client process driven line by line."""

    def __init__(self, socket_path: Path) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(socket_path)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
        )

    def ask(self, line: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


def test_pool_urls_parse_and_bad_ones_are_refused() -> None:
    assert parse_remote_url("lm+shm:///run/lmc.sock") == RemoteUrl("lm+shm", (), socket="/run/lmc.sock")
    with_token = parse_remote_url("lm+shm://:s3cret@/run/lmc.sock")
    assert with_token.password == "s3cret" and with_token.socket == "/run/lmc.sock"
    assert with_token.display() == "lm+shm://:***@/run/lmc.sock"
    for bad in ("lm+shm://run/lmc.sock", "lm+shm://", "lm+shm://:t@relative"):
        with pytest.raises(ValueError, match="remote_url=.*lm\\+shm:///absolute"):
            parse_remote_url(bad)


def test_socket_is_owner_only_takes_the_token_and_shares_entries_with_tcp(pool, tmp_path) -> None:
    assert stat.S_IMODE(os.stat(pool.unix_socket).st_mode) == 0o600
    shm = create_connector(pool.pool_url)
    tcp = LMServerConnector("127.0.0.1", pool.port)
    try:
        assert shm.batched_put([("a", b"A" * (BIG // 2)), ("b", b"tiny")]) == [True, True]
        assert bytes(tcp.get("a")) == b"A" * (BIG // 2) and bytes(tcp.get("b")) == b"tiny"
        assert tcp.put("c", b"from tcp")
        assert [None if v is None else bytes(v) for v in shm.batched_get(["c", "b", "nope"])] == [b"from tcp", b"tiny", None]
        # A batch far over what one connection may reserve or lease at once goes in windows.
        many = [(f"m{i}", b"%d" % i) for i in range(600)]
        assert all(shm.batched_put(many)) and [bytes(v) for v in shm.batched_get([k for k, _ in many])] == [v for _, v in many]
        info = pool.info()
        assert info["pool_clients"] == 1 and info["pool_leases"] == 0 and info["pool_reservations"] == 0
        assert info["refused_puts"] == 0
    finally:
        shm.close()
        tcp.close()

    (tmp_path / "token").write_text("pool-tok-7")
    guarded = LMServerProcess(
        ["--token-file", str(tmp_path / "token")], log_path=tmp_path / "guarded.log", unix_socket=tmp_path / "g.sock"
    ).start()
    try:
        good = create_connector(f"lm+shm://:pool-tok-7@{tmp_path / 'g.sock'}")
        assert good.put("k", b"v") and bytes(good.get("k")) == b"v"
        good.close()
        for url in (guarded.pool_url, f"lm+shm://:wrong@{tmp_path / 'g.sock'}"):
            refused = create_connector(url)
            with pytest.raises(RemoteAuthError):
                refused.get("k")
            refused.close()
    finally:
        guarded.stop()


def test_socket_group_opens_the_socket_to_that_group_only_and_an_unknown_one_is_refused(tmp_path) -> None:
    gid = os.getgid()
    group = grp.getgrgid(gid).gr_name
    with passable_dir() as where:
        path = Path(where) / "pool.sock"
        server = LMServerProcess(["--socket-group", group], log_path=tmp_path / "server.log", unix_socket=path).start()
        try:
            info = os.stat(path)
            assert (stat.S_IMODE(info.st_mode), info.st_uid, info.st_gid) == (0o660, os.getuid(), gid)
            shm = create_connector(server.pool_url)
            assert shm.put("k", b"for the group")
            shm.close()
            if os.geteuid() == 0:  # clients of another user, in the group and not in it
                assert as_nobody([gid], lambda: read_through_pool(str(path), "k")) == repr(b"for the group")
                assert as_nobody([], lambda: read_through_pool(str(path), "k")).startswith("PermissionError")
                assert "this user is not in it" in as_nobody([], _give_a_file_to_group_zero)
        finally:
            server.stop()
    assert "cannot pass through" not in (tmp_path / "server.log").read_text()
    # A socket in a directory the group may not enter: served, with a warning saying why.
    tmp_path.chmod(0o700)
    hidden = LMServerProcess(["--socket-group", group], log_path=tmp_path / "hidden.log",
                             unix_socket=tmp_path / "hidden.sock").start()
    hidden.stop()
    assert f"group {group} cannot pass through {tmp_path} (mode 700" in (tmp_path / "hidden.log").read_text()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for argv, why in (
        (["--unix-socket", str(tmp_path / "u.sock"), "--socket-group", "no-such-group-lmc"],
         "socket group 'no-such-group-lmc': no such group"),
        (["0", "--socket-group", group], "needs a unix socket"),
    ):
        refused = subprocess.run([sys.executable, "-m", "lmcache.server", *argv],
                                 capture_output=True, text=True, timeout=60, env=env)
        assert refused.returncode == 2 and why in refused.stderr
    assert not (tmp_path / "u.sock").exists()


def _give_a_file_to_group_zero() -> None:
    """As a user outside group 0: make a file and try to give it to that group."""
    fd, path = tempfile.mkstemp()
    os.close(fd)
    try:
        share_with_group(path, "0", 0o660)
    finally:
        os.unlink(path)


def test_client_killed_mid_store_publishes_nothing_and_frees_its_block(pool) -> None:
    child = Child(pool.unix_socket)
    try:
        assert child.ask(f"reserve half {BIG}") == "OK"
        assert pool.info()["pool_reservations"] == 1
        shm = create_connector(pool.pool_url)
        # The reserved block holds the arena: a second value of that size has no room.
        assert shm.put("other", b"o" * BIG) is False
        child.kill()
        assert wait_for(lambda: pool.info()["pool_clients"] == 1, timeout=10)  # only `shm` is left
        assert not shm.exists("half") and shm.get("half") is None  # never published
        assert shm.put("other", b"o" * BIG)  # its block came back
        shm.close()
    finally:
        child.kill()


def test_a_leased_block_is_not_reused_and_its_lease_dies_with_its_client(pool) -> None:
    shm = create_connector(pool.pool_url)
    assert shm.put("held", b"h" * BIG)
    child = Child(pool.unix_socket)
    try:
        assert child.ask("lease held") == "OK"
        assert shm.delete("held") and not shm.exists("held")
        # Gone from the index, but its block is leased: a value that needs it is refused.
        assert shm.put("next", b"n" * BIG) is False
        assert child.ask("check held") == "True"
        info = pool.info()
        assert info["pool_leases"] == 1 and info["entries"] == 0
        child.kill()
        assert wait_for(lambda: pool.info()["pool_leases"] == 0, timeout=10)
        assert shm.put("next", b"n" * BIG) and bytes(shm.get("next")) == b"n" * BIG
    finally:
        child.kill()
        shm.close()


def test_server_killed_and_restarted_is_a_miss_then_a_new_arena(pool, lmcache_log) -> None:  # noqa: F811
    cpu = remote_cpu()
    backend = remote_backend(pool.pool_url, options=FAST_REMOTE, cpu=cpu)
    try:
        first = remote_chunk(cpu, seed=1)
        backend.submit_put_task(key(1), first)
        assert backend.flush() and backend.contains(key(1))
        hit = backend.get_blocking(key(1))
        assert hit is not None and torch.equal(hit.tensor, first.tensor)
        hit.ref_count_down()
        # A value whose bytes are not the chunk (written over TCP) is a miss, not data.
        tcp = LMServerConnector("127.0.0.1", pool.port)
        blob = bytearray(tcp.get(key(1).to_string()))
        blob[-1] ^= 0xFF
        assert tcp.put(key(2).to_string(), blob) and tcp.put(key(3).to_string(), b"not a chunk")
        tcp.close()
        assert backend.get_blocking(key(2)) is None and backend.get_blocking(key(3)) is None

        pool.kill()
        assert backend.get_blocking(key(1)) is None  # a miss, not an error
        assert not backend.contains(key(1)) and "is down" in lmcache_log.text
        pool.start()  # same socket path (the dead server's file is replaced), a new empty arena
        assert wait_for(lambda: backend.is_up)
        assert backend.get_blocking(key(1)) is None  # the new arena does not have it
        second = remote_chunk(cpu, seed=2)
        backend.submit_put_task(key(1), second)
        assert backend.flush()
        hit = backend.get_blocking(key(1))
        assert hit is not None and torch.equal(hit.tensor, second.tensor)
        hit.ref_count_down()
        stats = backend.remote_stats()
        assert stats.times_down == 1 and stats.times_recovered == 1 and stats.gets_rejected == 2
    finally:
        backend.close()


def test_server_cli_takes_the_unix_socket_alone_and_never_takes_over_a_live_one(pool, tmp_path) -> None:
    from lmcache.server.__main__ import _parse_args

    config = _parse_args(["--unix-socket", str(tmp_path / "p.sock")])
    assert config.port is None and config.unix_socket == str(tmp_path / "p.sock")
    with pytest.raises(SystemExit):
        _parse_args([])
    with pytest.raises(RemoteUnavailableError):  # nobody listens there
        create_connector(f"lm+shm://{tmp_path / 'p.sock'}").ping()
    (tmp_path / "plain").write_text("not a socket")
    for path, why in ((pool.unix_socket, "another server listens there"), (tmp_path / "plain", "not a socket")):
        second = subprocess.run([sys.executable, "-m", "lmcache.server", "--unix-socket", str(path)],
                                capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert second.returncode == 1 and why in second.stderr
    assert create_connector(pool.pool_url).put("still", b"served")  # the live server kept its socket


def test_pool_ops_are_refused_over_tcp_and_a_foreign_commit_closes_the_connection(tmp_path) -> None:
    server = LMCacheServer(ServerConfig(port=0, unix_socket=str(tmp_path / "p.sock"), max_size_bytes=1 << 20))
    host, port = server.start_in_thread() or ("", 0)
    try:
        with socket.create_connection((host, port), timeout=5) as tcp:
            send_frame(tcp, Op.LEASE, key=b"k")
            head = parse_header(recv_exact(tcp, HEADER_SIZE, "header"), 1 << 16, is_request=False)
            reason = bytes(recv_exact(tcp, head.payload_len, "reason")).decode()
            assert head.op == Op.ERROR and "unix socket only" in reason
        with socket.socket(socket.AF_UNIX) as unix:
            unix.connect(str(tmp_path / "p.sock"))
            arena = map_arena(unix, None)
            send_frame(unix, Op.RESERVE, key=b"mine", payload=POOL_WORD.pack(1000))
            head = parse_header(recv_exact(unix, HEADER_SIZE, "header"), 1 << 16, is_request=False)
            (offset,) = POOL_WORD.unpack(bytes(recv_exact(unix, head.payload_len, "offset")))
            assert head.status == Status.OK and offset + 1000 <= arena.size
            assert server.info()["pool_reservations"] == 1
            send_frame(unix, Op.COMMIT, key=b"other", payload=POOL_WORD.pack(offset))  # not this key's block
            head = parse_header(recv_exact(unix, HEADER_SIZE, "header"), 1 << 16, is_request=False)
            assert head.op == Op.ERROR and unix.recv(4096) and unix.recv(4096) == b""  # answered, then closed
        assert wait_for(lambda: server.info()["pool_reservations"] == 0, timeout=5)
        assert server.info()["entries"] == 0
    finally:
        server.shutdown()


def test_delay_ms_holds_every_lease_as_it_holds_a_get(tmp_path) -> None:
    """`--delay-ms` makes the pool a slow tier too (the client-faults test drops a client while one
    of its loads waits); a put is not delayed."""
    slow = LMServerProcess(["--delay-ms", "300"], log_path=tmp_path / "slow.log", unix_socket=tmp_path / "s.sock").start()
    shm = create_connector(slow.pool_url)
    try:
        started = time.monotonic()
        assert shm.batched_put([("a", b"A"), ("b", b"B")]) == [True, True]
        assert time.monotonic() - started < 0.3
        started = time.monotonic()
        assert [bytes(v) for v in shm.batched_get(["a", "b"])] == [b"A", b"B"]
        assert time.monotonic() - started >= 0.6  # one delay per lease
    finally:
        shm.close()
        slow.stop()


def _prefaulting() -> bool:
    return any(t.name == "lmcache-pool-prefault" for t in threading.enumerate())


def test_a_store_into_a_fresh_pool_does_not_fault_page_by_page(tmp_path, monkeypatch) -> None:
    """A connector maps the arena as it is created and faults the mapping in on a background
    thread, so the first stores into a new pool copy at memory speed: without that every 4 KiB
    page faulted (and was allocated and zeroed) inside the store, 0.2x memcpy (issue 43)."""
    value_bytes = 32 << 20
    server = LMServerProcess(["--max-size-gb", str(96 / 1024)], log_path=tmp_path / "server.log",
                             unix_socket=tmp_path / "pool.sock").start()
    shms = []
    try:

        def faults_of_a_put(name: str) -> int:
            shms.append(create_connector(server.pool_url))  # maps the arena now
            deadline = time.monotonic() + 30
            while _prefaulting() and time.monotonic() < deadline:
                time.sleep(0.02)
            value = bytes([len(shms)]) * value_bytes
            before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
            assert shms[-1].batched_put([(name, value)]) == [True]
            return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before

        pages = value_bytes // mmap.PAGESIZE
        first = faults_of_a_put("first")
        assert first < pages // 16
        # A second mapping without its prefault, into blocks nobody touched yet: page by page.
        monkeypatch.setattr(PoolArena, "prefault_in_background", lambda self: None)
        assert faults_of_a_put("second") > pages // 2
    finally:
        for shm in shms:
            shm.close()
        server.stop()
