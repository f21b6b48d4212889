"""`LMCacheEngine` (store / retrieve / lookup / prefetch) and `LMCacheEngineBuilder` (one engine
per name, per process).

Store: tokens -> chunks and keys (token database) -> for each chunk not cached yet, a memory
object from the CPU tier's allocator (or, where the node pool is the only tier, a block of its
arena: `pool_in_place.py`); the connector fills them all in one call (one kernel call per
request: see docs/design.md, "Decisions"), then each goes to every tier.
Retrieve: chunk by chunk from the fastest tier that has it (all at once, leased in place, from a
sole node pool), stopping at the first missing chunk; the connector copies them into the serving
engine's KV cache in one call (earlier when a tier has a chunk but no memory is left to read it
into).
Lookup: the cached prefix length; a pinned lookup also holds that prefix in CPU memory for a
request id (see `pins.py`) so the retrieve that follows cannot come back short.
Each of them updates the `lmcache:` Prometheus metrics (`metrics.py`) from the engine's counters.

A cache problem (memory full, a tier failing, a bad chunk on disk) never raises into the serving
path: it is logged, counted, and becomes a skipped store or a miss. Caller errors (a bad mask,
missing connector kwargs) still raise.
"""

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, Generator, Iterable, List, Optional, Sequence, Tuple

import torch

from lmcache.config import LMCacheEngineMetadata
from lmcache.experimental.chunk_tokens import BlockNames, ChunkTokens
from lmcache.experimental.config import LMCacheEngineConfig
from lmcache.experimental.gpu_connector import GPUConnectorInterface
from lmcache.experimental.holdings import CONTROLLER, KV_EVENTS, P2P, HoldingsStream
from lmcache.experimental.layerwise import ChunkSpan, LayerCopier, paged_connector, request_slots
from lmcache.experimental.memory_management import MemoryAllocatorInterface, MemoryFormat, MemoryObj, MixedMemoryAllocator
from lmcache.experimental.metrics import EngineMetrics, EngineObservation
from lmcache.experimental.stats import EngineStats, EngineStatsSnapshot
from lmcache.experimental.storage_backend import GB, StorageManager, create_storage_manager
from lmcache.experimental.storage_backend.remote_backend import RemoteBackend
from lmcache.experimental.token_database import ChunkedTokenDatabase, TokenDatabase, tokens_to_bytes
from lmcache.logging import init_logger
from lmcache.utils import CacheEngineKey

if TYPE_CHECKING:
    from lmcache.experimental.p2p.service import P2PService

logger = init_logger(__name__)


def _num_selected(tokens: Sequence[int], mask: Optional[torch.Tensor]) -> int:
    return len(tokens) if mask is None else int(mask.sum())


class _RunningClock:
    """Seconds a layer-wise generator spent running: its `time_to_store` / `time_to_retrieve`. The
    span from its start to its end would also count the forward pass between its layers."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._since: Optional[float] = time.perf_counter()

    def pause(self) -> None:
        if self._since is not None:
            self.seconds += time.perf_counter() - self._since
            self._since = None

    def resume(self) -> None:
        self._since = time.perf_counter()


@dataclass
class _LayerStorePlan:
    """What a layer-wise store found before copying: the chunks it will write and the counts."""

    requested: int
    clock: _RunningClock
    spans: List[ChunkSpan] = field(default_factory=list)
    keys: List[CacheEngineKey] = field(default_factory=list)
    stored: int = 0
    skipped: int = 0

    @property
    def dropped(self) -> int:
        """Tokens neither stored nor already cached: memory full, a refused put, or a storer closed
        before its last layer."""
        return self.requested - self.stored - self.skipped

    def release(self) -> None:
        """Drop this store's own reference on each object (the tiers keep theirs)."""
        for span in self.spans:
            span.obj.ref_count_down()
        self.spans = []


