"""The multi-instance benchmark's workload: multi-round QA in the shape of LMCache's own benchmark.

U users chat for R rounds. Every conversation starts with the same system prompt (shared by all
users), then the user's own context, then its history: each round adds a question, and the rounds
before it their question and answer, so a user's prompt grows round by round and starts with the
whole of its previous prompt. Requests go round by round, users in order within a round; behind a
round-robin proxy over N instances request k lands on instance k mod N, so with U not a multiple of
N a user's next turn lands on another instance (`next_turn_moves`).

    messages of user u in round r:
      system (shared) | context u | q(u,0) a(u,0) | ... | q(u,r-1) a(u,r-1) | q(u,r)

Texts are words of the bench model's tokenizer vocabulary (`make_tiny_model.WORDS`, about one
token each) drawn from generators seeded by the seed and the part's name, and the answers in the
history are seeded too rather than what the model said: every kind of server gets the very same
requests, whatever its numerics. Requests are streamed chat completions (`stream_chat`).

Before the plan, `warm_up` sends each instance one short request of its own (sharing nothing with
the plan) straight, not through the proxy, so that an instance's first request is not the first
user's. It is shorter than a chunk, so it stores nothing: each of our instances' first store, which
costs more than later ones, stays in round 1 (up to 0.4 s over vLLM alone's first request in the
quiet run of 2026-11-27).
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import aiohttp

from bench_serving_client import stream_chat

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # make_tiny_model
from make_tiny_model import WORDS  # noqa: E402

WORKLOAD = "multi_round_qa"


@dataclass(frozen=True)
class QASizes:
    """Every size and the seed that shape the conversations (the same for all kinds)."""

    seed: int = 0
    users: int = 5
    rounds: int = 4
    system_words: int = 1000  # the shared system prompt
    context_words: int = 1000  # each user's own context
    question_words: int = 32
    answer_words: int = 32  # each past answer in the history
    max_tokens: int = 32  # tokens generated per request
    concurrency: int = 1  # users in flight at once within a round

    def validate(self) -> None:
        for name, value in self.__dict__.items():
            if name != "seed" and value <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")

    def longest_prompt_words(self) -> int:
        """Words in the last round's prompt (the template adds a few tokens per message)."""
        return (self.system_words + self.context_words + self.rounds * self.question_words
                + (self.rounds - 1) * self.answer_words)


@dataclass(frozen=True)
class Turn:
    """One request: user `user`'s round `round` (both from 0), with its whole conversation so far."""

    user: int
    round: int
    messages: tuple[tuple[str, str], ...]  # (role, content)

    def as_json(self) -> list[dict]:
        return [{"role": role, "content": content} for role, content in self.messages]


def words(n: int, *seed_parts: object) -> str:
    """`n` vocabulary words from a generator seeded by `seed_parts` (stable across runs)."""
    rng = random.Random("/".join(str(p) for p in seed_parts))
    return " ".join(rng.choice(WORDS) for _ in range(n))


def qa_plan(s: QASizes) -> list[list[Turn]]:
    """The turns, round by round; within a round, users in order."""
    system = ("system", words(s.system_words, s.seed, "system"))
    rounds: list[list[Turn]] = []
    for r in range(s.rounds):
        turns = []
        for u in range(s.users):
            history: list[tuple[str, str]] = [system, ("user", words(s.context_words, s.seed, "context", u))]
            for k in range(r):
                history += [("user", words(s.question_words, s.seed, "question", u, k)),
                            ("assistant", words(s.answer_words, s.seed, "answer", u, k))]
            history.append(("user", words(s.question_words, s.seed, "question", u, r)))
            turns.append(Turn(u, r, tuple(history)))
        rounds.append(turns)
    return rounds


def next_turn_moves(users: int, instances: int) -> bool:
    """Whether, sent in order behind a round-robin proxy, a user's next turn lands on another
    instance: request k goes to k mod N and a user's next turn is U requests later."""
    return instances > 1 and users % instances != 0


@dataclass
class QARecord:
    """One turn's measurement on one kind."""

    server: str  # the kind
    user: int
    round: int
    request_id: str
    served_by: str  # the instance the proxy chose ("" without a proxy)
    prompt_tokens: int
    output_tokens: int
    ttft_s: float
    latency_s: float
    start_s: float  # on the run's clock


@dataclass
class QARunner:
    """Sends the plan to one base URL (the proxy) and collects the records."""

    server: str
    base_url: str
    model: str
    clock_zero: float
    concurrency: int = 1
    on_done: Callable[[QARecord], None] = lambda rec: None
    records: list[QARecord] = field(default_factory=list)
    wall_s: float = 0.0  # from the first request sent to the last answer received

    def header_id(self, turn: Turn) -> str:
        return f"bench-{self.server}-{WORKLOAD}-r{turn.round}-u{turn.user}"

    async def run(self, rounds: Sequence[Sequence[Turn]], max_tokens: int) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_read=900)
        gate = asyncio.Semaphore(self.concurrency)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            async def one(turn: Turn) -> None:
                async with gate:
                    comp = await stream_chat(session, self.base_url, self.model, turn.as_json(), max_tokens,
                                             self.header_id(turn), self.clock_zero)
                rec = QARecord(self.server, turn.user, turn.round, comp.request_id, comp.served_by,
                               comp.prompt_tokens, comp.output_tokens, comp.ttft_s, comp.latency_s, comp.start_s)
                self.records.append(rec)
                self.on_done(rec)

            start = time.perf_counter()
            for turns in rounds:
                if self.concurrency == 1:
                    for turn in turns:  # strictly in order: the proxy's routing is then exact
                        await one(turn)
                else:
                    await asyncio.gather(*(one(turn) for turn in turns))
            self.wall_s = time.perf_counter() - start


WARMUP_WORDS = 24


async def warm_up(base_urls: Sequence[str], model: str, s: QASizes, clock_zero: float) -> list[float]:
    """One short request to each of `base_urls` in turn; their TTFTs."""
    ttfts = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_read=900)) as session:
        for i, url in enumerate(base_urls):
            messages = [{"role": "user", "content": words(WARMUP_WORDS, s.seed, "warmup", i)}]
            comp = await stream_chat(session, url, model, messages, 2, f"bench-warmup-{i}", clock_zero)
            ttfts.append(comp.ttft_s)
    return ttfts


def run_plan(runner: QARunner, rounds: Sequence[Sequence[Turn]], max_tokens: int,
             timeout_s: Optional[float] = None) -> None:
    """`runner.run` from synchronous code."""
    asyncio.run(asyncio.wait_for(runner.run(rounds, max_tokens), timeout_s))
