"""The node pool as the engine's memory (issue 31): with `local_cpu: false` and the pool as the
only tier, a store's kernel writes each chunk straight into a reserved arena block and a hit is
read straight out of its leased block - one copy each way - against a real server process.

Checked: no host memory object is ever allocated on that path and the chunks are readable by
any other client; each process hashes a commit's payload once; a block corrupted in the arena
before that (or a header, at any time) is a miss; a refused reserve (or a dead server)
takes the copying path or drops the put, counted, never failing the store; every reservation and
lease is given back, also when the kernel copy fails; an engine killed after its kernel filled
its blocks publishes none of them; the layer-wise paths (which keep their copies) read and write
the same chunks.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import prompt, slots_for
from kv_reference import make_kvcaches
from redis_fixture import LMServerProcess, pool  # noqa: F401
from tier_helpers import ENGINE_GEO, keys_of, retrieve_and_check, small_engine, store_prompt, wait_for

from lmcache.experimental.remote import create_connector
from lmcache.experimental.storage_backend import chunk_format
from lmcache.experimental.storage_backend.remote_backend import RemoteBackend


ROOT = Path(__file__).resolve().parent.parent

# An engine that reserves its chunks' blocks, has the kernel fill them, says so and waits to be killed.
FILL_AND_WAIT = r"""
import sys
sys.path.insert(0, "tests")
from kv_reference import make_kvcaches
from helpers import prompt, slots_for
from tier_helpers import ENGINE_GEO, small_engine

engine = small_engine(remote_url=sys.argv[1], local_cpu=False, remote_serde="naive")
chunks = list(engine.token_database.process_tokens(prompt(32, seed=12)))
shapes = [engine.gpu_connector.get_shape(end - start) for start, end, _ in chunks]
objs = engine.storage_manager.reserve_in_place([key for *_, key in chunks], shapes, engine.metadata.kv_dtype)
engine.gpu_connector.batched_from_gpu(objs, [c[0] for c in chunks], [c[1] for c in chunks],
                                      kvcaches=make_kvcaches(ENGINE_GEO, seed=12), slot_mapping=slots_for(ENGINE_GEO, 32))
