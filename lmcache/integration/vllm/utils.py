"""What both vLLM doors (v0 `v0/`, v1 `v1/`) need to know about vLLM.

Operations:
- `ENGINE_NAME`: the one name the engine is registered under in each worker process (vLLM's
  own v0 connector imports it, so it must stay here).
- `lmcache_get_config(extra_config)`: the base config (`LMCACHE_CONFIG_FILE` if set, else
  `LMCACHE_*` over the defaults) with `kv_connector_extra_config` keys starting with
  `lmcache.` applied on top; a key naming no field or a bad value raises, naming it.
- `force_skip_save()`: whether `LMCACHE_FORCE_SKIP_SAVE` asks never to store.
- `kv_cache_dtype`, `detect_kv_layout`, `worker_rank`, `create_engine_metadata`,
  `create_gpu_connector`: vLLM config -> the engine's metadata and the connector for the
  paged layout vLLM's attention backend uses (CPU with or without IPEX, flash, MLA).
- `check_kv_caches`: the KV cache tensors vLLM actually handed over match what the metadata
  and layout promised (a mismatch would copy garbage, so it is an error naming the layer).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

import torch

from lmcache.config import LMCacheEngineMetadata
from lmcache.experimental.config import BOOL_WORDS, LMCacheEngineConfig, parse_bool, prefixed_overrides
from lmcache.experimental.kv_layout import KVLayout, mla_latent_view, vllm_layer_cache_shape
from lmcache.integration.vllm.mp_keys import MP_CONNECTOR, pool_extra_config
from lmcache.integration.vllm.vllm_compat import cpu_kv_layout, torch_dtype_of

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from lmcache.experimental.gpu_connector import GPUConnectorInterface

ENGINE_NAME = "vllm-instance"
# First field of every key stored through vLLM.
VLLM_KEY_FORMAT = "vllm"
FORCE_SKIP_SAVE_ENV = "LMCACHE_FORCE_SKIP_SAVE"
EXTRA_CONFIG_SOURCE = "kv_transfer_config.kv_connector_extra_config"



def lmcache_get_config(extra_config: Optional[Mapping[str, Any]] = None) -> LMCacheEngineConfig:
    """The engine config for this vLLM instance.

    The base comes from `LMCACHE_CONFIG_FILE` (YAML) when set, else from `LMCACHE_*` variables
    over the CPU-only defaults; then every `lmcache.<field>` key of vLLM's
    `kv_connector_extra_config` replaces that field. Keys without the prefix belong to the door
    (`skip_last_n_tokens`, `discard_partial_chunks`) or to vLLM and are left alone here.
    """
    config = LMCacheEngineConfig.from_env()
    overrides = prefixed_overrides(extra_config or {})
    if overrides:
        config = config.with_overrides(overrides, source=EXTRA_CONFIG_SOURCE)
    return config


def extra_config_of(vllm_config: "VllmConfig") -> Mapping[str, Any]:
    """vLLM's `kv_connector_extra_config` (empty without a KV transfer config); for upstream's
    `LMCacheMPConnector`, its `lmcache.mp.*` keys mapped onto ours (`mp_keys.pool_extra_config`)."""
    kv_transfer = vllm_config.kv_transfer_config
    if kv_transfer is None:
        return {}
    extra = dict(kv_transfer.kv_connector_extra_config or {})
    if kv_transfer.kv_connector == MP_CONNECTOR:
        return pool_extra_config(extra)
    return extra


def force_skip_save(environ: Optional[Mapping[str, str]] = None) -> bool:
    """True when `LMCACHE_FORCE_SKIP_SAVE` is set to a true word (`parse_bool`; empty is unset)."""
    env = os.environ if environ is None else environ
    raw = env.get(FORCE_SKIP_SAVE_ENV)
    if raw is None or not raw.strip():
        return False
    parsed = parse_bool(raw)
    if parsed is None:
        raise ValueError(f"{FORCE_SKIP_SAVE_ENV}={raw!r}: expected a bool ({BOOL_WORDS})")
    return parsed


def kv_cache_dtype(vllm_config: "VllmConfig") -> torch.dtype:
    """The element type of vLLM's KV cache tensors (the model dtype unless `kv_cache_dtype` is set)."""
    cache_dtype = vllm_config.cache_config.cache_dtype
    if cache_dtype == "auto":
        dtype = vllm_config.model_config.dtype
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"model_config.dtype={dtype!r} is not resolved to a torch dtype")
        return dtype
    dtype = torch_dtype_of(cache_dtype)
    if dtype is None:
        raise ValueError(f"kv_cache_dtype={cache_dtype!r}: LMCache does not know this KV cache dtype")
    return dtype


