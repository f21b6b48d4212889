"""The request-kind matrix both vLLM lines run: every kind of request a vLLM server takes, sent over
HTTP twice to servers with our cache and once to vLLM alone, answers compared.

One set of servers per line (`MatrixServers`), started together and shared by every kind: vLLM
alone (the cache-off reference) and one server per door with our CPU tier, all with the same
flags: float32, vLLM's own prefix cache off (a repeat can only hit LMCache), two LoRA adapters,
the priority scheduler (vLLM 0.32; see `MatrixServers`). Each kind is a request body on a seeded prompt; the second send of a kind
that may load is a full LMCache hit (checked on the door's log lines), the second send of a kind
that must compute its prompt (prompt logprobs) loads nothing and says why. Greedy tokens, texts,
finish reasons and logprobs must equal vLLM alone's (logprobs within float32 noise), and a
server must answer `/health` after every request. Where vLLM itself refuses a kind, our server
must refuse it the same way (same status), and stay healthy.
"""

from __future__ import annotations

import json
import random
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Sequence

from conftest import ROOT, random_prompt

sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "scripts" / "bench"))
from bench_serving_servers import (  # noqa: E402
    VLLM_KIND,
    ManagedProcess,
    ServerSettings,
    free_port,
    launch,
    server_launch,
)
from make_tiny_lora import make_tiny_lora  # noqa: E402
from make_tiny_model import WORDS  # noqa: E402

from lmcache.experimental.metrics import lmcache_samples  # noqa: E402
from lmcache.integration.vllm.request_log import parse_request_lines, parse_v0_step_lines  # noqa: E402

CHUNK = 256
LORAS = ("lora-a", "lora-b")
KV_TOKENS = 8192  # vLLM's own KV space per server
LOGPROB_TOLERANCE = 1e-3  # float32 noise between a full prefill and one over a loaded prefix
PROMPT = random_prompt(700, seed=40)  # two whole chunks and a partial one
SHORT = random_prompt(100, seed=41)  # inside the first chunk
LONG = random_prompt(900, seed=42)  # truncated to its last 600 tokens by one kind


def chat_text(seed: int, words: int = 300) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


CHAT = [{"role": "system", "content": chat_text(43)}, {"role": "user", "content": chat_text(44, 60)}]
JSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "count": {"type": "integer"}},
    "required": ["name", "count"],
}


@dataclass(frozen=True)
class Kind:
    """One kind of request: its endpoint and body, and what the cache may do with it."""

    name: str
    path: str  # "/v1/completions" or "/v1/chat/completions"
    body: Dict[str, Any]  # without "model" unless the kind names an adapter
    loads: bool = True  # False: the request must compute its whole prompt (never loads)
    stream: bool = False
    new_keys: bool = False  # its first send must miss (a salt or adapter no kind before it used)
    per_request_lines: bool = True  # False: vLLM sends it as requests of its own ids (beam search)


def _completion(name: str, prompt: Sequence[int], **body: Any) -> Kind:
    return Kind(name, "/v1/completions", {"prompt": list(prompt), "temperature": 0.0, **body})


def _chat(name: str, **body: Any) -> Kind:
    return Kind(name, "/v1/chat/completions", {"messages": CHAT, "temperature": 0.0, **body})


