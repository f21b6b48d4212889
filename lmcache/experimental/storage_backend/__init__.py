"""Storage tiers and the factory that builds them from the engine config.

`create_storage_manager` is the one place that decides which tiers exist and in which order
(fastest first): the CPU tier ("Hot", when `local_cpu`), the local disk tier (when
`local_disk` is set), then remote tiers, then a PD decoder's receive buffer, then other
instances' tiers (`enable_p2p`). Everything else talks to tiers through
`StorageBackendInterface` and the `StorageManager`.
"""

from typing import List, Optional

from lmcache.config import LMCacheEngineMetadata
from lmcache.experimental.config import LMCacheEngineConfig
from lmcache.experimental.holdings import HoldingsStream
from lmcache.experimental.memory_management import MemoryAllocatorInterface
from lmcache.experimental.stats import EngineStats
from lmcache.experimental.storage_backend.abstract_backend import StorageBackendInterface
from lmcache.experimental.storage_backend.local_cpu_backend import LocalCPUBackend
from lmcache.experimental.storage_backend.local_disk_backend import LocalDiskBackend
from lmcache.experimental.storage_backend.storage_manager import StorageManager

GB = 1024**3

__all__ = [
    "GB",
    "LocalCPUBackend",
    "LocalDiskBackend",
    "StorageBackendInterface",
    "StorageManager",
    "create_storage_backends",
    "create_storage_manager",
]


def create_storage_backends(
    config: LMCacheEngineConfig,
    metadata: LMCacheEngineMetadata,
    local_cpu_backend: LocalCPUBackend,
    stats: EngineStats,
) -> List[StorageBackendInterface]:
    """The configured tiers, fastest first (the CPU tier only when it keeps objects)."""
    tiers: List[StorageBackendInterface] = []
    if local_cpu_backend.keeps_objects:
        tiers.append(local_cpu_backend)
    if config.local_disk is not None and config.max_local_disk_size > 0:
        tiers.append(
            LocalDiskBackend(
                config.local_disk,
                int(config.max_local_disk_size * GB),
                local_cpu_backend,
                stats.tier(LocalDiskBackend.__name__),
            )
        )
    if config.remote_url is not None:
        # Imported here: the remote tier pulls in connectors and serdes that import this package.
        from lmcache.experimental.remote.mooncake_settings import MooncakeSettings
        from lmcache.experimental.storage_backend.remote_backend import RemoteBackend

        tiers.append(
            RemoteBackend(
                config.remote_url,
                config.remote_serde or "naive",
                metadata,
                local_cpu_backend,
                stats.tier(RemoteBackend.__name__),
                password=config.remote_password,
                mooncake=MooncakeSettings.from_config(config),
            )
        )
    if config.enable_pd and config.pd_role == "receiver":
        tiers.append(_pd_receive_buffer(config, metadata, local_cpu_backend, stats))
    if config.enable_p2p:
        tiers.append(_p2p_tier(config, metadata, local_cpu_backend, stats))
    return tiers


def _p2p_tier(
    config: LMCacheEngineConfig, metadata: LMCacheEngineMetadata, cpu: LocalCPUBackend, stats: EngineStats
) -> StorageBackendInterface:
    """Other instances' chunks, found in the lookup records (the slowest tier: last)."""
    # Imported here: the peer tier pulls in remote connectors, which import this package.
    from lmcache.experimental.p2p.peer_server import p2p_client_tls, p2p_token, served_address
    from lmcache.experimental.p2p.service import lookup_records
    from lmcache.experimental.storage_backend.p2p_backend import P2PBackend

    return P2PBackend(lookup_records(config), served_address(config, metadata.worker_id), cpu, metadata.kv_dtype,
                      stats.tier(P2PBackend.__name__), p2p_token(config), p2p_client_tls(config))


def _pd_receive_buffer(
    config: LMCacheEngineConfig, metadata: LMCacheEngineMetadata, cpu: LocalCPUBackend, stats: EngineStats
) -> StorageBackendInterface:
    """The decoder's buffer for pushed KV, listening on the peer port plus the worker id (for
    senders with the token, if one is set: `pd.auth`)."""
    from lmcache.experimental.pd.auth import pd_token
    from lmcache.experimental.pd.receiver import PDReceiveBuffer

    assert config.pd_peer_host is not None and config.pd_peer_init_port is not None  # the config checks it
    token = pd_token(config)
    buffer = PDReceiveBuffer(metadata, config.pd_buffer_size, cpu, stats.tier(PDReceiveBuffer.__name__))
    buffer.listen(config.pd_peer_host, config.pd_peer_init_port + metadata.worker_id, token, config.pd_no_auth,
                  config.pd_encrypt)
    return buffer


def create_storage_manager(
    config: LMCacheEngineConfig,
    metadata: LMCacheEngineMetadata,
    memory_allocator: MemoryAllocatorInterface,
    stats: Optional[EngineStats] = None,
    holdings: Optional[HoldingsStream] = None,
) -> StorageManager:
    """The CPU tier over `memory_allocator` plus every configured tier, in one manager (their
    admits and losses reported into `holdings` when given)."""
    stats = stats if stats is not None else EngineStats()
    cpu = LocalCPUBackend(memory_allocator, keep_objects=config.local_cpu, stats=stats.tier("Hot"))
    return StorageManager(cpu, create_storage_backends(config, metadata, cpu, stats), stats, holdings)
