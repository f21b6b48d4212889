"""The synthetic task behind the CacheBlend quality benchmark: one partner pair split over two
documents, every other item alone, the answer the later partner in the order asked."""

from __future__ import annotations

import random
import sys

from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))

from blend_task import QUESTION, SYSTEM, BlendTask  # noqa: E402

SEP = (95,)


def pairs_in(docs) -> list[tuple[int, int]]:
    items = [t for doc in docs for t in doc]
    return [(a, b) for a in items for b in items if a < b and a ^ 1 == b]


def test_examples_hold_one_pair_across_documents_and_answer_its_later_partner() -> None:
    task = BlendTask(SEP)
    rng = random.Random(0)
    for _ in range(300):
        ex = task.sample(rng)
        assert len(ex.docs) == task.num_docs and all(len(d) == task.items_per_doc for d in ex.docs)
        items = [t for d in ex.docs for t in d]
        assert len(set(items)) == len(items) and not set(items) & set(SEP + SYSTEM + QUESTION)
        ((a, b),) = pairs_in(ex.docs)
        homes = [i for i, d in enumerate(ex.docs) if a in d or b in d]
        assert len(homes) == 2  # the partners sit in two different documents
        assert ex.answer == task.answer(ex.docs) and ex.answer in (a, b)
        later = ex.docs[homes[1]]
        assert ex.answer in later
        flipped = list(reversed(ex.docs))
        assert task.answer(flipped) == ex.answer ^ 1  # the order asked decides the answer


def test_prompts_and_the_earlier_context_of_a_document() -> None:
    task = BlendTask(SEP)
    rng = random.Random(1)
    ex = task.sample(rng)
    prompt = task.prompt(ex.docs)
    assert prompt[: len(SYSTEM) + 1] == list(SYSTEM + SEP) and prompt[-1] == QUESTION[0]
    assert prompt.count(SEP[0]) == task.num_docs + 1
    earlier = task.earlier_context(ex.docs[0], rng)
    other = earlier[len(SYSTEM) + 1 : len(SYSTEM) + 1 + task.items_per_doc]
    assert earlier[-task.items_per_doc - 2 : -2] == list(ex.docs[0])
    assert len(pairs_in([other, ex.docs[0]])) == 1  # the context flags one of the document's items
