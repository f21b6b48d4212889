"""Upstream's multiprocess mode by its names, without vLLM: `lmcache server` (`lmcache/cli.py`),
how a port names the node pool's socket (`pool_address.py`), and `LMCacheMPConnector`'s
`lmcache.mp.*` keys mapped onto the v1 door's config (`mp_keys.py`). The same with a real vLLM
0.32 engine: tests/latest/test_latest_mp_connector.py.
"""

from __future__ import annotations

import grp
import os
import stat
import tempfile
from pathlib import Path

import pytest
from redis_fixture import LMCacheCommandServer
from tier_helpers import as_nobody, passable_dir, read_through_pool

from lmcache.cli import REFUSED_FLAGS, parse_server_args
from lmcache.experimental.remote import create_connector
from lmcache.experimental.remote.lm_connector import LMServerConnector
from lmcache.integration.vllm.mp_keys import REFUSED_KEYS, pool_extra_config
from lmcache.integration.vllm.utils import lmcache_get_config
from lmcache.server.pool_address import RUNTIME_DIR_ENV, ensure_runtime_dir, pool_socket_path, runtime_dir

GIB = 1 << 30


# ----- the pool's socket, from the port -------------------------------------------------------


def test_the_socket_is_named_by_the_port_under_a_per_user_dir():
    default = os.path.join(tempfile.gettempdir(), f"lmcache-{os.getuid()}")
    assert runtime_dir({}) == default
    assert pool_socket_path(5555, {}) == os.path.join(default, "pool-5555.sock")
    assert pool_socket_path(6000, {RUNTIME_DIR_ENV: "/run/lm"}) == "/run/lm/pool-6000.sock"


@pytest.mark.parametrize("port", [0, 65536, -1, True, "5555"])
def test_a_port_that_names_no_server_is_refused(port):
    with pytest.raises(ValueError, match="port="):
        pool_socket_path(port, {})


def test_a_relative_or_too_long_runtime_dir_is_refused_naming_the_variable():
    with pytest.raises(ValueError, match=RUNTIME_DIR_ENV):
        runtime_dir({RUNTIME_DIR_ENV: "run/lm"})
    with pytest.raises(ValueError, match=RUNTIME_DIR_ENV):
        pool_socket_path(5555, {RUNTIME_DIR_ENV: "/" + "d" * 120})


def test_the_runtime_dir_is_created_owner_only_and_an_open_one_is_refused(tmp_path):
    made = tmp_path / "rt"
    ensure_runtime_dir(str(made))
    assert stat.S_IMODE(made.stat().st_mode) == 0o700
    ensure_runtime_dir(str(made))  # an existing one of ours is fine
    made.chmod(0o777)
    with pytest.raises(OSError, match="writable by others"):
        ensure_runtime_dir(str(made))
    link = tmp_path / "link"
    link.symlink_to(made)
    with pytest.raises(OSError, match="not a directory"):
        ensure_runtime_dir(str(link))


# ----- lmcache server -------------------------------------------------------------------------


def test_lmcache_server_listens_on_loopback_and_the_pool_socket_of_its_port(monkeypatch, tmp_path):
    monkeypatch.setenv(RUNTIME_DIR_ENV, str(tmp_path))
    config = parse_server_args(["server", "--port", "5555", "--l1-size-gb", "8"])
    assert (config.host, config.port) == ("127.0.0.1", 5555)
    assert config.unix_socket == str(tmp_path / "pool-5555.sock")
    assert config.max_size_bytes == 8 * GIB
    assert parse_server_args(["server", "--eviction-policy", "LRU"]).port == 5555  # upstream's default port


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--chunk-size", "256"], "--chunk-size"),
        (["--max-workers=4"], "--max-workers"),
        (["--l2-adapter", '{"type": "fs"}'], "--l2-adapter"),
        (["--p2p-advertise-url", "h:1"], "--p2p-advertise-url"),
        (["--http-port", "8080"], "--http-port"),
    ],
)
def test_upstream_flags_without_meaning_here_are_refused_by_name(capsys, argv, named):
    with pytest.raises(SystemExit):
        parse_server_args(["server", *argv])
    err = capsys.readouterr().err
    assert f"{named} (an upstream LMCache flag) is not supported here" in err


def test_every_refusal_gives_a_reason_and_other_mistakes_are_usage_errors(capsys):
    assert all(reason for reason in REFUSED_FLAGS.values())
    for argv, message in (
        (["--eviction-policy", "ARC"], "evicts LRU only"),
        (["--port", "0"], "--port must be in 1..65535"),
        (["--l1-size-gb", "0"], "--l1-size-gb must be positive"),
        (["--frobnicate"], "unrecognized arguments: --frobnicate"),
    ):
        with pytest.raises(SystemExit):
            parse_server_args(["server", *argv])
        assert message in capsys.readouterr().err


def test_lmcache_server_process_serves_the_pool_where_the_port_says(tmp_path):
    """The real command: a pool client finds the socket from the port alone, and a TCP client on
    127.0.0.1:PORT sees the same entries."""
    runtime = tmp_path / "rt"
    server = LMCacheCommandServer(["--l1-size-gb", "0.05"], log_path=tmp_path / "server.log", runtime_dir=runtime)
    server.start()
    try:
        socket_path = pool_socket_path(server.port, {RUNTIME_DIR_ENV: str(runtime)})
        assert stat.S_IMODE(os.stat(socket_path).st_mode) == 0o600
        assert stat.S_IMODE(runtime.stat().st_mode) == 0o700
        pool = create_connector(f"lm+shm://{socket_path}")
        assert pool.put("k", b"through the pool")
        tcp = LMServerConnector("127.0.0.1", server.port)
        assert bytes(tcp.get("k")) == b"through the pool"
        assert tcp.info()["max_bytes"] == int(0.05 * GIB)
        tcp.close()
        pool.close()
    finally:
        server.stop()


