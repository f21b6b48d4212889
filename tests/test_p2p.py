"""Peer-to-peer sharing: real Redis, real engines, real peer servers (loopback and, as root, two
network namespaces on one switch, `scripts/netns_machines.py`).

Instance A stores a prompt's KV; instance B, with nothing of its own, looks it up (the lookup
counts the peer's chunks, and a pinned lookup holds them) and retrieves exactly A's bytes. The
faults are each a miss, never an error: a peer killed, a chunk evicted after the lookup, a stale
record, a corrupt chunk, Redis down, a peer without the token.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest
import redis
import torch
from helpers import CHUNK, check_loaded, chunk_bytes, config, geometry, make_engine, prompt, slots_for
from kv_reference import make_kvcaches
from netns_fixture import A_ADDRESS, B_ADDRESS, Machines, in_netns, two_machines  # noqa: F401 (fixture)
from redis_fixture import RedisServer, free_port, stop_process
from tls_fixture import TlsFiles, tls_files  # noqa: F401 (fixture)

from lmcache.experimental.cache_engine import LMCacheEngine
from lmcache.experimental.p2p.records import CHUNK_PREFIX, LIVE_PREFIX
from lmcache.experimental.storage_backend.p2p_backend import P2PBackend

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
GEO = geometry()
TOKENS = 4 * CHUNK + 3  # four full chunks and a partial one: five chunks


@pytest.fixture
def lookup(tmp_path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


def p2p_config(lookup_url: str, port: int, **extra):
    return config(enable_p2p=True, lookup_url=lookup_url, distributed_url=f"127.0.0.1:{port}", **extra)


def wait_for(cond: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.02)


def records(server: RedisServer) -> dict:
    """Every chunk record: its Redis key -> {holder url: epoch}."""
    client = redis.Redis(port=server.port, decode_responses=True)
    return {k: client.hgetall(k) for k in client.scan_iter(CHUNK_PREFIX + "*")}


def p2p_stats(engine: LMCacheEngine):
    """The P2P tier's counters (chunks read, rejected, errors, auth refusals)."""
    return engine.stats().tiers[P2PBackend.__name__]


def served_at(engine: LMCacheEngine) -> str:
    return engine.config.distributed_url  # worker 0: the port as configured


class Pair:
    """Instance A (stored a prompt) and instance B (empty), both on loopback, one Redis."""

    def __init__(self, server: RedisServer, **extra) -> None:
        self.server = server
        self.a = make_engine(GEO, p2p_config(server.url, free_port(), **extra))
        self.b = make_engine(GEO, p2p_config(server.url, free_port(), **extra))
        self.tokens = prompt(TOKENS, seed=3)
        self.source = make_kvcaches(GEO, seed=1)
        self.src_slots = slots_for(GEO, TOKENS, seed=1)

    def store(self) -> None:
        self.a.store(self.tokens, kvcaches=self.source, slot_mapping=self.src_slots)
        wait_for(lambda: len(records(self.server)) == 5, "A's five chunks recorded")

    def retrieve(self) -> int:
        """B's pinned lookup and retrieve; asserts the loaded prefix is A's bytes, returns its length."""
        hit = self.b.lookup(self.tokens, request_id="r1", pin=True)
        target = make_kvcaches(GEO, seed=2)
        dst = slots_for(GEO, TOKENS, seed=2)
        loaded = int(self.b.retrieve(self.tokens, kvcaches=target, slot_mapping=dst).sum())
        self.b.lookup_unpin(["r1"])
        assert loaded == hit
        check_loaded(GEO, self.source, self.src_slots, target, dst, loaded)
        return loaded

    def close(self) -> None:
        self.a.close()
        self.b.close()


@pytest.fixture
def pair(lookup) -> Iterator[Pair]:
    p = Pair(lookup)
    yield p
    p.close()


def test_b_retrieves_exactly_what_a_stored(pair: Pair) -> None:
    pair.store()
    (holders,) = {tuple(r.items()) for r in records(pair.server).values()}  # one holder, one run, every chunk
    ((url, epoch),) = holders
    assert url == served_at(pair.a) and len(epoch) == 16
    assert pair.b.lookup(pair.tokens) == TOKENS  # counted, so the v1 door promises it
    assert pair.retrieve() == TOKENS
    assert p2p_stats(pair.b).chunks_read == 5


def chunk_keys(engine: LMCacheEngine, tokens: torch.Tensor) -> list:
    return [key for *_, key in engine.token_database.process_tokens(tokens)]


