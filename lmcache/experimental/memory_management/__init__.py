"""Memory formats, memory objects and allocators (`lmcache.experimental.memory_management`).

`objects` holds what a chunk lives in; `allocators` holds where it comes from. Everything
public is re-exported here, which is the import path the rest of the code uses.
"""

from lmcache.experimental.memory_management.allocators import (
    BufferAllocator,
    FreeBlock,
    GPUMemoryAllocator,
    HostMemoryAllocator,
    MemoryAllocatorInterface,
    MixedMemoryAllocator,
    PinMemoryAllocator,
    TensorMemoryAllocator,
)
from lmcache.experimental.memory_management.objects import (
    BorrowedMemoryObj,
    BytesBufferMemoryObj,
    MemoryFormat,
    MemoryObj,
    MemoryObjMetadata,
    TensorMemoryObj,
    payload_size,
)

__all__ = [
    "BorrowedMemoryObj",
    "BufferAllocator",
    "BytesBufferMemoryObj",
    "FreeBlock",
    "GPUMemoryAllocator",
    "HostMemoryAllocator",
    "MemoryAllocatorInterface",
    "MemoryFormat",
    "MemoryObj",
    "MemoryObjMetadata",
    "MixedMemoryAllocator",
    "PinMemoryAllocator",
    "TensorMemoryAllocator",
    "TensorMemoryObj",
    "payload_size",
]
