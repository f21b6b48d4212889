"""The serde interface shared by `naive` and `cachegen`."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Callable, Optional, Union

import torch

from lmcache.experimental.memory_management import MemoryFormat, MemoryObj
from lmcache.experimental.remote.connector import Parts
from lmcache.utils import CacheEngineKey

if TYPE_CHECKING:
    from lmcache.experimental.remote.value_reader import ValueReader

Buffer = Union[bytes, bytearray, memoryview]
KeyLike = Union[CacheEngineKey, str]
# (shape, dtype, fmt) -> a fresh object the caller owns, or None when memory is full.
AllocateFn = Callable[[torch.Size, Optional[torch.dtype], MemoryFormat], Optional[MemoryObj]]


class Serde(ABC):
    """Turns one chunk into self-checking bytes and back."""

    name: str = ""

    @abstractmethod
    def encode(self, key: KeyLike, obj: MemoryObj) -> bytes:
        """The complete stored value for `obj` under `key` (header included)."""

    def encode_parts(self, key: KeyLike, obj: MemoryObj) -> Parts:
        """`encode` as parts a connector may send without joining (valid while `obj` is)."""
        return Parts((self.encode(key, obj),))

    @abstractmethod
    def decode(
        self, key: KeyLike, data: Buffer, allocate: AllocateFn, dtype: Optional[torch.dtype] = None
    ) -> Optional[MemoryObj]:
        """A new object holding the chunk, or None (logged) when `data` is not a valid chunk
        of this serde for `key` (and of `dtype`, when given) or memory is full."""

    def receive(
        self, key: KeyLike, reader: "ValueReader", allocate: AllocateFn, dtype: Optional[torch.dtype] = None
    ) -> Optional[MemoryObj]:
        """`decode` of a value as it comes off the connection. This default reads it whole
        first; a serde that can place the bytes where they end up reads them there instead."""
        return self.decode(key, reader.read(reader.remaining), allocate, dtype)