def test_socket_group_opens_the_runtime_dir_and_the_socket_to_that_group(tmp_path, capsys):
    gid = os.getgid()
    group = grp.getgrgid(gid).gr_name
    with passable_dir() as where:
        runtime = Path(where) / "rt"
        server = LMCacheCommandServer(["--l1-size-gb", "0.05", "--socket-group", group],
                                      log_path=tmp_path / "server.log", runtime_dir=runtime)
        server.start()
        try:
            socket_path = pool_socket_path(server.port, {RUNTIME_DIR_ENV: str(runtime)})
            for path, mode in ((runtime, 0o750), (socket_path, 0o660)):
                info = os.stat(path)
                assert (stat.S_IMODE(info.st_mode), info.st_gid) == (mode, gid), path
            pool = create_connector(f"lm+shm://{socket_path}")
            assert pool.put("k", b"for the group")
            pool.close()
            if os.geteuid() == 0:  # clients of another user, in the group and not in it
                assert as_nobody([gid], lambda: read_through_pool(socket_path, "k")) == repr(b"for the group")
                assert as_nobody([], lambda: read_through_pool(socket_path, "k")).startswith("PermissionError")
        finally:
            server.stop()
    with pytest.raises(SystemExit):
        parse_server_args(["server", "--socket-group", "no-such-group-lmc"])
    assert "socket group 'no-such-group-lmc': no such group" in capsys.readouterr().err


# ----- LMCacheMPConnector's keys ----------------------------------------------------------------


def test_upstream_keys_become_the_pool_as_the_only_tier(monkeypatch, tmp_path):
    monkeypatch.setenv(RUNTIME_DIR_ENV, str(tmp_path))
    extra = {"lmcache.mp.host": "tcp://localhost", "lmcache.mp.port": 5555}
    mapped = pool_extra_config(extra)
    assert mapped == {"lmcache.remote_url": f"lm+shm://{tmp_path}/pool-5555.sock", "lmcache.local_cpu": False}
    config = lmcache_get_config(mapped)
    assert config.remote_url == f"lm+shm://{tmp_path}/pool-5555.sock"
    assert config.local_cpu is False and config.local_disk is None
    # No keys at all: upstream's defaults, tcp://localhost:5555.
    assert pool_extra_config({}) == mapped


@pytest.mark.parametrize("host", ["tcp://localhost", "localhost", "tcp://127.0.0.1", "127.0.0.1", "tcp://[::1]"])
def test_loopback_hosts_and_string_ports_are_accepted(monkeypatch, tmp_path, host):
    monkeypatch.setenv(RUNTIME_DIR_ENV, str(tmp_path))
    mapped = pool_extra_config({"lmcache.mp.host": host, "lmcache.mp.port": "6001"})
    assert mapped["lmcache.remote_url"] == f"lm+shm://{tmp_path}/pool-6001.sock"


def test_our_own_keys_still_apply_beside_upstreams():
    mapped = pool_extra_config(
        {"lmcache.mp.port": 5555, "lmcache.local_cpu": True, "lmcache.chunk_size": 128,
         "lmcache.mp.mp_transfer_mode": "engine_driven", "skip_last_n_tokens": 1}
    )
    assert mapped["lmcache.local_cpu"] is True  # a private CPU tier beside the pool, when asked for
    assert mapped["lmcache.chunk_size"] == 128 and mapped["skip_last_n_tokens"] == 1
    assert not any(key.startswith("lmcache.mp.") for key in mapped)


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"lmcache.mp.host": "tcp://10.0.0.7"}, "lmcache.mp.host='tcp://10.0.0.7': the node pool is shared memory"),
        ({"lmcache.mp.host": "ipc:///tmp/x"}, "lmcache.mp.host="),
        ({"lmcache.mp.port": 70000}, "lmcache.mp.port=70000"),
        ({"lmcache.mp.port": True}, "lmcache.mp.port=True"),
        ({"lmcache.mp.mp_transfer_mode": "lmcache_driven"}, "lmcache.mp.mp_transfer_mode='lmcache_driven'"),
        ({"lmcache.mp.lazy_offload_threshold": 50}, "lmcache.mp.lazy_offload_threshold: not an LMCacheMPConnector key"),
        ({"lmcache.remote_url": "lm://h:1"}, "lmcache.remote_url is not an LMCacheMPConnector key"),
        *[({key: 1}, f"{key} (an upstream LMCacheMPConnector key) is not supported here") for key in REFUSED_KEYS],
    ],
)
def test_keys_without_meaning_here_are_refused_by_name(extra, message):
    with pytest.raises(ValueError) as err:
        pool_extra_config(extra)
    assert message in str(err.value)


def test_the_token_comes_as_for_lm_urls(monkeypatch, tmp_path):
    """`LMCACHE_REMOTE_TOKEN` (read by the connector) or our `lmcache.remote_password` key."""
    monkeypatch.setenv(RUNTIME_DIR_ENV, str(tmp_path))
    config = lmcache_get_config(pool_extra_config({"lmcache.remote_password": "tok-1"}))
    assert config.remote_password == "tok-1"
    assert "tok-1" not in repr(config)

