"""The lm:// server's store (`server/store.py`) and its arena (`server/arena.py`): LRU order,
exact accounting, values received into reused arena blocks, and leases that keep a value's
memory from reuse while it is being sent."""

from __future__ import annotations

import socket
import sys
import time

import pytest

from test_host_memory import _mapping_stats

from lmcache.server.arena import ALIGN, ValueArena
from lmcache.server.protocol import Op, Status, pack_header
from lmcache.server.server import LMCacheServer, ServerConfig
from lmcache.server.store import LRUChunkStore


def _fill(store: LRUChunkStore, key: bytes, value: bytes) -> bool:
    """Receive `value` as the server does: into a reservation, then put."""
    reservation = store.reserve(len(value))
    assert reservation is not None
    reservation.view[:] = value
    return store.put(key, reservation)


def test_store_evicts_least_recently_used_first() -> None:
    store = LRUChunkStore(max_bytes=3 * 128)
    for name in (b"a", b"b", b"c"):
        assert store.put(name, bytes(127))
    lease = store.get(b"a")  # a becomes most recent; b is now the oldest
    assert lease is not None
    lease.release()
    assert store.put(b"d", bytes(127))
    assert store.get(b"b") is None
    assert all(store.exists(k) for k in (b"a", b"c", b"d"))
    stats = store.stats()
    assert stats.evictions == 1 and stats.entries == 3 and stats.bytes_used == 384


def test_store_refuses_what_can_never_fit_and_keeps_the_rest() -> None:
    store = LRUChunkStore(max_bytes=1000)
    assert store.put(b"k", bytes(500))
    assert not store.fits(1, 1000)
    assert not store.put(b"big", bytes(1000))
    with store.get(b"k") as value:
        assert value == bytes(500)
    assert store.stats().refused_puts == 1


def test_store_replace_and_delete_keep_accounting_exact() -> None:
    store = LRUChunkStore(max_bytes=1000)
    store.put(b"k", bytes(100))
    store.put(b"k", bytes(300))
    assert store.stats().bytes_used == 301
    assert store.delete(b"k") and not store.delete(b"k")
    assert store.stats().bytes_used == 0 and store.stats().entries == 0


# A value that, with its 2-byte key, takes one arena block: a store of N blocks holds N.
V = ALIGN - 8


def test_values_live_in_arena_blocks_that_are_reused_once_evicted() -> None:
    store = LRUChunkStore(max_bytes=3 * ALIGN)
    for i in range(3):
        assert _fill(store, b"k%d" % i, bytes([i]) * V)
    assert store.arena.used_bytes == 3 * ALIGN and store.stats().puts_outside_arena == 0
    first = store.get(b"k0")
    assert first is not None
    first.release()
    # k1 is now the oldest: a fourth value evicts it and takes its block (no fresh memory).
    reservation = store.reserve(V)
    assert reservation is not None and reservation.block == ALIGN
    assert store.get(b"k1") is None and store.stats().evictions == 1
    reservation.view[:] = b"\x07" * V
    assert store.put(b"k3", reservation)
    for key, byte in ((b"k0", 0), (b"k2", 2), (b"k3", 7)):
        with store.get(key) as value:
            assert value == bytes([byte]) * V
    assert store.delete(b"k3") and store.arena.used_bytes == 2 * ALIGN


def test_a_leased_value_keeps_its_memory_until_released() -> None:
    """A GET still sending an evicted value must not see a later put's bytes in it."""
    store = LRUChunkStore(max_bytes=2 * ALIGN)
    assert _fill(store, b"ol", b"\x01" * V)
    lease = store.get(b"ol")
    assert lease is not None
    assert _fill(store, b"k1", b"\x02" * V)
    # The arena is full: a third value evicts "ol", whose block is leased, then "k1" - and gets
    # k1's block, never the leased one.
    reservation = store.reserve(V)
    assert reservation is not None and reservation.block == ALIGN
    assert not store.exists(b"ol") and store.stats().evictions == 2
    reservation.view[:] = b"\x03" * V
    assert store.put(b"k2", reservation)
    # Once more: k2 goes, its block comes back; with that one reserved, nothing is left.
    again = store.reserve(V)
    assert again is not None and again.block == ALIGN and store.stats().entries == 0
    assert store.reserve(V) is None and store.stats().puts_outside_arena == 1
    store.cancel(again)
    assert lease.view == b"\x01" * V
    lease.release()
    lease.release()  # a second release is harmless
    assert store.arena.used_bytes == 0
    assert store.reserve(2 * ALIGN) is not None


