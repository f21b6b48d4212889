"""Serdes: memory object <-> the bytes a remote store keeps (config `remote_serde`).

Every encoding is a `chunk_format` chunk (header with format version, key, shape, dtype, memory
format, payload length and payload checksum, then the payload), so whatever a remote store
hands back is checked before it is trusted:
- `naive`: the object's own bytes; the header describes the object. Decoding is exact.
- `cachegen`: the header describes a `BINARY` payload that is a cachegen stream (magic
  `LMCG`, its own version, the original shape/dtype/format, quantization parameters, then
  entropy-coded codes). Lossy, with a stated error bound (see `cachegen.py`).
- `safetensor`: the header describes a `BINARY` payload that is a safetensors file holding the
  object as one tensor (see `safetensor.py`). Decoding is exact.
A chunk written by another serde, for another key, with another shape or dtype, with a bad
checksum, or cut short is a miss (`decode` returns None), never an exception.
"""

from __future__ import annotations

from lmcache.experimental.remote.serde.base import AllocateFn, Serde
from lmcache.experimental.remote.serde.cachegen import CacheGenSerde
from lmcache.experimental.remote.serde.naive import NaiveSerde
from lmcache.experimental.remote.serde.safetensor import SafetensorSerde

SERDES = ("naive", "cachegen", "safetensor")

__all__ = ["SERDES", "AllocateFn", "CacheGenSerde", "NaiveSerde", "SafetensorSerde", "Serde", "create_serde"]


def create_serde(name: str) -> Serde:
    """The serde called `name` (`remote_serde` in the config)."""
    if name == "naive":
        return NaiveSerde()
    if name == "cachegen":
        return CacheGenSerde()
    if name == "safetensor":
        return SafetensorSerde()
    raise ValueError(f"remote_serde={name!r}: expected one of {SERDES}")