class LMCacheEngine:
    """Moves KV caches between the serving engine (through a GPU connector) and the tiers.

    Store takes KV out of the serving engine's cache into CPU memory objects and hands them to
    the tiers (slow tiers write in the background). Retrieve fetches the objects back from the
    fastest tier that has them and writes them into the serving engine's cache. Prefetch asks
    slower tiers to bring chunks into the CPU tier ahead of a retrieve.
    """

    def __init__(
        self,
        config: LMCacheEngineConfig,
        metadata: LMCacheEngineMetadata,
        memory_allocator: MemoryAllocatorInterface,
        token_database: TokenDatabase,
        gpu_connector: GPUConnectorInterface,
    ) -> None:
        self.config = config
        self.metadata = metadata
        self.memory_allocator = memory_allocator
        self.token_database = token_database
        self.gpu_connector = gpu_connector
        self._stats = EngineStats()
        self._metrics = EngineMetrics(metadata.model_name, metadata.worker_id)
        # With KV events or the controller on: what the tiers admit and lose, one queue per
        # consumer (`holdings.py`); with KV events, also the tokens of the chunks stored (their
        # publisher drains both: `integration/vllm/kv_events.py`; the controller client needs keys only).
        consumers = [name for name, on in ((KV_EVENTS, config.enable_kv_events),
                                           (CONTROLLER, config.enable_controller), (P2P, config.enable_p2p)) if on]
        self.holdings: Optional[HoldingsStream] = HoldingsStream(consumers=consumers) if consumers else None
        self.chunk_tokens: Optional[ChunkTokens] = ChunkTokens() if config.enable_kv_events else None
        self.storage_manager: StorageManager = create_storage_manager(
            config, metadata, memory_allocator, self._stats, self.holdings
        )
        # With P2P on: the peer server over these tiers and the recorder of their holdings.
        self._p2p: Optional["P2PService"] = None
        if config.enable_p2p:
            from lmcache.experimental.p2p.service import P2PService  # its server and Redis only when on

            assert self.holdings is not None
            try:
                self._p2p = P2PService(config, metadata, self.storage_manager, self.holdings).start()
            except BaseException:
                self.storage_manager.close()
                raise
        self._close_lock = threading.Lock()
        self._closed = False

    def store(
        self,
        tokens: torch.Tensor,
        mask: Optional[torch.Tensor] = None,
        *,
        cache_salt: Optional[str] = None,
        block_names: Optional[BlockNames] = None,
        **kwargs,
    ) -> None:
        """Store the KV of the tokens the mask selects (mask FFF...TTT; None = all).

        `kwargs` go to the GPU connector (e.g. `kvcaches`, `slot_mapping`). `block_names`: the
        serving engine's names of the prompt's blocks, which KV events then give the chunks.
        Chunks already cached locally are skipped (a chunk only the remote store has is copied,
        and its put skipped by the remote tier's put thread: asking the server here would cost a
        round trip per chunk).
        When memory is full even after eviction, the rest is not stored (logged). Raises
        ValueError if the number of Falses in the mask is not a multiple of the chunk size.
        """
        started = time.perf_counter()
        chunks = self.token_database.process_tokens(tokens, mask, cache_salt=cache_salt or "")
        requested = _num_selected(tokens, mask)
        if self._closed:
            logger.warning("store on a closed engine: %d tokens not stored", requested)
            self._stats.record_store(requested, 0, 0, requested)
            return
        stored = skipped = dropped = 0
        full = False
        batch: List[Tuple[int, int, CacheEngineKey, MemoryObj]] = []

        def flush() -> None:
            """Copy the batch in one connector call, then hand each chunk to the tiers."""
            nonlocal stored, dropped
            try:
                if batch:
                    objs = [b[3] for b in batch]
                    checksums = self.gpu_connector.batched_from_gpu(
                        objs, [b[0] for b in batch], [b[1] for b in batch], checksums=sum_payloads, **kwargs
                    )
                    for obj, checksum in zip(objs, checksums or ()):
                        obj.payload_checksum = checksum
                for start, end, key, obj in batch:
                    if self.storage_manager.put(key, obj) > 0:
                        stored += end - start
                    else:
                        dropped += end - start
            finally:
                for *_, obj in batch:
                    obj.ref_count_down()
                batch.clear()

        todo: List[Tuple[int, int, CacheEngineKey]] = []
        chunks = list(chunks)
        if self.chunk_tokens is not None and chunks:
            self._record_tokens(tokens, chunks, cache_salt or "", block_names)
        for start, end, key in chunks:
            if self.storage_manager.contains_locally(key):
                skipped += end - start
            else:
                todo.append((start, end, key))
        # Where the only tier can be the engine's memory (the node pool), the kernel writes there.
        reserved = self.storage_manager.reserve_in_place(
            [key for *_, key in todo], [self.gpu_connector.get_shape(end - start) for start, end, _ in todo],
            self.metadata.kv_dtype,
        )
        # The kernel sums what it writes where a tier writes headers (not for the CPU tier alone).
        sum_payloads = self.storage_manager.writes_headers()
        try:
            for i, (start, end, key) in enumerate(todo):
                n = end - start
                if full:
                    dropped += n
                    continue
                obj, reserved[i] = reserved[i], None
                if obj is not None:
                    batch.append((start, end, key, obj))
                    continue
                shape = self.gpu_connector.get_shape(n)
                obj = self.storage_manager.allocate(shape, self.metadata.kv_dtype, MemoryFormat.KV_BLOB)
                if obj is None and batch:
                    flush()  # the batch held the memory; once stored, its chunks can be evicted
                    obj = self.storage_manager.allocate(shape, self.metadata.kv_dtype, MemoryFormat.KV_BLOB)
                if obj is None:
                    logger.warning(
                        "memory full: not storing tokens [%d, %d) of %d (chunk %s and later)",
                        start, len(tokens), len(tokens), key.chunk_hash,
                    )
                    full = True
                    dropped += n
                    continue
                batch.append((start, end, key, obj))
            flush()
        finally:
            for *_, obj in batch:
                obj.ref_count_down()
            for obj in reserved:  # not filled: never published
                if obj is not None:
                    obj.ref_count_down()
        self._stats.record_store(requested, stored, skipped, dropped)
        self._metrics.observe_store(time.perf_counter() - started)
        self.publish_metrics()
        logger.debug(
            "store: %d tokens requested, %d stored, %d already cached, %d dropped", requested, stored, skipped, dropped
        )

    def _record_tokens(
        self, tokens: torch.Tensor, chunks: List[Tuple[int, int, CacheEngineKey]], cache_salt: str,
        block_names: Optional[BlockNames],
    ) -> None:
        """Note each chunk's tokens and parent before the tiers admit it (their events name them);
        a masked prefix is hashed again for the first chunk's parent (a few microseconds)."""
        assert self.chunk_tokens is not None
        first = chunks[0][0]
        parent = None
        if first > 0:
            *_, (_, _, parent) = self.token_database.process_tokens(tokens[:first], cache_salt=cache_salt)
        self.chunk_tokens.record_prompt(chunks, tokens_to_bytes(tokens), parent, cache_salt, block_names)

    def retrieve(
        self,
        tokens: torch.Tensor,
        mask: Optional[torch.Tensor] = None,
        *,
        cache_salt: Optional[str] = None,
        **kwargs,
    ) -> torch.Tensor:
        """Load cached KV for the tokens the mask selects into the serving engine's cache.

        Stops at the first chunk no tier has. Returns a CPU bool tensor as long as `tokens`, True
        for every token whose KV was loaded. Raises ValueError if the number of Falses in the
        mask is not a multiple of the chunk size.
        """
        started = time.perf_counter()
        chunks = self.token_database.process_tokens(tokens, mask, cache_salt=cache_salt or "")
        ret_mask = torch.zeros(len(tokens), dtype=torch.bool, device="cpu")
        requested = _num_selected(tokens, mask)
        if self._closed:
            logger.warning("retrieve on a closed engine: nothing loaded")
            chunks = iter(())
        hit = 0
        todo = list(chunks)
        batch: List[Tuple[int, int, MemoryObj]] = []

        def flush() -> None:
            """Copy the batch into the KV cache in one connector call and release it."""
            nonlocal hit
            try:
                if batch:
                    self.gpu_connector.batched_to_gpu(
                        [b[2] for b in batch], [b[0] for b in batch], [b[1] for b in batch], **kwargs
                    )
                for start, end, _ in batch:
                    ret_mask[start:end] = True
                    hit += end - start
            finally:
                for *_, obj in batch:
                    obj.ref_count_down()
                batch.clear()

        # Where the only tier hands out its own bytes (the node pool), the kernel reads them there.
        leased = self.storage_manager.lease_in_place([key for *_, key in todo], self.metadata.kv_dtype) if todo else None
        if todo and leased is None:
            self.storage_manager.read_ahead([key for *_, key in todo])
        try:
            for i, (start, end, key) in enumerate(todo):
                if leased is not None:
                    obj, leased[i] = leased[i], None
                else:
                    if i + 1 < len(todo):
                        # Let a slower tier read the next chunk into the CPU tier while this one is read.
                        self.storage_manager.prefetch(todo[i + 1][2])
                    obj = self.storage_manager.get(key)
                    if obj is None and batch and self.storage_manager.contains(key):
                        # A tier has the chunk but could not read it into memory the batch holds:
                        # copy the batch (its chunks become evictable) and read again.
                        flush()
                        obj = self.storage_manager.get(key)
                if obj is None or not self._fits(key, obj, end - start):
                    break
                batch.append((start, end, obj))
            flush()
        finally:
            for *_, obj in batch:
                obj.ref_count_down()
            for obj in leased or ():  # after the first miss: not used
                if obj is not None:
                    obj.ref_count_down()
        self._stats.record_retrieve(requested, hit)
        self._metrics.observe_retrieve(time.perf_counter() - started)
        self.publish_metrics()
        logger.debug("retrieve: %d tokens requested, %d loaded", requested, hit)
        return ret_mask

    def _fits(self, key: CacheEngineKey, obj: MemoryObj, num_tokens: int) -> bool:
        """Whether a read chunk has the shape and dtype of `num_tokens` of this model's KV; if not,
        it is released and removed (logged): a miss."""
        expected = self.gpu_connector.get_shape(num_tokens)
        meta = obj.metadata
        if meta.shape == expected and meta.dtype == self.metadata.kv_dtype:
            return True
        logger.warning(
            "chunk %s has shape %s %s, expected %s %s: treating it as a miss",
            key.chunk_hash, list(meta.shape), meta.dtype, list(expected), self.metadata.kv_dtype,
        )
        obj.ref_count_down()
        self.storage_manager.remove(key)
        return False

    def lookup(
        self,
        tokens: torch.Tensor,
        search_range: Optional[List[str]] = None,
        *,
        cache_salt: Optional[str] = None,
        request_id: Optional[str] = None,
        pin: bool = False,
        pin_from: int = 0,
    ) -> int:
        """How many leading tokens are cached, searching the tiers named in `search_range`
        (a subset of ["Hot", "LocalDiskBackend", ...]; None = all tiers). Each tier is asked
        once for the whole prefix (a remote tier: one round trip).

        With `pin=True` (needs `request_id`) the answer is a promise a later `retrieve` can keep:
        every chunk of the prefix that ends after token `pin_from` (the serving engine's own
        prefix cache holds the rest, which a load skips) is brought into CPU memory now (read
        from a slower tier if need be, in one batch) and held for `request_id` until
        `lookup_unpin([request_id])`, replacing that id's earlier pins. The count is then only
        the prefix that could be pinned: a chunk that cannot be read or allocated ends it
        (logged and counted, never raised).
        """
        if search_range is not None and (
            isinstance(search_range, str) or not all(isinstance(name, str) for name in search_range)
        ):
            raise ValueError(f"search_range must be a list of tier names, got {search_range!r}")
        if pin and (not isinstance(request_id, str) or not request_id):
            raise ValueError(f"lookup(pin=True) needs a request_id (a non-empty str), got {request_id!r}")
        chunks = list(self.token_database.process_tokens(tokens, cache_salt=cache_salt or ""))
        chunks = chunks[: self.storage_manager.contains_prefix([key for *_, key in chunks], search_range)]
        hit = chunks[-1][1] if chunks else 0
        if pin:
            assert request_id is not None
            hit = self._pin(request_id, chunks, search_range, pin_from)
        self._stats.record_lookup(len(tokens), hit)
        self.publish_metrics()
        return hit

    def _pin(
        self,
        request_id: str,
        chunks: List[Tuple[int, int, CacheEngineKey]],
        search_range: Optional[List[str]],
        pin_from: int,
    ) -> int:
        """Pin the chunks of a found prefix that end after `pin_from`; the tokens covered by the
        chunks below it and the run that was pinned."""
        skipped = sum(1 for _, end, _ in chunks if end <= pin_from)

        def usable(i: int, obj: MemoryObj) -> bool:
            start, end, key = chunks[skipped + i]
            expected = self.gpu_connector.get_shape(end - start)
            if obj.metadata.shape == expected and obj.metadata.dtype == self.metadata.kv_dtype:
                return True
            logger.warning(
                "chunk %s has shape %s %s, expected %s %s: not pinning it",
                key.chunk_hash, list(obj.metadata.shape), obj.metadata.dtype, list(expected), self.metadata.kv_dtype,
            )
            return False

        if self._closed:
            logger.warning("pinned lookup on a closed engine: nothing pinned for request %s", request_id)
            return 0
        found = chunks[-1][1] if chunks else 0
        tail = [key for _, _, key in chunks[skipped:]]
        count = self.storage_manager.pin_prefix(request_id, tail, search_range, usable, self.metadata.kv_dtype) + skipped
        pinned = chunks[count - 1][1] if count else 0
        if pinned < found:
            logger.warning(
                "request %s: lookup found %d cached tokens but could pin only %d (a chunk could not be read "
                "into memory: CPU memory full of pinned or in-flight chunks, or a tier failed)",
                request_id, found, pinned,
            )
            self._stats.record_pin_failure(found - pinned)
        return pinned

    def lookup_unpin(self, request_ids: Iterable[str]) -> None:
        """Release the pins of these requests' lookups (ids without pins are ignored)."""
        self.storage_manager.pins.unpin(request_ids)
        self.publish_metrics()  # the live_pins gauge drops now, not at the next store or lookup

    def prefetch(
        self,
        tokens: torch.Tensor,
        mask: Optional[torch.Tensor] = None,
        *,
        cache_salt: Optional[str] = None,
    ) -> None:
        """Start loading the selected chunks from slower tiers into the CPU tier (returns at once),
        up to the first chunk no tier has."""
        for _, _, key in self.token_database.process_tokens(tokens, mask, cache_salt=cache_salt or ""):
            if not self.storage_manager.prefetch(key):
                break

    # ----- layer-wise paths (`layerwise.py`): one layer per `next()` --------------------------------

    def store_layer(
        self,
        tokens: torch.Tensor,
        mask: Optional[torch.Tensor] = None,
        *,
        kvcaches: Sequence[Any],
        slot_mapping: torch.Tensor,
        offset: int = 0,
        sync: bool = True,
        cache_salt: Optional[str] = None,
        block_names: Optional[BlockNames] = None,
    ) -> Generator[None, None, None]:
        """Like `store`, one layer per `next()`: the i-th `next()` copies layer i of every chunk out
        of `kvcaches` (so it may run as soon as layer i's KV is written); after the last layer the
        chunks go to the tiers. `slot_mapping[j]` is token `offset + j`'s slot. `sync` is the
        reference's "this request finishes before the step goes on"; on CPU every `next()` has
        finished its copy when it returns. Mask and slot errors raise here, before any `next()`."""
        del sync
        spans, plan = self._layer_store_plan(tokens, mask, cache_salt, block_names)
        try:
            copier = LayerCopier(
                self.gpu_connector, kvcaches, request_slots(slot_mapping, offset, spans, True), spans, storing=True
            )
        except Exception:
            plan.release()
            raise
        plan.clock.pause()
        return self._store_layers(copier, plan)

    def _layer_store_plan(
        self, tokens: torch.Tensor, mask: Optional[torch.Tensor], cache_salt: Optional[str],
        block_names: Optional[BlockNames],
    ) -> Tuple[List[ChunkSpan], "_LayerStorePlan"]:
        plan = _LayerStorePlan(requested=_num_selected(tokens, mask), clock=_RunningClock())
        chunks = list(self.token_database.process_tokens(tokens, mask, cache_salt=cache_salt or ""))
        if self._closed:
            logger.warning("store on a closed engine: %d tokens not stored", plan.requested)
            chunks = []
        if self.chunk_tokens is not None and chunks:
            self._record_tokens(tokens, chunks, cache_salt or "", block_names)
        for start, end, key in chunks:
            n = end - start
            if self.storage_manager.contains_locally(key):
                plan.skipped += n
                continue
            obj = self.storage_manager.allocate(self.gpu_connector.get_shape(n), self.metadata.kv_dtype, MemoryFormat.KV_BLOB)
            if obj is None:
                logger.warning("memory full: not storing tokens [%d, %d) of %d", start, len(tokens), len(tokens))
                break
            plan.spans.append(ChunkSpan(start, end, obj))
            plan.keys.append(key)
        return plan.spans, plan

    def _store_layers(self, copier: LayerCopier, plan: "_LayerStorePlan") -> Generator[None, None, None]:
        try:
            for layer in range(copier.num_layers):
                plan.clock.resume()
                copier.copy_layer(layer)
                if layer == copier.num_layers - 1:
                    for key, span in zip(plan.keys, plan.spans):
                        if self.storage_manager.put(key, span.obj) > 0:
                            plan.stored += span.end - span.start
                plan.clock.pause()
                yield None
        finally:
            plan.clock.pause()
            plan.release()
            self._stats.record_store(plan.requested, plan.stored, plan.skipped, plan.dropped)
            self._metrics.observe_store(plan.clock.seconds)
            self.publish_metrics()

    def retrieve_layer(
        self,
        tokens: torch.Tensor,
        mask: Optional[torch.Tensor] = None,
        *,
        kvcaches: Sequence[Any],
        slot_mapping: torch.Tensor,
        sync: bool = True,
        cache_salt: Optional[str] = None,
    ) -> Generator[Optional[torch.Tensor], None, None]:
        """Like `retrieve`, one layer per `next()`: the chunks are read from the tiers up to the first
        miss (before anything is written), then the i-th `next()` writes layer i of them into
        `kvcaches` and yields None; one more `next()` yields the mask of loaded tokens (a CPU bool
        tensor as long as `tokens`). `slot_mapping` covers every token. `sync`: as in
        `store_layer`. Mask errors raise here, before any `next()`."""
        del sync
        chunks = list(self.token_database.process_tokens(tokens, mask, cache_salt=cache_salt or ""))
        paged_connector(self.gpu_connector)
        return self._retrieve_layers(tokens, mask, chunks, kvcaches, slot_mapping)

    def _retrieve_layers(
        self,
        tokens: torch.Tensor,
        mask: Optional[torch.Tensor],
        chunks: List[Tuple[int, int, CacheEngineKey]],
        kvcaches: Sequence[Any],
        slot_mapping: torch.Tensor,
    ) -> Generator[Optional[torch.Tensor], None, None]:
        clock = _RunningClock()
        spans: List[ChunkSpan] = []
        ret_mask = torch.zeros(len(tokens), dtype=torch.bool, device="cpu")
        try:
            if self._closed:
                logger.warning("retrieve on a closed engine: nothing loaded")
                chunks = []
            for i, (start, end, key) in enumerate(chunks):
                if i + 1 < len(chunks):
                    self.storage_manager.prefetch(chunks[i + 1][2])
                obj = self.storage_manager.get(key)
                if obj is None:
                    break
                meta = obj.metadata
                if meta.shape != self.gpu_connector.get_shape(end - start) or meta.dtype != self.metadata.kv_dtype:
                    logger.warning("chunk %s has shape %s %s: treating it as a miss", key.chunk_hash, list(meta.shape), meta.dtype)
                    obj.ref_count_down()
                    self.storage_manager.remove(key)
                    break
                spans.append(ChunkSpan(start, end, obj))
            copier = LayerCopier(
                self.gpu_connector, kvcaches, request_slots(slot_mapping, 0, spans, False), spans, storing=False
            )
            for layer in range(copier.num_layers):
                copier.copy_layer(layer)
                clock.pause()
                yield None
                clock.resume()
            for span in spans:
                ret_mask[span.start : span.end] = True
            hit = int(ret_mask.sum())
            self._stats.record_retrieve(_num_selected(tokens, mask), hit)
            clock.pause()
            self._metrics.observe_retrieve(clock.seconds)
            self.publish_metrics()
            logger.debug("retrieve_layer: %d tokens requested, %d loaded", _num_selected(tokens, mask), hit)
            yield ret_mask
        finally:
            for span in spans:
                span.obj.ref_count_down()

    def stats(self) -> EngineStatsSnapshot:
        """A snapshot of the engine's and its tiers' counters."""
        return self._stats.snapshot()

    def observation(self) -> EngineObservation:
        """The counters, the tiers' usage and the remote tier's put/health counters, now."""
        remote = next((t.remote_stats() for t in self.storage_manager.tiers if isinstance(t, RemoteBackend)), None)
        return EngineObservation(self._stats.snapshot(), self.storage_manager.usage_bytes(), remote)

    def publish_metrics(self) -> None:
        """Bring the Prometheus metrics up to date (background tier work shows at the next call)."""
        self._metrics.publish(self.observation())

    def close(self, timeout_s: Optional[float] = None) -> None:
        """Wait for pending writes of every tier (at most `timeout_s`; None: each tier's own
        bound), then release every pin (standing ones too) and the CPU tier's objects."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        registry = self.storage_manager.pins
        pins, requests, standing = registry.num_pins, registry.num_requests, registry.num_standing_requests
        if self._p2p is not None:
            self._p2p.close()  # peers stop asking before the tiers go
        self.storage_manager.close(timeout_s)
        self.memory_allocator.close()
        self.publish_metrics()
        # The serving engine unpins every request it looked up; pins left here are a leak (tests read
        # this line), unless they are standing ones (the controller's /pin), which last until here.
        log = logger.warning if requests > standing else logger.info
        log("LMCache engine closed: live_pins=%d pinned_requests=%d at close (released; %d of them standing)",
            pins, requests, standing)


class LMCacheEngineBuilder:
    """One engine per instance id in this process (vLLM's connectors find it by name)."""

    _lock = threading.Lock()
    _instances: Dict[str, LMCacheEngine] = {}

    @classmethod
    def get_or_create(
        cls,
        instance_id: str,
        config: LMCacheEngineConfig,
        metadata: LMCacheEngineMetadata,
        gpu_connector: GPUConnectorInterface,
        *,
        memory_allocator: Optional[MemoryAllocatorInterface] = None,
        token_database: Optional[TokenDatabase] = None,
    ) -> LMCacheEngine:
        """The engine named `instance_id`, built on first call (with a host-memory allocator of
        `max_local_cpu_size` GB and a `ChunkedTokenDatabase` unless given).

        Raises ValueError if the engine exists with a different config or metadata.
        """
        with cls._lock:
            engine = cls._instances.get(instance_id)
            if engine is not None:
                if engine.config != config:
                    raise ValueError(f"LMCache engine {instance_id!r} already exists with a different config")
                if engine.metadata != metadata:
                    raise ValueError(f"LMCache engine {instance_id!r} already exists with different metadata")
                return engine
            if memory_allocator is None:
                memory_allocator = cls._build_allocator(config)
            if token_database is None:
                token_database = ChunkedTokenDatabase(config, metadata)
            engine = LMCacheEngine(config, metadata, memory_allocator, token_database, gpu_connector)
            cls._instances[instance_id] = engine
            logger.info("created LMCache engine %r (tiers: %s)", instance_id, engine.storage_manager.tier_names)
            return engine

    @staticmethod
    def _build_allocator(config: LMCacheEngineConfig) -> MemoryAllocatorInterface:
        size = int(config.max_local_cpu_size * GB)
        if size <= 0:
            raise ValueError(
                f"max_local_cpu_size={config.max_local_cpu_size!r}: must be > 0, every chunk is staged in host memory"
            )
        return MixedMemoryAllocator(size, tier=config.local_cpu)

    @classmethod
    def get(cls, instance_id: str) -> Optional[LMCacheEngine]:
        """The engine named `instance_id`, or None."""
        with cls._lock:
            return cls._instances.get(instance_id)

    @classmethod
    def destroy(cls, instance_id: str, timeout_s: Optional[float] = None) -> None:
        """Close the engine named `instance_id` (waiting for its pending writes, at most
        `timeout_s`) and forget it."""
        with cls._lock:
            engine = cls._instances.pop(instance_id, None)
        if engine is not None:
            engine.close(timeout_s)
