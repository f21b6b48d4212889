"""What the engine must know about the model and the worker it serves.

`LMCacheEngineMetadata` travels from the vLLM integration into the engine, the token
database (key fields) and the GPU connector (KV shape). It is validated once here so
the parts that use it can trust it. The engine's own settings live in
`lmcache.experimental.config.LMCacheEngineConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LMCacheEngineMetadata:
    """Identity and KV geometry of one worker's cache."""

    # Model name as vLLM knows it; part of every key.
    model_name: str
    # Tensor-parallel world size and this worker's rank; both part of every key.
    world_size: int
    worker_id: int
    # Serving engine format tag (e.g. "vllm"); first field of every key.
    fmt: str
    # Element type of the KV cache.
    kv_dtype: torch.dtype
    # (num_layers, 2 or 1 for MLA, chunk_size, num_kv_heads, head_size).
    kv_shape: tuple[int, int, int, int, int]
    # Multi-head latent attention: K only, one latent "head".
    use_mla: bool = False

    def __post_init__(self) -> None:
        if not self.model_name:
            raise ValueError("LMCacheEngineMetadata.model_name must be non-empty")
        if not self.fmt or "@" in self.fmt:
            raise ValueError(f"LMCacheEngineMetadata.fmt must be non-empty without '@', got {self.fmt!r}")
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"LMCacheEngineMetadata.world_size must be an int >= 1, got {self.world_size!r}")
        if not isinstance(self.worker_id, int) or not 0 <= self.worker_id < self.world_size:
            raise ValueError(
                f"LMCacheEngineMetadata.worker_id must be an int in [0, {self.world_size}), "
                f"got {self.worker_id!r}"
            )
        if not isinstance(self.kv_dtype, torch.dtype):
            raise ValueError(f"LMCacheEngineMetadata.kv_dtype must be a torch.dtype, got {self.kv_dtype!r}")
        shape = tuple(self.kv_shape)
        if len(shape) != 5 or not all(isinstance(d, int) and d > 0 for d in shape):
            raise ValueError(
                "LMCacheEngineMetadata.kv_shape must be 5 positive ints "
                f"(num_layers, kv, chunk_size, num_kv_heads, head_size), got {self.kv_shape!r}"
            )
        expected_kv = 1 if self.use_mla else 2
        if shape[1] != expected_kv:
            raise ValueError(
                f"LMCacheEngineMetadata.kv_shape[1] must be {expected_kv} when use_mla={self.use_mla}, "
                f"got {shape[1]}"
            )
        self.kv_shape = shape  # type: ignore[assignment]

    @property
    def num_layers(self) -> int:
        return self.kv_shape[0]

    @property
    def chunk_size(self) -> int:
        return self.kv_shape[2]

    @property
    def hidden_size(self) -> int:
        """Elements per token per layer for K (or V): num_kv_heads * head_size."""
        return self.kv_shape[3] * self.kv_shape[4]
