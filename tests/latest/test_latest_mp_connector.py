"""Upstream's multiprocess mode as its docs start it, on vLLM 0.32: `lmcache server --port PORT`,
then vLLM with `LMCacheMPConnector` and nothing but `lmcache.mp.host` / `lmcache.mp.port`.

One engine (each costs ~30-40 s here), prefix cache off, two rounds of two prompts sharing a
1024-token prefix. With no private CPU tier every hit comes from the node pool: B's prefix in
round 1, everything in round 2; round 2's greedy tokens and logprobs equal round 1's. Also, with
no engine: which class vLLM's factory builds for the name. The keys and the command without vLLM:
tests/test_mp_connector.py.
"""

from __future__ import annotations

import pytest
from redis_fixture import LMCacheCommandServer
from test_v1_e2e import LOGPROB_TOLERANCE, MAX_BATCHED, P_SHARED_A, P_SHARED_B, assert_no_pins_left, hits, run

from lmcache.experimental.remote.lm_connector import LMServerConnector
from lmcache.integration.vllm.lmcache_mp_connector import LMCacheMPConnector
from lmcache.integration.vllm.mp_keys import MP_CONNECTOR
from lmcache.integration.vllm.vllm_compat import FORCE_UPSTREAM_MP_ENV, route_mp_connector
from lmcache_vllm.plugin import MP_CONNECTOR_MODULE, general_plugin

CHUNK = 256  # the config's default: the connector is given no LMCache setting of ours


def test_vllms_factory_builds_ours_for_the_name_unless_upstreams_copy_is_forced(monkeypatch):
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    monkeypatch.setenv(FORCE_UPSTREAM_MP_ENV, "1")
    assert route_mp_connector(MP_CONNECTOR, MP_CONNECTOR_MODULE, MP_CONNECTOR) is False
    monkeypatch.delenv(FORCE_UPSTREAM_MP_ENV)
    general_plugin()  # what vLLM runs in each of its processes
    config = KVTransferConfig(kv_connector=MP_CONNECTOR, kv_role="kv_both")
    assert KVConnectorFactory.get_connector_class(config) is LMCacheMPConnector


@pytest.mark.vllm
def test_lmcache_server_and_mp_connector_share_the_pool(tiny_model, tmp_path):
    runtime = tmp_path / "rt"
    server = LMCacheCommandServer(["--l1-size-gb", "0.25"], log_path=tmp_path / "server.log", runtime_dir=runtime)
    llm_kwargs = {
        "enable_prefix_caching": False,
        "max_num_batched_tokens": MAX_BATCHED,
        "kv_transfer_config": {
            "kv_connector": "LMCacheMPConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"lmcache.mp.host": "tcp://localhost", "lmcache.mp.port": server.port},
        },
    }
    env = {"LMCACHE_LOG_LEVEL": "INFO", "LMCACHE_RUNTIME_DIR": str(runtime)}
    server.start()
    try:
        result = run(tiny_model, [P_SHARED_A, P_SHARED_B], llm_kwargs, env, rounds=2)
        tcp = LMServerConnector("127.0.0.1", server.port)
        info = tcp.info()
        tcp.close()
    finally:
        server.stop()
    assert "Creating v1 connector with name: LMCacheMPConnector" in result.log
    # (prompt, vLLM cached, LMCache hit, loaded, stored) per request, in order.
    assert hits(result.lines) == [
        (1424, 0, 0, 0, 1424),
        (1424, 0, 1024, 1024, 400),  # the shared prefix (4 chunks) from the pool
        (1424, 0, 1424, 1424, 0),
        (1424, 0, 1424, 1424, 0),
    ]
    # One copy on the machine: A's 6 chunks (the last partial) and B's 2 of its own, in the pool.
    assert info["entries"] == 2 * -(-1424 // CHUNK) - 1024 // CHUNK
    assert info["pool_leases"] == 0 and info["pool_reservations"] == 0
    cold, warm = result.outputs
    assert warm == cold, "greedy tokens of the warm round differ from the cold round"
    for i, (cold_lp, warm_lp) in enumerate(zip(*result.logprobs)):
        diff = max(abs(a - b) for a, b in zip(cold_lp, warm_lp))
        assert diff <= LOGPROB_TOLERANCE, f"prompt {i}: logprobs of the warm round differ by {diff}"
    assert_no_pins_left(result)
