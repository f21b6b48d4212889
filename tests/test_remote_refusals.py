"""A chunk too large for the remote store is a refused put: counted, logged, never a tier failure -
against a real `lmcache_server` process and a real `redis-server` whose CONFIG is disabled."""

from __future__ import annotations

import json
import socket

import torch
from redis_fixture import LMServerProcess, RedisServer, lmcache_log  # noqa: F401
from helpers import key
from tier_helpers import remote_backend, remote_chunk, remote_cpu

from lmcache.experimental.remote.lm_connector import LMServerConnector
from lmcache.experimental.remote.redis_connector import RedisConnector
from lmcache.server.protocol import HEADER_SIZE, Op, Status, pack_header, parse_header, recv_exact, send_frame

MIB = 1 << 20


def _put_big_and_small(url: str) -> tuple:
    """Store one chunk over 1 MiB (float32) and one under it; (stats, backend, small object)."""
    cpu = remote_cpu()
    backend = remote_backend(url, cpu=cpu)
    big, small = remote_chunk(cpu, 1, dtype=torch.float32), remote_chunk(cpu, 2)
    assert big.get_size() >= MIB > small.get_size()
    backend.submit_put_task(key(1), big)
    backend.submit_put_task(key(2), small)
    assert backend.flush(10)
    return backend.remote_stats(), backend, small


def test_lm_chunk_over_the_server_frame_limit_is_refused_and_the_tier_stays_up(tmp_path) -> None:
    server = LMServerProcess(extra_args=("--max-frame-mb", "1"), log_path=tmp_path / "s.log").start()
    try:
        stats, backend, small = _put_big_and_small(server.url)
        assert stats.puts_refused == 1 and stats.puts_acknowledged == 1
        assert stats.puts_lost == 0 and stats.times_down == 0 and backend.is_up
        assert backend.contains(key(2)) and not backend.contains(key(1))
        got = backend.get_blocking(key(2))
        assert got is not None and torch.equal(got.tensor, small.tensor)
        backend.close()
    finally:
        server.stop()


def test_lm_server_refuses_an_oversize_put_on_a_connection_that_stays_usable(tmp_path) -> None:
    """An older or misconfigured client that sends it anyway: REFUSED naming the limit, the
    payload drained, the next request on the same connection answered, the refusal counted."""
    server = LMServerProcess(extra_args=("--max-frame-mb", "1"), log_path=tmp_path / "s.log").start()
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            send_frame(sock, Op.PUT, key=b"big", payload=bytes(2 * MIB))
            reply = parse_header(recv_exact(sock, HEADER_SIZE, "reply"), MIB, is_request=False)
            body = json.loads(bytes(recv_exact(sock, reply.payload_len, "reason")))
            assert (reply.op, reply.status) == (Op.PUT, Status.REFUSED)
            assert body == {"reason": "too_large", "max_payload_bytes": MIB}
            sock.sendall(pack_header(Op.PING, Status.OK, 0, 0))
            pong = parse_header(recv_exact(sock, HEADER_SIZE, "pong"), MIB, is_request=False)
            assert (pong.op, pong.status) == (Op.PING, Status.OK)
        conn = LMServerConnector("127.0.0.1", server.port)
        info = conn.info()
        assert info["refused_puts"] == 1 and info["refused_too_large"] == 1 and info["protocol_errors"] == 0
        assert info["max_payload_bytes"] == MIB
        conn.close()
    finally:
        server.stop()


def test_lm_client_learns_a_lower_limit_from_the_refusal_after_a_restart(tmp_path) -> None:
    server = LMServerProcess(extra_args=("--max-frame-mb", "4"), log_path=tmp_path / "s.log").start()
    conn = LMServerConnector("127.0.0.1", server.port, timeout=5, lookup_timeout=2)
    try:
        assert conn.put("a", bytes(2 * MIB)) and conn.max_payload_bytes == 4 * MIB  # learned by INFO
        server.stop()
        server.extra_args = ("--max-frame-mb", "1")
        server.start()  # same port, lower limit; the client still believes 4 MiB
        assert not conn.put("b", bytes(2 * MIB))  # sent, refused, limit named in the reply
        assert conn.max_payload_bytes == MIB
        assert not conn.put("c", bytes(2 * MIB)) and conn.put("d", b"small")
        assert conn.info()["refused_too_large"] == 1  # "c" was refused without being sent
    finally:
        conn.close()
        server.stop()


def _redis_without_config(tmp_path) -> RedisServer:
    """A Redis like a managed one: CONFIG disabled, and a bulk limit lower than the default."""
    return RedisServer(
        tmp_path / "redis", extra_args=("--proto-max-bulk-len", "1mb", "--rename-command", "CONFIG", "")
    ).start()


def test_redis_without_config_refuses_too_long_values_and_keeps_serving(tmp_path, lmcache_log) -> None:  # noqa: F811
    server = _redis_without_config(tmp_path)
    conn = RedisConnector([("127.0.0.1", server.port)], timeout=5, lookup_timeout=2)
    try:
        assert conn.put("small", b"x" * 100)
        assert not conn.put("big", bytes(2 * MIB))  # Redis drops the connection: a refusal
        assert "values over" in lmcache_log.text and conn.refused_puts == 1
        assert conn.put("small2", b"y" * 100) and bytes(conn.get("small")) == b"x" * 100
        assert not conn.put("big2", bytes(2 * MIB)) and conn.refused_puts == 2  # refused before sending
        assert conn.get("big") is None and conn.get("big2") is None
    finally:
        conn.close()
        server.stop()


def test_redis_without_config_oversize_chunk_never_takes_the_tier_down(tmp_path) -> None:
    server = _redis_without_config(tmp_path)
    try:
        stats, backend, small = _put_big_and_small(server.url)
        assert stats.puts_refused == 1 and stats.puts_acknowledged == 1
        assert stats.puts_lost == 0 and stats.times_down == 0 and backend.is_up
        got = backend.get_blocking(key(2))
        assert got is not None and torch.equal(got.tensor, small.tensor)
        backend.close()
    finally:
        server.stop()