def test_unfinished_reservations_are_bounded_and_cancelled() -> None:
    store = LRUChunkStore(max_bytes=64 * ALIGN, max_unfinished_bytes=4 * ALIGN)
    held = [store.reserve(2 * ALIGN), store.reserve(2 * ALIGN)]
    assert all(r is not None for r in held)
    assert store.reserve(1) is None and store.stats().puts_outside_arena == 1  # over the bound
    for reservation in held:
        store.cancel(reservation)
    assert store.arena.used_bytes == 0
    assert store.reserve(4 * ALIGN) is not None


def test_a_value_received_outside_the_arena_is_copied_in_or_refused() -> None:
    """The store's memory stays within its size: nothing is kept outside the arena."""
    store = LRUChunkStore(max_bytes=4 * ALIGN, max_unfinished_bytes=2 * ALIGN)
    arriving = store.reserve(2 * ALIGN)
    assert arriving is not None and store.reserve(V) is None  # the share for arriving puts is taken
    assert store.put(b"k1", b"\x01" * V)  # received into a buffer of its own: copied in
    assert store.arena.used_bytes == 3 * ALIGN
    with store.get(b"k1") as value:
        assert value == b"\x01" * V
        # One block is free, the rest is being read or received: two blocks cannot be had (k1
        # was evicted trying; its memory stays the reader's).
        assert not store.put(b"k2", b"\x02" * 2 * ALIGN) and store.stats().refused_puts == 1
        assert value == b"\x01" * V
    store.cancel(arriving)
    assert store.put(b"k2", b"\x02" * 2 * ALIGN) and store.stats().puts_outside_arena == 1
    assert store.arena.used_bytes == 2 * ALIGN


def test_a_refused_reservation_goes_back_to_the_arena() -> None:
    store = LRUChunkStore(max_bytes=ALIGN)
    reservation = store.reserve(ALIGN)
    assert reservation is not None
    assert not store.put(b"k", reservation)  # key + value over max_bytes
    assert store.arena.used_bytes == 0 and store.stats().refused_puts == 1


def test_arena_blocks_are_page_multiples() -> None:
    assert ValueArena.block_size(1) == ALIGN and ValueArena.block_size(ALIGN + 1) == 2 * ALIGN


def test_server_receives_puts_into_the_arena_and_gives_back_abandoned_ones() -> None:
    srv = LMCacheServer(ServerConfig(port=0, max_size_bytes=64 << 20, frame_timeout_s=1.0))
    srv.start_in_thread()
    try:
        with socket.create_connection(srv.address, timeout=5) as sock:
            value = b"\x05" * (3 << 20)
            sock.sendall(pack_header(Op.PUT, Status.OK, 1, len(value)) + b"k" + value)
            assert sock.recv(64)
        assert srv.store.stats().puts_outside_arena == 0
        assert srv.store.arena.used_bytes == 3 << 20
        # A peer that announces 4 MiB, sends 1 MiB and hangs up: its block goes back.
        with socket.create_connection(srv.address, timeout=5) as sock:
            sock.sendall(pack_header(Op.PUT, Status.OK, 1, 4 << 20) + b"j" + bytes(1 << 20))
        deadline = time.monotonic() + 5
        while srv.store.arena.used_bytes != 3 << 20 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert srv.store.arena.used_bytes == 3 << 20
    finally:
        srv.shutdown()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="page advice is Linux's")
def test_prefault_makes_the_whole_store_resident() -> None:
    srv = LMCacheServer(ServerConfig(port=0, max_size_bytes=32 << 20, prefault=True))
    address = srv.store.arena._address
    assert _mapping_stats(address).get("Rss", 0) < 8 << 10  # kB: nothing touched yet
    srv.start_in_thread()
    try:
        deadline = time.monotonic() + 10
        while _mapping_stats(address).get("Rss", 0) < 32 << 10 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _mapping_stats(address)["Rss"] >= 32 << 10
    finally:
        srv.shutdown()
