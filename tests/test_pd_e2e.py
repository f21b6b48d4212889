"""PD end to end on vLLM 0.9.2 (v1): two real servers (a prefiller, `kv_producer` +
`pd_role: sender`, started with vLLM's own OpenAI server module, and a decoder, `kv_consumer` +
`pd_role: receiver`, started with `lmcache_vllm serve`) and the proxy, shared by every test here.

- Through the proxy the decoder loads the prompt the prefiller pushed (its per-request line) and
  its greedy tokens and logprobs equal the decoder computing the same prompt with nothing cached
  (the decoder keeps no CPU tier, so a direct repeat is a cache-off run of the same engine).
- Chat streaming and token-id prompts pass through; the prefiller pushed chunk by chunk (its
  prefill runs in several chunked-prefill steps).
- A bad `disagg_spec` sent to the prefiller is an error for that request, naming the field; the
  servers keep serving.
- A proxy whose decoder is down answers 503 within seconds; a proxy whose prefiller is down still
  answers correctly (the decoder computes the prompt itself).
"""

from __future__ import annotations

import json
import re
import time
import urllib.request

import pytest
from conftest import random_prompt
from pd_servers import Server, free_port, pd_env, post, start_proxy, start_vllm

from lmcache.integration.vllm.request_log import parse_request_lines

pytestmark = pytest.mark.vllm

CHUNK = 128
PROMPT_TOKENS = 600  # four whole chunks and a partial one
PREFILL_STEP_TOKENS = 256  # the prefiller's chunked prefill: three steps for the prompt
PUSH_LINE = re.compile(r"PD: request (pd-\S+) pushed (\d+) tokens to \S+ in ([\d.]+) ms \(tokens (\d+\.\.\d+)(, last prefill)?\)")
COMMON_ENV = {"LMCACHE_CHUNK_SIZE": str(CHUNK), "LMCACHE_MAX_LOCAL_CPU_SIZE": "0.25"}


@pytest.fixture(scope="module")
def pd(tiny_model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("pd")
    init_port = free_port()
    decoder = start_vllm("decoder", tiny_model, "kv_consumer",
                         {**COMMON_ENV, **pd_env("receiver", init_port, 64 << 20), "LMCACHE_LOCAL_CPU": "False"},
                         logs / "decoder.log")
    prefiller = start_vllm("prefiller", tiny_model, "kv_producer", {**COMMON_ENV, **pd_env("sender", init_port)},
                           logs / "prefiller.log",
                           ["--max-num-batched-tokens", str(PREFILL_STEP_TOKENS), "--enable-chunked-prefill"],
                           own_cli=True)
    proxy = start_proxy([prefiller], [(decoder, init_port)], logs / "proxy.log")
    servers = [decoder, prefiller, proxy]
    try:
        for server in servers:
            server.wait_healthy()
        yield {"decoder": decoder, "prefiller": prefiller, "proxy": proxy, "init_port": init_port,
               "model": tiny_model, "logs": logs}
    finally:
        for server in reversed(servers):
            server.stop()


def _lines(server: Server, count: int, timeout: float = 20):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = parse_request_lines(server.log_text())
        if len(lines) >= count:
            return lines
        time.sleep(0.2)
    pytest.fail(f"{server.name}: expected {count} request lines:\n{server.log_text()[-4000:]}")


def _completion(model: str, prompt, **extra) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "logprobs": 1, "seed": 0, **extra}


