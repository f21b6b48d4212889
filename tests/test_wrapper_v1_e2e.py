"""The v1 engine through `import lmcache_vllm.vllm as vllm`, with no KV transfer config from the user:
the wrapper turns on `LMCacheConnectorV1` by itself, configured only by `LMCACHE_*` variables.

Same prompts as the v0 end-to-end test (miss, full hit, partial hit, then one batch of hit, partial
hit and miss), compared with plain `vllm` on the v1 engine: equal greedy tokens, logprobs within
float32 noise. vLLM's own prefix cache is off in both runs so repeats are LMCache's to serve.
"""

from __future__ import annotations

import pytest
from conftest import run_vllm_job
from helpers import A, B, C, D, V0_CHUNK, assert_same_generation

from lmcache.integration.vllm.request_log import parse_request_lines

pytestmark = pytest.mark.vllm

ENV = {"VLLM_USE_V1": "1", "LMCACHE_CHUNK_SIZE": str(V0_CHUNK), "LMCACHE_MAX_LOCAL_CPU_SIZE": "0.25"}


def test_v1_through_the_wrapper_hits_partial_hits_and_misses(tiny_model):
    job = {
        "model": tiny_model,
        "prompts": [A, A, B, [A, D, C]],
        "max_tokens": 12,
        "logprobs": True,
        "llm_kwargs": {"enable_prefix_caching": False},
    }
    cached = run_vllm_job({**job, "vllm_module": "lmcache_vllm.vllm"}, env=ENV)
    plain = run_vllm_job({**job, "vllm_module": "vllm"}, env=ENV)
    assert "using KV connector LMCacheConnectorV1" in cached.log
    assert "LMCache" not in plain.log
    assert_same_generation(cached, plain)
    hits = [(line.stats.prompt_tokens, line.stats.lmcache_hit_tokens) for line in parse_request_lines(cached.log)]
    # The batch's requests may log in any order.
    assert hits[:3] == [(700, 0), (700, 700), (700, 256)]
    assert sorted(hits[3:]) == sorted([(700, 700), (700, 512), (300, 0)])
