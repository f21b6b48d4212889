"""`lmcache_vllm serve` over HTTP, through `scripts/serve_demo.py` (what `make serve` runs).

One server start (v0 engine, CPU and disk tiers): OpenAI completions, the same long prompt twice,
the second served from LMCache (the door's log line), the engine process's `lmcache:` metrics on
vLLM's `/metrics` agreeing with the door's lines, Ctrl-C (SIGINT to the process group) stops it
with exit code 0, and the disk tier holds every chunk complete (header and checksum verify).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from conftest import ROOT, VLLM_TEST_ENV

from lmcache.experimental.storage_backend.chunk_format import read_header, verify_payload
from lmcache.integration.vllm.request_log import parse_v0_step_lines

pytestmark = pytest.mark.vllm

PROMPT_TOKENS = 1000
CHUNK = 256


def test_serve_hits_over_http_and_flushes_disk_on_ctrl_c(tmp_path, tiny_model):
    disk, log, metrics_json = tmp_path / "disk", tmp_path / "server.log", tmp_path / "metrics.json"
    env = {**VLLM_TEST_ENV, "LMCACHE_CHUNK_SIZE": str(CHUNK)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "serve_demo.py"), "--engine", "v0", "--model", tiny_model,
         "--prompt-tokens", str(PROMPT_TOKENS), "--disk", str(disk), "--log", str(log),
         "--metrics-json", str(metrics_json), "--start-timeout", "300"],
        capture_output=True, text=True, timeout=600, cwd=str(ROOT),
        env={**os.environ, **env},
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-3000:]
    assert re.search(rf"first \(cold\) .* LMCache hit tokens 0/{PROMPT_TOKENS}", out), out
    assert re.search(rf"second \(repeat\) .* LMCache hit tokens {PROMPT_TOKENS}/{PROMPT_TOKENS}", out), out
    assert "server stopped cleanly (exit code 0)" in out
    assert "same completion text both times: True" in out

    server_log = log.read_text()
    assert f"LMCache v0 door: prompt of {PROMPT_TOKENS} tokens: {PROMPT_TOKENS} hit tokens loaded, computing 1" in server_log
    assert "LMCache v0 door: engine closed" in server_log

    # The v0 engine runs in vLLM's engine process; its metrics reach the API server's /metrics.
    metrics, steps = json.loads(metrics_json.read_text()), parse_v0_step_lines(server_log)
    assert metrics["lmcache:num_hit_tokens_total"] == sum(s.loaded_tokens for s in steps) == PROMPT_TOKENS
    assert metrics["lmcache:num_stored_tokens_total"] == PROMPT_TOKENS  # the first request's prompt
    assert metrics["lmcache:num_retrieve_requests_total"] == metrics["lmcache:time_to_retrieve_count"] >= 2
    assert metrics['lmcache:local_cache_usage{tier="Hot"}'] > 0
    assert metrics["lmcache:retrieve_hit_rate"] > 0

    files = sorted(disk.iterdir())
    assert [f.suffix for f in files] == [".lmck"] * (-(-PROMPT_TOKENS // CHUNK)), files
    for path in files:
        with open(path, "rb") as f:
            header = read_header(f)
            assert header is not None, path
            assert verify_payload(header, f.read()), path
