"""PD end to end on vLLM 0.32 (.venv-latest): a prefiller (`kv_producer`, `pd_role: sender`) and
a decoder (`kv_consumer`, `pd_role: receiver`), both `lmcache_vllm serve` with the same
`LMCACHE_PD_TOKEN` and `pd_encrypt` on (the 0.9.2 e2e runs the token without encryption), and
the proxy. Through the proxy the decoder loads the pushed prompt (its per-request line) and its
greedy tokens and logprobs equal the decoder computing the prompt itself (it keeps no CPU tier,
so the direct repeat finds nothing cached)."""

from __future__ import annotations

import time

import pytest
from conftest import random_prompt
from pd_servers import free_port, pd_env, post, start_proxy, start_vllm

from lmcache.integration.vllm.request_log import parse_request_lines

pytestmark = pytest.mark.vllm

CHUNK = 128
PROMPT_TOKENS = 600
ENV = {"LMCACHE_CHUNK_SIZE": str(CHUNK), "LMCACHE_MAX_LOCAL_CPU_SIZE": "0.25", "LMCACHE_PD_TOKEN": "pd-latest-Tk9",
       "LMCACHE_PD_ENCRYPT": "true"}


def _line(server, index: int, timeout: float = 20):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = parse_request_lines(server.log_text())
        if len(lines) > index:
            return lines[index]
        time.sleep(0.2)
    pytest.fail(f"{server.name}: no request line {index}:\n{server.log_text()[-4000:]}")


def test_proxy_decoder_loads_pushed_prompt_and_equals_compute(tiny_model, tmp_path):
    init_port = free_port()
    decoder = start_vllm("decoder", tiny_model, "kv_consumer",
                         {**ENV, **pd_env("receiver", init_port, 64 << 20), "LMCACHE_LOCAL_CPU": "False"},
                         tmp_path / "decoder.log", ["--enforce-eager"])
    prefiller = start_vllm("prefiller", tiny_model, "kv_producer", {**ENV, **pd_env("sender", init_port)},
                           tmp_path / "prefiller.log", ["--max-num-batched-tokens", "256", "--enforce-eager"])
    proxy = start_proxy([prefiller], [(decoder, init_port)], tmp_path / "proxy.log")
    servers = [decoder, prefiller, proxy]
    try:
        for server in servers:
            server.wait_healthy()
        body = {"model": tiny_model, "prompt": random_prompt(PROMPT_TOKENS, seed=21), "max_tokens": 8,
                "temperature": 0.0, "logprobs": 1, "seed": 0}
        status, via_proxy = post(f"{proxy.url}/v1/completions", body)
        assert status == 200, via_proxy
        line = _line(decoder, 0)
        assert line.stats.lmcache_hit_tokens == PROMPT_TOKENS and line.counters.loaded_tokens >= PROMPT_TOKENS - 1
        assert "last prefill" in prefiller.log_text() and "token required, encrypted" in decoder.log_text()
        status, computed = post(f"{decoder.url}/v1/completions", body)
        assert status == 200 and _line(decoder, 1).stats.lmcache_hit_tokens == 0
        got, want = via_proxy["choices"][0], computed["choices"][0]
        assert got["text"] == want["text"] and got["logprobs"]["tokens"] == want["logprobs"]["tokens"]
        diffs = [abs(a - b) for a, b in zip(got["logprobs"]["token_logprobs"], want["logprobs"]["token_logprobs"])]
        assert len(diffs) == 8 and max(diffs) < 1e-3
    finally:
        for server in reversed(servers):
            server.stop()
