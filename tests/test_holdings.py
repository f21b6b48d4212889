"""The stream of what the tiers hold (`holdings.py`): bounded, numbered, a resync after an
overflow; and every tier reporting what it admits and what it loses, with the reason."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import key
from redis_fixture import pool  # noqa: F401 (fixture)
from tier_helpers import (  # noqa: F401 (cpu: fixture)
    cpu,
    disk_store,
    disk_tier,
    keys_of,
    remote_backend,
    remote_chunk,
    remote_cpu,
    small_engine,
    store_prompt,
    wait_for,
)

from lmcache.experimental.holdings import Change, HoldingsStream, Medium
from lmcache.experimental.remote.lm_connector import LMServerConnector
from lmcache.experimental.storage_backend import chunk_format
from lmcache.server import LMCacheServer, ServerConfig

KV_EVENTS = {"enable_kv_events": True, "kv_events_endpoint": "tcp://*:5557"}


def changes(stream: HoldingsStream, tier: str = "") -> list:
    """(change, key, reason) of the events taken, of one tier (all tiers when "")."""
    return [(e.change, e.key, e.reason) for e in stream.take().events if not tier or e.tier == tier]


def test_events_are_numbered_and_taken_once() -> None:
    stream = HoldingsStream()
    tier = stream.tier("T", Medium.CPU)
    tier.admitted(key(1))
    tier.lost(key(1), "eviction")
    batch = stream.take()
    assert [(e.seq, e.change, e.tier, e.medium) for e in batch.events] == [
        (1, Change.ADMITTED, "T", Medium.CPU), (2, Change.LOST, "T", Medium.CPU),
    ]
    assert batch.next_seq == 3 and not batch.resync and batch.dropped == 0
    assert stream.take().events == ()


def test_a_full_stream_drops_counts_and_asks_for_one_resync_with_a_visible_gap() -> None:
    stream = HoldingsStream(max_pending=3)
    tier = stream.tier("T", Medium.STORAGE)
    for i in range(5):
        tier.admitted(key(i))
    batch = stream.take()
    assert [e.seq for e in batch.events] == [1, 2, 3] and batch.dropped == 2 and batch.resync
    tier.cleared("clear")
    after = stream.take()
    assert [e.seq for e in after.events] == [6]  # 4 and 5 never arrive: the gap shows the loss
    assert not after.resync and after.dropped == 2  # the resync was handed over once
    with pytest.raises(ValueError, match="max_pending"):
        HoldingsStream(max_pending=0)


def test_each_consumer_gets_every_event_and_its_own_overflow_and_resync() -> None:
    stream = HoldingsStream(max_pending=2, consumers=("kv_events", "controller"))
    tier = stream.tier("T", Medium.CPU)
    tier.admitted(key(1))
    tier.admitted(key(2))
    assert [e.seq for e in stream.take("kv_events").events] == [1, 2]  # one consumer's take steals nothing
    tier.admitted(key(3))
    late = stream.take("controller")
    assert [e.seq for e in late.events] == [1, 2] and late.resync and late.dropped == 1
    prompt = stream.take("kv_events")
    assert [e.seq for e in prompt.events] == [3] and not prompt.resync and prompt.dropped == 0
    with pytest.raises(KeyError, match="no consumer 'router'"):
        stream.take("router")
    with pytest.raises(ValueError, match="distinct"):
        HoldingsStream(consumers=("a", "a"))


def test_a_consumer_sleeps_until_its_queue_has_something_and_wakes_at_once() -> None:
    """`wait` lets the controller client and the P2P recorder sleep while nothing changes, and
    wakes only the consumer whose queue got an event (or a resync)."""
    import threading
    import time

    stream = HoldingsStream(max_pending=1, consumers=("a", "b"))
    started = time.monotonic()
    assert stream.wait("a", 0.05) is False and time.monotonic() - started >= 0.05
    woke = []
    waiter = threading.Thread(target=lambda: woke.append((stream.wait("a", 5.0), time.monotonic())))
    waiter.start()
    time.sleep(0.05)
    sent = time.monotonic()
    stream.report(Change.ADMITTED, "Hot", Medium.CPU, key(1), "store")
    waiter.join(5)
    assert woke and woke[0][0] is True and woke[0][1] - sent < 0.5
    assert stream.wait("a", 0.0) is True and stream.wait("b", 0.0) is True  # both queues hold it
    stream.take("a")
    assert stream.wait("a", 0.0) is False
    stream.report(Change.ADMITTED, "Hot", Medium.CPU, key(2), "store")  # "b" is full: a drop and a resync
    stream.take("a")
    stream.take("b")
    assert stream.wait("b", 0.0) is False
    stream.report(Change.ADMITTED, "Hot", Medium.CPU, key(3), "store")
    stream.report(Change.ADMITTED, "Hot", Medium.CPU, key(4), "store")  # dropped for "b": resync asked
    b = stream.take("b")
    assert b.resync and stream.wait("b", 0.0) is False


def test_the_controller_alone_gets_a_stream_without_token_records() -> None:
    engine = small_engine(num_chunks=4, enable_controller=True, controller_pull_url="127.0.0.1:1",
                          controller_reply_url="127.0.0.1:2")
    tokens, *_ = store_prompt(engine, 16, seed=1)
    assert engine.holdings.consumers == ("controller",) and engine.chunk_tokens is None
    assert [e.key for e in engine.holdings.take("controller").events] == keys_of(engine, tokens)
    engine.close()


def test_cpu_tier_reports_store_eviction_remove_and_close_and_the_store_records_tokens() -> None:
    engine = small_engine(num_chunks=4, **KV_EVENTS)
    stream = engine.holdings
    tokens, *_ = store_prompt(engine, 32, seed=1)  # 4 chunks of 8
    first = keys_of(engine, tokens)
    admitted = stream.take().events
    assert [(e.change, e.key, e.reason, e.tier, e.medium) for e in admitted] == [
        (Change.ADMITTED, k, "store", "Hot", Medium.CPU) for k in first
    ]
    record = engine.chunk_tokens.get(first[1])
    assert record.token_ids() == tokens[8:16].tolist() and record.parent == first[0]
    assert engine.chunk_tokens.get(first[0]).parent is None

    store_prompt(engine, 16, seed=2)  # 2 more chunks: the 2 least recently used go
    got = changes(stream)
    assert got[:2] == [(Change.LOST, first[0], "eviction"), (Change.LOST, first[1], "eviction")]
    assert [c for c, *_ in got[2:]] == [Change.ADMITTED, Change.ADMITTED]

    engine.storage_manager.remove(first[2])
    assert changes(stream) == [(Change.LOST, first[2], "remove")]
    engine.close()
    assert changes(stream) == [(Change.CLEARED, None, "close")]


def test_a_masked_store_records_the_parent_of_its_first_chunk() -> None:
    engine = small_engine(num_chunks=8, **KV_EVENTS)
    tokens, source, slots = store_prompt(engine, 16, seed=3)
    mask = torch.ones(24, dtype=torch.bool)
    mask[:16] = False
    longer = torch.cat([tokens, tokens[:8] + 1])
    engine.store(longer, mask, kvcaches=source, slot_mapping=torch.cat([slots, slots[:8]]))
    keys = keys_of(engine, longer)
    assert engine.chunk_tokens.get(keys[2]).parent == keys[1]
    engine.close()


def test_without_kv_events_nothing_is_recorded() -> None:
    engine = small_engine(num_chunks=4)
    store_prompt(engine, 16, seed=1)
    assert engine.holdings is None and engine.chunk_tokens is None
    engine.close()


def test_disk_tier_reports_writes_evictions_corrupt_files_removes_and_what_it_found(tmp_path, cpu) -> None:
    stream = HoldingsStream()
    disk = disk_tier(tmp_path, cpu)
    disk.report_holdings_to(stream.tier(disk.tier_name, disk.medium))
    disk_store(disk, cpu, 0, 1)
    disk.flush()
    assert changes(stream) == [(Change.ADMITTED, key(0), "store"), (Change.ADMITTED, key(1), "store")]
    assert disk.medium is Medium.STORAGE
    one_file = os.path.getsize(disk.key_to_path(key(0)))
    disk.close()

    small = disk_tier(tmp_path, cpu, max_bytes=2 * one_file + one_file // 2)
    small.report_holdings_to(stream.tier(small.tier_name, small.medium))
    assert changes(stream) == [(Change.ADMITTED, key(0), "found at start"), (Change.ADMITTED, key(1), "found at start")]
    disk_store(small, cpu, 2)
    small.flush()
    assert changes(stream) == [(Change.LOST, key(0), "eviction"), (Change.ADMITTED, key(2), "store")]
    with open(small.key_to_path(key(1)), "r+b") as f:
        f.seek(-3, os.SEEK_END)
        f.write(b"\xff\xfe\xfd")
    assert small.get_blocking(key(1)) is None
    assert small.remove(key(2))
    assert changes(stream) == [(Change.LOST, key(1), "corrupt"), (Change.LOST, key(2), "remove")]
    small.close()


def test_disk_tier_reports_a_failed_write_as_lost(tmp_path, cpu, monkeypatch) -> None:
    stream = HoldingsStream()
    disk = disk_tier(tmp_path, cpu)
    disk.report_holdings_to(stream.tier(disk.tier_name, disk.medium))

    def no_header(*args, **kwargs):
        raise ValueError("no room for the header")

    monkeypatch.setattr(chunk_format, "encode_header", no_header)
    disk_store(disk, cpu, 3)
    disk.flush()
    assert changes(stream) == [(Change.LOST, key(3), "write failed")]
    disk.close()


def test_remote_tier_reports_acknowledged_puts_corrupt_reads_and_going_down(tmp_path) -> None:
    srv = LMCacheServer(ServerConfig(port=0, max_size_bytes=64 << 20))
    srv.start_in_thread()
    host, port = srv.address
    stream = HoldingsStream()
    cpu = remote_cpu()
    remote = remote_backend(f"lm://{host}:{port}", cpu=cpu)
    remote.report_holdings_to(stream.tier(remote.tier_name, remote.medium))
    try:
        assert remote.medium is Medium.STORAGE
        for i in (1, 2):
            obj = remote_chunk(cpu, seed=i)
            remote.submit_put_task(key(i), obj)
            obj.ref_count_down()
        assert remote.flush()
        # Sent by the put thread in one or two batches: in either order.
        assert sorted(changes(stream), key=str) == [(Change.ADMITTED, key(1), "store"), (Change.ADMITTED, key(2), "store")]
        raw = LMServerConnector(host, port)
        assert raw.put(key(2).to_string(), b"not a chunk at all")
        raw.close()
        assert remote.get_blocking(key(2)) is None
        assert changes(stream) == [(Change.LOST, key(2), "corrupt")]
        srv.shutdown()
        assert not remote.contains(key(1))
        assert changes(stream) == [(Change.CLEARED, None, "tier down")]
    finally:
        remote.close()
        srv.shutdown()


def test_node_pool_reports_its_in_place_commits_as_host_memory(pool) -> None:  # noqa: F811
    engine = small_engine(remote_url=pool.pool_url, local_cpu=False, remote_serde="naive", **KV_EVENTS)
    remote = engine.storage_manager.tiers[-1]
    try:
        tokens, *_ = store_prompt(engine, 16, seed=5)
        assert remote.flush()
        got = [(e.change, e.key, e.tier, e.medium) for e in engine.holdings.take().events]
        assert got == [(Change.ADMITTED, k, remote.tier_name, Medium.CPU) for k in keys_of(engine, tokens)]
    finally:
        engine.close()
