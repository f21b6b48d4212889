"""The controller end to end: one real vLLM 0.9.2 engine (v1) whose worker reports to a controller
in this process. After a prompt is stored, `/lookup` names the instance with the prompt's whole
length; after a second prompt pushed the first one's chunks out of the small CPU tier, it no
longer does; when the engine exits, its worker deregisters. One engine, paused at gates between
the prompts (`gate_before`), so the test asks the controller while the instance still runs."""

from __future__ import annotations

import pytest
from conftest import random_prompt, run_vllm_job
from helpers import post_json
from redis_fixture import free_port
from tier_helpers import wait_for

from lmcache.controller.server import Controller, ControllerSettings

pytestmark = pytest.mark.vllm

CHUNK = 256
INSTANCE = "vllm-e2e"
P_FIRST = random_prompt(1500, seed=11)
P_SECOND = random_prompt(1100, seed=17)
P_LAST = random_prompt(64, seed=18)
# A CPU tier of ~3 MB: the first prompt's chunks fit, and the second prompt pushes most of them out.
CPU_GB = "0.003"


def test_lookup_names_the_instance_after_a_store_and_not_after_its_eviction(tiny_model) -> None:
    controller = Controller(ControllerSettings(port=0, pull_port=free_port(), reply_port=free_port())).start()
    pull, reply = controller.worker_ports
    url = "http://%s:%d/lookup" % controller.http_address
    env = {
        "VLLM_USE_V1": "1", "LMCACHE_LOG_LEVEL": "INFO", "LMCACHE_MAX_LOCAL_CPU_SIZE": CPU_GB,
        "LMCACHE_ENABLE_CONTROLLER": "true", "LMCACHE_LMCACHE_INSTANCE_ID": INSTANCE,
        "LMCACHE_CONTROLLER_PULL_URL": f"127.0.0.1:{pull}", "LMCACHE_CONTROLLER_REPLY_URL": f"127.0.0.1:{reply}",
        "LMCACHE_LMCACHE_WORKER_HEARTBEAT_TIME": "1",
    }
    job = {
        "model": tiny_model,
        "prompts": [P_FIRST, P_SECOND, P_LAST],
        "max_tokens": 4,
        "llm_kwargs": {
            "enable_prefix_caching": False,
            "max_num_batched_tokens": 512,
            "kv_transfer_config": {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both",
                                   "kv_connector_extra_config": {"lmcache.chunk_size": CHUNK}},
        },
        "gate_before": [1, 2],
    }
    seen = {}

    def layout(tokens) -> dict:
        status, body = post_json(url, {"tokens": tokens})
        assert status == 200, body
        return body["layout_info"]

    def at_gate(index: int, stderr) -> None:
        if index == 1:  # the first prompt is stored: its whole length, in the CPU tier
            wait_for(lambda: layout(P_FIRST) == {INSTANCE: ["Hot", len(P_FIRST)]}, timeout=30)
            seen["first"] = layout(P_FIRST)
        else:  # the second one is stored, and the first one's oldest chunks are gone
            wait_for(lambda: layout(P_SECOND) == {INSTANCE: ["Hot", len(P_SECOND)]}
                     and layout(P_FIRST) == {}, timeout=30)
            seen["second"], seen["first_after"] = layout(P_SECOND), layout(P_FIRST)
            seen["workers"] = controller.index.workers(INSTANCE)

    try:
        result = run_vllm_job(job, env=env, at_gate=at_gate)
        assert seen["first"] == {INSTANCE: ["Hot", len(P_FIRST)]}, result.log[-3000:]
        assert seen["second"] == {INSTANCE: ["Hot", len(P_SECOND)]}
        assert seen["first_after"] == {}, "the first prompt's first chunk was evicted by the second prompt"
        (worker,) = seen["workers"]
        assert (worker.chunk_size, worker.stale, worker.resyncs) == (CHUNK, False, 1)  # no gap, one snapshot
        assert wait_for(lambda: controller.index.workers(INSTANCE) == [], timeout=30)  # deregistered at exit
        assert "LMCache controller at" not in result.log  # never unreachable
    finally:
        controller.close()