def detect_kv_layout(vllm_config: "VllmConfig") -> KVLayout:
    """The paged layout of one layer's K (V) cache for this vLLM configuration.

    CPU backend (`vllm_compat.cpu_kv_layout`): `CPU_IPEX` when vLLM 0.9's CPU attention runs
    through IPEX, `CPU_PACKED` when it falls back to its own kernels, `CPU_ATTN` on vLLM 0.32.
    GPU: `FLASH` (flash-attention's `(2, blocks, block_size, heads, head_size)`). MLA models:
    `MLA` on either.
    """
    if vllm_config.model_config.use_mla:
        return KVLayout.MLA
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return cpu_kv_layout(vllm_config)
    if current_platform.is_cuda_alike():
        return KVLayout.FLASH
    raise ValueError(
        f"LMCache cannot place KV caches on platform {type(current_platform).__name__}: "
        "only the CPU backend and CUDA flash-attention layouts are supported"
    )


def worker_rank(vllm_config: "VllmConfig") -> tuple[int, int]:
    """(world size, this worker's rank) across tensor and pipeline parallelism.

    Uses vLLM's world group when the distributed environment is up (always, in a worker), else
    the parallel config (a single worker)."""
    from vllm.distributed import parallel_state

    world_size = vllm_config.parallel_config.world_size
    if parallel_state.model_parallel_is_initialized():
        group = parallel_state.get_world_group()
        return group.world_size, group.rank_in_group
    return world_size, vllm_config.parallel_config.rank


def create_engine_metadata(
    vllm_config: "VllmConfig",
    config: LMCacheEngineConfig,
    world_size: int,
    worker_id: int,
) -> LMCacheEngineMetadata:
    """The engine's metadata: model name, this worker's place, KV dtype and per-chunk KV shape
    `(num_layers, 2 or 1 for MLA, chunk_size, num_kv_heads, head_size)` for this worker's shard."""
    model_config = vllm_config.model_config
    parallel_config = vllm_config.parallel_config
    use_mla = bool(model_config.use_mla)
    num_layers = model_config.get_num_layers(parallel_config)
    num_kv_heads = 1 if use_mla else model_config.get_num_kv_heads(parallel_config)
    head_size = model_config.get_head_size()
    kv_shape = (num_layers, 1 if use_mla else 2, config.chunk_size, num_kv_heads, head_size)
    return LMCacheEngineMetadata(
        model_name=model_config.model,
        world_size=world_size,
        worker_id=worker_id,
        fmt=VLLM_KEY_FORMAT,
        kv_dtype=kv_cache_dtype(vllm_config),
        kv_shape=kv_shape,
        use_mla=use_mla,
    )


def create_gpu_connector(
    vllm_config: "VllmConfig", metadata: LMCacheEngineMetadata, layout: KVLayout
) -> "GPUConnectorInterface":
    """The paged-memory connector for vLLM's per-layer KV cache tensors in `layout`."""
    from vllm.platforms import current_platform

    from lmcache.experimental.gpu_connector import VLLMPagedMemGPUConnectorV2

    num_layers, _, chunk_size, num_kv_heads, head_size = metadata.kv_shape
    return VLLMPagedMemGPUConnectorV2(
        num_kv_heads * head_size,
        num_layers,
        use_gpu=not current_platform.is_cpu(),
        layout=layout,
        num_kv_heads=num_kv_heads,
        block_size=vllm_config.cache_config.block_size,
        use_mla=metadata.use_mla,
        chunk_size=chunk_size,
    )


def check_kv_caches(
    kv_caches: Sequence[torch.Tensor],
    metadata: LMCacheEngineMetadata,
    layout: KVLayout,
    block_size: int,
) -> None:
    """Refuse KV caches that contradict the metadata or layout (layer count, dtype, shape)."""
    num_layers, _, _, num_kv_heads, head_size = metadata.kv_shape
    if len(kv_caches) != num_layers:
        raise ValueError(
            f"vLLM handed over {len(kv_caches)} attention layers' KV caches, "
            f"the engine metadata says {num_layers}"
        )
    for index, cache in enumerate(kv_caches):
        if cache.dtype != metadata.kv_dtype:
            raise ValueError(
                f"KV cache of layer {index} has dtype {cache.dtype}, the engine metadata says {metadata.kv_dtype}"
            )
        shape = tuple((mla_latent_view(cache) if layout == KVLayout.MLA else cache).shape)
        one_tensor = layout in (KVLayout.MLA, KVLayout.CPU_ATTN)  # blocks on dim 0, not K/V
        num_blocks = shape[0] if one_tensor else (shape[1] if len(shape) > 1 else 0)
        if shape != vllm_layer_cache_shape(layout, num_blocks, block_size, num_kv_heads, head_size):
            raise ValueError(
                f"KV cache of layer {index} has shape {shape}, which is not a {layout.name} cache with "
                f"block_size={block_size}, num_kv_heads={num_kv_heads}, head_size={head_size}"
            )
