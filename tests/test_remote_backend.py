"""The remote tier over real servers: sharing, serdes, async puts, health, faults, recovery."""

from __future__ import annotations

import socket
import threading
import time
from typing import Iterator, Optional

import pytest
import torch
from helpers import key
from tier_helpers import (
    FAST_REMOTE,
    REMOTE_CHUNK,
    REMOTE_LAYERS,
    remote_backend,
    remote_chunk,
    remote_cpu,
    remote_metadata,
    wait_for,
)
from redis_fixture import (  # noqa: F401
    LMServerProcess,
    RedisServer,
    free_port,
    lmcache_log,
    redis_cluster,
    redis_server,
)

from lmcache.experimental.memory_management import MemoryObj
from lmcache.experimental.remote.connector import RemoteUnavailableError
from lmcache.experimental.remote.lm_connector import LMServerConnector
from lmcache.experimental.remote.serde.cachegen import error_bound
from lmcache.experimental.storage_backend.remote_backend import RemoteBackend, RemoteBackendOptions
from lmcache.server import LMCacheServer, ServerConfig

@pytest.fixture
def lm_server() -> Iterator[LMCacheServer]:
    srv = LMCacheServer(ServerConfig(port=0, max_size_bytes=512 << 20))
    srv.start_in_thread()
    yield srv
    srv.shutdown()


def _lm_url(srv: LMCacheServer) -> str:
    host, port = srv.address
    return f"lm://{host}:{port}"


@pytest.fixture(params=["lm", "redis", "redis-cluster"])
def remote_url(request, tmp_path) -> Iterator[str]:
    if request.param == "lm":
        srv = LMCacheServer(ServerConfig(port=0, max_size_bytes=512 << 20))
        srv.start_in_thread()
        yield _lm_url(srv)
        srv.shutdown()
    elif request.param == "redis":
        server = RedisServer(tmp_path / "redis").start()
        yield server.url
        server.stop()
    else:
        cluster = request.getfixturevalue("redis_cluster")
        cluster.flush_all()
        yield cluster.url


@pytest.mark.parametrize("serde", ["naive", "cachegen"])
def test_second_instance_hits_what_the_first_stored(remote_url: str, serde: str) -> None:
    writer_cpu = remote_cpu()
    writer = remote_backend(remote_url, serde, cpu=writer_cpu)
    chunks = {i: remote_chunk(writer_cpu, seed=i, tokens=REMOTE_CHUNK if i < 3 else 100) for i in range(4)}
    for i, obj in chunks.items():
        writer.submit_put_task(key(i), obj)
    writer.close()
    assert writer.remote_stats().puts_acknowledged == 4

    reader = remote_backend(remote_url, serde)
    assert all(reader.contains(key(i)) for i in chunks) and not reader.contains(key(99))
    got = reader.batched_get_blocking([key(i) for i in chunks] + [key(99)])
    assert got[-1] is None
    for (i, want), obj in zip(chunks.items(), got):
        assert obj is not None and obj.tensor is not None
        assert obj.tensor.shape == want.tensor.shape and obj.tensor.dtype == want.tensor.dtype
        if serde == "naive":
            assert torch.equal(obj.tensor, want.tensor)
        else:
            err = (obj.tensor.float() - want.tensor.float()).abs()
            assert bool((err <= error_bound(want.tensor, 8, 6, 64)).all())
            assert not torch.equal(obj.tensor, want.tensor)  # lossy by design
        obj.ref_count_down()
    single = reader.get_blocking(key(0))
    assert single is not None
    single.ref_count_down()
    assert reader.remote_stats().gets_hit == 5
    reader.close()


def test_flush_sends_the_queue_itself_when_the_put_thread_gets_no_cpu(lm_server, monkeypatch) -> None:
    """The idle-priority put thread starves while the cores are busy; a flush (an engine closing)
    must not wait for it and drop the puts."""
    host, port = lm_server.address
    monkeypatch.setattr(RemoteBackend, "_ensure_worker", lambda self: None)  # the put thread never runs
    cpu = remote_cpu()
    backend = remote_backend(f"lm://{host}:{port}", cpu=cpu)
    for i in range(3):
        obj = remote_chunk(cpu, seed=i)
        backend.submit_put_task(key(i), obj)
        obj.ref_count_down()
    assert backend.flush(timeout_s=10)
    assert backend.remote_stats().puts_acknowledged == 3
    backend.close()
    reader = remote_backend(f"lm://{host}:{port}")
    assert reader.batched_contains([key(i) for i in range(3)]) == [True] * 3
    reader.close()


