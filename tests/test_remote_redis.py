"""The Redis connector against a real redis-server (single node and a three-master cluster)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess

import pytest
import redis
from redis_fixture import RedisServer, free_port, lmcache_log, redis_cluster, redis_server  # noqa: F401

from lmcache.experimental.remote import create_connector
from lmcache.experimental.remote.connector import RemoteUnavailableError
from lmcache.experimental.remote.redis_connector import RedisConnector
from lmcache.experimental.remote.resp_get import PIECE, ValueChanged, _read_length


def _connector(server: RedisServer, **kwargs) -> RedisConnector:
    return RedisConnector([("127.0.0.1", server.port)], key_prefix="lmcache:tiny:", **kwargs)


def test_round_trip_with_prefix_and_pipelined_batches(redis_server: RedisServer) -> None:  # noqa: F811
    conn = _connector(redis_server)
    items = [(f"vllm@tiny@1@0@{i:04x}", os.urandom(10_000 + i)) for i in range(50)]
    assert conn.batched_put(items) == [True] * 50
    keys = [k for k, _ in items] + ["vllm@tiny@1@0@ffff"]
    got = conn.batched_get(keys)
    assert got[:-1] == [v for _, v in items] and got[-1] is None
    assert conn.batched_exists(keys) == [True] * 50 + [False]
    raw = redis.Redis(port=redis_server.port)
    stored = sorted(k.decode() for k in raw.scan_iter(match="lmcache:tiny:*"))
    assert stored == sorted(f"lmcache:tiny:{k}" for k, _ in items)
    assert raw.ttl(stored[0]) == -1  # no TTL unless asked for
    assert conn.delete(keys[0]) and not conn.exists(keys[0])
    conn.close()


def test_value_changed_while_read_is_a_miss_and_the_next_values_still_arrive(redis_server: RedisServer) -> None:  # noqa: F811
    conn = _connector(redis_server)
    values = {f"v{i}": os.urandom(2 * PIECE + 1000 + i) for i in range(3)}  # three pieces each
    assert all(conn.batched_put(list(values.items())))
    other = redis.Redis(port=redis_server.port)
    outcome: dict = {}

    def receive(i: int, reader) -> None:
        if i == 0:  # value 1's length is known, its later pieces not asked for yet
            other.delete("lmcache:tiny:v1")
        target = bytearray(reader.size)
        try:
            reader.readinto(memoryview(target))
        except ValueChanged:
            outcome[i] = "changed"
            return
        outcome[i] = bytes(target)

    conn.batched_get_into(list(values), receive)
    assert outcome == {0: values["v0"], 1: "changed", 2: values["v2"]}
    assert conn.batched_get(["v0", "v1"]) == [values["v0"], None]  # the connection stayed in step
    conn.close()


def test_ttl_is_applied(redis_server: RedisServer) -> None:  # noqa: F811
    conn = _connector(redis_server, ttl_s=120)
    assert conn.put("k", b"v")
    ttl = redis.Redis(port=redis_server.port).pttl("lmcache:tiny:k")
    assert 0 < ttl <= 120_000
    conn.close()


def test_value_over_proto_max_bulk_len_is_refused_with_a_clear_message(tmp_path, lmcache_log) -> None:  # noqa: F811
    server = RedisServer(tmp_path / "r", extra_args=("--proto-max-bulk-len", "1mb")).start()
    try:
        conn = _connector(server)
        results = conn.batched_put([("small", b"x" * 1000), ("big", b"x" * (2 << 20))])
        assert results == [True, False]
        assert "proto-max-bulk-len of 1048576" in lmcache_log.text and "big" in lmcache_log.text
        assert conn.exists("small") and not conn.exists("big") and conn.refused_puts == 1
        conn.close()
    finally:
        server.stop()


def test_out_of_memory_reply_is_a_dropped_put_not_an_error(tmp_path, lmcache_log) -> None:  # noqa: F811
    server = RedisServer(tmp_path / "r", extra_args=("--maxmemory", "3mb", "--maxmemory-policy", "noeviction")).start()
    try:
        conn = _connector(server)
        results = [conn.put(f"k{i}", b"x" * 500_000) for i in range(20)]
        assert results[0] and not results[-1]
        assert conn.refused_puts >= 1 and "out of memory" in lmcache_log.text
        assert conn.get("k0") == b"x" * 500_000  # what landed is still served
        conn.close()
    finally:
        server.stop()


def test_dead_and_black_hole_servers_raise_unavailable() -> None:
    conn = RedisConnector([("127.0.0.1", free_port())], lookup_timeout=0.3, timeout=0.5)
    with pytest.raises(RemoteUnavailableError):
        conn.exists("k")
    with pytest.raises(RemoteUnavailableError):
        conn.put("k", b"v")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    conn = RedisConnector([("127.0.0.1", listener.getsockname()[1])], lookup_timeout=0.3, timeout=0.5)
    with pytest.raises(RemoteUnavailableError, match="Timeout"):
        conn.exists("k")
    with pytest.raises(RemoteUnavailableError):
        conn.get("k")
    listener.close()


def test_restart_recovers_without_a_new_connector(tmp_path) -> None:
    server = RedisServer(tmp_path / "r").start()
    conn = _connector(server)
    assert conn.put("k", b"v1")
    server.stop()
    with pytest.raises(RemoteUnavailableError):
        conn.get("k")
    server.start()
    assert conn.put("k", b"v2") and conn.get("k") == b"v2"
    conn.close()
    server.stop()


def test_cluster_spreads_keys_over_three_masters(redis_cluster) -> None:  # noqa: F811
    hosts = [("127.0.0.1", n.port) for n in redis_cluster.nodes]
    conn = RedisConnector(hosts, cluster=True, key_prefix="lmcache:tiny:")
    items = [(f"vllm@tiny@1@0@{i:04x}", os.urandom(2000)) for i in range(60)]
    assert conn.batched_put(items) == [True] * 60
    assert conn.batched_get([k for k, _ in items]) == [v for _, v in items]
    assert conn.batched_exists(["vllm@tiny@1@0@0001", "nope"]) == [True, False]
    per_node = [redis.Redis(port=n.port).dbsize() for n in redis_cluster.nodes]
    assert sum(per_node) >= 60 and all(count > 0 for count in per_node)
    assert conn.delete("vllm@tiny@1@0@0001") and not conn.exists("vllm@tiny@1@0@0001")
    conn.close()


def test_rediss_connects_over_tls(tmp_path, monkeypatch) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    port = free_port()
    tls = ("--port", "0", "--tls-port", str(port), "--tls-cert-file", str(cert), "--tls-key-file", str(key),
           "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no")  # fmt: skip
    server = RedisServer(tmp_path / "r", extra_args=tls, port=port).start()
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # trust the test certificate
    try:
        conn = create_connector(f"rediss://127.0.0.1:{port}", key_prefix="lmcache:tiny:")
        assert conn.url.startswith("rediss://")
        assert conn.put("k", b"over tls") and conn.get("k") == b"over tls"
        got: list = []  # our own reader of GET replies, on redis-py's TLS connection
        conn.batched_get_into(["missing", "k"], lambda i, reader: got.append((i, bytes(reader.read(reader.size)))))
        assert got == [(1, b"over tls")]
        conn.close()
        plain = RedisConnector([("127.0.0.1", port)], lookup_timeout=0.5, timeout=0.5)
        with pytest.raises(RemoteUnavailableError):  # a plain client cannot talk to a TLS port
            plain.exists("k")
    finally:
        server.stop()


@pytest.mark.parametrize("reply", [b":-5\r\n", b":12x\r\n", b"+OK\r\n"])
def test_strlen_reply_out_of_step_is_unavailable_not_a_read(reply: bytes) -> None:
    ours, peer = socket.socketpair()
    with ours, peer:
        peer.sendall(reply)
        with pytest.raises(RemoteUnavailableError):
            _read_length(ours, "k", "redis://test")
