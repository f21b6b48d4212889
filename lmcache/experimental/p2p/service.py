"""The serving half of peer-to-peer sharing for one engine: its peer server and its recorder.

Started by the engine after its tiers exist (the server reads them, the recorder lists them) and
closed before them: the live key goes first, so peers stop asking as soon as the instance leaves.
"""

from __future__ import annotations

from lmcache.config import LMCacheEngineMetadata
from lmcache.experimental.config import LMCacheEngineConfig, mask_url
from lmcache.experimental.holdings import HoldingsStream
from lmcache.experimental.p2p.peer_server import PeerServer, p2p_token, served_address
from lmcache.experimental.p2p.recorder import HoldingsRecorder
from lmcache.experimental.p2p.records import LookupRecords, redis_client
from lmcache.experimental.storage_backend.storage_manager import StorageManager
from lmcache.logging import init_logger

logger = init_logger(__name__)


def lookup_records(config: LMCacheEngineConfig) -> LookupRecords:
    """A client of the records at `lookup_url` (the URL shown masked in its log lines)."""
    assert config.lookup_url is not None  # the config checks it with enable_p2p
    return LookupRecords(redis_client(config.lookup_url), f"the P2P lookup server {mask_url(config.lookup_url)}")


class P2PService:
    """This worker's peer server and recorder."""

    def __init__(self, config: LMCacheEngineConfig, metadata: LMCacheEngineMetadata, storage: StorageManager,
                 holdings: HoldingsStream) -> None:
        address = served_address(config, metadata.worker_id)
        self._shown = (f"serving tiers {storage.local_tier_names} at {address}"
                       f"{' over TLS' if config.p2p_tls_cert_file else ''}, recorded in {mask_url(config.lookup_url or '')}")
        self.server = PeerServer(storage, address, p2p_token(config), config.p2p_no_auth,
                                 config.p2p_tls_cert_file, config.p2p_tls_key_file)
        self.recorder = HoldingsRecorder(lookup_records(config), holdings, storage, address)

    def start(self) -> "P2PService":
        self.server.start_in_thread()
        self.recorder.start()
        logger.info("peer-to-peer: %s", self._shown)
        return self

    def close(self) -> None:
        self.recorder.close()
        self.server.shutdown()