def test_a_retrieve_without_a_pinned_lookup_reads_the_peer_once_for_the_whole_prefix(pair: Pair, monkeypatch) -> None:
    """The v0 door and CacheBlend's fetch retrieve without a lookup first: the peer's chunks come
    in one pipelined exchange (`StorageManager.read_ahead`), not one round trip per chunk."""
    pair.store()
    (tier,) = [t for t in pair.b.storage_manager.tiers if isinstance(t, P2PBackend)]
    exchanges = []
    read_peer = tier._read_peer
    monkeypatch.setattr(tier, "_read_peer", lambda url, keys: exchanges.append(len(keys)) or read_peer(url, keys))
    target = make_kvcaches(GEO, seed=2)
    dst = slots_for(GEO, TOKENS, seed=2)
    loaded = int(pair.b.retrieve(pair.tokens, kvcaches=target, slot_mapping=dst).sum())
    assert loaded == TOKENS and exchanges == [5]
    check_loaded(GEO, pair.source, pair.src_slots, target, dst, loaded)


def test_a_reader_becomes_a_second_holder_and_dropping_its_copy_hides_nothing(pair: Pair) -> None:
    pair.store()
    assert pair.retrieve() == TOKENS
    a, b = served_at(pair.a), served_at(pair.b)
    wait_for(lambda: all(set(r) == {a, b} for r in records(pair.server).values()), "B recorded beside A")
    assert pair.b.storage_manager.clear_tier("Hot") == 5
    wait_for(lambda: all(set(r) == {a} for r in records(pair.server).values()), "B's copies withdrawn, A's kept")


def test_a_chunk_evicted_after_the_lookup_ends_the_hit_there(pair: Pair) -> None:
    pair.store()
    assert pair.b.lookup(pair.tokens) == TOKENS
    third = chunk_keys(pair.a, pair.tokens)[2]
    assert pair.a.storage_manager.remove(third) == 1  # gone from A between B's lookup and its read
    assert pair.retrieve() == 2 * CHUNK
    wait_for(lambda: len(records(pair.server)) == 4, "the evicted chunk's record withdrawn")


def test_a_stale_record_is_a_miss_and_is_dropped(pair: Pair) -> None:
    pair.store()
    client = redis.Redis(port=pair.server.port)
    client.set(LIVE_PREFIX + served_at(pair.a), "0123456789abcdef")  # A's run as a restarted A would name it
    assert pair.b.lookup(pair.tokens) == 0
    assert records(pair.server) == {}  # the lookup script dropped all five
    # A notices its live key is not its own at its next heartbeat and records everything again.
    pair.a._p2p.recorder._next_heartbeat = 0.0
    wait_for(lambda: len(records(pair.server)) == 5, "A's records written again under a new epoch")
    assert pair.retrieve() == TOKENS


def test_a_closed_instance_is_a_miss_at_once_and_its_records_are_dropped(pair: Pair) -> None:
    pair.store()
    pair.a.close()  # deletes its live key first
    assert pair.b.lookup(pair.tokens) == 0
    assert records(pair.server) == {}


def test_the_periodic_renewal_renews_the_ttls_under_the_same_epoch(pair: Pair) -> None:
    pair.store()
    client = redis.Redis(port=pair.server.port)
    for name in records(pair.server):
        client.expire(name, 100)
    before = records(pair.server)
    pair.a._p2p.recorder._next_refresh = 0.0  # due now instead of in 12 h
    wait_for(lambda: all(client.ttl(name) > 1000 for name in before), "TTLs renewed")
    assert records(pair.server) == before


def test_a_corrupt_chunk_is_a_miss_and_its_record_is_deleted(pair: Pair) -> None:
    from lmcache.experimental.storage_backend.chunk_format import memory_obj_payload

    pair.store()
    fourth = chunk_keys(pair.a, pair.tokens)[3]
    obj = pair.a.storage_manager.get(fourth)
    memory_obj_payload(obj)[100] ^= 0xFF  # a bit flip in A's memory after the checksum
    obj.ref_count_down()
    assert pair.retrieve() == 3 * CHUNK
    assert p2p_stats(pair.b).rejected_chunks == 1
    assert CHUNK_PREFIX + fourth.to_string() not in records(pair.server)


def test_no_memory_to_read_into_shortens_the_hit_but_keeps_the_peers_records(lookup) -> None:
    pair = Pair(lookup)
    pair.b.close()
    pair.b = make_engine(GEO, p2p_config(lookup.url, free_port()), cpu_bytes=2 * chunk_bytes(GEO))
    try:
        pair.store()
        assert pair.retrieve() == 2 * CHUNK  # room for two chunks
        assert len(records(lookup)) == 5 and p2p_stats(pair.b).rejected_chunks == 0
    finally:
        pair.close()


