"""The model families people serve, on vLLM 0.32 (.venv-latest): a hybrid attention/Mamba model
refused at engine start in LMCache's words."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT, VLLM_TEST_ENV, family_model
from test_v1_e2e import LMCACHE_ENV, connector_kwargs

from lmcache.integration.vllm import vllm_compat
from lmcache.integration.vllm.model_support import check_kv_cache_specs

pytestmark = pytest.mark.vllm


def test_hybrid_mamba_model_is_refused_in_our_words():
    """A tiny GraniteMoeHybrid (Mamba layer, then attention), which plain vLLM 0.32 serves: with
    LMCache's connector the engine stops at start naming the Mamba layer, before vLLM's own
    "Failed to promote local KV cache specs to one unified type"."""
    job = {"model": family_model("granitemoehybrid"), "prompts": [list(range(4, 104))], "max_tokens": 1,
           "llm_kwargs": {**connector_kwargs(prefix_caching=False), "max_model_len": 1024}}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "vllm_job.py")], input=json.dumps(job), capture_output=True,
        text=True, env={**os.environ, **VLLM_TEST_ENV, **LMCACHE_ENV}, timeout=600, cwd=str(ROOT),
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "RESULT " not in log
    assert ("LMCache does not support layers of kind MambaSpec(mamba2) (model "
            f"{job['model']}: model.layers.0.mixer)") in log, log[-3000:]
    assert "vLLM's own prefix cache still works without it" in log
    assert "Failed to promote" not in log


def test_kv_spec_check_names_each_non_kv_kind_and_passes_attention():
    """vLLM 0.32's own spec classes: attention kinds pass, Mamba and unknown kinds are named."""
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec, MambaSpec, MLAAttentionSpec, SinkFullAttentionSpec, SlidingWindowSpec,
    )

    attn = dict(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float32)
    specs = {
        "model.layers.0.self_attn.attn": FullAttentionSpec(**attn),
        "model.layers.1.self_attn.attn": SlidingWindowSpec(**attn, sliding_window=32),
        "model.layers.2.self_attn.attn": MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576,
                                                          dtype=torch.float32),
    }
    assert vllm_compat.layers_without_paged_kv([specs, specs]) == []
    mamba = MambaSpec(block_size=16, shapes=((4, 8),), dtypes=(torch.float32,))
    sink = SinkFullAttentionSpec(**attn, sink_len=4)
    found = vllm_compat.layers_without_paged_kv({**specs, "model.layers.3.mixer": mamba, "model.layers.4.attn": sink})
    assert found == [("model.layers.3.mixer", "MambaSpec(mamba2)"), ("model.layers.4.attn", "SinkFullAttentionSpec")]

    class Config:  # the two parts of a VllmConfig the check reads
        model_config = type("M", (), {"model": "m"})
        kv_transfer_config = type("K", (), {"kv_connector": "LMCacheConnectorV1", "kv_connector_extra_config": {}})

    with pytest.raises(ValueError, match=r"kind MambaSpec\(mamba2\), SinkFullAttentionSpec \(model m: "):
        check_kv_cache_specs(Config, [{**specs, "model.layers.3.mixer": mamba, "model.layers.4.attn": sink}])
    Config.kv_transfer_config.kv_connector = "SomeOtherConnector"  # not ours: vLLM decides
    check_kv_cache_specs(Config, [{"model.layers.3.mixer": mamba}])