def test_completion_through_proxy_loads_pushed_kv_and_equals_compute(pd):
    decoder, prefiller, proxy, model = pd["decoder"], pd["prefiller"], pd["proxy"], pd["model"]
    prompt = random_prompt(PROMPT_TOKENS, seed=11)
    before = len(parse_request_lines(decoder.log_text()))
    status, via_proxy = post(f"{proxy.url}/v1/completions", _completion(model, prompt))
    assert status == 200, via_proxy
    line = _lines(decoder, before + 1)[before]
    assert line.stats.prompt_tokens == PROMPT_TOKENS
    assert line.stats.lmcache_hit_tokens == PROMPT_TOKENS and line.counters.loaded_tokens >= PROMPT_TOKENS - 1, line
    assert line.counters.stored_tokens == 0 and "kv_consumer" in line.reason
    # The prefiller pushed as its chunked prefill went: whole chunks first, the partial one last.
    pushes = [m for m in PUSH_LINE.finditer(prefiller.log_text())]
    mine = [m for m in pushes if m[1] == pushes[-1][1]]  # the latest request's pushes, one per step
    assert len(mine) == -(-PROMPT_TOKENS // PREFILL_STEP_TOKENS), [m[0] for m in mine]
    assert sum(int(m[2]) for m in mine) == PROMPT_TOKENS
    assert mine[-1][4] == f"{PROMPT_TOKENS // PREFILL_STEP_TOKENS * PREFILL_STEP_TOKENS}..{PROMPT_TOKENS}"
    assert mine[-1][5] and not any(m[5] for m in mine[:-1])  # the partial chunk went with the last step

    status, computed = post(f"{decoder.url}/v1/completions", _completion(model, prompt))
    assert status == 200, computed
    again = _lines(decoder, before + 2)[before + 1]
    assert again.stats.lmcache_hit_tokens == 0 and again.counters.loaded_tokens == 0  # the buffer was claimed
    got, want = via_proxy["choices"][0], computed["choices"][0]
    assert got["text"] == want["text"]
    assert got["logprobs"]["tokens"] == want["logprobs"]["tokens"]
    diffs = [abs(a - b) for a, b in zip(got["logprobs"]["token_logprobs"], want["logprobs"]["token_logprobs"])]
    assert len(diffs) == 8 and max(diffs) < 1e-3


def _stream_text(url: str, body: dict) -> str:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    text = []
    with urllib.request.urlopen(request, timeout=300) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                delta = json.loads(line[len("data: "):])["choices"][0].get("delta", {})
                text.append(delta.get("content") or "")
    return "".join(text)


def test_chat_streams_through_proxy_from_pushed_kv(pd):
    decoder, proxy, model = pd["decoder"], pd["proxy"], pd["model"]
    from make_tiny_model import WORDS

    words = [WORDS[(i * 7) % len(WORDS)] for i in range(400)]
    body = {"model": model, "messages": [{"role": "user", "content": " ".join(words)}], "max_tokens": 8,
            "temperature": 0.0, "seed": 0}
    before = len(parse_request_lines(decoder.log_text()))
    streamed = _stream_text(f"{proxy.url}/v1/chat/completions", {**body, "stream": True})
    line = _lines(decoder, before + 1)[before]
    assert line.stats.lmcache_hit_tokens == line.stats.prompt_tokens > CHUNK
    status, computed = post(f"{decoder.url}/v1/chat/completions", body)
    assert status == 200 and streamed == computed["choices"][0]["message"]["content"]
    assert _lines(decoder, before + 2)[before + 1].stats.lmcache_hit_tokens == 0


@pytest.mark.parametrize("spec,field", [
    ({"req_id": "x", "receiver_host": "10.9.9.9", "receiver_init_port": 7300, "receiver_alloc_port": 7400},
     "receiver_host"),
    ({"req_id": "x", "receiver_host": "127.0.0.1", "receiver_alloc_port": 7400}, "receiver_init_port"),
    ({"req_id": "x", "receiver_host": "127.0.0.1", "receiver_init_port": "7300", "receiver_alloc_port": 7400},
     "receiver_init_port"),
])
def test_bad_disagg_spec_is_an_error_for_that_request_only(pd, spec, field):
    prefiller, model = pd["prefiller"], pd["model"]
    status, reply = post(f"{prefiller.url}/v1/completions",
                         _completion(model, random_prompt(50, seed=3), max_tokens=1,
                                     kv_transfer_params={"disagg_spec": spec}))
    assert status == 200
    assert field in reply["kv_transfer_params"]["disagg_error"], reply
    assert "PD: request x pushed" not in prefiller.log_text()
    # The prefiller and the proxy keep serving.
    status, ok = post(f"{pd['proxy'].url}/v1/completions", _completion(model, random_prompt(40, seed=4)))
    assert status == 200 and ok["choices"][0]["text"] is not None


def test_decoder_down_is_a_quick_503_naming_it(pd):
    dead = Server("decoder", free_port(), pd["logs"] / "none.log", None)  # type: ignore[arg-type]
    proxy = start_proxy([pd["prefiller"]], [(dead, pd["init_port"])], pd["logs"] / "proxy-dead-decoder.log")
    try:
        proxy.wait_healthy(60)
        began = time.monotonic()
        status, reply = post(f"{proxy.url}/v1/completions", _completion(pd["model"], random_prompt(60, seed=5)))
        assert status == 503 and str(dead.port) in reply["error"]["instance"], reply
        assert time.monotonic() - began < 30
    finally:
        proxy.stop()


def test_prefiller_down_the_decoder_computes_and_answers_the_same(pd):
    decoder, model = pd["decoder"], pd["model"]
    proxy = start_proxy([], [(decoder, pd["init_port"])], pd["logs"] / "proxy-dead-prefiller.log",
                        prefiller_ports=[free_port()])
    try:
        proxy.wait_healthy(60)
        prompt = random_prompt(300, seed=6)
        before = len(parse_request_lines(decoder.log_text()))
        status, via_proxy = post(f"{proxy.url}/v1/completions", _completion(model, prompt))
        assert status == 200, via_proxy
        assert _lines(decoder, before + 1)[before].stats.lmcache_hit_tokens == 0
        status, direct = post(f"{decoder.url}/v1/completions", _completion(model, prompt))
        assert via_proxy["choices"][0]["text"] == direct["choices"][0]["text"]
    finally:
        proxy.stop()
