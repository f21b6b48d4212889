"""`naive` serde: the object's bytes behind a `chunk_format` header; decoding is bit-exact."""

from __future__ import annotations

from typing import Optional

import torch

from lmcache.experimental.memory_management import MemoryFormat, MemoryObj
from lmcache.experimental.remote.serde.base import AllocateFn, Buffer, KeyLike, Serde
from lmcache.experimental.remote.serde.cachegen import is_cachegen_chunk
from lmcache.experimental.storage_backend import chunk_format
from lmcache.logging import init_logger

logger = init_logger(__name__)


class NaiveSerde(Serde):
    """Raw payload + header. A cachegen chunk under the same key is a miss, not lossy data."""

    name = "naive"

    def encode(self, key: KeyLike, obj: MemoryObj) -> bytes:
        return chunk_format.encode_memory_obj(key, obj)

    def decode(
        self, key: KeyLike, data: Buffer, allocate: AllocateFn, dtype: Optional[torch.dtype] = None
    ) -> Optional[MemoryObj]:
        header = chunk_format.decode_header(data)
        if header is None:
            return None
        if header.fmt == MemoryFormat.BINARY and is_cachegen_chunk(header, data):
            logger.warning(
                "chunk %s was written with remote_serde=cachegen; this instance reads naive: miss",
                header.key,
            )
            return None
        return chunk_format.decode_into(data, allocate, key=key, dtype=dtype)
