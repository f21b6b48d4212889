"""Tokens -> one cache key per chunk.

`ChunkedTokenDatabase` cuts a token sequence into `chunk_size` chunks (the last one may
be shorter) and names each by a rolling prefix hash, so a key stands for the whole
prefix up to its chunk's end:

    h_0 = H(salt)            h_i = H(h_{i-1} || chunk_i as little-endian int32)

with `H` = BLAKE2b-128 (`hashlib`), identical on every process, machine and Python
version. The salt names whatever else shapes the KV (LoRA adapter, multimodal input
hashes); the empty salt is plain text.

Operations:
- `process_tokens(tokens, mask)`: `(start, end, key)` per chunk the mask selects;
- `prefix_keys(tokens)`: `(end, key)` per chunk, lazily, for lookups that stop at the
  first miss;
- `skip_prefix_mask(num_tokens, skip, chunk_size)`: the mask that leaves out the chunks a
  caller already has (both vLLM doors use it for their loads and stores).
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from typing import Iterable, Iterator, Optional, Protocol, Sequence, Tuple, Union

import numpy as np
import torch

from lmcache.config import LMCacheEngineMetadata
from lmcache.utils import CacheEngineKey

HASH_DIGEST_BYTES = 16
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1

TokensLike = Union[torch.Tensor, Sequence[int], np.ndarray]


class _HasChunkSize(Protocol):
    chunk_size: int


def tokens_to_bytes(tokens: TokensLike) -> bytes:
    """The tokens as little-endian int32 bytes (the hash input), checking the range."""
    if isinstance(tokens, torch.Tensor):
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be a 1-D tensor, got shape {list(tokens.shape)}")
        if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
            raise ValueError(f"tokens must be integers, got dtype {tokens.dtype}")
        arr = tokens.detach().cpu().numpy()
    else:
        arr = np.asarray(tokens)
        if arr.size == 0:
            arr = arr.astype(np.int64)
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            raise ValueError(f"tokens must be a 1-D sequence of integers, got {arr.dtype} {arr.shape}")
    if arr.size and (int(arr.min()) < _INT32_MIN or int(arr.max()) > _INT32_MAX):
        raise ValueError("token ids must fit in int32")
    return arr.astype("<i4", copy=False).tobytes()


def rolling_chunk_hashes(token_bytes: bytes, chunk_size: int, salt: str = "") -> Iterator[bytes]:
    """Yield the digest h_i for each chunk of `chunk_size` int32 tokens in `token_bytes`."""
    step = chunk_size * 4
    view = memoryview(token_bytes)
    prev = hashlib.blake2b(salt.encode("utf-8"), digest_size=HASH_DIGEST_BYTES).digest()
    for off in range(0, len(view), step):
        h = hashlib.blake2b(prev, digest_size=HASH_DIGEST_BYTES)
        h.update(view[off : off + step])
        prev = h.digest()
        yield prev


def prefix_chunk_hashes(tokens: TokensLike, chunk_size: int, cache_salt: str = "") -> Iterator[Tuple[int, str]]:
    """`(end, chunk_hash)` per chunk, lazily: the hex hash a key of that prefix carries, whatever
    the worker (`ChunkedTokenDatabase` builds its keys from it, and the controller hashes a
    `/lookup`'s tokens with it, so both always agree)."""
    token_bytes = tokens_to_bytes(tokens)
    num_tokens = len(token_bytes) // 4
    for i, digest in enumerate(rolling_chunk_hashes(token_bytes, chunk_size, cache_salt)):
        yield min((i + 1) * chunk_size, num_tokens), digest.hex()


def skip_prefix_mask(num_tokens: int, skip: int, chunk_size: int) -> torch.Tensor:
    """The mask that leaves out the whole chunks among the first `skip` tokens (store/retrieve).

    A chunk is keyed, stored and loaded whole, so only the chunk-aligned part of `skip` can be
    left out; the chunk holding token `skip` is kept even though its head is skipped:

        tokens  0 ........ floor(skip/C)*C ... skip ....... num_tokens
        mask    F F F F F F|T T T T T T T T T T T T T T T T T|
    """
    if num_tokens < 0 or skip < 0:
        raise ValueError(f"num_tokens={num_tokens} and skip={skip} must be >= 0")
    mask = torch.ones(num_tokens, dtype=torch.bool)
    mask[: min(skip - skip % chunk_size, num_tokens)] = False
    return mask


class TokenDatabase(ABC):
    """Turns token sequences into cache keys, one per stored unit."""

    @abstractmethod
    def process_tokens(
        self, tokens: TokensLike, mask: Optional[torch.Tensor] = None, *, cache_salt: str = ""
    ) -> Iterable[Tuple[int, int, CacheEngineKey]]:
        """Yield `(start, end, key)` for each unit the mask selects.

        `mask` has the length of `tokens` and looks like FFF...TTT: True marks tokens to
        process, the Falses are a prefix that is skipped. Raises ValueError if the number
        of Falses is not a multiple of the chunk size, or the mask has another shape.
        """


class ChunkedTokenDatabase(TokenDatabase):
    """Fixed-size chunks keyed by a rolling BLAKE2b-128 prefix hash."""

    def __init__(self, config: _HasChunkSize, metadata: LMCacheEngineMetadata) -> None:
        chunk_size = config.chunk_size
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
            raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
        self.chunk_size = chunk_size
        self.metadata = metadata

    def _make_key(self, chunk_hash: str) -> CacheEngineKey:
        m = self.metadata
        return CacheEngineKey(m.fmt, m.model_name, m.world_size, m.worker_id, chunk_hash)

    def _num_skipped(self, mask: Optional[torch.Tensor], num_tokens: int) -> int:
        """Number of leading False tokens, after checking the mask's shape."""
        if mask is None:
            return 0
        if not isinstance(mask, torch.Tensor) or mask.dim() != 1:
            raise ValueError("mask must be a 1-D bool tensor")
        if mask.numel() != num_tokens:
            raise ValueError(f"mask has {mask.numel()} entries for {num_tokens} tokens")
        m = mask.detach().cpu().to(torch.bool)
        num_false = num_tokens - int(m.sum())
        if not bool(m[num_false:].all()):
            raise ValueError("mask must be False for a prefix and True after it (FFF...TTT)")
        if num_false % self.chunk_size != 0:
            raise ValueError(
                f"number of Falses in the mask ({num_false}) is not a multiple of "
                f"chunk_size ({self.chunk_size})"
            )
        return num_false

    def process_tokens(
        self, tokens: TokensLike, mask: Optional[torch.Tensor] = None, *, cache_salt: str = ""
    ) -> Iterator[Tuple[int, int, CacheEngineKey]]:
        token_bytes = tokens_to_bytes(tokens)
        num_tokens = len(token_bytes) // 4
        skipped = self._num_skipped(mask, num_tokens)
        return self._chunks(token_bytes, num_tokens, skipped, cache_salt)

    def _chunks(
        self, token_bytes: bytes, num_tokens: int, skipped: int, salt: str
    ) -> Iterator[Tuple[int, int, CacheEngineKey]]:
        size = self.chunk_size
        for i, digest in enumerate(rolling_chunk_hashes(token_bytes, size, salt)):
            start = i * size
            if start < skipped:
                continue
            yield start, min(start + size, num_tokens), self._make_key(digest.hex())

    def prefix_keys(
        self, tokens: TokensLike, *, cache_salt: str = ""
    ) -> Iterator[Tuple[int, CacheEngineKey]]:
        """Yield `(end, key)` per chunk, computing each hash only when asked for.

        A lookup walks this until the first missing key; `end` of the last hit is the
        number of cached prefix tokens.
        """
        for end, chunk_hash in prefix_chunk_hashes(tokens, self.chunk_size, cache_salt):
            yield end, self._make_key(chunk_hash)
