"""Mooncake Store as the remote tier (`mooncakestore://`), against a real `mooncake_master`:
the settings and their errors, the connector's round trip, the tier's checksum misses, and a
master killed with SIGKILL and restarted."""

from __future__ import annotations

import json
import signal
import threading
import time

import numpy as np
import pytest
import torch
from helpers import key
from mooncake_fixture import MooncakeMaster, MooncakeStorage, mooncake_master  # noqa: F401
from redis_fixture import lmcache_log  # noqa: F401
from tier_helpers import FAST_REMOTE, remote_backend, remote_chunk, remote_cpu, wait_for

from lmcache.experimental.config import LMCacheEngineConfig, parse_remote_url
from lmcache.experimental.remote import create_connector
from lmcache.experimental.remote.connector import Parts, RemoteUnavailableError
from lmcache.experimental.remote.mooncake_settings import MooncakeSettings
from lmcache.experimental.remote.serde.naive import NaiveSerde
from lmcache.experimental.storage_backend import chunk_format

# Small enough for a test machine: 64 MiB lent to the pool, 16 MiB to receive into.
SMALL = MooncakeSettings(global_segment_size=64 << 20, local_buffer_size=16 << 20)


def _connector(master: MooncakeMaster, **kwargs):
    return create_connector(master.url, mooncake=SMALL, **kwargs)


def _small_backend(master: MooncakeMaster, **kwargs):
    return remote_backend(master.url, mooncake=SMALL, **kwargs)


# ---------------------------------------------------------------- settings


def test_url_and_fields_from_the_environment() -> None:
    cfg = LMCacheEngineConfig.from_env({
        "LMCACHE_REMOTE_URL": "mooncakestore://10.0.0.5:50051",
        "LMCACHE_MOONCAKE_GLOBAL_SEGMENT_SIZE": "0",
        "LMCACHE_MOONCAKE_PROTOCOL": "rdma",
        "LMCACHE_MOONCAKE_DEVICE_NAME": "mlx5_0",
    })  # fmt: skip
    assert cfg.remote_address().hosts == (("10.0.0.5", 50051),)
    settings = MooncakeSettings.from_config(cfg)
    assert (settings.global_segment_size, settings.protocol, settings.device_name) == (0, "rdma", "mlx5_0")
    assert settings.metadata_server == "P2PHANDSHAKE" and settings.local_hostname is None
    with pytest.raises(ValueError, match="mooncake_local_buffer_size=0"):
        LMCacheEngineConfig.from_env({"LMCACHE_MOONCAKE_LOCAL_BUFFER_SIZE": "0"})
    with pytest.raises(ValueError, match="mooncake_protocol='udp'.*LMCACHE_MOONCAKE_PROTOCOL"):
        LMCacheEngineConfig.from_env({"LMCACHE_MOONCAKE_PROTOCOL": "udp"})
    with pytest.raises(ValueError, match="no authentication"):
        parse_remote_url("mooncakestore://user:secret@h:1")
    # With no hostname set, the address facing the master: loopback for a master on loopback.
    assert MooncakeSettings().hostname_towards(("127.0.0.1", 50051)) == "127.0.0.1"


def test_upstream_json_file_wins_and_its_errors_name_the_key(tmp_path) -> None:
    path = tmp_path / "mooncake.json"
    master = ("127.0.0.1", 50051)
    env = {"MOONCAKE_CONFIG_PATH": str(path)}
    path.write_text(json.dumps({
        "local_hostname": "10.0.0.7", "metadata_server": "P2PHANDSHAKE", "global_segment_size": "512MB",
        "local_buffer_size": 134217728, "protocol": "tcp", "device_name": "",
        "master_server_address": "127.0.0.1:50051", "tenant_id": "default",
    }))  # fmt: skip
    got = MooncakeSettings().with_config_file(master, env)
    assert (got.local_hostname, got.global_segment_size, got.local_buffer_size) == ("10.0.0.7", 512 << 20, 128 << 20)
    assert MooncakeSettings().with_config_file(master, {}) == MooncakeSettings()
    for bad, message in (
        ({"master_server_address": "10.9.9.9:50051"}, "master_server_address='10.9.9.9:50051' is not remote_url's"),
        ({"global_segment_size": "lots"}, "global_segment_size='lots'"),
        ({"protocl": "tcp"}, "unknown key 'protocl'"),
        ({"protocol": "udp"}, "protocol='udp'"),
    ):
        path.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=message):
            MooncakeSettings().with_config_file(master, env)


