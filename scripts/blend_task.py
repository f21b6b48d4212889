"""The synthetic RAG task CacheBlend's quality is measured on (`train_tiny_model.py` trains on it,
`bench_blend.py` scores it).

A prompt is a system prompt, `num_docs` documents between blend separators, and a question
token. Each document is a list of distinct item tokens; exactly one item appears in two
documents, and the answer (the next token) is that shared item. Only a document token that saw
the other document can tell it is the shared one: the answer needs attention across documents,
which KV cached for each document on its own lacks (naive reuse), and CacheBlend must restore
by recomputing the tokens whose KV changed most.

```
  SYS SEP a b c d e f g h SEP i j k d l m n o SEP ... SEP Q  ->  d
```
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import List, Sequence, Tuple

SYSTEM = (10, 11, 12)  # ordinary byte tokens of the tiny tokenizer
QUESTION = (13,)
ITEMS = range(100, 164)  # a small pool: the tiny model learns to copy each item quickly


@dataclass(frozen=True)
class Example:
    docs: Tuple[Tuple[int, ...], ...]
    answer: int


@dataclass(frozen=True)
class BlendTask:
    separator: Tuple[int, ...]
    num_docs: int = 3
    items_per_doc: int = 4

    def items(self) -> List[int]:
        reserved = set(self.separator) | set(SYSTEM) | set(QUESTION)
        return [t for t in ITEMS if t not in reserved]

    def sample(self, rng: random.Random) -> Example:
        """Distinct items in every slot but two, which hold the shared item (in two documents)."""
        size = self.items_per_doc
        distinct = rng.sample(self.items(), self.num_docs * size - 1)
        shared, others = distinct[0], iter(distinct[1:])
        homes = rng.sample(range(self.num_docs), 2)
        docs = []
        for d in range(self.num_docs):
            spot = rng.randrange(size) if d in homes else -1
            docs.append(tuple(shared if i == spot else next(others) for i in range(size)))
        return Example(tuple(docs), shared)

    def prompt(self, docs: Sequence[Sequence[int]]) -> List[int]:
        tokens = list(SYSTEM) + list(self.separator)
        for doc in docs:
            tokens += list(doc) + list(self.separator)
        return tokens + list(QUESTION)

    def earlier_context(self, doc: Sequence[int], rng: random.Random) -> List[int]:
        """A prompt where `doc` was first retrieved after another document that shares one of its
        items (not the answer of any later prompt): what caches `doc` with a context of its own,
        as a RAG store meets it."""
        size = self.items_per_doc
        other = rng.sample([t for t in self.items() if t not in doc], size - 1)
        other.insert(rng.randrange(size), rng.choice(list(doc)))
        return self.prompt([other, doc])