def test_redis_down_is_a_miss_never_an_error_nor_a_wait(pair: Pair) -> None:
    pair.store()
    pair.server.stop()
    started = time.monotonic()
    assert pair.b.lookup(pair.tokens) == 0
    assert pair.b.lookup(pair.tokens, request_id="r2", pin=True) == 0
    assert time.monotonic() - started < 1.5  # one short timeout, then the backoff answers at once
    pair.a.store(prompt(TOKENS, seed=9), kvcaches=pair.source, slot_mapping=pair.src_slots)  # stores go on


def test_after_redis_comes_back_everything_held_is_recorded_again(pair: Pair, tmp_path) -> None:
    pair.store()
    pair.server.stop()  # its records are gone with it (nothing persisted)
    other = prompt(TOKENS, seed=9)
    pair.a.store(other, kvcaches=pair.source, slot_mapping=pair.src_slots)  # admitted while Redis is down
    time.sleep(0.3)
    pair.server = RedisServer(tmp_path / "redis-again", port=pair.server.port).start()
    try:
        wait_for(lambda: len(records(pair.server)) == 10, "both prompts' chunks recorded again", timeout=8.0)
        assert pair.retrieve() == TOKENS
    finally:
        pair.server.stop()


def test_a_killed_peer_is_a_miss(lookup) -> None:
    port = free_port()
    job = {"role": "store", "lookup_url": f"127.0.0.1:{lookup.port}", "distributed_url": f"127.0.0.1:{port}"}
    peer = run_job(job)
    try:
        assert json.loads(peer.stdout.readline()) == {"stored": True}
        peer.kill()
        peer.wait()
        b = make_engine(GEO, p2p_config(lookup.url, free_port()))
        try:
            started = time.monotonic()
            assert b.lookup(prompt(TOKENS, seed=3), request_id="r", pin=True) == 0  # records live, peer dead
            assert time.monotonic() - started < 2.0
            assert p2p_stats(b).errors == 1
        finally:
            b.close()
    finally:
        stop_process(peer)


def test_a_peer_cut_off_mid_chunk_is_a_miss_and_frees_what_it_half_filled(lookup) -> None:
    from lmcache.experimental.memory_management import MemoryFormat
    from lmcache.experimental.storage_backend.chunk_format import encode_header
    from lmcache.server.protocol import Op, Status, pack_header

    listener = socket.create_server(("127.0.0.1", 0))
    url = f"127.0.0.1:{listener.getsockname()[1]}"
    b = make_engine(GEO, p2p_config(lookup.url, free_port()))
    tokens = prompt(TOKENS, seed=3)
    payload = bytes(torch.zeros(b.gpu_connector.get_shape(CHUNK), dtype=GEO.dtype).numpy().tobytes())
    head = encode_header(chunk_keys(b, tokens)[0], b.gpu_connector.get_shape(CHUNK), GEO.dtype, MemoryFormat.KV_BLOB,
                         payload)

    def half_a_chunk() -> None:  # a peer that dies in the middle of its first answer's payload
        conn, _ = listener.accept()
        conn.recv(65536)
        conn.sendall(pack_header(Op.GET, Status.OK, 0, len(head) + len(payload)) + head + payload[:1000])
        conn.close()

    server = threading.Thread(target=half_a_chunk, daemon=True)
    server.start()
    try:
        client = redis.Redis(port=lookup.port)
        client.set(LIVE_PREFIX + url, "e1")
        for key in chunk_keys(b, tokens):
            client.hset(CHUNK_PREFIX + key.to_string(), url, "e1")
        assert b.lookup(tokens, request_id="r", pin=True) == 0
        assert b.storage_manager.usage_bytes().get("Hot", 0) == 0  # the half-filled object was freed
        assert (p2p_stats(b).errors, p2p_stats(b).rejected_chunks) == (1, 0)
    finally:
        b.close()
        server.join(timeout=5)
        listener.close()


def test_a_stalled_peer_costs_a_lookup_one_read_timeout(lookup) -> None:
    from lmcache.experimental.storage_backend.p2p_backend import READ_TIMEOUT_S

    listener = socket.create_server(("127.0.0.1", 0))  # accepts (the kernel does), never answers
    url = f"127.0.0.1:{listener.getsockname()[1]}"
    b = make_engine(GEO, p2p_config(lookup.url, free_port()))
    try:
        tokens = prompt(TOKENS, seed=3)
        client = redis.Redis(port=lookup.port)
        client.set(LIVE_PREFIX + url, "e1")
        for key in chunk_keys(b, tokens):
            client.hset(CHUNK_PREFIX + key.to_string(), url, "e1")
        started = time.monotonic()
        assert b.lookup(tokens, request_id="r", pin=True) == 0
        assert b.lookup(tokens) == 0  # the peer is skipped now: not even counted
        assert time.monotonic() - started < READ_TIMEOUT_S + 1.0
    finally:
        b.close()
        listener.close()


