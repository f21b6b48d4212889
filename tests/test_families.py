"""The model families people serve, on vLLM 0.9.2 (.venv): one engine each through vLLM's
`LMCacheConnectorV1` on the v1 engine (tests/family_matrix.py), and Gemma 2 on the v0 engine
through the wrapper, which the door refuses with the cache off.

Llama is the tiny model of every other e2e test. Not run here: Gemma 2 on 0.9.2's v1 engine
(issue 35: plain vLLM 0.9.2 does not serve it on CPU's v1 engine) and DeepSeek-V2 (transformers
4.53 has no DeepseekV2Config).
"""

from __future__ import annotations

import pytest
from conftest import family_model, run_vllm_job
from family_matrix import MAX_MODEL_LEN, PROMPTS, check_family

from lmcache.integration.vllm.request_log import parse_v0_step_lines

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("family", ["qwen2", "mixtral", "gpt2"])
def test_family_through_the_v1_connector(family):
    """Qwen2, Mixtral (MoE), GPT-2 (learned positions, no rotary)."""
    check_family(family_model(family))


def test_gemma2_on_the_v0_door_is_served_with_the_cache_off():
    """Gemma 2's windowed layers alternate with global ones; vLLM 0.9.2 keeps that window in
    `interleaved_sliding_window`. The door must see it: a hit would reach vLLM's CPU prefix
    attention, which cannot mask a window (`assert not self.need_mask`). Round 2 repeats the
    prompts, so a door that served them would load them."""
    job = {"model": family_model("gemma2"), "prompts": PROMPTS, "rounds": 2, "max_tokens": 8,
           "vllm_module": "lmcache_vllm.vllm", "llm_kwargs": {"max_model_len": MAX_MODEL_LEN}}
    result = run_vllm_job(job, env={"VLLM_USE_V1": "0", "LMCACHE_LOCAL_CPU": "true"})
    cold, warm = result.outputs
    assert cold[0] != cold[1] and warm == cold
    assert "LMCache v0 door: sliding-window attention (window 32) is not supported; the cache stays off" in result.log
    assert parse_v0_step_lines(result.log) == []  # the door served no step: nothing loaded or stored
