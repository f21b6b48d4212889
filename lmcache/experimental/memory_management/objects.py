"""Memory formats and reference-counted memory objects.

- `.tensor` is a view with the metadata's shape and dtype (None for byte objects),
  `.byte_array` a writable `memoryview` of the payload bytes (host memory only);
- a fresh object has ref count 1; whoever keeps it takes a ref (`ref_count_up`) and
  drops it (`ref_count_down`); at zero it goes back to its allocator and may no longer
  be used. A ref count going below zero is a bug in the caller and raises: hiding it
  would let two owners share one block.
"""

from __future__ import annotations

import math
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Callable, Optional, Sequence, Union

import torch

if TYPE_CHECKING:
    from lmcache.experimental.memory_management.allocators import MemoryAllocatorInterface

ShapeLike = Union[torch.Size, Sequence[int]]


class MemoryFormat(Enum):
    """How the bytes of a memory object are to be read."""

    UNDEFINED = 0
    # [2, num_layers, num_tokens, hidden] ([1, num_layers, num_tokens, head_size] for MLA)
    KV_BLOB = 1
    # Compressed binary array in a tensor-backed object
    BINARY = 2
    # Compressed binary array in a plain byte buffer
    BINARY_BUFFER = 3


@dataclass
class MemoryObjMetadata:
    """What an object holds and where: `address` is the byte offset in its allocator's
    buffer, `phy_size` the bytes reserved there (payload rounded up to the alignment)."""

    shape: torch.Size
    dtype: Optional[torch.dtype]
    address: int
    phy_size: int
    ref_count: int
    fmt: MemoryFormat = MemoryFormat.UNDEFINED

    def get_size(self) -> int:
        """Payload bytes: number of elements times element size (1 when dtype is None)."""
        return payload_size(self.shape, self.dtype)


def payload_size(shape: ShapeLike, dtype: Optional[torch.dtype]) -> int:
    """Bytes needed for `shape` x `dtype`; a zero or negative dimension is a ValueError."""
    dims = tuple(int(d) for d in shape)
    if any(d <= 0 for d in dims):
        raise ValueError(f"cannot allocate shape {list(dims)}: every dimension must be positive")
    itemsize = 1 if dtype is None else dtype.itemsize
    return math.prod(dims) * itemsize


class MemoryObj(ABC):
    """A reference-counted piece of memory with metadata.

    Ref counting lives here so every kind of object follows the same rules; subclasses
    say where the bytes are.
    """

    def __init__(self, allocator: Optional[MemoryAllocatorInterface]) -> None:
        self._allocator = allocator
        self._ref_lock = threading.Lock()
        self._freed = False
        # The payload checksum of its bytes (`chunk_format`), where the store that filled it had
        # the copy kernel sum them (an object is filled once: memory reused is a new object);
        # None: whoever writes a header computes it.
        self.payload_checksum: Optional[bytes] = None

    @property
    @abstractmethod
    def metadata(self) -> MemoryObjMetadata:
        """The object's metadata."""

    @property
    @abstractmethod
    def tensor(self) -> Optional[torch.Tensor]:
        """A view with the metadata's shape and dtype; None for byte objects."""

    @property
    @abstractmethod
    def byte_array(self) -> memoryview:
        """The payload bytes, writable where the memory allows."""

    @abstractmethod
    def get_size(self) -> int:
        """Payload bytes."""

    def get_memory_format(self) -> MemoryFormat:
        return self.metadata.fmt

    def get_shape(self) -> torch.Size:
        return self.metadata.shape

    def get_dtype(self) -> Optional[torch.dtype]:
        return self.metadata.dtype

    def get_physical_size(self) -> int:
        """Bytes reserved for the object in its allocator (payload plus alignment padding)."""
        return self.metadata.phy_size

    def is_valid(self) -> bool:
        """False once the object went back to its allocator."""
        return not self._freed

    def get_ref_count(self) -> int:
        return self.metadata.ref_count

    def ref_count_up(self) -> None:
        """Take one more reference; a freed object cannot be revived."""
        with self._ref_lock:
            if self._freed or self.metadata.ref_count <= 0:
                raise RuntimeError(f"ref_count_up on a released memory object: {self!r}")
            self.metadata.ref_count += 1

    def ref_count_down(self) -> None:
        """Drop one reference; the last one returns the memory to the allocator."""
        with self._ref_lock:
            if self._freed or self.metadata.ref_count <= 0:
                raise RuntimeError(f"ref_count_down below zero on memory object: {self!r}")
            self.metadata.ref_count -= 1
            last = self.metadata.ref_count == 0
        if last:
            if self._allocator is not None:
                self._allocator.free(self)
            else:
                self._mark_freed()

    def _mark_freed(self) -> None:
        """Called by the owning allocator (or the last ref without one) exactly once."""
        with self._ref_lock:
            if self._freed:
                raise RuntimeError(f"memory object freed twice: {self!r}")
            self._freed = True
            self.metadata.ref_count = 0

    def _check_valid(self) -> None:
        if self._freed:
            raise RuntimeError(f"use of a freed memory object: {self!r}")

    def __repr__(self) -> str:
        m = self.metadata
        state = "freed" if self._freed else f"refs={m.ref_count}"
        return (
            f"{type(self).__name__}(shape={list(m.shape)}, dtype={m.dtype}, fmt={m.fmt.name}, "
            f"address={m.address}, phy_size={m.phy_size}, {state})"
        )