def test_pending_puts_are_served_from_memory_and_a_full_queue_drops(lm_server) -> None:
    gate = threading.Event()

    class GatedConnector(LMServerConnector):
        def batched_put(self, items):
            gate.wait(timeout=30)
            return super().batched_put(items)

    host, port = lm_server.address
    options = RemoteBackendOptions(put_queue_size=2, put_batch_size=1, lookup_timeout_s=2)
    cpu = remote_cpu()
    backend = remote_backend(_lm_url(lm_server), options=options, cpu=cpu, connector=GatedConnector(host, port))
    objs = [remote_chunk(cpu, seed=i) for i in range(6)]
    for i, obj in enumerate(objs):
        backend.submit_put_task(key(i), obj)
    # One put is held by the worker at the gate, two wait in the queue: the rest were dropped.
    assert wait_for(lambda: backend.remote_stats().puts_dropped_queue_full >= 3)
    assert backend.exists_in_put_tasks(key(0)) and backend.contains(key(0))
    early = backend.get_blocking(key(0))
    assert early is not None and torch.equal(early.tensor, objs[0].tensor)
    early.ref_count_down()
    assert (backend.remote_stats().gets_queued, backend.remote_stats().gets_hit) == (1, 0)  # a hit, not a read
    gate.set()
    backend.close()
    stats = backend.remote_stats()
    assert stats.puts_acknowledged + stats.puts_dropped_queue_full == 6, stats
    assert all(obj.get_ref_count() == 1 for obj in objs)  # the tier released every reference


def test_dead_server_is_a_fast_miss_and_logged(lmcache_log) -> None:  # noqa: F811
    cpu = remote_cpu()
    backend = remote_backend(f"lm://127.0.0.1:{free_port()}", options=FAST_REMOTE, cpu=cpu)
    obj = remote_chunk(cpu, seed=1)
    assert not backend.contains(key(1))
    assert backend.get_blocking(key(1)) is None
    backend.submit_put_task(key(1), obj)
    assert not backend.is_up
    assert "is down" in lmcache_log.text and "requests recompute" in lmcache_log.text
    stats = backend.remote_stats()
    assert stats.times_down == 1 and stats.lookups_failed == 1 and stats.puts_dropped_tier_down >= 1
    backend.close()
    assert obj.get_ref_count() == 1


def test_black_hole_server_times_out_once_then_misses_at_once() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)  # accepts through the backlog, never answers
    try:
        options = RemoteBackendOptions(lookup_timeout_s=0.3, timeout_s=0.5, backoff_initial_s=60)
        backend = remote_backend(f"lm://127.0.0.1:{listener.getsockname()[1]}", options=options)
        assert not backend.contains(key(1))
        assert not backend.is_up
        # Down: no more waiting on the server, for lookups or reads.
        assert not backend.contains(key(2)) and backend.get_blocking(key(2)) is None
        assert backend.remote_stats().lookups_failed == 1
        backend.close()
    finally:
        listener.close()


def test_server_killed_mid_run_then_restarted_resumes_on_its_own(tmp_path, lmcache_log) -> None:  # noqa: F811
    server = LMServerProcess(log_path=tmp_path / "server.log").start()
    cpu = remote_cpu()
    backend = remote_backend(server.url, options=FAST_REMOTE, cpu=cpu)
    try:
        backend.submit_put_task(key(1), remote_chunk(cpu, seed=1))
        assert backend.flush() and backend.contains(key(1))
        server.kill()
        assert not backend.contains(key(1))  # miss, not an error
        assert backend.get_blocking(key(1)) is None
        backend.submit_put_task(key(2), remote_chunk(cpu, seed=2))
        assert "is down" in lmcache_log.text
        server.start()  # same port, empty memory
        assert wait_for(lambda: backend.is_up)
        assert "is back" in lmcache_log.text
        obj = remote_chunk(cpu, seed=3)
        backend.submit_put_task(key(3), obj)
        assert backend.flush() and backend.contains(key(3))
        hit = backend.get_blocking(key(3))
        assert hit is not None and torch.equal(hit.tensor, obj.tensor)
        hit.ref_count_down()
        stats = backend.remote_stats()
        assert stats.times_down == 1 and stats.times_recovered == 1 and stats.puts_acknowledged == 2
    finally:
        backend.close()
        server.stop()


def test_corrupt_foreign_and_misshapen_chunks_are_misses(lm_server) -> None:
    url = _lm_url(lm_server)
    cpu = remote_cpu()
    writer = remote_backend(url, "cachegen", cpu=cpu)
    writer.submit_put_task(key(1), remote_chunk(cpu, seed=1))
    writer.close()
    naive_reader = remote_backend(url, "naive")
    assert naive_reader.contains(key(1)) and naive_reader.get_blocking(key(1)) is None

    raw = LMServerConnector(*lm_server.address)
    good = remote_backend(url, "naive", cpu=cpu)
    good.submit_put_task(key(2), remote_chunk(cpu, seed=2))
    good.flush()
    blob = bytearray(raw.get(key(2).to_string()))
    blob[-1] ^= 0xFF
    assert raw.put(key(2).to_string(), blob)
    assert good.get_blocking(key(2)) is None  # checksum mismatch
    assert raw.put(key(3).to_string(), b"not a chunk at all")
    assert good.get_blocking(key(3)) is None
    # A chunk stored under another key's name is not handed out for it.
    good.submit_put_task(key(4), remote_chunk(cpu, seed=4))
    good.flush()
    assert raw.put(key(5).to_string(), raw.get(key(4).to_string()))
    assert good.get_blocking(key(5)) is None

    other_model = remote_backend(url, "naive", metadata=remote_metadata(layers=REMOTE_LAYERS + 1))
    assert other_model.get_blocking(key(4)) is None
    other_dtype = remote_backend(url, "naive", metadata=remote_metadata(dtype=torch.bfloat16))
    assert other_dtype.get_blocking(key(4)) is None
    assert good.remote_stats().gets_rejected == 3
    for b in (naive_reader, good, other_model, other_dtype):
        b.close()
    raw.close()


