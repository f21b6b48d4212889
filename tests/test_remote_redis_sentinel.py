"""`redis-sentinel://` against real `redis-sentinel` processes: the master is found through the
Sentinels, and when it is killed the remote tier goes down, then puts and gets resume on the
promoted replica without a new backend."""

from __future__ import annotations

import time

import pytest
import redis
import torch
from redis_fixture import SENTINEL_SERVICE, RedisSentinelSet, lmcache_log, redis_sentinels  # noqa: F401
from helpers import key
from tier_helpers import remote_backend, remote_chunk, remote_cpu, wait_for

from lmcache.experimental.config import LMCacheEngineConfig
from lmcache.experimental.remote import create_connector
from lmcache.experimental.remote.redis_sentinel_connector import RedisSentinelConnector, sentinel_service_name
from lmcache.experimental.remote.serde.cachegen import error_bound


def test_service_name_from_url_then_environment_then_default() -> None:
    assert sentinel_service_name("from-url", {"REDIS_SERVICE_NAME": "env"}) == "from-url"
    assert sentinel_service_name(None, {"REDIS_SERVICE_NAME": " env "}) == "env"
    assert sentinel_service_name(None, {}) == "mymaster"


def test_master_found_by_redis_service_name_and_a_legacy_config_builds_a_tier(redis_sentinels: RedisSentinelSet,  # noqa: F811
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REDIS_SERVICE_NAME", SENTINEL_SERVICE)
    conn = create_connector(redis_sentinels.url(with_service=False), key_prefix="lmcache:tiny:")
    assert isinstance(conn, RedisSentinelConnector) and conn.url.endswith(f"/{SENTINEL_SERVICE}")
    assert conn.batched_put([("a", b"1"), ("b", b"2")]) == [True, True]
    assert conn.batched_get(["a", "b", "c"]) == [b"1", b"2", None]
    assert redis.Redis(port=redis_sentinels.master_port()).get("lmcache:tiny:a") == b"1"  # on the master
    conn.close()

    # Upstream's harness config (no local tier, Sentinels, the pickle-era `torch` serde) builds a
    # tier that stores and serves exact chunks.
    config = LMCacheEngineConfig.from_env({"LMCACHE_REMOTE_URL": redis_sentinels.url(with_service=False),
                                           "LMCACHE_REMOTE_SERDE": "torch", "LMCACHE_LOCAL_DEVICE": "null"})
    assert config.remote_serde == "naive" and config.local_cpu is False
    cpu = remote_cpu()
    backend = remote_backend(config.remote_url, config.remote_serde, cpu=cpu)
    try:
        obj = remote_chunk(cpu, seed=5)
        backend.submit_put_task(key(5), obj)
        assert backend.flush()
        got = backend.get_blocking(key(5))
        assert got is not None and torch.equal(got.tensor, obj.tensor)
        got.ref_count_down()
    finally:
        backend.close()


def test_failover_puts_and_gets_resume_on_the_promoted_replica(redis_sentinels: RedisSentinelSet,  # noqa: F811
                                                               lmcache_log) -> None:  # noqa: F811
    cpu = remote_cpu()
    backend = remote_backend(redis_sentinels.url(), "cachegen", cpu=cpu)
    try:
        before = remote_chunk(cpu, seed=1)
        backend.submit_put_task(key(1), before)
        assert backend.flush() and backend.contains(key(1))
        replica = redis.Redis(port=redis_sentinels.replica.port)
        assert wait_for(lambda: len(replica.keys("lmcache:tiny:*")) == 1)  # replicated before the crash

        started = time.monotonic()
        redis_sentinels.kill_master()
        # Until the Sentinels promote the replica there is no master: misses, not errors.
        assert not backend.contains(key(1)) and backend.get_blocking(key(1)) is None
        assert not backend.is_up and "is down" in lmcache_log.text
        redis_sentinels.wait_for_failover()
        print(f"failover took {time.monotonic() - started:.1f} s")
        assert redis_sentinels.master_port() == redis_sentinels.replica.port
        # The backend's own probe reaches the promoted replica through the Sentinels.
        assert wait_for(lambda: backend.is_up, timeout=20)
        after = remote_chunk(cpu, seed=2)
        backend.submit_put_task(key(2), after)
        assert backend.flush() and backend.contains(key(2))
        for k, want in ((key(1), before), (key(2), after)):
            got = backend.get_blocking(k)
            assert got is not None and got.tensor.shape == want.tensor.shape
            err = (got.tensor.float() - want.tensor.float()).abs()
            assert bool((err <= error_bound(want.tensor, 8, 6, 64)).all())
            got.ref_count_down()
        assert len(replica.keys("lmcache:tiny:*")) == 2  # written to the new master
        stats = backend.remote_stats()
        assert stats.times_down == 1 and stats.times_recovered == 1
    finally:
        backend.close()