def test_a_peer_without_the_token_reads_nothing(lookup, tmp_path) -> None:
    token = tmp_path / "p2p-token"
    token.write_text("s3cret-p2p-token\n")
    pair = Pair(lookup, p2p_token_file=str(token))
    try:
        pair.store()
        outsider = make_engine(GEO, p2p_config(lookup.url, free_port()))
        try:
            assert outsider.lookup(pair.tokens, request_id="r", pin=True) == 0
            assert p2p_stats(outsider).auth_refusals == 1
        finally:
            outsider.close()
        assert pair.retrieve() == TOKENS  # with the token: everything
    finally:
        pair.close()


def test_peers_over_tls_read_everything_and_a_plaintext_or_untrusting_reader_nothing(lookup, tls_files: TlsFiles) -> None:
    tls = dict(p2p_tls_cert_file=str(tls_files.cert), p2p_tls_key_file=str(tls_files.key))
    pair = Pair(lookup, **tls, p2p_tls_ca_file=str(tls_files.ca))
    try:
        pair.store()
        assert pair.retrieve() == TOKENS
        for outsider_keys in ({}, dict(tls, p2p_tls_ca_file=str(tls_files.other_ca))):  # no TLS; another CA
            outsider = make_engine(GEO, p2p_config(lookup.url, free_port(), **outsider_keys))
            try:
                assert outsider.lookup(pair.tokens, request_id="r", pin=True) == 0
                outsider.lookup_unpin(["r"])
            finally:
                outsider.close()
    finally:
        pair.close()


def test_tls_keys_must_come_together_and_unreadable_files_are_named(tmp_path) -> None:
    from lmcache.experimental.p2p.peer_server import PeerServer

    with pytest.raises(ValueError, match="p2p_tls_key_file=None"):
        config(p2p_tls_cert_file="/etc/cert.pem")
    with pytest.raises(ValueError, match="p2p_tls_ca_file='/etc/ca.pem' without"):
        config(p2p_tls_ca_file="/etc/ca.pem")
    with pytest.raises(ValueError, match="p2p_tls_cert_file=.*cannot load"):
        PeerServer(None, "127.0.0.1:8200", token=None, no_auth=False,  # type: ignore[arg-type]
                   tls_cert=str(tmp_path / "missing.pem"), tls_key=str(tmp_path / "missing.key"))


def test_worker_n_serves_on_port_plus_n_and_the_token_comes_from_the_file_or_the_variable(tmp_path) -> None:
    from lmcache.experimental.p2p.peer_server import P2P_TOKEN_ENV, p2p_token, served_address

    cfg = config(enable_p2p=True, lookup_url="127.0.0.1:6379", distributed_url="[::1]:8200")
    assert (served_address(cfg, 0), served_address(cfg, 3)) == ("[::1]:8200", "[::1]:8203")
    assert p2p_token(cfg, {}) is None and p2p_token(cfg, {P2P_TOKEN_ENV: " abc\n"}) == b"abc"
    (tmp_path / "t").write_text("from-file\n")
    assert p2p_token(config(p2p_token_file=str(tmp_path / "t")), {P2P_TOKEN_ENV: "abc"}) == b"from-file"


def test_protected_mode_refuses_a_peer_server_beyond_loopback_without_a_token(lookup) -> None:
    from lmcache.experimental.p2p.peer_server import PeerServer

    with pytest.raises(ValueError, match=r"without a token.*LMCACHE_P2P_TOKEN"):
        PeerServer(None, "198.18.0.1:8200", token=None, no_auth=False)  # type: ignore[arg-type]


def run_job(job: dict, netns: str = "") -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{TESTS}", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([*in_netns(netns), sys.executable, str(TESTS / "p2p_engine_job.py"), json.dumps(job)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)


def test_b_in_another_namespace_retrieves_what_a_stored(two_machines: Machines, tmp_path) -> None:
    token = tmp_path / "p2p-token"
    token.write_text("s3cret-p2p-token\n")
    common = {"lookup_url": two_machines.lookup_url, "config": {"p2p_token_file": str(token)}}
    peer = run_job({"role": "store", "distributed_url": f"{A_ADDRESS}:8200", **common}, netns=two_machines.a)
    try:
        assert json.loads(peer.stdout.readline()) == {"stored": True}
        reader = run_job({"role": "retrieve", "distributed_url": f"{B_ADDRESS}:8200", **common}, netns=two_machines.b)
        out, _ = reader.communicate(timeout=120)
        assert json.loads(out.strip().splitlines()[-1]) == {"lookup": TOKENS, "loaded": TOKENS, "exact": True}
    finally:
        stop_process(peer)
