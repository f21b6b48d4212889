"""CacheBlend on vLLM 0.32: not built for this line (issue #14 targets 0.9.2's v1 engine), so
`enable_blending` is refused when the connector is built, naming the version."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT, VLLM_TEST_ENV

from lmcache.integration.vllm.vllm_compat import blend_unsupported_reason


def test_blending_is_refused_naming_the_vllm_version():
    from vllm.version import __version__

    reason = blend_unsupported_reason(["LlamaForCausalLM"])
    assert reason is not None and "0.9.2" in reason and __version__ in reason


@pytest.mark.vllm
def test_an_engine_with_blending_fails_to_start_with_that_message(tiny_model):
    job = {"model": tiny_model, "prompts": [[5, 6, 7]], "max_tokens": 1,
           "llm_kwargs": {"kv_transfer_config": {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}}}
    env = {**os.environ, **VLLM_TEST_ENV, "LMCACHE_ENABLE_BLENDING": "true", "LMCACHE_USE_LAYERWISE": "true"}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "vllm_job.py")], input=json.dumps(job),
                          capture_output=True, text=True, env=env, timeout=600, cwd=str(ROOT))
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0, log[-3000:]
    assert "enable_blending=True: CacheBlend runs on vLLM 0.9.2's v1 engine" in log, log[-3000:]
