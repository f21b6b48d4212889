"""The model families people serve, on vLLM 0.32 (.venv-latest): one engine each through vLLM's
`LMCacheConnectorV1` (tests/family_matrix.py), and a hybrid attention/Mamba model refused at
engine start in LMCache's words.

Llama is the tiny model of every other e2e test (tests/latest/test_latest_e2e.py).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from conftest import ROOT, VLLM_TEST_ENV, family_model
from family_matrix import MAX_MODEL_LEN, PROMPTS, check_family
from test_v1_e2e import LMCACHE_ENV, connector_kwargs, hits, run

from lmcache.integration.vllm import vllm_compat
from lmcache.integration.vllm.model_support import check_kv_cache_specs

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("family", ["qwen2", "gemma2", "mixtral", "gpt2"])
def test_family_through_the_connector(family):
    """Qwen2; Gemma 2 with a 32-token window (promoted to full attention: vLLM turns its hybrid
    KV cache manager off for our connector); Mixtral (MoE); GPT-2 (learned positions)."""
    check_family(family_model(family))


def test_deepseek_v2_mla_whole_chunks_then_layerwise_and_async_from_disk(tmp_path):
    """DeepSeek-V2: MLA, one 576-wide latent per token, which vLLM 0.32's CPU MLA cache keeps as
    `(num_blocks, 1, 16, 576)`; its platform turns chunked prefill off for MLA, so a step takes a
    whole prompt. The matrix's check (whole chunks) fills a disk tier; a second engine through
    `lmcache_vllm` with use_layerwise and enable_async_loading finds both prompts there only and
    loads them in the background, layer by layer: same tokens, full hits."""
    model = family_model("deepseek_v2")
    disk = {"LMCACHE_LOCAL_DISK": str(tmp_path / "disk"), "LMCACHE_MAX_LOCAL_DISK_SIZE": "1"}
    # Compiled, vLLM's default: eager, vLLM's MLA computes the one token left after a full hit
    # apart from a whole prefill (first logprob 2.4e-3 off, tokens equal; compiled: bit-exact).
    mla = {"max_num_batched_tokens": MAX_MODEL_LEN, "enforce_eager": False}
    writer = check_family(model, mla, disk)
    extra = {"lmcache.use_layerwise": True, "lmcache.enable_async_loading": True}
    kwargs = {**connector_kwargs(prefix_caching=False, extra=extra), "max_model_len": MAX_MODEL_LEN, **mla}
    reader = run(model, PROMPTS, kwargs, {**LMCACHE_ENV, **disk}, vllm_module="lmcache_vllm.vllm")
    assert reader.outputs[0] == writer.outputs[0]
    assert hits(reader.lines) == [(300, 0, 300, 300, 0), (316, 0, 316, 316, 0)]
    done = re.findall(r"background load done, (\d+) leading tokens ready of (\d+) promised", reader.log)
    assert sorted(done) == [("300", "300"), ("316", "316")]


def test_hybrid_mamba_model_is_refused_in_our_words():
    """A tiny GraniteMoeHybrid (Mamba layer, then attention), which plain vLLM 0.32 serves: with
    LMCache's connector the engine stops at start naming the Mamba layer, before vLLM's own
    "Failed to promote local KV cache specs to one unified type"."""
    job = {"model": family_model("granitemoehybrid"), "prompts": [PROMPTS[0]], "max_tokens": 1,
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
