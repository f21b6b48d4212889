"""Peer-to-peer sharing: real Redis, real engines, real peer servers (loopback and, as root, two
network namespaces joined by a veth pair).

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
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest
import redis
import torch
from helpers import CHUNK, check_loaded, config, geometry, make_engine, prompt, slots_for
from kv_reference import make_kvcaches
from redis_fixture import RedisServer, free_port, stop_process

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
    client = redis.Redis(port=server.port)
    return {k.decode(): client.get(k).decode() for k in client.scan_iter(CHUNK_PREFIX + "*")}


def p2p_tier(engine: LMCacheEngine) -> P2PBackend:
    return next(t for t in engine.storage_manager.tiers if isinstance(t, P2PBackend))


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
    assert set(records(pair.server).values()) == {f"{pair.a._p2p.recorder.holder.epoch} {pair.a._p2p.server.address[0]}:{pair.a._p2p.server.address[1]}"}
    assert pair.b.lookup(pair.tokens) == TOKENS  # counted, so the v1 door promises it
    assert pair.retrieve() == TOKENS
    assert p2p_tier(pair.b)._stats.snapshot().chunks_read == 5
    assert pair.a._p2p.server.served == 5
