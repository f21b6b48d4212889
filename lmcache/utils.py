"""Cache keys: what names one stored chunk, and its string form.

A key is `fmt@model_name@world_size@worker_id@chunk_hash`. The string form is what tiers
use as a file name component, a remote key and the key field of a chunk header, so it
must round-trip exactly. The model name may itself contain `@` (e.g. `org/model@rev`):
`from_string` splits one field off the left and three off the right, which is why the
other fields must not contain `@`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

KEY_SEPARATOR = "@"

_HEX_RE = re.compile(r"[0-9a-f]+")
_UINT_RE = re.compile(r"[0-9]+")


@dataclass(frozen=True)
class CacheEngineKey:
    """Names one chunk: the KV of the prefix ending at that chunk, for one worker."""

    fmt: str
    model_name: str
    world_size: int
    worker_id: int
    chunk_hash: str

    def __post_init__(self) -> None:
        if not self.fmt or KEY_SEPARATOR in self.fmt:
            raise ValueError(f"CacheEngineKey fmt must be non-empty without '@', got {self.fmt!r}")
        if not self.model_name:
            raise ValueError("CacheEngineKey model_name must be non-empty")
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"CacheEngineKey world_size must be an int >= 1, got {self.world_size!r}")
        if not isinstance(self.worker_id, int) or self.worker_id < 0:
            raise ValueError(f"CacheEngineKey worker_id must be an int >= 0, got {self.worker_id!r}")
        if not isinstance(self.chunk_hash, str) or not _HEX_RE.fullmatch(self.chunk_hash):
            raise ValueError(
                f"CacheEngineKey chunk_hash must be lowercase hex, got {self.chunk_hash!r}"
            )

    def to_string(self) -> str:
        """`fmt@model_name@world_size@worker_id@chunk_hash`."""
        return KEY_SEPARATOR.join(
            (self.fmt, self.model_name, str(self.world_size), str(self.worker_id), self.chunk_hash)
        )

    @classmethod
    def from_string(cls, s: str) -> CacheEngineKey:
        """Invert `to_string`; a string that is not a key raises ValueError naming it."""
        head = s.split(KEY_SEPARATOR, 1)
        if len(head) != 2:
            raise ValueError(f"not a cache key (expected fmt@model@world_size@worker_id@hash): {s!r}")
        fmt, rest = head
        tail = rest.rsplit(KEY_SEPARATOR, 3)
        if len(tail) != 4:
            raise ValueError(f"not a cache key (expected fmt@model@world_size@worker_id@hash): {s!r}")
        model_name, world_size, worker_id, chunk_hash = tail
        if not _UINT_RE.fullmatch(world_size) or not _UINT_RE.fullmatch(worker_id):
            raise ValueError(f"not a cache key (world_size and worker_id must be integers): {s!r}")
        try:
            return cls(fmt, model_name, int(world_size), int(worker_id), chunk_hash)
        except ValueError as err:
            raise ValueError(f"not a cache key: {s!r} ({err})") from None
