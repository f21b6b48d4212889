"""PD end to end on vLLM 0.9.2 (v1): two real servers (a prefiller, `kv_producer` +
`pd_role: sender`, started with vLLM's own OpenAI server module, and a decoder, `kv_consumer` +
`pd_role: receiver`, started with `lmcache_vllm serve`) and the proxy, shared by every test here.
The push channel takes a token: the decoder reads it from `pd_token_file`, the prefillers from
`LMCACHE_PD_TOKEN`.

- Through the proxy the decoder loads the prompt the prefiller pushed (its per-request line and
  `lmcache:num_hit_tokens`) and its greedy tokens and logprobs equal the decoder computing the
  same prompt with nothing cached (the decoder keeps no CPU tier, so a direct repeat is a
  cache-off run of the same engine).
- A third process pushing garbage KV for a prompt without the token, with a wrong one as a
  prefiller would, and with a wrong one ignoring the decoder's proof, is refused: counted in
  `lmcache:num_auth_refusals`, logged with its address, and the decoder's answer is unchanged.
  The same pushes with the token are taken and loaded (so the keys were the prompt's).
- A decoder told to listen on this machine's own non-loopback address without a token does not
  start, and says how to set one.
- Chat streaming and token-id prompts pass through; the prefiller pushed chunk by chunk (its
  prefill runs in several chunked-prefill steps).
- A bad `disagg_spec` sent to the prefiller is an error for that request, naming the field; the
  servers keep serving.
- A proxy whose decoder is down answers 503 within seconds; a proxy whose prefiller is down still
  answers correctly (the decoder computes the prompt itself).
- A prefiller SIGKILLed while it pushes (its own process, once the decoder's receive buffer took a
  push of the request, seen through the decoder's status API): the proxy's request still answers,
  the decoder loads what arrived and computes the rest, its greedy tokens equal computing it all,
  nothing stays in the buffer, and the decoder keeps serving.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import ROOT, random_prompt
from helpers import own_address
from pd_servers import Server, free_port, pd_env, post, start_proxy, start_vllm

from lmcache.experimental.metrics import lmcache_samples
from lmcache.integration.vllm.request_log import parse_request_lines

# vLLM's compile warm-up is not what these servers test (tests/vllm_job.py says why).
EAGER = ["--enforce-eager"]

pytestmark = pytest.mark.vllm

CHUNK = 128
PROMPT_TOKENS = 600  # four whole chunks and a partial one
PREFILL_STEP_TOKENS = 256  # the prefiller's chunked prefill: three steps for the prompt
PUSH_LINE = re.compile(r"PD: request (pd-\S+) pushed (\d+) tokens to \S+ in ([\d.]+) ms \(tokens (\d+\.\.\d+)(, last prefill)?\)")
COMMON_ENV = {"LMCACHE_CHUNK_SIZE": str(CHUNK), "LMCACHE_MAX_LOCAL_CPU_SIZE": "0.25"}
TOKEN = "pd-e2e-token-Vx3"
SENDER_ENV = {**COMMON_ENV, "LMCACHE_PD_TOKEN": TOKEN}
HIT_TOKENS = "lmcache:num_hit_tokens_total"
AUTH_REFUSALS = 'lmcache:num_auth_refusals_total{tier="PDReceiveBuffer"}'


@pytest.fixture(scope="module")
def pd(tiny_model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("pd")
    init_port, status_port = free_port(), free_port()
    status_env = {"LMCACHE_INTERNAL_API_SERVER_ENABLED": "True",
                  "LMCACHE_INTERNAL_API_SERVER_PORT_START": str(status_port)}
    token_file = logs / "pd-token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    decoder = start_vllm("decoder", tiny_model, "kv_consumer",
                         {**COMMON_ENV, **pd_env("receiver", init_port, 64 << 20), "LMCACHE_LOCAL_CPU": "False",
                          "LMCACHE_PD_TOKEN_FILE": str(token_file), **status_env},
                         logs / "decoder.log", EAGER)
    prefiller = start_vllm("prefiller", tiny_model, "kv_producer", {**SENDER_ENV, **pd_env("sender", init_port)},
                           logs / "prefiller.log",
                           ["--max-num-batched-tokens", str(PREFILL_STEP_TOKENS), "--enable-chunked-prefill", *EAGER],
                           own_cli=True)
    proxy = start_proxy([prefiller], [(decoder, init_port)], logs / "proxy.log")
    servers = [decoder, prefiller, proxy]
    try:
        for server in servers:
            server.wait_healthy()
        yield {"decoder": decoder, "prefiller": prefiller, "proxy": proxy, "init_port": init_port,
               "model": tiny_model, "logs": logs, "decoder_status": f"http://127.0.0.1:{status_port}"}
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


def _metrics(server: Server) -> dict[str, float]:
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as resp:
        return lmcache_samples(resp.read().decode())


def test_completion_through_proxy_loads_pushed_kv_and_equals_compute(pd):
    decoder, prefiller, proxy, model = pd["decoder"], pd["prefiller"], pd["proxy"], pd["model"]
    assert re.search(r"PD receiver listening on tcp://127\.0\.0\.1:\d+ \(buffer \d+ bytes, token required\)",
                     decoder.log_text())
    prompt = random_prompt(PROMPT_TOKENS, seed=11)
    before, metrics_before = len(parse_request_lines(decoder.log_text())), _metrics(decoder)
    status, via_proxy = post(f"{proxy.url}/v1/completions", _completion(model, prompt))
    assert status == 200, via_proxy
    line = _lines(decoder, before + 1)[before]
    assert line.stats.prompt_tokens == PROMPT_TOKENS
    assert line.stats.lmcache_hit_tokens == PROMPT_TOKENS and line.counters.loaded_tokens >= PROMPT_TOKENS - 1, line
    metrics = _metrics(decoder)
    assert metrics[HIT_TOKENS] - metrics_before.get(HIT_TOKENS, 0) == line.counters.loaded_tokens
    assert metrics.get(AUTH_REFUSALS, 0) == metrics_before.get(AUTH_REFUSALS, 0)
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


def _receive_buffer(status_url: str) -> tuple[int, int]:
    """(chunks the decoder's PD receive buffer has taken in all, bytes it holds now): its status API."""
    with urllib.request.urlopen(f"{status_url}/usage", timeout=5) as resp:
        usage = json.loads(resp.read())
    return usage["tiers"].get("PDReceiveBuffer", {}).get("chunks_written", 0), usage["usage_bytes"]["PDReceiveBuffer"]


# 32 chunked-prefill steps of one chunk each: a 2000-token prompt took 0.8 s from its first push to
# its last (load average 7), so a kill right after the first lands well inside this prefill.
KILLED_PROMPT_TOKENS = 4000


def test_prefiller_killed_mid_push_the_decoder_computes_the_rest(pd):
    decoder, model, logs = pd["decoder"], pd["model"], pd["logs"]
    # A prefiller of this test's own (the shared one serves the other tests), one chunk per step.
    prefiller = start_vllm("doomed prefiller", model, "kv_producer",
                           {**SENDER_ENV, **pd_env("sender", pd["init_port"])}, logs / "prefiller-killed.log",
                           ["--max-num-batched-tokens", str(CHUNK), "--enable-chunked-prefill", *EAGER])
    proxy = start_proxy([prefiller], [(decoder, pd["init_port"])], logs / "proxy-killed-prefiller.log")
    try:
        prefiller.wait_healthy()
        proxy.wait_healthy(60)
        prompt = random_prompt(KILLED_PROMPT_TOKENS, seed=21)
        # (Other tests leave pushes for requests that never reached this decoder, freed after 60 s.)
        taken_before, held_before = _receive_buffer(pd["decoder_status"])
        before = len(parse_request_lines(decoder.log_text()))
        with ThreadPoolExecutor(1) as pool:
            reply = pool.submit(post, f"{proxy.url}/v1/completions", _completion(model, prompt))
            deadline = time.monotonic() + 300
            while _receive_buffer(pd["decoder_status"])[0] == taken_before:
                assert time.monotonic() < deadline and not reply.done(), "the decoder never received a push"
                time.sleep(0.01)
            os.killpg(prefiller.proc.pid, signal.SIGKILL)  # the API server and its engine core
            prefiller.proc.wait(timeout=30)
            status, via_proxy = reply.result(timeout=300)
        assert status == 200, via_proxy
        taken, held = _receive_buffer(pd["decoder_status"])
        received = taken - taken_before
        assert 0 < received < -(-KILLED_PROMPT_TOKENS // CHUNK), f"not killed mid-push: {received} chunks arrived"
        assert "the decoder computes the prompt" in proxy.log_text()
        line = _lines(decoder, before + 1)[before]
        assert line.stats.prompt_tokens == KILLED_PROMPT_TOKENS
        # What arrived is loaded (a prefix of whole chunks), the rest computed; nothing is left behind.
        assert line.stats.lmcache_hit_tokens == line.counters.loaded_tokens == received * CHUNK, (line, received)
        assert held <= held_before, f"{held - held_before} bytes of this request left in the receive buffer"

        # The decoder keeps serving, and computing the prompt with nothing pushed gives the same tokens.
        status, computed = post(f"{decoder.url}/v1/completions", _completion(model, prompt))
        assert status == 200, computed
        assert _lines(decoder, before + 2)[before + 1].stats.lmcache_hit_tokens == 0
        got, want = via_proxy["choices"][0], computed["choices"][0]
        assert got["text"] == want["text"] and got["logprobs"]["tokens"] == want["logprobs"]["tokens"]
        diffs = [abs(a - b) for a, b in zip(got["logprobs"]["token_logprobs"], want["logprobs"]["token_logprobs"])]
        assert len(diffs) == 8 and max(diffs) < 1e-3
    finally:
        proxy.stop()
        prefiller.stop()


def _intrude(pd, prompt: list[int], attempts: list[dict]) -> dict:
    """`pd_intruder.py` in its own process against the shared decoder: its JSON answer."""
    job = {"address": f"tcp://127.0.0.1:{pd['init_port']}", "model": pd["model"], "chunk": CHUNK,
           "prompt": prompt, "attempts": attempts}
    env = {key: value for key, value in os.environ.items() if key != "LMCACHE_PD_TOKEN"}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "pd_intruder.py"), json.dumps(job)],
                          capture_output=True, text=True, timeout=120, env=env, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_pushes_without_the_token_are_refused_and_the_answer_is_unchanged(pd):
    decoder, model = pd["decoder"], pd["model"]
    prompt = random_prompt(3 * CHUNK + 20, seed=31)
    before = len(parse_request_lines(decoder.log_text()))
    status, reference = post(f"{decoder.url}/v1/completions", _completion(model, prompt))  # nothing pushed
    assert status == 200 and _lines(decoder, before + 1)[before].stats.lmcache_hit_tokens == 0
    refused_before, (taken_before, _) = _metrics(decoder).get(AUTH_REFUSALS, 0), _receive_buffer(pd["decoder_status"])

    got = _intrude(pd, prompt, [{"token": None}, {"token": "not-" + TOKEN}, {"token": "not-" + TOKEN, "hostile": True}])
    none, wrong, hostile = got["results"]
    assert got["chunks"] == 3 and all(r["taken"] == 0 for r in got["results"]), got
    assert "takes a token and this prefiller has none" in none["refused"]
    assert "failed the token handshake" in wrong["refused"]
    assert "wrong token" in hostile["refused"] and "authentication required" in hostile["refused"]
    assert _receive_buffer(pd["decoder_status"])[0] == taken_before
    assert re.search(r"PD receiver on tcp://\S+: refused a peer at 127\.0\.0\.1", decoder.log_text())

    status, after = post(f"{decoder.url}/v1/completions", _completion(model, prompt))
    assert status == 200 and _lines(decoder, before + 2)[before + 1].stats.lmcache_hit_tokens == 0
    got, want = after["choices"][0], reference["choices"][0]
    assert got["text"] == want["text"] and got["logprobs"]["tokens"] == want["logprobs"]["tokens"]
    diffs = [abs(a - b) for a, b in zip(got["logprobs"]["token_logprobs"], want["logprobs"]["token_logprobs"])]
    assert len(diffs) == 8 and max(diffs) < 1e-3
    # none: 1 push; wrong: its empty proof; hostile: its proof and 3 pushes (published at that lookup)
    assert _metrics(decoder)[AUTH_REFUSALS] - refused_before == 6

    # The same garbage pushed with the token is taken and loaded: the refusals were the token's doing.
    got = _intrude(pd, prompt, [{"token": TOKEN}])
    assert got["results"] == [{"taken": 3, "refused": None}], got
    status, _ = post(f"{decoder.url}/v1/completions", _completion(model, prompt))
    assert status == 200 and _lines(decoder, before + 3)[before + 2].stats.lmcache_hit_tokens == 3 * CHUNK


def test_decoder_on_a_public_address_without_a_token_does_not_start(tiny_model, tmp_path):
    address, port = own_address(), free_port()
    decoder = start_vllm("open decoder", tiny_model, "kv_consumer",
                         {**COMMON_ENV, **pd_env("receiver", port, 16 << 20, LMCACHE_PD_PEER_HOST=address)},
                         tmp_path / "decoder.log", EAGER)
    try:
        decoder.proc.wait(timeout=300)
    finally:
        decoder.stop()
    assert decoder.proc.returncode != 0
    log = decoder.log_text()
    assert f"refusing to listen for PD pushes on {address}:{port}" in log, log[-4000:]
    assert "LMCACHE_PD_TOKEN" in log and "pd_no_auth" in log