def test_redis_out_of_memory_is_a_counted_refusal(tmp_path) -> None:
    server = RedisServer(tmp_path / "r", extra_args=("--maxmemory", "4mb")).start()
    cpu = remote_cpu()
    # One chunk per write: Redis counts a pipeline's pending input against maxmemory too.
    backend = remote_backend(server.url, cpu=cpu, options=RemoteBackendOptions(put_batch_size=1))
    try:
        for i in range(12):
            backend.submit_put_task(key(i), remote_chunk(cpu, seed=i))
        assert backend.flush()
        stats = backend.remote_stats()
        assert stats.puts_refused >= 1 and stats.puts_acknowledged >= 1
        assert stats.puts_refused + stats.puts_acknowledged == 12
        assert backend.is_up  # a full Redis is not a dead Redis
    finally:
        backend.close()
        server.stop()


def test_prefetch_brings_a_chunk_into_the_cpu_tier(lm_server) -> None:
    url = _lm_url(lm_server)
    cpu = remote_cpu()
    writer = remote_backend(url, cpu=cpu)
    obj = remote_chunk(cpu, seed=7)
    writer.submit_put_task(key(7), obj)
    writer.close()
    reader_cpu = remote_cpu()
    reader = remote_backend(url, cpu=reader_cpu)
    assert reader.submit_prefetch_task(key(7))
    assert wait_for(lambda: reader_cpu.contains(key(7)))
    hit: Optional[MemoryObj] = reader_cpu.get_blocking(key(7))
    assert hit is not None and torch.equal(hit.tensor, obj.tensor)
    hit.ref_count_down()
    reader.close()


def test_get_of_a_chunk_being_prefetched_waits_instead_of_reading_twice(lm_server) -> None:
    url = _lm_url(lm_server)
    cpu = remote_cpu()
    writer = remote_backend(url, cpu=cpu)
    obj = remote_chunk(cpu, seed=8)
    writer.submit_put_task(key(8), obj)
    writer.close()
    gate = threading.Event()
    reads: list[int] = []

    class CountingConnector(LMServerConnector):
        def batched_get_into(self, keys, receive):
            reads.append(len(keys))
            gate.wait(timeout=30)
            super().batched_get_into(keys, receive)

    reader = remote_backend(url, connector=CountingConnector(*lm_server.address))
    assert reader.submit_prefetch_task(key(8))
    got: list = []
    getter = threading.Thread(target=lambda: got.append(reader.get_blocking(key(8))))
    getter.start()
    assert wait_for(lambda: len(reads) == 1)
    time.sleep(0.2)  # give a second (wrong) read the chance to start
    gate.set()
    getter.join(timeout=30)
    assert reads == [1] and got[0] is not None and torch.equal(got[0].tensor, obj.tensor)
    got[0].ref_count_down()
    reader.close()


def test_unavailable_error_is_a_connection_error() -> None:
    assert issubclass(RemoteUnavailableError, ConnectionError)


def test_store_path_asks_the_server_nothing_and_a_stored_chunk_is_not_resent(lm_server) -> None:
    """A store's skip test is local (a round trip per chunk would sit in the store); the put
    thread asks once per batch and sends only what the server lacks."""
    cpu = remote_cpu()
    writer = remote_backend(_lm_url(lm_server), cpu=cpu)
    first = remote_chunk(cpu, seed=1)
    writer.submit_put_task(key(1), first)
    first.ref_count_down()
    assert writer.flush(10)
    writer.close()

    backend = remote_backend(_lm_url(lm_server), cpu=cpu)
    asked = []
    real_exists = backend._connector.batched_exists
    backend._connector.batched_exists = lambda keys: (asked.append(len(keys)), real_exists(keys))[1]
    assert backend.contains(key(1)) and asked == [1]  # a lookup asks the server...
    assert not backend.contains_locally(key(1)) and asked == [1]  # ...a store's skip test does not
    for i in (1, 2):
        obj = remote_chunk(cpu, seed=i)
        backend.submit_put_task(key(i), obj)
        assert backend.contains_locally(key(i))  # pending
        obj.ref_count_down()
    assert backend.flush(10)
    stats = backend.remote_stats()
    assert stats.puts_skipped_stored == 1 and stats.puts_acknowledged == 1
    assert sum(asked[1:]) == 2  # one pipelined EXISTS per batch, before sending it
    backend.close()
