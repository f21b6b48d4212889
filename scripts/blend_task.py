"""The synthetic RAG task CacheBlend's quality is measured on (`train_tiny_model.py` trains on it,
`bench_blend.py` scores it).

A prompt is a system prompt, `num_docs` documents between blend separators, and a question
token. Each document is a list of item tokens. Items come in partner pairs (`i` and `i ^ 1`);
exactly one pair has both partners in the prompt, in two different documents, and the answer
(the next token) is the partner that comes later. The easy way to find it is for each item to
look back for its partner: that is attention from one document into another, which KV cached
with another context lacks (naive reuse) and CacheBlend must restore by recomputing the tokens
whose KV changed most. Counting occurrences does not help: every item occurs once.

```
  SYS SEP a b c d SEP e f g h SEP i j k l SEP Q   (c's partner is j)  ->  j
```
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import List, Sequence, Tuple

SYSTEM = (10, 11, 12)  # ordinary byte tokens of the tiny tokenizer
QUESTION = (13,)
ITEMS = range(100, 196)  # a small pool: the tiny model learns to copy each item quickly


@dataclass(frozen=True)
class Example:
    docs: Tuple[Tuple[int, ...], ...]
    answer: int


@dataclass(frozen=True)
class BlendTask:
    separator: Tuple[int, ...]
    num_docs: int = 4
    items_per_doc: int = 8

    def items(self) -> List[int]:
        """Whole partner pairs of ordinary tokens, none of them reserved."""
        reserved = set(self.separator) | set(SYSTEM) | set(QUESTION)
        return [t for t in ITEMS if t not in reserved and (t ^ 1) not in reserved and (t ^ 1) in ITEMS]

    def sample(self, rng: random.Random) -> Example:
        """One pair split over two documents; every other item without its partner."""
        size = self.items_per_doc
        pairs = sorted({t & ~1 for t in self.items()})
        chosen = rng.sample(pairs, self.num_docs * size - 1)
        first, second = rng.sample([chosen[0], chosen[0] + 1], 2)
        singles = iter(p + rng.randrange(2) for p in chosen[1:])
        homes = rng.sample(range(self.num_docs), 2)  # documents of the earlier and later partner
        docs = []
        for d in range(self.num_docs):
            spot = rng.randrange(size) if d in homes else -1
            item = first if d == homes[0] else second
            docs.append(tuple(item if i == spot else next(singles) for i in range(size)))
        return Example(tuple(docs), second if homes[0] < homes[1] else first)

    def answer(self, docs: Sequence[Sequence[int]]) -> int:
        """The later partner of the one pair in `docs`, in this order."""
        seen: set = set()
        for doc in docs:
            for t in doc:
                if t ^ 1 in seen:
                    return t
            seen.update(doc)
        raise ValueError("no partner pair in these documents")

    def prompt(self, docs: Sequence[Sequence[int]]) -> List[int]:
        tokens = list(SYSTEM) + list(self.separator)
        for doc in docs:
            tokens += list(doc) + list(self.separator)
        return tokens + list(QUESTION)

    def earlier_context(self, doc: Sequence[int], rng: random.Random) -> List[int]:
        """A prompt where `doc` was first retrieved after another document holding the partner of
        one of its items: what caches `doc` with a context of its own, as a RAG store meets it."""
        taken = {t & ~1 for t in doc}
        free = [p for p in sorted({t & ~1 for t in self.items()}) if p not in taken]
        other = [p + rng.randrange(2) for p in rng.sample(free, self.items_per_doc - 1)]
        other.insert(rng.randrange(self.items_per_doc), rng.choice(list(doc)) ^ 1)
        return self.prompt([other, doc])