class TensorMemoryObj(MemoryObj):
    """Wraps a raw flat tensor (a slice of an allocator's buffer) with metadata."""

    def __init__(
        self,
        raw_data: torch.Tensor,
        metadata: MemoryObjMetadata,
        *,
        allocator: Optional[MemoryAllocatorInterface] = None,
    ) -> None:
        super().__init__(allocator)
        if not raw_data.is_contiguous():
            raise ValueError("TensorMemoryObj raw_data must be contiguous")
        raw = raw_data.reshape(-1).view(torch.uint8)
        if metadata.dtype is None:
            raise ValueError("TensorMemoryObj needs a dtype in its metadata")
        need = metadata.get_size()
        if raw.numel() < need:
            raise ValueError(
                f"TensorMemoryObj raw_data has {raw.numel()} bytes, metadata needs {need}"
            )
        self._raw = raw
        self._meta = metadata

    @property
    def metadata(self) -> MemoryObjMetadata:
        return self._meta

    @property
    def raw_data(self) -> torch.Tensor:
        """The whole reserved region as flat uint8 (including padding)."""
        self._check_valid()
        return self._raw

    @property
    def tensor(self) -> torch.Tensor:
        self._check_valid()
        meta = self._meta
        assert meta.dtype is not None
        return self._raw[: meta.get_size()].view(meta.dtype).view(meta.shape)

    @property
    def byte_array(self) -> memoryview:
        self._check_valid()
        if self._raw.device.type != "cpu":
            raise RuntimeError(
                f"byte_array needs host memory; this object lives on {self._raw.device}"
            )
        return memoryview(self._raw[: self._meta.get_size()].numpy())

    def get_size(self) -> int:
        return self._meta.get_size()


class BytesBufferMemoryObj(MemoryObj):
    """Wraps a plain byte buffer (compressed chunks, bytes read off the wire)."""

    def __init__(
        self,
        raw_bytes: Union[bytes, bytearray, memoryview],
        metadata: Optional[MemoryObjMetadata] = None,
        *,
        allocator: Optional[MemoryAllocatorInterface] = None,
    ) -> None:
        super().__init__(allocator)
        self._bytes = raw_bytes
        n = len(memoryview(raw_bytes).cast("B"))
        if metadata is None:
            metadata = MemoryObjMetadata(
                shape=torch.Size([n]),
                dtype=None,
                address=0,
                phy_size=n,
                ref_count=1,
                fmt=MemoryFormat.BINARY_BUFFER,
            )
        self._meta = metadata
        self._size = n

    @property
    def metadata(self) -> MemoryObjMetadata:
        return self._meta

    @property
    def tensor(self) -> None:
        self._check_valid()
        return None

    @property
    def byte_array(self) -> memoryview:
        self._check_valid()
        return memoryview(self._bytes).cast("B")

    def get_size(self) -> int:
        return self._size


class BorrowedMemoryObj(TensorMemoryObj):
    """A tensor object over memory some other owner lends (a block of the node pool's arena):
    when the last reference goes, `on_free` hands the memory back to that owner."""

    def __init__(
        self, payload: memoryview, metadata: MemoryObjMetadata, on_free: Callable[["BorrowedMemoryObj"], None]
    ) -> None:
        super().__init__(torch.frombuffer(payload, dtype=torch.uint8), metadata)
        self._on_free = on_free

    def _mark_freed(self) -> None:
        super()._mark_freed()
        self._on_free(self)
