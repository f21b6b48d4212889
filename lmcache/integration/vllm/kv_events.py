"""LMCache's tiers as vLLM KV events, published over ZeroMQ the way vLLM publishes its own.

Operations:
- `KVEventsTranslator(engine).take()`: the engine's holdings stream since the last take as vLLM
  events: `BlockStored` for each chunk a tier admitted, `BlockRemoved` for each one it lost,
  built from vLLM's own event classes (`vllm_compat.kv_event_types`), so the decoder of the
  running vLLM line reads them.
- `start_kv_events(engine, rank)` / `KVEventsPublisher.close()`: with `kv_events_endpoint`, this
  worker's publisher thread: every `PUBLISH_INTERVAL_S`, one `KVEventBatch` as the frames `topic`,
  8-byte big-endian sequence number, msgpack payload (vLLM's `ZmqEventPublisher`), on the
  endpoint (its port + the worker's rank).
- `connector_kv_events(engine)`: without an endpoint, the translator vLLM 0.32's connector hook
  drains each step (`get_kv_connector_kv_cache_events`, patched by `lmcache_vllm`: the shell's
  own turns `get_kv_events()` into `BlockStored` only), so vLLM's `--kv-events-config` publisher
  sends ours beside its own blocks.

Each event is one chunk. On vLLM 0.32, where the store knew vLLM's hashes of the chunk's blocks
(`chunk_tokens.BlockNames`, from the scheduler's `request.block_hashes`), it names the chunk as
vLLM's OffloadingConnector names its CPU copies (self-describing events): `block_hashes` vLLM's
hash of each of its blocks in the chunk, `parent_block_hash` vLLM's hash of the block before,
`block_size` vLLM's block size; the removal names the same hashes. Otherwise (vLLM 0.9.2, a chunk
stored without them, a chunk size that is not a multiple of vLLM's block size) the chunk is one
block: its hash is the chunk's own (the first 8 bytes of its key, as an int), `block_size` the
chunk size, `parent_block_hash` the chunk before it. Either way `token_ids` are its tokens,
`medium` `CPU` (the CPU tier, the node pool) or `STORAGE` (disk, remote stores), `ownership`
`lmcache.<tier name>`, and the request's `cache_salt` in the first block's `extra_keys`, where
vLLM puts it. A chunk shorter than the chunk size (a prompt's tail) is no block, as vLLM
publishes whole blocks only. A tier's loss of everything (`Change.CLEARED`) and a resync are
logged, not published: vLLM's `AllBlocksCleared` would also clear the GPU blocks a router holds
for this instance.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Dict, List, Optional

import msgspec
import zmq

from lmcache.background_threads import prepared
from lmcache.experimental.cache_engine import LMCacheEngine
from lmcache.experimental.config import LMCacheEngineConfig
from lmcache.experimental.holdings import Change, HoldingEvent
from lmcache.integration.vllm import vllm_compat
from lmcache.logging import init_logger
from lmcache.utils import CacheEngineKey

logger = init_logger(__name__)

# How often the publisher drains the stream: events reach routers within about this long.
PUBLISH_INTERVAL_S = 0.1
# Messages ZeroMQ queues for a slow subscriber before it drops them (vLLM's default `hwm`).
SEND_HWM = 100_000
# Events per published batch, so one message stays small whatever a take brought.
MAX_EVENTS_PER_BATCH = 1024
# How long the last batches may take to leave when the publisher closes.
CLOSE_LINGER_MS = 500


def block_hash(key: CacheEngineKey) -> int:
    """The chunk's block hash: the first 8 bytes of its prefix hash (vLLM's hashes are 64-bit ints
    on 0.9.2; 0.32 also takes ints)."""
    return int(key.chunk_hash[:16], 16)


class KVEventsTranslator:
    """The engine's holdings as vLLM events, with counts of what could not be published."""

    def __init__(self, engine: LMCacheEngine) -> None:
        assert engine.holdings is not None and engine.chunk_tokens is not None, "enable_kv_events is off"
        self._holdings = engine.holdings
        self._chunk_tokens = engine.chunk_tokens
        self._chunk_size = engine.config.chunk_size
        self._stored, self._removed, self._batch = vllm_compat.kv_event_types()
        self._stored_fields = set(self._stored.__struct_fields__)
        self._removed_fields = set(self._removed.__struct_fields__)
        self.undescribed = 0  # admits whose tokens were no longer recorded: not published

    def take(self) -> List[Any]:
        """vLLM events for everything the tiers reported since the last take."""
        batch = self._holdings.take()
        if batch.resync:
            logger.warning("LMCache KV events: %d events dropped so far (stream full); a router's view "
                           "of this instance's tiers may be stale", batch.dropped)
        events = []
        for event in batch.events:
            translated = self._translate(event)
            if translated is not None:
                events.append(translated)
        return events

    def batch(self, events: List[Any]) -> Any:
        """One `KVEventBatch` of `events`, stamped now."""
        return self._batch(ts=time.time(), events=events)

    def _translate(self, event: HoldingEvent) -> Optional[Any]:
        if event.change is Change.CLEARED:
            logger.info("LMCache KV events: tier %s lost every chunk (%s); not published", event.tier, event.reason)
            return None
        assert event.key is not None
        where = {"medium": event.medium.value, "ownership": f"lmcache.{event.tier}"}
        record = self._chunk_tokens.get(event.key)
        if record is not None and record.num_tokens < self._chunk_size:
            return None  # a prompt's tail: never published as stored, so never as removed
        named = record is not None and record.vllm_hashes is not None
        hashes = list(record.vllm_hashes) if named else [block_hash(event.key)]
        if event.change is Change.LOST:
            return self._removed(**self._known({"block_hashes": hashes, **where}, self._removed_fields))
        if record is None:
            self.undescribed += 1
            return None
        if named:
            parent = record.vllm_parent
        else:
            parent = block_hash(record.parent) if record.parent is not None else None
        first_with_salt = record.parent is None and record.cache_salt
        fields: Dict[str, Any] = {
            "block_hashes": hashes,
            "parent_block_hash": parent,
            "token_ids": record.token_ids(),
            "block_size": self._chunk_size // len(hashes),
            "lora_id": None,
            "lora_name": None,
            "extra_keys": [(record.cache_salt,)] + [None] * (len(hashes) - 1) if first_with_salt else None,
            **where,
        }
        return self._stored(**self._known(fields, self._stored_fields))

    @staticmethod
    def _known(fields: Dict[str, Any], known: set) -> Dict[str, Any]:
        """The fields the running vLLM's event class has (0.9.2's has no `medium`, `ownership`...)."""
        return {name: value for name, value in fields.items() if name in known}


