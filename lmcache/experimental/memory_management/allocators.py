"""Allocators: where memory objects come from and go back to.

`allocate(shape, dtype, fmt)` returns a `MemoryObj` with ref count 1, or `None` when
there is no room (the caller evicts and retries, or skips). Tensor-backed allocators
carve objects out of one preallocated byte buffer with an explicit free list
(`TensorMemoryAllocator` over `lmcache.free_list`): first fit, blocks rounded up to
`ALIGN_BYTES`, neighbours coalesced on free. A second free of the same object raises.
First fit hands out the front first, so the highest offset ever handed out (the high-water mark)
grows only as the pool fills: host pools are faulted in a window ahead of it (`host_memory`).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from typing import Callable, Optional, Union

import torch

from lmcache.experimental.memory_management.host_memory import fault_ahead, host_buffer
from lmcache.experimental.memory_management.objects import (
    BytesBufferMemoryObj,
    MemoryFormat,
    MemoryObj,
    MemoryObjMetadata,
    ShapeLike,
    TensorMemoryObj,
    payload_size,
)
from lmcache.free_list import FreeBlock, FreeList
from lmcache.logging import init_logger
from lmcache.page_advice import BackgroundPrefault

logger = init_logger(__name__)


class MemoryAllocatorInterface(ABC):
    """Hands out memory objects and takes them back when their ref count reaches zero."""

    @abstractmethod
    def allocate(
        self,
        shape: ShapeLike,
        dtype: Optional[torch.dtype],
        fmt: MemoryFormat = MemoryFormat.UNDEFINED,
    ) -> Optional[MemoryObj]:
        """A new object with ref count 1, or None when there is no room.

        Raises ValueError for a shape with a zero or negative dimension.
        """

    @abstractmethod
    def free(self, memory_obj: MemoryObj) -> None:
        """Return the object's memory. Callers use `ref_count_down` instead; a second
        free of the same object raises RuntimeError."""

    def get_ref_count(self, memory_obj: MemoryObj) -> int:
        return memory_obj.get_ref_count()

    @property
    @abstractmethod
    def total_bytes(self) -> Optional[int]:
        """Capacity in bytes; None for an allocator without a fixed pool."""

    @property
    @abstractmethod
    def used_bytes(self) -> int:
        """Bytes currently reserved by live objects."""

    def close(self) -> None:
        """Stop background work on the pool (its objects stay valid)."""


def _take_live(live: dict, memory_obj: MemoryObj) -> tuple:
    """Remove `memory_obj`'s entry from an allocator's live objects (keyed by id, the object
    first) and return it; RuntimeError for an object freed twice or another allocator's."""
    entry = live.get(id(memory_obj))
    if entry is None or entry[0] is not memory_obj:
        raise RuntimeError(f"free of a memory object this allocator does not hold (freed twice or foreign): {memory_obj!r}")
    del live[id(memory_obj)]
    return entry


