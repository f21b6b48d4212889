"""Split a prompt into the segments CacheBlend reuses, and name their cache identity.

A blendable prompt is `head SEP doc_1 SEP doc_2 ... SEP tail`: the documents between two
separators are the segments; the head (system prompt), the separators and the tail (question)
are never reused, they are always recomputed. Each segment is cached under its own tokens as if
it started at position 0, so the same document is found wherever it sits (`segment_salt` keeps
these entries apart from the prefix-keyed ones of a prompt that starts with the same tokens).

```
  tokens:  h h h | S S | d d d d | S S | e e e | S S | q q
  segment:               [-- 0 --]       [- 1 -]
```
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence

# Appended to a request's cache salt for segment entries.
SEGMENT_SALT_SUFFIX = "\x00cacheblend-segment"


@dataclass(frozen=True)
class Segment:
    """Tokens `[start, end)` of a prompt, reused as one cached document."""

    start: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.start


def find_separators(tokens: Sequence[int], separator: Sequence[int]) -> List[int]:
    """Start index of every non-overlapping occurrence of `separator` in `tokens`, left to right."""
    sep = list(separator)
    if not sep:
        raise ValueError("the blend separator encodes to no tokens")
    found: List[int] = []
    i, n, width = 0, len(tokens), len(sep)
    first = sep[0]
    while i + width <= n:
        if tokens[i] == first and list(tokens[i : i + width]) == sep:
            found.append(i)
            i += width
        else:
            i += 1
    return found


def split_segments(tokens: Sequence[int], separator: Sequence[int]) -> List[Segment]:
    """The non-empty runs of tokens between two consecutive separators."""
    starts = find_separators(tokens, separator)
    width = len(separator)
    return [Segment(a + width, b) for a, b in zip(starts, starts[1:]) if b > a + width]


def segment_salt(cache_salt: str) -> str:
    """The cache salt segment entries are stored under, for a request with `cache_salt`."""
    return cache_salt + SEGMENT_SALT_SUFFIX