# ---------------------------------------------------------------- the connector


def test_connector_round_trip_parts_missing_oversize_delete(mooncake_master: MooncakeMaster) -> None:  # noqa: F811
    conn = _connector(mooncake_master)
    # Set up as it is made (the engine's start-up), not at the first request, which would
    # otherwise wait for the setup and, past the lookup timeout, miss: its segment is lent unasked.
    assert wait_for(lambda: mooncake_master.gauge("master_total_capacity_bytes") == SMALL.global_segment_size, timeout=10)
    payload = np.random.default_rng(0).integers(0, 255, 3 << 20, dtype=np.uint8)
    items = [("a", Parts((b"head-a", memoryview(payload)))), ("b", b"plain value b")]
    assert conn.batched_put(items) == [True, True]
    assert conn.batched_exists(["a", "b", "nope"]) == [True, True, False]
    got = conn.batched_get(["a", "nope", "b"])
    assert got[0] == b"head-a" + payload.tobytes() and got[1] is None and got[2] == b"plain value b"
    # Larger than the local buffer (what whole-value readers get into): refused unsent.
    assert conn.batched_put([("big", bytes(17 << 20))]) == [False]
    assert conn.exists("big") is False
    assert conn.batched_put([("c", b"gone soon")]) == [True] and conn.delete("c") and not conn.exists("c")
    conn.close()


# ---------------------------------------------------------------- the tier


def test_tier_round_trip_and_corrupt_or_foreign_values_miss(mooncake_master: MooncakeMaster) -> None:  # noqa: F811
    cpu = remote_cpu()
    tier = _small_backend(mooncake_master, cpu=cpu)
    chunk = remote_chunk(cpu, seed=1)
    tier.submit_put_task(key(1), chunk)
    assert tier.flush(10.0) and tier.remote_stats().puts_acknowledged == 1
    assert tier.contains(key(1))
    got = tier.get_blocking(key(1))
    assert got is not None and torch.equal(got.tensor, chunk.tensor)
    # A flipped payload byte, and a value someone else wrote: both misses, never data.
    raw = bytearray(chunk_format.encode_memory_obj(key(2), chunk))
    raw[-1] ^= 0x01
    conn = tier._connector
    assert conn.batched_put([(key(2).to_string(), bytes(raw)), (key(3).to_string(), b"not a chunk")]) == [True, True]
    assert tier.contains(key(2)) and tier.get_blocking(key(2)) is None
    assert tier.get_blocking(key(3)) is None
    assert tier.remote_stats().gets_rejected == 2 and tier.is_up
    tier.close()


def test_master_killed_is_a_miss_then_back_after_restart(tmp_path, lmcache_log) -> None:  # noqa: F811
    master = MooncakeMaster(tmp_path / "master.log").start()
    cpu = remote_cpu()
    tier = _small_backend(master, cpu=cpu, options=FAST_REMOTE)
    try:
        # The client sets up as the tier is made; if that outlasts a lookup, the tier probes again.
        assert wait_for(lambda: tier.contains(key(9)) is False and tier.is_up, timeout=10)
        tier.submit_put_task(key(1), remote_chunk(cpu, seed=1))
        assert tier.flush(10.0) and tier.contains(key(1))
        master.kill()
        seen = len(lmcache_log.text)
        started = time.monotonic()
        misses = [tier.contains(key(1)) for _ in range(5)] + [tier.get_blocking(key(1)) is None for _ in range(3)]
        assert misses == [False] * 5 + [True] * 3
        assert time.monotonic() - started < 5 * FAST_REMOTE.lookup_timeout_s
        assert not tier.is_up
        assert lmcache_log.text[seen:].count("is down") == 1
        master.start()  # same port, no metadata: what was stored is gone, the tier comes back
        assert wait_for(lambda: tier.is_up, timeout=20), "the tier did not come back after the restart"
        assert "is back" in lmcache_log.text
        chunk = remote_chunk(cpu, seed=2)
        assert wait_for(lambda: _put_lands(tier, chunk), timeout=15)
        got = tier.get_blocking(key(2))
        assert got is not None and torch.equal(got.tensor, chunk.tensor)
        assert tier.get_blocking(key(1)) is None
    finally:
        tier.close()
        master.stop()


