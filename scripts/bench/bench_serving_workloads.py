"""The benchmark's workloads as fixed, seeded plans, and the executor that runs a plan against a server.

A plan is a list of steps (clear vLLM's own prefix cache / send one request / send a batch
concurrently) built only from the sizes and the seed, so every server gets the very same requests
in the very same order. Prompts are token ids (no tokenizer round trip, exact lengths), drawn from
the ordinary ids of the vocabulary (the 4 special tokens are left out).

Workloads (issue 8):
- `repeat`: N long prompts; per prompt: clear, `first` send, clear, `second` send, `limit` send.
  Clearing vLLM's own prefix cache before `second` makes it a reload from our tier (a recompute for
  vLLM alone); `limit` follows right after, so vLLM's own prefix cache answers it: the floor.
- `beyond`: D documents whose KV is several times vLLM's KV space; a `warmup` pass sends each once,
  then `query` sends them in shuffled rounds, each followed by a fresh short question. vLLM's
  own cache mostly misses (the LRU space holds ~1-2 documents); ours hits from its tier.
- `unique`: prompts sharing nothing, sent in passes of P at fixed concurrency: our overhead on pure
  misses. `bench_serving` sends each pass to one of our servers and to a vLLM alone running beside
  it, in turn (A B, B A, ...), and takes the median pass pair's ratio.
- `restart`: `repeat`'s prompts replayed on a new server process over the same disk/remote tier.
- `interference` (issue 12): per round: clear, `store` a long prefix into our (slow) tier, clear,
  stream a short request `alone`, then stream another (`stream`) and, once it has streamed a few
  tokens, send the long prefix again (`load`: it now loads from the slow tier). The streaming
  request's inter-token latency while the load is in flight over its latency alone tells whether
  a slow load stalls everyone else's decoding (`bench_serving_report.interference`).
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import aiohttp

from bench_serving_client import (
    PrefixCounters, RequestFailed, prefix_cache_counters, reset_prefix_cache, stream_completion,
)

WORKLOADS = ("repeat", "beyond", "unique", "restart", "interference")
FIRST_ORDINARY_TOKEN = 4  # ids 0-3 are <unk> <s> </s> <pad> in make_tiny_model's tokenizer
# `interference`: the load is sent once the streaming request has this many tokens (it decodes).
OVERLAP_AFTER_TOKENS = 4


@dataclass(frozen=True)
class WorkloadSizes:
    """Every size and the seed that shape the requests (the same for all servers)."""

    vocab: int
    seed: int = 0
    repeat_prompts: int = 6
    prompt_tokens: int = 3000
    docs: int = 8
    doc_tokens: int = 3072
    question_tokens: int = 32
    rounds: int = 3
    # One prompt per pass, 12 passes: the side-by-side pairs the README's no-reuse row reports
    # (a median of 12 pairs moves ~2% run to run on this machine; fewer pairs, more).
    unique_prompts: int = 1  # per pass
    unique_passes: int = 12
    unique_tokens: int = 2048
    concurrency: int = 1
    max_tokens: int = 8  # generated tokens per TTFT request
    unique_max_tokens: int = 32  # generated tokens per `unique` request (throughput)
    interference_rounds: int = 3
    interference_prefix_tokens: int = 3072  # the prefix loaded from the slow tier (whole chunks)
    stream_tokens: int = 64  # prompt of the streaming request
    stream_max_tokens: int = 160  # its generated tokens: enough to outlast the load

    def validate(self, max_model_len: int) -> None:
        for name in ("repeat_prompts", "prompt_tokens", "docs", "doc_tokens", "question_tokens",
                     "rounds", "unique_prompts", "unique_passes", "unique_tokens", "concurrency", "max_tokens",
                     "unique_max_tokens", "interference_rounds", "interference_prefix_tokens", "stream_tokens",
                     "stream_max_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        longest = max(
            self.prompt_tokens + self.max_tokens,
            self.doc_tokens + self.question_tokens + self.max_tokens,
            self.unique_tokens + self.unique_max_tokens,
            self.interference_prefix_tokens + self.max_tokens,
            self.stream_tokens + self.stream_max_tokens,
        )
        if longest > max_model_len:
            raise ValueError(f"the longest request needs {longest} tokens > --max-model-len {max_model_len}")
        if self.stream_max_tokens <= OVERLAP_AFTER_TOKENS + 1:
            raise ValueError(f"--stream-max-tokens must be above {OVERLAP_AFTER_TOKENS + 1}, got {self.stream_max_tokens}")
        if self.vocab <= FIRST_ORDINARY_TOKEN + 1:
            raise ValueError(f"vocab {self.vocab} leaves no ordinary token ids")


@dataclass(frozen=True)
class BenchRequest:
    workload: str
    phase: str
    index: int
    prompt: tuple[int, ...]
    max_tokens: int
    doc: Optional[int] = None  # `beyond`: which document the prompt starts with


@dataclass(frozen=True)
class Step:
    """`reset` (clear vLLM's own prefix cache), or requests: one alone, or several at `concurrency`;
    with `overlap`, that request is sent once the single request has streamed OVERLAP_AFTER_TOKENS."""

    requests: tuple[BenchRequest, ...] = ()
    reset: bool = False
    concurrency: int = 1
    overlap: Optional[BenchRequest] = None
    # A throughput pass: its tokens/s is recorded, even when it holds a single request.
    timed_pass: bool = False


@dataclass
class RequestRecord:
    """One request's measurement on one server, with the hits seen for it."""

    server: str  # server label, e.g. "lmcache-disk" or "lmcache-disk#restart"
    workload: str
    phase: str
    index: int
    doc: Optional[int]
    request_id: str
    prompt_tokens: int
    output_tokens: int
    ttft_s: float
    latency_s: float
    start_s: float
    vllm_hit_tokens: Optional[float]  # from vLLM's counters around this request (None in a batch)
    # From our server's per-request log line (None: no line for this request, e.g. vLLM alone).
    lmcache_hit_tokens: Optional[int] = None  # our cached prefix at lookup
    lmcache_loaded_tokens: Optional[int] = None  # tokens copied from our tier into vLLM's cache
    lmcache_stored_tokens: Optional[int] = None
    # (arrival on the run's clock, tokens so far) per streamed chunk; kept for `interference` only.
    token_times: list[tuple[float, int]] = field(default_factory=list)


@dataclass
class PhaseTotals:
    """Per (workload, phase): seconds the server was busy with it, vLLM's own prefix-cache counters,
    and the tokens/s of each concurrent batch (pass) in it."""

    busy_s: float = 0.0
    prefix: PrefixCounters = field(default_factory=lambda: PrefixCounters(0.0, 0.0))
    batch_tok_s: list[float] = field(default_factory=list)

    def add(self, busy_s: float, prefix: PrefixCounters, batch_tok_s: Sequence[float] = ()) -> None:
        self.busy_s += busy_s
        self.prefix = PrefixCounters(self.prefix.queries + prefix.queries, self.prefix.hits + prefix.hits)
        self.batch_tok_s.extend(batch_tok_s)


def token_ids(n: int, vocab: int, *seed_parts: object) -> tuple[int, ...]:
    """`n` ordinary token ids from a generator seeded by `seed_parts` (stable across runs)."""
    rng = random.Random("/".join(str(p) for p in seed_parts))
    return tuple(rng.randrange(FIRST_ORDINARY_TOKEN, vocab) for _ in range(n))


def repeat_prompts(s: WorkloadSizes) -> list[tuple[int, ...]]:
    return [token_ids(s.prompt_tokens, s.vocab, s.seed, "repeat", i) for i in range(s.repeat_prompts)]


def repeat_plan(s: WorkloadSizes, workload: str = "repeat") -> list[Step]:
    """Per prompt: clear, first, clear, second, limit (`restart` replays the same prompts)."""
    steps: list[Step] = []
    for i, prompt in enumerate(repeat_prompts(s)):
        for phase in ("first", "second", "limit"):
            if phase != "limit":
                steps.append(Step(reset=True))
            steps.append(Step((BenchRequest(workload, phase, i, prompt, s.max_tokens),)))
    return steps


def query_order(s: WorkloadSizes) -> list[int]:
    """`rounds` shuffled passes over the documents; no document twice in a row across passes."""
    rng = random.Random(f"{s.seed}/beyond/order")
    order: list[int] = []
    for _ in range(s.rounds):
        docs = list(range(s.docs))
        rng.shuffle(docs)
        if order and len(docs) > 1 and docs[0] == order[-1]:
            docs[0], docs[-1] = docs[-1], docs[0]
        order.extend(docs)
    return order


def beyond_plan(s: WorkloadSizes) -> list[Step]:
    """Clear, a warm-up pass (each document once, in order), then the shuffled query rounds."""
    docs = [token_ids(s.doc_tokens, s.vocab, s.seed, "doc", d) for d in range(s.docs)]
    steps = [Step(reset=True)]
    for d, doc in enumerate(docs):
        question = token_ids(s.question_tokens, s.vocab, s.seed, "warmup-question", d)
        steps.append(Step((BenchRequest("beyond", "warmup", d, doc + question, s.max_tokens, d),)))
    for k, d in enumerate(query_order(s)):
        question = token_ids(s.question_tokens, s.vocab, s.seed, "question", k)
        steps.append(Step((BenchRequest("beyond", "query", k, docs[d] + question, s.max_tokens, d),)))
    return steps


def unique_plan(s: WorkloadSizes) -> list[Step]:
    """Clear, then `unique_passes` batches of `unique_prompts` new prompts at the configured concurrency."""
    steps = [Step(reset=True)]
    for k in range(s.unique_passes):
        batch = tuple(
            BenchRequest("unique", "unique", i, token_ids(s.unique_tokens, s.vocab, s.seed, "unique", i),
                         s.unique_max_tokens)
            for i in range(k * s.unique_prompts, (k + 1) * s.unique_prompts)
        )
        steps.append(Step(batch, concurrency=s.concurrency, timed_pass=True))
    return steps


def interference_plan(s: WorkloadSizes) -> list[Step]:
    """Per round: clear, store the prefix, clear, a stream alone, a stream with the prefix's load."""
    steps: list[Step] = []
    for i in range(s.interference_rounds):
        prefix = token_ids(s.interference_prefix_tokens, s.vocab, s.seed, "interference", i)
        alone, during = (BenchRequest("interference", phase, i,
                                      token_ids(s.stream_tokens, s.vocab, s.seed, "stream", phase, i),
                                      s.stream_max_tokens) for phase in ("alone", "stream"))
        steps += [Step(reset=True), Step((BenchRequest("interference", "store", i, prefix, s.max_tokens),)),
                  Step(reset=True), Step((alone,)),
                  Step((during,), overlap=BenchRequest("interference", "load", i, prefix, s.max_tokens))]
    return steps


def build_plan(workload: str, s: WorkloadSizes) -> list[Step]:
    if workload in ("repeat", "restart"):
        return repeat_plan(s, workload)
    if workload == "beyond":
        return beyond_plan(s)
    if workload == "unique":
        return unique_plan(s)
    if workload == "interference":
        return interference_plan(s)
    raise ValueError(f"workload {workload!r} is not one of {', '.join(WORKLOADS)}")


def count_requests(steps: Sequence[Step]) -> int:
    return sum(len(step.requests) + (step.overlap is not None) for step in steps)


@dataclass
class PlanRunner:
    """Runs plans against one server and collects records and per-phase totals."""

    server: str
    base_url: str
    model: str
    clock_zero: float
    on_done: Callable[[RequestRecord], None]
    records: list[RequestRecord] = field(default_factory=list)
    totals: dict[tuple[str, str], PhaseTotals] = field(default_factory=dict)

    def _header_id(self, req: BenchRequest) -> str:
        return f"bench-{self.server.replace('#', '-')}-{req.workload}-{req.phase}-{req.index}"

    def _record(self, req: BenchRequest, comp, vllm_hits: Optional[float]) -> RequestRecord:
        rec = RequestRecord(
            self.server, req.workload, req.phase, req.index, req.doc, comp.request_id,
            comp.prompt_tokens, comp.output_tokens, comp.ttft_s, comp.latency_s, comp.start_s, vllm_hits,
            token_times=list(comp.token_times) if req.workload == "interference" else [],
        )
        self.records.append(rec)
        self.on_done(rec)
        return rec

    def _phase(self, req: BenchRequest) -> PhaseTotals:
        return self.totals.setdefault((req.workload, req.phase), PhaseTotals())

    async def _send(self, session: aiohttp.ClientSession, req: BenchRequest,
                    progress: Optional[Callable[[int], None]] = None):
        return await stream_completion(
            session, self.base_url, self.model, req.prompt, req.max_tokens, self._header_id(req),
            self.clock_zero, progress,
        )

    async def run(self, steps: Sequence[Step]) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_read=900)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            for step in steps:
                if step.reset:
                    await reset_prefix_cache(session, self.base_url)
                elif step.overlap is not None:
                    await self._run_overlapped(session, step.requests[0], step.overlap)
                elif len(step.requests) == 1 and not step.timed_pass:
                    await self._run_one(session, step.requests[0])
                else:
                    await self._run_batch(session, step)

    async def _run_one(self, session: aiohttp.ClientSession, req: BenchRequest) -> None:
        before = await prefix_cache_counters(session, self.base_url)
        comp = await self._send(session, req)
        delta = (await prefix_cache_counters(session, self.base_url)).minus(before)
        self._record(req, comp, delta.hits)
        self._phase(req).add(comp.latency_s, delta)

    async def _run_overlapped(self, session: aiohttp.ClientSession, stream: BenchRequest,
                              overlap: BenchRequest) -> None:
        """`stream`, and `overlap` sent once `stream` is decoding (both recorded; vLLM's prefix
        counters are not split between the two, so neither gets them)."""
        decoding = asyncio.Event()

        def progress(generated: int) -> None:
            if generated >= OVERLAP_AFTER_TOKENS:
                decoding.set()

        streaming = asyncio.ensure_future(self._send(session, stream, progress))
        waiting = asyncio.ensure_future(decoding.wait())
        await asyncio.wait((streaming, waiting), return_when=asyncio.FIRST_COMPLETED)
        waiting.cancel()
        if streaming.done():
            streaming.result()  # its error, if it failed
            if decoding.is_set():  # its tokens came in faster than the loop could send the other
                raise RequestFailed(f"{self._header_id(stream)} ended before the overlapping request was sent: "
                                    "raise --stream-max-tokens so the stream outlasts it")
            raise RequestFailed(f"{self._header_id(stream)} ended before {OVERLAP_AFTER_TOKENS} tokens")
        loaded = await self._send(session, overlap)
        self._record(stream, await streaming, None)
        self._record(overlap, loaded, None)

    async def _run_batch(self, session: aiohttp.ClientSession, step: Step) -> None:
        gate = asyncio.Semaphore(step.concurrency)

        async def one(req: BenchRequest) -> int:
            async with gate:
                rec = self._record(req, await self._send(session, req), None)
                return rec.prompt_tokens + rec.output_tokens

        before = await prefix_cache_counters(session, self.base_url)
        start = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(req) for req in step.requests)))
        wall = time.perf_counter() - start
        delta = (await prefix_cache_counters(session, self.base_url)).minus(before)
        phases = {(r.workload, r.phase) for r in step.requests}
        if len(phases) != 1:
            raise ValueError(f"a concurrent batch must hold one phase, got {sorted(phases)}")
        self._phase(step.requests[0]).add(wall, delta, [tokens / wall])