KINDS: List[Kind] = [
    # lm-evaluation-harness's loglikelihood request: the prompt's own logprobs, one token out.
    replace(_completion("echo-logprobs", PROMPT, echo=True, logprobs=1, max_tokens=1), loads=False),
    _completion("logprobs", PROMPT, logprobs=2, max_tokens=8),
    _chat("chat-logprobs", logprobs=True, top_logprobs=2, max_tokens=8),
    _completion("n-2", PROMPT, n=2, max_tokens=6, temperature=0.8, seed=7),  # n > 1 must sample
    _completion("best-of-2", PROMPT, n=1, best_of=2, max_tokens=4, temperature=0.8, seed=7),
    replace(_completion("beam-search", PROMPT, n=2, use_beam_search=True, max_tokens=4), per_request_lines=False),
    _completion("stop-string-first-chunk", SHORT, stop=[" the", "e"], max_tokens=12),
    _completion("max-tokens-first-chunk", SHORT, max_tokens=3, logprobs=1),
    _completion("min-tokens", PROMPT, min_tokens=6, max_tokens=6, stop_token_ids=[2, 5, 7]),
    _chat("json-schema", max_tokens=16,
          response_format={"type": "json_schema", "json_schema": {"name": "item", "schema": JSON_SCHEMA}}),
    *[replace(_completion(name, PROMPT, model=name, max_tokens=8, logprobs=1), new_keys=True) for name in LORAS],
    # vLLM 0.9.2 takes `cache_salt` on chat only (its completions ignore it), and on its v1 engine only.
    replace(_chat("cache-salt", cache_salt="tenant-7", max_tokens=8, logprobs=True), new_keys=True),
    _completion("priority", PROMPT, priority=-1, max_tokens=8, logprobs=1),
    _completion("truncate-prompt", LONG, truncate_prompt_tokens=600, max_tokens=8, logprobs=1),
    replace(_completion("stream-completion", PROMPT, max_tokens=8, logprobs=1, stream=True), stream=True),
    replace(_chat("stream-chat", max_tokens=8, logprobs=True, stream=True), stream=True),
]


@dataclass
class Answer:
    """What a server said to one request, reduced to what must match: the HTTP status, and per
    choice the text, finish reason, tokens and logprobs (streamed answers joined)."""

    status: int
    choices: List[Dict[str, Any]] = field(default_factory=list)
    request_id: str = ""
    error: str = ""


def _logprob_rows(choice: Dict[str, Any]) -> tuple:
    """(tokens, logprobs) of a choice, completions and chat alike (None for the first echoed token)."""
    lp = choice.get("logprobs") or {}
    if "content" in lp:  # chat
        rows = lp["content"] or []
        return [r["token"] for r in rows], [r["logprob"] for r in rows]
    return list(lp.get("tokens") or []), list(lp.get("token_logprobs") or [])


def _reduce(choices: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    out = []
    for choice in sorted(choices, key=lambda c: c.get("index", 0)):
        text = choice.get("text")
        if text is None:
            text = (choice.get("message") or {}).get("content")
        tokens, logprobs = _logprob_rows(choice)
        out.append({"text": text, "finish_reason": choice.get("finish_reason"), "tokens": tokens,
                    "logprobs": logprobs})
    return out


def _join_stream(lines: Sequence[str]) -> tuple[str, List[Dict[str, Any]]]:
    """The request id and the choices of an SSE stream, each choice's deltas joined."""
    joined: Dict[int, Dict[str, Any]] = {}
    request_id = ""
    for line in lines:
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[len("data: "):])
        request_id = request_id or event.get("id", "")
        for part in event.get("choices", []):
            acc = joined.setdefault(part.get("index", 0), {"index": part.get("index", 0), "text": "",
                                                          "finish_reason": None, "logprobs": {}})
            acc["text"] += part.get("text") or (part.get("delta") or {}).get("content") or ""
            acc["finish_reason"] = part.get("finish_reason") or acc["finish_reason"]
            lp = part.get("logprobs") or {}
            for key, value in lp.items():
                if isinstance(value, list):
                    acc["logprobs"].setdefault(key, []).extend(value)
    return request_id, list(joined.values())