def test_value_whose_segment_left_is_a_miss_and_the_tier_stays_up(
    mooncake_master: MooncakeMaster, tmp_path, lmcache_log  # noqa: F811
) -> None:
    storage = MooncakeStorage(mooncake_master, tmp_path / "storage.log", segment="64MB").start()
    cpu = remote_cpu()
    pure_client = MooncakeSettings(global_segment_size=0, local_buffer_size=16 << 20)
    tier = remote_backend(mooncake_master.url, mooncake=pure_client, cpu=cpu)
    try:
        chunk = remote_chunk(cpu, seed=3)
        assert wait_for(lambda: _put_lands(tier, chunk), timeout=15)  # the storage process's segment
        storage.kill()
        assert tier.get_blocking(key(2)) is None
        assert tier.is_up and "could not hand back" in lmcache_log.text
    finally:
        tier.close()
        storage.stop()


def test_gets_read_straight_into_objects_partial_chunks_overlapping_batches_and_a_stall(
    mooncake_master: MooncakeMaster, tmp_path  # noqa: F811
) -> None:
    """Gets are ranged reads into the object the serde allocates (a get session per batch): a
    full and a partial chunk come back equal from two threads reading the same keys at once (one
    batch ending its session must not end the other's); a read stalled past its timeout (the
    storage process stopped mid-get) does not free the object Mooncake may still write into until
    its call returns."""
    storage = MooncakeStorage(mooncake_master, tmp_path / "storage.log", segment="64MB").start()
    cpu = remote_cpu()
    pure_client = MooncakeSettings(global_segment_size=0, local_buffer_size=16 << 20)
    tier = remote_backend(mooncake_master.url, mooncake=pure_client, cpu=cpu)
    impatient = create_connector(mooncake_master.url, mooncake=pure_client, timeout=1.0, lookup_timeout=10.0)
    try:
        full, partial = remote_chunk(cpu, seed=4), remote_chunk(cpu, seed=5, tokens=5)
        tier.submit_put_task(key(4), full)
        tier.submit_put_task(key(5), partial)
        assert tier.flush(10.0) and tier.remote_stats().puts_acknowledged == 2
        wrong: list = []

        def read() -> None:
            for _ in range(50):
                got = tier.batched_get_blocking([key(4), key(6), key(5)])
                wrong.append(got[1] is not None or not all(
                    o is not None and torch.equal(o.tensor, want.tensor) for o, want in ((got[0], full), (got[2], partial))
                ))
                for obj in got:
                    if obj is not None:
                        obj.ref_count_down()

        readers = [threading.Thread(target=read) for _ in range(2)]
        for t in readers:
            t.start()
        for t in readers:
            t.join()
        assert wrong == [False] * 100 and tier.is_up

        def used() -> int:
            return cpu.memory_allocator.used_bytes

        def stop_then_receive(i: int, reader) -> None:
            storage.proc.send_signal(signal.SIGSTOP)  # the header is in; the payload read stalls
            NaiveSerde().receive(key(4), reader, cpu.allocate)

        before = used()
        with pytest.raises(chunk_format.FillAbandoned):
            impatient.batched_get_into([key(4).to_string()], stop_then_receive)
        assert used() > before  # still Mooncake's to write into
        storage.proc.send_signal(signal.SIGCONT)
        assert wait_for(lambda: used() == before, timeout=70)  # freed once the read returned
    finally:
        if storage.proc is not None:
            storage.proc.send_signal(signal.SIGCONT)
        impatient.close()
        tier.close()
        storage.stop()


def _put_lands(tier, chunk) -> bool:
    """One put of `chunk` as key 2 (the client re-mounts its segment a moment after a restart)."""
    tier.submit_put_task(key(2), chunk)
    tier.flush(5.0)
    return tier.contains(key(2))


def test_unreachable_master_does_not_hold_a_lookup(tmp_path) -> None:
    """Mooncake's setup retries for ~90 s: a lookup waits for it at most the lookup timeout."""
    master = MooncakeMaster(tmp_path / "never.log")  # never started: nothing listens on its port
    tier = _small_backend(master, options=FAST_REMOTE)
    started = time.monotonic()
    assert tier.contains(key(1)) is False and not tier.is_up
    assert time.monotonic() - started < 5.0  # not the ~90 s of Mooncake's own retries
    with pytest.raises(RemoteUnavailableError, match="not set up"):
        tier._connector.ping()
    tier.close()