def endpoint_for_rank(endpoint: str, rank: int) -> str:
    """Worker `rank`'s endpoint: a tcp port + rank, an ipc path + `_<rank>` (rank 0 unchanged)."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return f"{base}:{int(port) + rank}"
    return f"{endpoint}_{rank}"


class KVEventsPublisher:
    """One PUB socket and the thread that drains the translator into it (`start`); a failure is
    logged and costs events, never serving."""

    def __init__(self, translator: KVEventsTranslator, endpoint: str, topic: str) -> None:
        self._translator = translator
        self._endpoint = endpoint
        self._topic = topic.encode()
        self._seq = 0
        self._stop = threading.Event()
        self.unsent = 0  # batches ZeroMQ refused (subscriber too slow) or that failed to send
        self._ctx = zmq.Context.instance()
        self._socket = self._ctx.socket(zmq.PUB)
        self._socket.set_hwm(SEND_HWM)
        # vLLM's rule: bind a wildcard or ipc endpoint, connect to a named host (its subscriber binds).
        if "*" in endpoint or "::" in endpoint or endpoint.startswith("ipc://"):
            self._socket.bind(endpoint)
        else:
            self._socket.connect(endpoint)
        self._thread = threading.Thread(target=prepared(self._run, "lmc-kv-events", background=False),
                                        name="lmcache-kv-events", daemon=True)

    def start(self) -> "KVEventsPublisher":
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(PUBLISH_INTERVAL_S):
            self._publish()

    def _publish(self) -> None:
        try:
            events = self._translator.take()
            encoder = msgspec.msgpack.Encoder()
            for start in range(0, len(events), MAX_EVENTS_PER_BATCH):
                payload = encoder.encode(self._translator.batch(events[start:start + MAX_EVENTS_PER_BATCH]))
                try:
                    self._socket.send_multipart((self._topic, self._seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)
                    self._seq += 1
                except zmq.Again:
                    self.unsent += 1
        except Exception as err:  # events are advisory: serving goes on without them
            self.unsent += 1
            logger.warning("LMCache KV events: publishing on %s failed: %r", self._endpoint, err)

    def close(self) -> None:
        """Publish what the tiers reported up to now (the engine closed first: its last writes
        count), then close the socket, letting queued messages leave for `CLOSE_LINGER_MS`."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._publish()
        self._socket.close(linger=CLOSE_LINGER_MS)
        logger.info("LMCache KV events on %s closed: %d batches published, %d not sent, %d admits undescribed",
                    self._endpoint, self._seq, self.unsent, self._translator.undescribed)


def check_kv_events_config(config: LMCacheEngineConfig) -> None:
    """ValueError when KV events are on without an endpoint on vLLM 0.9.2, which has no connector
    events (checked before the engine is built, so a refused config leaves no engine behind)."""
    if config.enable_kv_events and config.kv_events_endpoint is None and vllm_compat.is_legacy_vllm():
        raise ValueError("kv_events_endpoint=None: vLLM 0.9.2 has no connector KV events, so "
                         "enable_kv_events=True needs an endpoint for LMCache to publish on, e.g. tcp://*:5557")


def connector_kv_events(engine: LMCacheEngine) -> Optional[KVEventsTranslator]:
    """The translator vLLM's connector hook drains, when KV events are on without an endpoint
    (None otherwise). Raises ValueError on vLLM 0.9.2 (`check_kv_events_config`)."""
    config = engine.config
    check_kv_events_config(config)
    if not config.enable_kv_events or config.kv_events_endpoint is not None:
        return None
    return KVEventsTranslator(engine)


def start_kv_events(engine: LMCacheEngine, rank: int) -> Optional[KVEventsPublisher]:
    """This worker's publisher when the config turns KV events on with an endpoint (None otherwise)."""
    config = engine.config
    if not config.enable_kv_events or config.kv_events_endpoint is None:
        return None
    endpoint = endpoint_for_rank(config.kv_events_endpoint, rank)
    try:
        publisher = KVEventsPublisher(KVEventsTranslator(engine), endpoint, config.kv_events_topic).start()
    except zmq.ZMQError as err:  # serving goes on without events
        logger.error("LMCache KV events: cannot publish on %s (%s); no events from this worker", endpoint, err)
        return None
    logger.info("LMCache KV events: publishing on %s (topic %r)", endpoint, config.kv_events_topic)
    return publisher
