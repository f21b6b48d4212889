"""What each recently stored chunk holds (its tokens, its parent chunk), for events that name it.

A tier reports a chunk by key alone; an event in vLLM's format also carries the chunk's tokens
and its parent's hash, so a router can index it beside the serving engine's own blocks. The
store records them here; a tier's admit can come seconds later (a disk write), so the record is
kept in a bounded LRU map. An admit whose record was pushed out by then cannot be described
(`get` answers None): its event is skipped and counted, never published without its tokens.
"""

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np

from lmcache.utils import CacheEngineKey

# Records kept: about 1 KiB each for 256-token chunks, so at most ~8 MiB.
DEFAULT_MAX_CHUNKS = 8192


@dataclass(frozen=True)
class ChunkRecord:
    token_bytes: bytes  # the chunk's tokens as little-endian int32 (a tuple of ints took ~9x more)
    parent: Optional[CacheEngineKey]  # the chunk before it in its prompt; None for the first
    cache_salt: str  # the request's salt ("" for none): part of the first chunk's identity

    @property
    def num_tokens(self) -> int:
        return len(self.token_bytes) // 4

    def token_ids(self) -> List[int]:
        return np.frombuffer(self.token_bytes, dtype="<i4").tolist()


class ChunkTokens:
    """Bounded key -> `ChunkRecord` map, least recently recorded dropped first."""

    def __init__(self, max_chunks: int = DEFAULT_MAX_CHUNKS) -> None:
        if max_chunks <= 0:
            raise ValueError(f"ChunkTokens max_chunks must be positive, got {max_chunks}")
        self._max = max_chunks
        self._lock = threading.Lock()
        self._records: "OrderedDict[CacheEngineKey, ChunkRecord]" = OrderedDict()

    def record(self, key: CacheEngineKey, record: ChunkRecord) -> None:
        with self._lock:
            self._records[key] = record
            self._records.move_to_end(key)
            while len(self._records) > self._max:
                self._records.popitem(last=False)

    def record_prompt(
        self, chunks: Sequence[Tuple[int, int, CacheEngineKey]], token_bytes: bytes,
        first_parent: Optional[CacheEngineKey], cache_salt: str,
    ) -> None:
        """Record consecutive `(start, end, key)` chunks of one prompt (`token_bytes`: its tokens as
        `token_database.tokens_to_bytes` gives them); `first_parent` is the key of the chunk
        before the first of them (None when they start the prompt)."""
        parent = first_parent
        for start, end, key in chunks:
            self.record(key, ChunkRecord(token_bytes[start * 4 : end * 4], parent, cache_salt))
            parent = key

    def get(self, key: CacheEngineKey) -> Optional[ChunkRecord]:
        with self._lock:
            return self._records.get(key)
