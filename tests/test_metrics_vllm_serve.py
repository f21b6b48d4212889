"""vLLM's own server with its v1 connector shell (no wrapper): with `PROMETHEUS_MULTIPROC_DIR`
set, as docs/metrics.md tells users, the engine core's `lmcache:` metrics reach `/metrics` next to
vLLM's own and agree with the per-request lines (the wrapper's path is in test_legacy_serve)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import urllib.request

import pytest
from conftest import ROOT, VLLM_TEST_ENV
from redis_fixture import free_port
from test_legacy_serve import _wait_healthy

from lmcache.experimental.metrics import lmcache_samples
from lmcache.integration.vllm.request_log import parse_request_lines

pytestmark = pytest.mark.vllm

PROMPT_TOKENS = 1000


def _complete(port: int, model: str, prompt: list) -> None:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0.0}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as resp:
        assert resp.status == 200


def test_plain_vllm_server_publishes_lmcache_metrics(tiny_model, tmp_path):
    port, log, metrics_dir = free_port(), tmp_path / "serve.log", tmp_path / "prometheus"
    metrics_dir.mkdir()
    env = {**os.environ, **VLLM_TEST_ENV, "VLLM_USE_V1": "1", "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir),
           "LMCACHE_CHUNK_SIZE": "256", "LMCACHE_MAX_LOCAL_CPU_SIZE": "1", "LMCACHE_REMOTE_URL": "None"}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", tiny_model,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "4096",
           "--no-enable-prefix-caching", "--enforce-eager",
           "--kv-transfer-config", json.dumps({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"})]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT),
                                start_new_session=True)
    try:
        _wait_healthy(proc, port, log)
        prompt = [random.Random(1).randrange(4, 1000) for _ in range(PROMPT_TOKENS)]
        for _ in range(2):
            _complete(port, tiny_model, prompt)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            page = resp.read().decode()
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    lines = parse_request_lines(log.read_text())
    assert [(line.counters.loaded_tokens, line.counters.stored_tokens) for line in lines] == [
        (0, PROMPT_TOKENS), (PROMPT_TOKENS, 0)]
    samples = lmcache_samples(page)
    assert "vllm:prompt_tokens_total" in page
    assert samples["lmcache:num_hit_tokens_total"] == PROMPT_TOKENS
    assert samples["lmcache:num_stored_tokens_total"] == PROMPT_TOKENS
    assert samples["lmcache:time_to_retrieve_count"] == 1
    assert samples['lmcache:local_cache_usage{tier="Hot"}'] > 0
