"""Upstream's offline harness flow, as an old `lmcache_vllm` user runs it: `from lmcache_vllm.vllm
import LLM, SamplingParams`, a legacy YAML (`local_device: cpu`, `remote_url: lm://...`,
`remote_serde: cachegen`, `pipelined_backend: False`), the `lm://` server started the old way
(`python -m lmcache.server HOST PORT cpu`) and `close_lmcache_engine()` at the end.

The flow, on the v0 engine and then on the v1 engine against the same server: the same request
four times, shuffled-document full prefills (each sent twice), then one batch mixing a hit and
a miss, and the miss again alone. Within a run every prompt gets the same greedy tokens each time
(miss or hit); the v1 run's first requests hit the chunks the v0 run stored in the server.
A bad legacy config stops the v0 `LLM(...)` itself, not its first request.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import List, Tuple

import pytest
from conftest import ROOT, VLLM_TEST_ENV, random_prompt, run_vllm_job
from redis_fixture import LMServerProcess

pytestmark = pytest.mark.vllm

LEGACY_YAML = Path(__file__).resolve().parent / "data" / "legacy" / "remote_cachegen.yaml"
P = random_prompt(700, seed=21)
DOCS = [random_prompt(300, seed=30 + i) for i in range(3)]
SHUFFLED = [DOCS[0] + DOCS[1] + DOCS[2], DOCS[2] + DOCS[0] + DOCS[1], DOCS[1] + DOCS[2] + DOCS[0]]
V0_LINE = re.compile(r"LMCache v0 door: prompt of (\d+) tokens: (\d+) hit tokens loaded")
V1_LINE = re.compile(r"LMCache request \S+: prompt_tokens=(\d+) vllm_cached_tokens=\d+ lmcache_hit_tokens=(\d+)")


def flow(miss: List[int]) -> list:
    """Request order: P x4, the shuffled documents twice, a batch [P, miss], then miss alone."""
    return [P, P, P, P, *SHUFFLED, *SHUFFLED, [P, miss], miss]


def assert_same_tokens_for_same_prompt(outputs: list) -> None:
    assert outputs[0] == outputs[1] == outputs[2] == outputs[3]
    assert outputs[4:7] == outputs[7:10]
    assert outputs[10] == [outputs[0], outputs[11]]


def hits(pattern: re.Pattern, log: str) -> List[Tuple[int, int]]:
    return [(int(p), int(h)) for p, h in pattern.findall(log)]


@pytest.fixture(scope="module")
def legacy_server(tmp_path_factory: pytest.TempPathFactory):
    """The `lm://` server started as the old harness did, with a device argument."""
    server = LMServerProcess(extra_args=("cpu",), log_path=tmp_path_factory.mktemp("lm") / "server.log").start()
    yield server
    server.stop()


def test_offline_flow_on_v0_then_v1_with_a_legacy_yaml(tiny_model, legacy_server, tmp_path):
    config = tmp_path / "lmcache.yaml"
    config.write_text(LEGACY_YAML.read_text().replace("lm://localhost:65431", legacy_server.url))
    job = {"model": tiny_model, "max_tokens": 8, "vllm_module": "lmcache_vllm.vllm", "close_engine": True,
           "llm_kwargs": {}}

    v0 = run_vllm_job({**job, "prompts": flow(random_prompt(700, seed=40))},
                      env={"VLLM_USE_V1": "0", "LMCACHE_CONFIG_FILE": str(config)})
    (v0_outputs,) = v0.outputs
    assert_same_tokens_for_same_prompt(v0_outputs)
    assert "local_device='cpu' is deprecated" in v0.log and "pipelined_backend=False" in v0.log
    assert hits(V0_LINE, v0.log) == [
        (700, 0), (700, 700), (700, 700), (700, 700),
        (900, 0), (900, 0), (900, 0), (900, 900), (900, 900), (900, 900),
        (700, 700), (700, 0),  # the batch: a hit and a miss
        (700, 700),
    ]
    assert "LMCache v0 door: engine closed" in v0.log

    # A new process with an empty CPU tier: what it hits first comes from the lm:// server.
    v1 = run_vllm_job({**job, "prompts": flow(random_prompt(700, seed=41)),
                       "llm_kwargs": {"enable_prefix_caching": False}},
                      env={"VLLM_USE_V1": "1", "LMCACHE_CONFIG_FILE": str(config)})
    (v1_outputs,) = v1.outputs
    assert_same_tokens_for_same_prompt(v1_outputs)
    found = hits(V1_LINE, v1.log)
    assert found[:10] == [(700, 700)] * 4 + [(900, 900)] * 6  # v0's chunks, cachegen-decoded
    assert sorted(found[10:12]) == [(700, 0), (700, 700)] and found[12] == (700, 700)


def test_v0_config_error_stops_the_llm_build_not_the_first_request(tiny_model, tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("chunk_size: 256\nlocal_device: cpu\nmax_local_cache_size: -1\n")
    job = {"model": tiny_model, "prompts": [], "vllm_module": "lmcache_vllm.vllm"}  # builds LLM, sends nothing
    env = {**os.environ, **VLLM_TEST_ENV, "VLLM_USE_V1": "0", "LMCACHE_CONFIG_FILE": str(config)}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "vllm_job.py")], input=json.dumps(job),
                          capture_output=True, text=True, env=env, cwd=str(ROOT), timeout=600)
    assert proc.returncode != 0 and "RESULT" not in proc.stdout
    assert "max_local_cache_size=-1: a size in GB cannot be negative" in proc.stderr, proc.stderr[-3000:]
    assert "LLM(" in proc.stderr  # raised from the constructor