print(sum(obj is not None for obj in objs), flush=True)
sys.stdin.readline()
"""


def _settled(server: LMServerProcess, entries: int) -> bool:
    """The server holds `entries` chunks and no reservation or lease of anybody."""
    info = server.info()
    return info["entries"] == entries and info["pool_reservations"] == 0 and info["pool_leases"] == 0


def _pool_engine(url: str, monkeypatch):
    """An engine whose only tier is the pool, counting the host objects it allocates."""
    engine = small_engine(remote_url=url, local_cpu=False, remote_serde="naive")
    remote = engine.storage_manager.tiers[-1]
    assert isinstance(remote, RemoteBackend)
    allocated = []
    real = engine.memory_allocator.allocate
    monkeypatch.setattr(engine.memory_allocator, "allocate", lambda *a, **k: allocated.append(a) or real(*a, **k))
    return engine, remote, allocated


def test_store_and_retrieve_copy_once_each_way_and_other_clients_read_the_chunks(pool, monkeypatch) -> None:
    engine, remote, allocated = _pool_engine(pool.pool_url, monkeypatch)
    tcp_engine = small_engine(remote_url=pool.url, local_cpu=False, remote_serde="naive")
    try:
        tokens, source, slots = store_prompt(engine, 32, seed=1)
        # Read back at once: a chunk whose commit is queued is read after it, from the pool.
        retrieve_and_check(engine, tokens, source, slots, expected=32)
        assert remote.flush()
        stats = remote.remote_stats()
        assert stats.puts_in_place == stats.puts_acknowledged == 4 and stats.reserves_refused == 0
        assert allocated == []  # the kernel wrote into the arena: no host object in between
        assert wait_for(lambda: _settled(pool, 4))  # every block committed, the connection back

        retrieve_and_check(engine, tokens, source, slots, expected=32)
        assert allocated == [] and remote.remote_stats().gets_in_place == 4 + 4
        assert _settled(pool, 4)  # the retrieve released its leases

        # Whoever reads them the copying way (here over TCP) gets the same chunks.
        retrieve_and_check(tcp_engine, tokens, source, slots, expected=32)
    finally:
        engine.close()
        tcp_engine.close()


def test_pinned_lookups_hold_leases_up_to_a_bound_and_copy_beyond_it(pool, monkeypatch) -> None:
    """A lookup's pins on the sole pool are its leased blocks (no host object); at most
    MAX_HELD_BATCHES lookups hold leases at once, the next pins copies; a chunk pinned already is
    shared; every lease comes back."""
    from lmcache.experimental.storage_backend.pool_in_place import MAX_HELD_BATCHES

    engine, remote, allocated = _pool_engine(pool.pool_url, monkeypatch)
    held = 4 * MAX_HELD_BATCHES
    try:
        prompts = [store_prompt(engine, 32, seed=10 + n) for n in range(MAX_HELD_BATCHES + 1)]
        assert remote.flush() and wait_for(lambda: _settled(pool, len(prompts) * 4))
        for n in range(MAX_HELD_BATCHES):
            assert engine.lookup(prompts[n][0], request_id=f"r{n}", pin=True) == 32
        assert allocated == [] and pool.info()["pool_leases"] == held
        assert engine.lookup(prompts[0][0], request_id="shares", pin=True) == 32  # r0's pins, shared
        assert allocated == [] and pool.info()["pool_leases"] == held
        tokens, source, slots = prompts[-1]
        assert engine.lookup(tokens, request_id="copies", pin=True) == 32
        assert len(allocated) == 4 and pool.info()["pool_leases"] == held
        retrieve_and_check(engine, tokens, source, slots, expected=32)  # from the copies
        retrieve_and_check(engine, *prompts[1], expected=32)  # from the leased pins
        engine.lookup_unpin(["r1", "copies"])
        assert wait_for(lambda: pool.info()["pool_leases"] == held - 4)
        assert engine.lookup(tokens, request_id="leases", pin=True) == 32 and len(allocated) == 4
        engine.lookup_unpin(["r0", "r2", "r3", "shares", "leases"])
        assert wait_for(lambda: _settled(pool, len(prompts) * 4))
        assert engine.stats().live_pins == 0
    finally:
        engine.close()


def test_a_process_hashes_a_commit_once_and_a_block_corrupted_before_that_is_a_miss(pool, monkeypatch) -> None:
    """The writer's kernel summed its chunks as it wrote them (no hash at commit) and a reader
    hashes each at its first lease: neither hashes them again. A bit of KV flipped in the arena
    before a reader's first lease, or a header bit flipped at any time, is a miss at that chunk,
    its lease released."""
    writer, writer_tier, _ = _pool_engine(pool.pool_url, monkeypatch)
    readers = [_pool_engine(pool.pool_url, monkeypatch) for _ in range(2)]
    other = create_connector(pool.pool_url)
    hashed = []
    real_checksum = chunk_format.payload_checksum
    monkeypatch.setattr(chunk_format, "payload_checksum", lambda payload: hashed.append(1) or real_checksum(payload))
    try:
        tokens, source, slots = store_prompt(writer, 32, seed=2)
        assert writer_tier.flush()
        assert hashed == [] and writer_tier.remote_stats().puts_in_place == 4  # the kernel's sums
        retrieve_and_check(writer, tokens, source, slots, expected=32)
        reader, reader_tier, _ = readers[0]
        for _ in range(2):
            retrieve_and_check(reader, tokens, source, slots, expected=32)  # their headers hold the kernel's sums
        assert len(hashed) == 4
        assert writer_tier.remote_stats().gets_hashed_in_place == 0
        assert reader_tier.remote_stats().gets_hashed_in_place == 4

        names = [key.to_string() for key in keys_of(writer, tokens)]
        late, late_tier, _ = readers[1]
        for chunk, flip, expected in ((3, -1, 24), (2, 8, 16)):  # a bit of KV, then of a header
            held = other.lease([names[chunk]])
            block = held.blocks[0]
            assert block is not None
            block[flip] ^= 0x01
            held.release(0)
            retrieve_and_check(late, tokens, source, slots, expected=expected)  # stops at that chunk
            assert _settled(pool, 4)
        stats = late_tier.remote_stats()
        assert stats.gets_in_place == 3 + 2 and stats.gets_rejected == 2 and stats.gets_hashed_in_place == 3
        retrieve_and_check(writer, tokens, source, slots, expected=16)  # the header is always read
    finally:
        other.close()
        writer.close()
        for engine, _, _ in readers:
            engine.close()


def test_known_commits_are_a_bounded_set_of_place_length_and_header() -> None:
    from lmcache.experimental.storage_backend.pool_in_place import KnownCommits

    known = KnownCommits(capacity=2)
    arena, other_arena = b"a" * 16, b"b" * 16
    known.add((arena, 0), 100, b"h0")
    known.add((arena, 128), 100, b"h1")
    assert ((arena, 0), 100, b"h0") in known  # now the most recently used
    for commit in (((other_arena, 0), 100, b"h0"), ((arena, 0), 99, b"h0"), ((arena, 0), 100, b"h2")):
        assert commit not in known  # another arena, length or header: another commit
    known.add((arena, 256), 100, b"h2")  # over capacity: the least recently used goes
    assert ((arena, 128), 100, b"h1") not in known
    assert ((arena, 0), 100, b"h0") in known and ((arena, 256), 100, b"h2") in known


def test_a_refused_reserve_takes_the_copying_path_and_a_dead_pool_drops_the_put(tmp_path, monkeypatch) -> None:
    # Reserved-but-uncommitted bytes may not pass ~2.5 chunks: a 4-chunk store gets 2 blocks.
    server = LMServerProcess(
        ["--max-size-gb", str(1 / 1024), "--max-frame-mb", "0.005", "--max-pending-mb", "0.01"],
        log_path=tmp_path / "server.log", unix_socket=tmp_path / "pool.sock",
    ).start()
    engine, remote, allocated = _pool_engine(server.pool_url, monkeypatch)
    try:
        tokens, source, slots = store_prompt(engine, 32, seed=3)
        assert remote.flush()
        stats = remote.remote_stats()
        assert stats.reserves_refused == len(allocated) == 2 and stats.puts_in_place == 2
        assert stats.puts_acknowledged == 4  # the other two were copied and put the usual way
        retrieve_and_check(engine, tokens, source, slots, expected=32)

        server.kill()
        more, more_source, more_slots = store_prompt(engine, 32, seed=4)  # no error: dropped, counted
        assert not remote.is_up and remote.remote_stats().puts_dropped_tier_down == 4
        server.start()
        assert wait_for(lambda: remote.is_up)
        more, more_source, more_slots = store_prompt(engine, 32, seed=4)
        assert remote.flush()
        stats = remote.remote_stats()
        assert stats.puts_in_place == 2 + 2 and stats.puts_acknowledged == 4 + 4
        retrieve_and_check(engine, more, more_source, more_slots, expected=32)
        assert _settled(server, 4)
    finally:
        engine.close()
        server.stop()


def test_reservations_and_leases_come_back_when_the_kernel_copy_fails(pool, monkeypatch) -> None:
    engine, remote, _ = _pool_engine(pool.pool_url, monkeypatch)
    try:
        tokens = prompt(32, seed=5)
        with pytest.raises(ValueError, match="slot_mapping"):  # too few slots: the kernel call refuses
            engine.store(tokens, kvcaches=make_kvcaches(ENGINE_GEO, seed=5), slot_mapping=slots_for(ENGINE_GEO, 4))
        assert remote.flush() and remote.remote_stats().puts_acknowledged == 0
        assert wait_for(lambda: _settled(pool, 0))  # the reserved blocks were never published

        tokens, source, slots = store_prompt(engine, 32, seed=6)
        assert remote.flush()
        with pytest.raises(ValueError, match="slot_mapping"):
            engine.retrieve(tokens, kvcaches=make_kvcaches(ENGINE_GEO, seed=7), slot_mapping=slots_for(ENGINE_GEO, 4))
        assert _settled(pool, 4)
        retrieve_and_check(engine, tokens, source, slots, expected=32)
    finally:
        engine.close()


def test_layerwise_paths_read_and_write_the_same_chunks(pool, monkeypatch) -> None:
    engine, remote, _ = _pool_engine(pool.pool_url, monkeypatch)
    try:
        # Stored in place, read layer by layer (through a host object: the layer-wise path copies).
        tokens, source, slots = store_prompt(engine, 32, seed=8)
        assert remote.flush()
        target, dst = make_kvcaches(ENGINE_GEO, seed=9), slots_for(ENGINE_GEO, 32, seed=10)
        *_, mask = engine.retrieve_layer(tokens, kvcaches=target, slot_mapping=dst)
        assert bool(mask.all())
        retrieve_and_check(engine, tokens, source, slots, expected=32)

        # Stored layer by layer (copied), read in place.
        tokens, source, slots = prompt(24, seed=11), make_kvcaches(ENGINE_GEO, seed=11), slots_for(ENGINE_GEO, 24, seed=11)
        for _ in engine.store_layer(tokens, kvcaches=source, slot_mapping=slots):
            pass
        assert remote.flush()
        retrieve_and_check(engine, tokens, source, slots, expected=24)
        assert remote.remote_stats().gets_in_place == 4 + 3
        assert _settled(pool, 7)
    finally:
        engine.close()


def test_an_engine_killed_after_filling_its_blocks_publishes_none_of_them(pool) -> None:
    child = subprocess.Popen([sys.executable, "-c", FILL_AND_WAIT, pool.pool_url], cwd=ROOT, text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "4"
        info = pool.info()
        assert info["pool_reservations"] == 4 and info["entries"] == 0
        child.kill()
        child.wait()
        assert wait_for(lambda: _settled(pool, 0))
    finally:
        child.kill()
        child.wait()