def send(port: int, model: str, kind: Kind, timeout_s: float = 300.0) -> Answer:
    """Send `kind` to the server on `port` and reduce its answer."""
    body = {"model": model, **kind.body}
    request = urllib.request.Request(f"http://127.0.0.1:{port}{kind.path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            if kind.stream:
                request_id, choices = _join_stream(resp.read().decode().splitlines())
            else:
                payload = json.loads(resp.read())
                request_id, choices = payload.get("id", ""), payload.get("choices", [])
            return Answer(resp.status, _reduce(choices), request_id)
    except urllib.error.HTTPError as err:
        return Answer(err.code, error=err.read().decode(errors="replace")[:300])


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def assert_same_answer(kind: str, ours: Answer, alone: Answer) -> None:
    """Our answer equals vLLM alone's: status, texts, finish reasons, tokens; logprobs within noise."""
    assert ours.status == alone.status, f"{kind}: {ours.status} {ours.error} against vLLM alone's {alone.status} {alone.error}"
    assert len(ours.choices) == len(alone.choices), kind
    for got, want in zip(ours.choices, alone.choices):
        for key in ("text", "finish_reason", "tokens"):
            assert got[key] == want[key], f"{kind}: {key} {got[key]!r} != {want[key]!r}"
        assert len(got["logprobs"]) == len(want["logprobs"]), kind
        for g, w in zip(got["logprobs"], want["logprobs"]):
            assert (g is None) == (w is None), kind
            if g is not None:
                assert abs(g - w) < LOGPROB_TOLERANCE, f"{kind}: logprob {g} != {w}"


@dataclass(frozen=True)
class Door:
    """One server of the matrix: how it is started (a `bench_serving_servers` kind, a door), and
    the environment it adds."""

    name: str
    kind: str  # VLLM_KIND for vLLM alone, else "lmcache-cpu"
    door: str = "wrapper"  # "wrapper" (`lmcache_vllm serve`) or "v1" (vLLM's server + our connector)
    env: Dict[str, str] = field(default_factory=dict)


class MatrixServers:
    """The matrix's servers, started together (their start-ups overlap) and stopped with SIGINT."""

    def __init__(self, model: str, doors: Sequence[Door], log_dir: Path) -> None:
        self.model = model
        block_size = 16 if _legacy() else 128  # vLLM 0.32's CPU attention wants a multiple of 32
        # vLLM 0.9.2's priority queue compares two requests of equal priority and arrival time
        # (the children of an n > 1 request) and its engine dies (vLLM alone too; 0.32 orders them):
        # there it runs first-come-first-served and refuses the priority kind, as it does for users.
        scheduling = "fcfs" if _legacy() else "priority"
        loras = [f"{name}={make_tiny_lora(Path(model), ROOT / '.cache' / f'tiny-{name}', seed=i + 1)}"
                 for i, name in enumerate(LORAS)]
        self.settings = ServerSettings(
            model=model, max_model_len=2048, block_size=block_size, num_kv_blocks=KV_TOKENS // block_size,
            chunk_size=CHUNK, cpu_tier_gb=1, disk_tier_gb=1, remote_tier_gb=1, disk_dir=str(log_dir / "disk"),
            extra_vllm_args=("--no-enable-prefix-caching", "--enable-lora", "--max-lora-rank", "8",
                             "--lora-modules", *loras, "--scheduling-policy", scheduling, "--enforce-eager"),
        )
        self.doors = list(doors)
        self.ports: Dict[str, int] = {}
        self.procs: Dict[str, ManagedProcess] = {}
        for door in self.doors:
            port = self.ports[door.name] = free_port()
            settings = replace(self.settings, door=door.door)
            spec = server_launch(door.kind, settings, port, log_dir / f"{door.name}.log")
            spec = replace(spec, env={**spec.env, **door.env})
            self.procs[door.name] = launch(spec, ROOT)

    def wait_ready(self, timeout_s: float = 400.0) -> None:
        for proc in self.procs.values():
            proc.wait_healthy(timeout_s)

    def log(self, door: str) -> str:
        return self.procs[door].spec.log_path.read_text(errors="replace")

    def stop(self) -> Dict[str, int]:
        """SIGINT to every server at once (a user's Ctrl-C); their exit codes."""
        with ThreadPoolExecutor(len(self.procs)) as pool:
            codes = pool.map(lambda proc: proc.stop(), self.procs.values())
            return dict(zip(self.procs, codes))


@contextmanager
def started(model: str, doors: Sequence[Door], log_dir: Path) -> Iterator[MatrixServers]:
    """The matrix's servers, ready; on leaving, Ctrl-C must stop every one cleanly (exit code 0)."""
    servers = MatrixServers(model, doors, log_dir)
    try:
        servers.wait_ready()
        yield servers
    finally:
        codes = servers.stop()
    assert codes == {door.name: 0 for door in doors}, codes


def _legacy() -> bool:
    from lmcache_vllm.compat import installed_vllm_release

    return (installed_vllm_release() or "").startswith("0.9.")


def run_matrix(
    servers: MatrixServers, references: Dict[str, str], kinds: Sequence[Kind] = KINDS
) -> Dict[str, Dict[str, List[Answer]]]:
    """Every kind twice to every server with our cache (once to vLLM alone), kind by kind; every
    answer compared with the first answer of its door's reference (`references[door]`), every
    server healthy after each request."""
    answers: Dict[str, Dict[str, List[Answer]]] = {}
    for kind in kinds:
        per_door = answers[kind.name] = {}
        for door in servers.doors:
            port = servers.ports[door.name]
            sends = 1 if door.kind == VLLM_KIND else 2
            per_door[door.name] = [send(port, servers.model, kind) for _ in range(sends)]
            assert healthy(port), f"{door.name} unhealthy after {kind.name}:\n{servers.procs[door.name].log_tail()}"
        for door, got in per_door.items():
            want = per_door[references[door]][0]
            for i, answer in enumerate(got):
                assert_same_answer(f"{kind.name} (send {i + 1} to {door})", answer, want)
    return answers


def v1_lines_of(log: str, answer: Answer) -> list:
    """The v1 door's per-request lines of one answer (vLLM's request ids start with the answer's id,
    or carry it after a child index for n > 1)."""
    return [line for line in parse_request_lines(log) if answer.request_id and answer.request_id in line.req_id]


def wait_for_lines(read_log: Callable[[], str], answer: Answer, timeout_s: float = 10.0) -> list:
    """The answer's lines once the engine core has logged them (its log may trail the HTTP reply)."""
    deadline = time.monotonic() + timeout_s
    while True:
        lines = v1_lines_of(read_log(), answer)
        if lines or time.monotonic() > deadline:
            return lines
        time.sleep(0.2)


def check_v1_lines(servers: MatrixServers, door: str, answers: Dict[str, Dict[str, List[Answer]]]) -> list:
    """Each kind's lines on a v1 door agree with what it may do: the second send of a kind that may
    load was a hit and loaded; a kind that must compute its prompt never looked up, said why, and
    stored; a kind with new keys missed first. Returns every line of the matched answers."""
    every = []
    for kind in KINDS:
        if not kind.per_request_lines or answers[kind.name][door][0].status != 200:
            continue
        first, second = (wait_for_lines(lambda: servers.log(door), a) for a in answers[kind.name][door])
        assert first and second, f"{kind.name} on {door}: no per-request line"
        every += first + second
        if kind.loads:
            assert all(ln.stats.lmcache_hit_tokens > 0 and ln.counters.loaded_tokens > 0 for ln in second), (kind.name, second)
        else:
            for ln in first + second:
                assert ln.load_reason == "prompt logprobs" and ln.stats.lmcache_hit_tokens == ln.counters.loaded_tokens == 0, ln
            assert all(ln.counters.stored_tokens > 0 for ln in first), (kind.name, first)
        if kind.new_keys:
            assert all(ln.stats.lmcache_hit_tokens == 0 for ln in first), (kind.name, first)
    return every


def check_v0_lines(log: str) -> None:
    """The v0 door logs a step line per prompt it serves: some loaded, and the prompt-logprobs
    prompts say why they did not."""
    steps = parse_v0_step_lines(log)
    assert any(s.loaded_tokens > 0 for s in steps), steps
    refused = [s for s in steps if s.load_reason]
    assert len(refused) >= 2 and all(s.load_reason == "prompt logprobs" and s.loaded_tokens == 0 for s in refused), refused


def check_metrics_add_up(servers: MatrixServers, door: str) -> None:
    """The door's `lmcache:` metrics on `/metrics` (the engine core's, through vLLM's multiprocess
    metrics) agree with its per-request lines: hit tokens are the loaded tokens; stored tokens
    (newly stored) at most what the lines handed to the store (a repeat's chunks are skipped)."""
    lines = parse_request_lines(servers.log(door))
    with urllib.request.urlopen(f"http://127.0.0.1:{servers.ports[door]}/metrics", timeout=30) as resp:
        page = resp.read().decode()
    samples = lmcache_samples(page)
    assert "vllm:prompt_tokens_total" in page
    assert samples["lmcache:num_hit_tokens_total"] == sum(ln.counters.loaded_tokens for ln in lines) > 0
    assert 0 < samples["lmcache:num_stored_tokens_total"] <= sum(ln.counters.stored_tokens for ln in lines)
    assert samples['lmcache:local_cache_usage{tier="Hot"}'] > 0


REFERENCE = Door("vllm-alone", VLLM_KIND)
