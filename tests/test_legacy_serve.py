"""`lmcache_vllm serve` started as a user would: no `OTEL_*` variables, the old wrapper's example
YAML (plus the status API's keys), vLLM's default (v1) engine, the OpenAI client.

One server start: a long chat prompt, then the same prompt one word longer (the second is a
partial LMCache hit: the whole chunks of the shared prefix); vLLM's `/metrics` shows the
`lmcache:` metrics of the engine core's process, matching the per-request log lines; the status
API answers from the engine core (read-only for anyone, clearing a tier with the token only); the log
stays free of telemetry noise; Ctrl-C (SIGINT to the process group) ends the server within 15 s with exit code 0.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import ROOT, VLLM_TEST_ENV
from lmcache.experimental.metrics import lmcache_samples
from lmcache.integration.vllm.request_log import parse_request_lines
from make_tiny_model import WORDS
from redis_fixture import free_port

pytestmark = pytest.mark.vllm

EXAMPLE_YAML = Path(__file__).resolve().parent / "data" / "legacy" / "wrapper_example.yaml"
CHUNK = 256
REQUEST_LINE = re.compile(r"LMCache request \S+: prompt_tokens=(\d+) vllm_cached_tokens=\d+ lmcache_hit_tokens=(\d+)")
# What the exporters that transformers sets up print when no collector runs.
TELEMETRY_NOISE = ("opentelemetry.exporter", "localhost:4318", "failed to export", "while exporting")


def _wait_healthy(proc: subprocess.Popen, port: int, log: Path, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"server exited with {proc.returncode}:\n{log.read_text()[-4000:]}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    pytest.fail(f"server not healthy within {timeout} s:\n{log.read_text()[-4000:]}")


def _request_lines(log: Path, count: int, timeout: float = 20) -> list:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [(int(p), int(h)) for p, h in REQUEST_LINE.findall(log.read_text())]
        if len(found) >= count:
            return found
        time.sleep(0.2)
    pytest.fail(f"expected {count} LMCache request lines:\n{log.read_text()[-4000:]}")


def _check_metrics(port: int, server_log: str) -> None:
    """The engine core's `lmcache:` counters on the API server's `/metrics` agree with the lines."""
    lines = parse_request_lines(server_log)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        page = resp.read().decode()
    samples = lmcache_samples(page)
    assert "vllm:prompt_tokens_total" in page  # vLLM's own metrics are still there
    assert samples["lmcache:num_hit_tokens_total"] == sum(line.counters.loaded_tokens for line in lines) > 0, samples
    assert samples["lmcache:num_stored_tokens_total"] == sum(line.counters.stored_tokens for line in lines) > 0
    assert samples["lmcache:num_lookup_requests_total"] >= len(lines)
    assert samples["lmcache:num_retrieve_requests_total"] >= 1
    assert samples["lmcache:time_to_retrieve_count"] == samples["lmcache:num_retrieve_requests_total"]
    assert samples["lmcache:time_to_store_count"] == samples["lmcache:num_store_requests_total"] >= 1
    assert samples['lmcache:local_cache_usage{tier="Hot"}'] > 0
    assert 0 < samples["lmcache:retrieve_hit_rate"] <= 1
    assert samples["lmcache:live_pins"] == 0  # every pinned lookup was loaded and released


def _status(port: int, path: str, token: str = "") -> tuple:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method="POST" if token != "" else "GET",
                                     data=b"" if token != "" else None)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, None


def _check_status_api(port: int, token: str) -> None:
    assert _status(port, "/health") == (200, {"status": "ok"})
    code, lines = _status(port, "/requests")
    assert code == 200 and len(parse_request_lines("\n".join(lines["lines"]))) == 2
    code, usage = _status(port, "/usage")
    assert code == 200 and usage["usage_bytes"]["Hot"] > 0
    assert _status(port, "/config")[1]["internal_api_server_token"] == "***"
    assert _status(port, "/clear?tier=Hot", token="not-the-token")[0] == 403
    code, cleared = _status(port, "/clear?tier=Hot", token=token)
    assert code == 200 and cleared["removed_chunks"] > 0


def test_chat_partial_hit_quiet_log_and_prompt_ctrl_c(tiny_model, tmp_path):
    import openai

    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(VLLM_TEST_ENV)
    status_port, token = free_port(), "status-token-1234"
    config_file = tmp_path / "lmcache.yaml"
    config_file.write_text(EXAMPLE_YAML.read_text() + "\ninternal_api_server_enabled: true\n"
                           f"internal_api_server_port_start: {status_port}\ninternal_api_server_token: {token}\n")
    env.update({"VLLM_USE_V1": "1", "LMCACHE_CONFIG_FILE": str(config_file)})
    port, log = free_port(), tmp_path / "serve.log"
    cli = Path(sys.executable).parent / "lmcache_vllm"
    # vLLM's own prefix cache is off so the repeat is LMCache's to serve.
    cmd = [str(cli), "serve", tiny_model, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
           "--max-model-len", "4096", "--seed", "0", "--no-enable-prefix-caching", "--enforce-eager"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT),
                                start_new_session=True)
    try:
        _wait_healthy(proc, port, log)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        rng = random.Random(7)
        text = " ".join(rng.choice(WORDS) for _ in range(700))
        usage = []
        for content in (text, text + " cache"):
            reply = client.chat.completions.create(
                model=tiny_model, messages=[{"role": "user", "content": content}],
                max_tokens=8, temperature=0.0, seed=0,
            )
            assert reply.choices[0].message.content is not None
            usage.append(reply.usage.prompt_tokens)
        (first_prompt, first_hit), (second_prompt, second_hit) = _request_lines(log, 2)[:2]
        assert (first_prompt, second_prompt) == tuple(usage) and second_prompt > first_prompt
        assert first_hit == 0
        # The whole chunks of the shared prefix (all but the template's last few tokens) hit; the
        # rest, from the new word on, is computed.
        assert second_hit % CHUNK == 0 and (first_prompt - 16) // CHUNK * CHUNK <= second_hit < first_prompt
        assert second_hit > 0
        _check_metrics(port, log.read_text())
        _check_status_api(status_port, token)
        time.sleep(3)  # exporters, if any, retry every 1-2 s
    finally:
        stopped = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            code = proc.wait()
        elapsed = time.monotonic() - stopped
    text_log = log.read_text()
    noisy = [line for line in text_log.splitlines() if any(w in line.lower() for w in TELEMETRY_NOISE)]
    assert not noisy, noisy[:5]
    assert "OpenTelemetry is off (OTEL_SDK_DISABLED=true)" in text_log
    assert code == 0 and elapsed < 15, (code, elapsed, text_log[-3000:])