class TensorMemoryAllocator(MemoryAllocatorInterface):
    """Explicit free-list allocator over one preallocated tensor.

    First fit over a free list sorted by start; every block is a multiple of
    `ALIGN_BYTES`, so every object starts 512-byte aligned within the buffer. A tail of
    the buffer shorter than `ALIGN_BYTES` is not used. Thread-safe. `on_high_water(end)` runs
    under the lock whenever a block ends further into the buffer than any before.
    """

    ALIGN_BYTES = 512

    def __init__(self, tensor: torch.Tensor, on_high_water: Optional[Callable[[int], None]] = None) -> None:
        if not tensor.is_contiguous():
            raise ValueError("TensorMemoryAllocator needs a contiguous tensor")
        flat = tensor.reshape(-1).view(torch.uint8)
        usable = flat.numel() // self.ALIGN_BYTES * self.ALIGN_BYTES
        if usable == 0:
            raise ValueError(
                f"TensorMemoryAllocator buffer of {flat.numel()} bytes is smaller than "
                f"ALIGN_BYTES={self.ALIGN_BYTES}"
            )
        self._buffer = flat[:usable]
        self._lock = threading.Lock()
        self._free = FreeList(usable)
        # id(obj) -> (obj, start, size): the truth about a live block, independent of
        # the object's (mutable) metadata.
        self._live: dict[int, tuple[MemoryObj, int, int]] = {}
        self._used = 0
        self._high_water = 0
        self._on_high_water = on_high_water

    @property
    def buffer(self) -> torch.Tensor:
        """The managed bytes (flat uint8)."""
        return self._buffer

    @property
    def total_bytes(self) -> int:
        return self._buffer.numel()

    @property
    def used_bytes(self) -> int:
        return self._used

    def free_blocks(self) -> list[FreeBlock]:
        """A copy of the free list, sorted by start (for checks and debugging)."""
        with self._lock:
            return self._free.blocks()

    def num_live_objects(self) -> int:
        with self._lock:
            return len(self._live)

    def allocate(
        self,
        shape: ShapeLike,
        dtype: Optional[torch.dtype],
        fmt: MemoryFormat = MemoryFormat.KV_BLOB,
    ) -> Optional[TensorMemoryObj]:
        if dtype is None:
            raise ValueError(f"TensorMemoryAllocator.allocate needs a dtype (fmt={fmt.name})")
        if fmt == MemoryFormat.BINARY_BUFFER:
            raise ValueError("BINARY_BUFFER objects are byte buffers; use a BufferAllocator")
        shape = torch.Size(shape)
        size = payload_size(shape, dtype)
        block = -(-size // self.ALIGN_BYTES) * self.ALIGN_BYTES
        with self._lock:
            start = self._free.take(block)
            if start is None:
                return None
            meta = MemoryObjMetadata(shape, dtype, start, block, 1, fmt)
            obj = TensorMemoryObj(self._buffer[start : start + block], meta, allocator=self)
            self._live[id(obj)] = (obj, start, block)
            self._used += block
            if start + block > self._high_water:
                self._high_water = start + block
                if self._on_high_water is not None:
                    self._on_high_water(self._high_water)
        return obj

    def free(self, memory_obj: MemoryObj) -> None:
        with self._lock:
            _, start, size = _take_live(self._live, memory_obj)
            memory_obj._mark_freed()
            self._used -= size
            self._free.give_back(start, size)


class _PooledAllocator(MemoryAllocatorInterface):
    """An allocator that owns one buffer and delegates to a TensorMemoryAllocator; `fault_ahead`
    (a host buffer's) is the thread that keeps it faulted in ahead of the high-water mark."""

    def __init__(self, buffer: torch.Tensor, fault_ahead: Optional[BackgroundPrefault] = None) -> None:
        self.fault_ahead = fault_ahead
        self._pool = TensorMemoryAllocator(buffer, None if fault_ahead is None else fault_ahead.reached)

    @property
    def pool(self) -> TensorMemoryAllocator:
        return self._pool

    @property
    def total_bytes(self) -> int:
        return self._pool.total_bytes

    @property
    def used_bytes(self) -> int:
        return self._pool.used_bytes

    def allocate(
        self,
        shape: ShapeLike,
        dtype: Optional[torch.dtype],
        fmt: MemoryFormat = MemoryFormat.KV_BLOB,
    ) -> Optional[MemoryObj]:
        return self._pool.allocate(shape, dtype, fmt)

    def free(self, memory_obj: MemoryObj) -> None:
        self._pool.free(memory_obj)

    def close(self) -> None:
        if self.fault_ahead is not None:
            self.fault_ahead.stop()


def _check_size(size: int, who: str) -> int:
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise ValueError(f"{who} size must be a positive number of bytes, got {size!r}")
    return size


class HostMemoryAllocator(_PooledAllocator):
    """Allocates from one preallocated buffer of host memory (huge pages, faulted in ahead of
    its high-water mark, or whole for a cache tier: `host_memory.fault_ahead`)."""

    def __init__(self, size: int, tier: bool = False) -> None:
        buf = host_buffer(_check_size(size, "HostMemoryAllocator"))
        super().__init__(buf, fault_ahead(buf, whole=tier))


class PinMemoryAllocator(_PooledAllocator):
    """Allocates from one preallocated host buffer, page-locked where CUDA exists.

    Pinned memory makes device copies asynchronous and fast; without a GPU there is
    nothing to pin for, so the buffer is host memory as `HostMemoryAllocator` has it.
    """

    def __init__(self, size: int, tier: bool = False) -> None:
        self.pinned = torch.cuda.is_available()
        _check_size(size, "PinMemoryAllocator")
        buf = torch.empty(size, dtype=torch.uint8, pin_memory=True) if self.pinned else host_buffer(size)
        super().__init__(buf, None if self.pinned else fault_ahead(buf, whole=tier))
        logger.debug("PinMemoryAllocator: %d bytes, pinned=%s", size, self.pinned)


class GPUMemoryAllocator(_PooledAllocator):
    """Allocates from one preallocated buffer on a device (CUDA by default)."""

    def __init__(self, size: int, device: Union[str, torch.device] = "cuda") -> None:
        buf = torch.empty(_check_size(size, "GPUMemoryAllocator"), dtype=torch.uint8, device=device)
        super().__init__(buf)


class BufferAllocator(MemoryAllocatorInterface):
    """Hands out `BytesBufferMemoryObj`s backed by fresh host `bytearray`s (no fixed pool)."""

    def __init__(self, device: Union[str, torch.device] = "cpu") -> None:
        if torch.device(device).type != "cpu":
            raise ValueError(f"BufferAllocator only supports host memory, got device={device!r}")
        self._lock = threading.Lock()
        self._live: dict[int, tuple[MemoryObj, int]] = {}
        self._used = 0

    @property
    def total_bytes(self) -> None:
        return None

    @property
    def used_bytes(self) -> int:
        return self._used

    def allocate(
        self,
        shape: ShapeLike,
        dtype: Optional[torch.dtype],
        fmt: MemoryFormat = MemoryFormat.BINARY_BUFFER,
    ) -> BytesBufferMemoryObj:
        if fmt != MemoryFormat.BINARY_BUFFER:
            raise ValueError(f"BufferAllocator only makes BINARY_BUFFER objects, got {fmt.name}")
        shape = torch.Size(shape)
        size = payload_size(shape, dtype)
        meta = MemoryObjMetadata(shape, dtype, 0, size, 1, fmt)
        obj = BytesBufferMemoryObj(bytearray(size), meta, allocator=self)
        with self._lock:
            self._live[id(obj)] = (obj, size)
            self._used += size
        return obj

    def free(self, memory_obj: MemoryObj) -> None:
        with self._lock:
            _, size = _take_live(self._live, memory_obj)
            memory_obj._mark_freed()
            self._used -= size


class MixedMemoryAllocator(MemoryAllocatorInterface):
    """KV_BLOB and BINARY objects from a (pinned where possible) host pool, BINARY_BUFFER
    objects as byte buffers. `total_bytes`/`used_bytes` describe the pool; byte buffers
    are counted in `buffer_bytes`. `tier`: the pool is the CPU tier, not only staging."""

    def __init__(self, size: int, tier: bool = False) -> None:
        self._pinned = PinMemoryAllocator(size, tier)
        self._buffers = BufferAllocator("cpu")

    @property
    def total_bytes(self) -> int:
        return self._pinned.total_bytes

    @property
    def used_bytes(self) -> int:
        return self._pinned.used_bytes

    @property
    def buffer_bytes(self) -> int:
        return self._buffers.used_bytes

    @property
    def pool(self) -> TensorMemoryAllocator:
        return self._pinned.pool

    @property
    def fault_ahead(self) -> Optional[BackgroundPrefault]:
        return self._pinned.fault_ahead

    def allocate(
        self,
        shape: ShapeLike,
        dtype: Optional[torch.dtype],
        fmt: MemoryFormat = MemoryFormat.KV_BLOB,
    ) -> Optional[MemoryObj]:
        if fmt in (MemoryFormat.KV_BLOB, MemoryFormat.BINARY):
            return self._pinned.allocate(shape, dtype, fmt)
        if fmt == MemoryFormat.BINARY_BUFFER:
            return self._buffers.allocate(shape, dtype, fmt)
        raise ValueError(f"MixedMemoryAllocator cannot allocate fmt={fmt.name}")

    def free(self, memory_obj: MemoryObj) -> None:
        if isinstance(memory_obj, BytesBufferMemoryObj):
            self._buffers.free(memory_obj)
        else:
            self._pinned.free(memory_obj)

    def close(self) -> None:
        self._pinned.close()
