"""`naive` serde: the object's bytes behind a `chunk_format` header; decoding is bit-exact."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from lmcache.experimental.memory_management import MemoryFormat, MemoryObj
from lmcache.experimental.remote.connector import Parts
from lmcache.experimental.remote.serde.base import AllocateFn, Buffer, KeyLike, Serde
from lmcache.experimental.remote.serde.cachegen import is_cachegen_chunk
from lmcache.experimental.remote.serde.safetensor import is_safetensor_chunk
from lmcache.experimental.storage_backend import chunk_format
from lmcache.logging import init_logger

if TYPE_CHECKING:
    from lmcache.experimental.remote.value_reader import ValueReader

logger = init_logger(__name__)


class NaiveSerde(Serde):
    """Raw payload + header. A cachegen or safetensor chunk under the same key is a miss, not
    its encoded bytes handed back as an object."""

    name = "naive"

    def encode(self, key: KeyLike, obj: MemoryObj) -> bytes:
        return chunk_format.encode_memory_obj(key, obj)

    def encode_parts(self, key: KeyLike, obj: MemoryObj) -> Parts:
        return Parts(chunk_format.encode_memory_obj_parts(key, obj))  # the payload is not copied

    def decode(
        self, key: KeyLike, data: Buffer, allocate: AllocateFn, dtype: Optional[torch.dtype] = None
    ) -> Optional[MemoryObj]:
        header = chunk_format.decode_header(data)
        if header is None:
            return None
        if header.fmt == MemoryFormat.BINARY:
            for other, is_other in (("cachegen", is_cachegen_chunk), ("safetensor", is_safetensor_chunk)):
                if is_other(header, data):
                    logger.warning(
                        "chunk %s was written with remote_serde=%s; this instance reads naive: miss",
                        header.key, other,
                    )
                    return None
        return chunk_format.decode_into(data, allocate, key=key, dtype=dtype)

    def receive(
        self, key: KeyLike, reader: "ValueReader", allocate: AllocateFn, dtype: Optional[torch.dtype] = None
    ) -> Optional[MemoryObj]:
        """The payload goes from the connection straight into the new object."""
        raw = chunk_format.read_header_bytes(reader)  # type: ignore[arg-type]
        header = None if raw is None else chunk_format.decode_header(raw)
        if header is None:
            return None
        if header.fmt == MemoryFormat.BINARY:  # perhaps another serde's chunk: checked whole
            return self.decode(key, raw + reader.read(reader.remaining), allocate, dtype)
        return chunk_format.receive_into(reader, header, allocate, key=key, dtype=dtype)
