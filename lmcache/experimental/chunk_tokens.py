"""What each recently stored chunk holds (its tokens, its parent chunk), for events that name it.

A tier reports a chunk by key alone; an event in vLLM's format also carries the chunk's tokens
and its parent's hash, so a router can index it beside the serving engine's own blocks. The
store records them here; a tier's admit can come seconds later (a disk write), so the record is
kept in a bounded LRU map. An admit whose record was pushed out by then cannot be described
(`get` answers None): its event is skipped and counted, never published without its tokens.

A store may also name its prompt's blocks as the serving engine does (`BlockNames`: vLLM 0.32's
own block hashes, which its scheduler knows); a chunk whose blocks are all named is recorded with
those names, so its events carry vLLM's hashes and a router matches our copy with vLLM's blocks.
"""

import dataclasses
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from lmcache.utils import CacheEngineKey

# Records kept: about 1 KiB each for 256-token chunks, so at most ~8 MiB.
DEFAULT_MAX_CHUNKS = 8192


@dataclass(frozen=True)
class ChunkRecord:
    token_bytes: bytes  # the chunk's tokens as little-endian int32 (a tuple of ints took ~9x more)
    parent: Optional[CacheEngineKey]  # the chunk before it in its prompt; None for the first
    cache_salt: str  # the request's salt ("" for none): part of the first chunk's identity
    # vLLM's hashes of the chunk's blocks and of the block before it (None: unknown or the first)
    vllm_hashes: Optional[Tuple[Any, ...]] = None
    vllm_parent: Optional[Any] = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_bytes) // 4

    def token_ids(self) -> List[int]:
        return np.frombuffer(self.token_bytes, dtype="<i4").tolist()


@dataclass(frozen=True)
class BlockNames:
    """The serving engine's names for one prompt's blocks `[first, first + len(hashes))` of
    `block_size` tokens each (vLLM's block hashes as its KV events carry them: ints or bytes)."""

    block_size: int
    first: int
    hashes: Tuple[Any, ...]

    def of_chunk(self, start: int, end: int) -> Optional[Tuple[Tuple[Any, ...], Optional[Any]]]:
        """`(hashes of the blocks in tokens [start, end), hash of the block before)`, or None when
        the chunk is not whole blocks or a block it needs is not named here."""
        if start % self.block_size or end % self.block_size or end <= start:
            return None
        lo, hi = start // self.block_size, end // self.block_size
        needed_from = lo - 1 if lo > 0 else 0  # the parent's block too
        if needed_from < self.first or hi > self.first + len(self.hashes):
            return None
        parent = self.hashes[lo - 1 - self.first] if lo > 0 else None
        return self.hashes[lo - self.first : hi - self.first], parent


class ChunkTokens:
    """Bounded key -> `ChunkRecord` map, least recently recorded dropped first."""

    def __init__(self, max_chunks: int = DEFAULT_MAX_CHUNKS) -> None:
        if max_chunks <= 0:
            raise ValueError(f"ChunkTokens max_chunks must be positive, got {max_chunks}")
        self._max = max_chunks
        self._lock = threading.Lock()
        self._records: "OrderedDict[CacheEngineKey, ChunkRecord]" = OrderedDict()

    def record(self, key: CacheEngineKey, record: ChunkRecord) -> None:
        """Record `key`; a key recorded already keeps its vLLM names, or their absence (the same key
        is the same tokens and parent), so its events name it one way from its store to its loss."""
        with self._lock:
            earlier = self._records.get(key)
            if earlier is not None and earlier.vllm_hashes != record.vllm_hashes:
                record = dataclasses.replace(record, vllm_hashes=earlier.vllm_hashes, vllm_parent=earlier.vllm_parent)
            self._records[key] = record
            self._records.move_to_end(key)
            while len(self._records) > self._max:
                self._records.popitem(last=False)

    def record_prompt(
        self, chunks: Sequence[Tuple[int, int, CacheEngineKey]], token_bytes: bytes,
        first_parent: Optional[CacheEngineKey], cache_salt: str, names: Optional[BlockNames] = None,
    ) -> None:
        """Record consecutive `(start, end, key)` chunks of one prompt (`token_bytes`: its tokens as
        `token_database.tokens_to_bytes` gives them); `first_parent` is the key of the chunk
        before the first of them (None when they start the prompt); `names`, vLLM's for the
        prompt's blocks, where the scheduler knew them."""
        parent = first_parent
        for start, end, key in chunks:
            named = names.of_chunk(start, end) if names is not None else None
            hashes, vllm_parent = named if named is not None else (None, None)
            self.record(key, ChunkRecord(token_bytes[start * 4 : end * 4], parent, cache_salt, hashes, vllm_parent))
            parent = key

    def get(self, key: CacheEngineKey) -> Optional[ChunkRecord]:
        with self._lock:
            return self._records.get(key)
