"""`safetensor` serde (the old `lmcache_vllm` name): the chunk as a safetensors file, bit-exact.

The stored value is a `chunk_format` chunk with memory format `BINARY` whose payload is a
safetensors file (`safetensors.torch.save`) holding one tensor, `kv`, and this metadata:

    {"lmcache_serde": "safetensor", "fmt": "<MemoryFormat name>", "dtype": "<dtype name or ''>",
     "shape": "<the object's shape as a JSON list>"}

so any safetensors reader can open a stored chunk, and nothing is ever unpickled. A byte object
(no tensor) is stored as a `uint8` tensor with `dtype` "". Decoding checks the chunk header,
its checksum, the safetensors header and the metadata before allocating; a chunk of another
serde, key or dtype is a miss (`decode` returns None, logged), never an exception.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch
from safetensors import SafetensorError
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save

from lmcache.experimental.memory_management import MemoryFormat, MemoryObj
from lmcache.experimental.remote.serde.base import AllocateFn, Buffer, KeyLike, Serde
from lmcache.experimental.storage_backend import chunk_format
from lmcache.logging import init_logger

logger = init_logger(__name__)

MARK = "safetensor"
TENSOR_NAME = "kv"
# A safetensors file starts with the length of its JSON header (u64, little-endian).
_JSON_LEN = struct.Struct("<Q")
# Our JSON header is a few hundred bytes; a longer one is not ours.
MAX_JSON_BYTES = 1 << 16


@dataclass(frozen=True)
class _Stored:
    """What a checked payload holds: the object's bytes as one flat tensor, and its metadata."""

    flat: torch.Tensor
    fmt: MemoryFormat
    dtype: Optional[torch.dtype]
    shape: Tuple[int, ...]


def _metadata(header: chunk_format.ChunkHeader, payload: memoryview) -> Optional[Dict[str, str]]:
    """The `__metadata__` of a safetensors payload written by this serde, else None (no log)."""
    if header.dtype is not None or header.fmt != MemoryFormat.BINARY or payload.nbytes < _JSON_LEN.size:
        return None
    (json_len,) = _JSON_LEN.unpack_from(payload, 0)
    if not 2 <= json_len <= min(MAX_JSON_BYTES, payload.nbytes - _JSON_LEN.size):
        return None
    try:
        parsed = json.loads(bytes(payload[_JSON_LEN.size : _JSON_LEN.size + json_len]))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    meta = parsed.get("__metadata__") if isinstance(parsed, dict) else None
    if not isinstance(meta, dict) or meta.get("lmcache_serde") != MARK:
        return None
    return meta


def is_safetensor_chunk(header: chunk_format.ChunkHeader, data: Buffer) -> bool:
    """Whether a decoded chunk header + data holds a payload of this serde."""
    return _metadata(header, memoryview(data).cast("B")[header.size :]) is not None


class SafetensorSerde(Serde):
    """Lossless like `naive`, in a format other tools can read."""

    name = MARK

    def encode(self, key: KeyLike, obj: MemoryObj) -> bytes:
        meta = obj.metadata
        tensor = obj.tensor
        if tensor is None:
            tensor = torch.frombuffer(bytearray(chunk_format.memory_obj_payload(obj)), dtype=torch.uint8)
        blob = safetensors_save(
            {TENSOR_NAME: tensor.detach().cpu().contiguous()},
            metadata={
                "lmcache_serde": MARK,
                "fmt": meta.fmt.name,
                "dtype": chunk_format.dtype_name(meta.dtype),
                "shape": json.dumps([int(d) for d in meta.shape]),
            },
        )
        return chunk_format.encode_header(key, (len(blob),), None, MemoryFormat.BINARY, blob) + blob

    def decode(
        self,
        key: KeyLike,
        data: Buffer,
        allocate: AllocateFn,
        dtype: Optional[torch.dtype] = None,
    ) -> Optional[MemoryObj]:
        view = memoryview(data).cast("B")
        header = chunk_format.decode_header(view)
        if header is None or not chunk_format.header_matches(header, key=key):
            return None
        payload = view[header.size :]
        meta = _metadata(header, payload)
        if meta is None:
            logger.warning("chunk %s was not written with remote_serde=safetensor: miss", header.key)
            return None
        if not chunk_format.verify_payload(header, payload):
            return None
        stored = _load(header.key, payload, meta)
        if stored is None:
            return None
        if dtype is not None and stored.dtype != dtype:
            logger.warning("chunk %s holds %s, expected %s: miss", header.key, stored.dtype, dtype)
            return None
        source = memoryview(stored.flat.view(torch.uint8).numpy()).cast("B")
        return chunk_format.copy_into_new(
            header.key, source, allocate, torch.Size(stored.shape), stored.dtype, stored.fmt
        )


def _load(key: str, payload: memoryview, meta: Dict[str, str]) -> Optional[_Stored]:
    """The tensor of a checksum-verified payload, checked against its metadata; None (logged) if off."""
    try:
        fmt = MemoryFormat[meta.get("fmt", "")]
        shape = tuple(int(d) for d in json.loads(meta.get("shape", "")))
        tensors: Dict[str, Any] = safetensors_load(bytes(payload))
    except (KeyError, ValueError, TypeError, SafetensorError) as err:
        logger.warning("chunk %s: safetensors payload does not parse (%s): miss", key, err)
        return None
    tensor = tensors.get(TENSOR_NAME)
    if set(tensors) != {TENSOR_NAME} or tensor is None:
        logger.warning("chunk %s: safetensors payload holds %s, expected one tensor %r: miss",
                       key, sorted(tensors), TENSOR_NAME)
        return None
    name = meta.get("dtype", "")
    try:
        dtype_ok = (tensor.dtype == torch.uint8) if name == "" else chunk_format.dtype_name(tensor.dtype) == name
    except ValueError:
        dtype_ok = False
    if not dtype_ok:
        logger.warning("chunk %s: safetensors tensor is %s, metadata says %r: miss", key, tensor.dtype, name)
        return None
    # A typed object keeps its shape; a byte object is stored flat.
    if any(d < 0 for d in shape) or list(tensor.shape) != (list(shape) if name else [tensor.numel()]):
        logger.warning("chunk %s: safetensors tensor shape %s, metadata says %s: miss", key, list(tensor.shape), shape)
        return None
    return _Stored(tensor.reshape(-1), fmt, None if name == "" else tensor.dtype, shape)
