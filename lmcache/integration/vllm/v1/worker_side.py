"""The worker side of the v1 door: the engine, loads before the forward pass, stores after it.

vLLM calls, per step (inside the forward context):
- `start_load_kv(metadata, forward_context)`: collect each attention layer's KV cache on first
  use, then for every request with a load, retrieve LMCache's chunks into vLLM's blocks and
  release the request's pins;
- `wait_for_save(metadata)`: hand every request's store of the step's new tokens to the
  off-step saver (`OffStepSaver`: it runs after the forward pass and is flushed before vLLM
  writes its cache again); a PD prefiller stores and pushes those chunks to the request's
  decoder inside the step (`PDSender`), so the decoder holds them before the prefiller answers;
- layer-wise (`use_layerwise`): `wait_for_layer_load` / `save_kv_layer` (`LayerwiseWorker`);
- `get_finished(finished_req_ids)`: background loads (`enable_async_loading`) that ended;
  pins of requests that ended before their load are released here;
- `get_block_ids_with_load_errors()` (vLLM 0.3x): the blocks of this step's loads that LMCache
  promised but could not fill, so vLLM recomputes them instead of reading stale KV.

It also answers the scheduler side's channel (`lookup`, `unpin`, `pop_request_counters`),
in-process or through `WorkerChannelServer` when the scheduler runs in another process.

Pins: the scheduler side's lookup names its request, and the engine holds the prefix it reports
in CPU memory (`LMCacheEngine.lookup(..., pin=True)`) so nothing evicts it before the load. Every
pin is released by exactly one of: the load (`start_load_kv`, loaded or not), the scheduler side
dropping the promise (`unpin` over the channel), the request's end (`get_finished`), a new lookup
for the same request (replaces), or the engine's close.

```
  load of one request (chunk C, vLLM's own prefix cache V, LMCache hit H):
  tokens     0 ........ floor(V/C)*C ..... V ................ H
  mask       F F F F F F|T T T T T T T T T T T T T T T T T T T|   (skip_prefix_mask)
  slots      -1 -1 -1 -1 -1 -1 -1 -1 -1 -1|s s s s s s s s s s|
             (chunks start on C boundaries; vLLM's own blocks are never written)
```
"""

from __future__ import annotations

import multiprocessing.util
import threading
import time
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence, Union

import torch

from lmcache.experimental.cache_engine import LMCacheEngine
from lmcache.experimental.config import LMCacheEngineConfig
from lmcache.experimental.kv_layout import KVLayout
from lmcache.experimental.pd.auth import pd_token
from lmcache.experimental.pd.sender import PDSender
from lmcache.integration.vllm.blend.runner import Blender
from lmcache.integration.vllm.utils import check_kv_caches
from lmcache.integration.vllm.blend.plan import check_blending
from lmcache.integration.vllm.request_log import RequestCounters
from lmcache.integration.vllm.off_step_saver import OffStepSaver
from lmcache.integration.vllm.v1.async_loader import AsyncLoader
from lmcache.integration.vllm.v1.layerwise_worker import LayerwiseWorker
from lmcache.integration.vllm.v1.request_state import LMCacheConnectorMetadata, ReqMeta
from lmcache.integration.vllm.v1.transfer_arguments import load_arguments, store_arguments
from lmcache.integration.vllm.v1.worker_channel import WorkerChannelServer, channel_socket_path
from lmcache.integration.vllm.vllm_compat import attention_kv_caches, kv_caches_in_layer_order
from lmcache.integration.vllm.worker_engine import ENGINE_EXIT_PRIORITY, open_worker_engine, report_held
from lmcache.logging import init_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext

logger = init_logger(__name__)

# Executors that run the scheduler and the (only) worker in one process.
IN_PROCESS_EXECUTORS = ("uni", "external_launcher")
# A step with nothing to compute waits at most this long for a background load to end: a new
# request arriving meanwhile is scheduled at most this late.
IDLE_STEP_WAIT_S = 0.01


class LMCacheWorkerSide:
    """Owns (a handle on) the engine of this worker process and moves KV for each step."""

    def __init__(self, engine: LMCacheEngine, layout: KVLayout, block_size: int) -> None:
        self.engine = engine
        self.layout = KVLayout(layout)
        self.block_size = block_size
        self.chunk_size = engine.config.chunk_size
        # Engine calls come from the model-runner thread and from the channel server's threads.
        self._lock = threading.Lock()
        self._kv_caches: Optional[list[torch.Tensor]] = None
        self._counters: dict[str, RequestCounters] = {}
        self._load_error_blocks: set[int] = set()
        self._server: Optional[WorkerChannelServer] = None
        # PD prefiller: pushes what each store wrote to the request's decoder.
        self.pd_sender: Optional[PDSender] = None
        # `use_layerwise`: loads and stores layer by layer on a copy thread (`layerwise_worker.py`).
        self.layerwise: Optional[LayerwiseWorker] = LayerwiseWorker(self) if engine.config.use_layerwise else None
        # `enable_async_loading`: slow-tier prefixes load in the background (`async_loader.py`).
        self.async_loader: Optional[AsyncLoader] = AsyncLoader(self) if engine.config.enable_async_loading else None
        self._nothing_scheduled = False  # this step's (`start_load_kv`), for `get_finished`
        # Whole-chunk stores run after the step; flushed before vLLM's cache is written again,
        # and at exit before the engine closes.
        self.saver = OffStepSaver("v1")
        multiprocessing.util.Finalize(self, self.saver.close, exitpriority=ENGINE_EXIT_PRIORITY + 1)

        self.blender: Optional[Blender] = None  # CacheBlend (enable_blending)

    @property
    def engine_lock(self) -> threading.Lock:
        """Held around every engine call of this side (model-runner, channel and copy threads)."""
        return self._lock

    @classmethod
    def from_vllm_config(cls, vllm_config: "VllmConfig", config: LMCacheEngineConfig) -> "LMCacheWorkerSide":
        """Create (or reuse, by `ENGINE_NAME`) this process's engine for vLLM's model and layout;
        open the worker channel on rank 0 when the scheduler runs in another process."""
        worker = open_worker_engine(vllm_config, config, "v1 worker")
        side = cls(worker.engine, worker.layout, vllm_config.cache_config.block_size)
        if config.enable_pd and config.pd_role == "sender":
            side.pd_sender = PDSender(worker.rank, token=pd_token(config), encrypt=config.pd_encrypt)
        if config.enable_blending:
            check_blending(vllm_config)
            side.blender = Blender(worker.engine, worker.layout, side.block_size, config.blend_recompute_ratio)
        report_held("v1 worker", side.held)
        backend = vllm_config.parallel_config.distributed_executor_backend
        if worker.rank == 0 and backend not in IN_PROCESS_EXECUTORS:
            side.serve_channel(channel_socket_path(vllm_config))
        return side

    def serve_channel(self, path: str) -> None:
        """Answer the scheduler side's lookups from another process."""
        server = WorkerChannelServer(self, path)
        server.start()
        self._server = server
        # Stop answering before the engine closes at exit.
        multiprocessing.util.Finalize(self, server.close, exitpriority=ENGINE_EXIT_PRIORITY + 1)

    # ----- channel endpoint ------------------------------------------------------------------------

    def lookup(self, token_ids: Sequence[int], cache_salt: str, request_id: str = "", computed: int = 0) -> int:
        """How many leading tokens of `token_ids` LMCache holds under `cache_salt`; with a
        `request_id`, the part of that prefix the load will read (past vLLM's own `computed`
        tokens) is pinned for the request's load."""
        tokens = torch.tensor(list(token_ids), dtype=torch.long)
        self.saver.flush()  # what the last step stored is found
        with self._lock:
            if request_id:
                return self.engine.lookup(
                    tokens, cache_salt=cache_salt, request_id=request_id, pin=True, pin_from=computed
                )
            return self.engine.lookup(tokens, cache_salt=cache_salt)

    def lookup_async(
        self, token_ids: Sequence[int], cache_salt: str, request_id: str, computed: int = 0
    ) -> tuple[int, bool]:
        """`(hit, needs a slow tier)`: the prefix already in CPU memory is pinned for the request as
        `lookup` pins; when a slower tier continues it, nothing is pinned (the background load
        pins as it reads) and the whole hit is reported."""
        tokens = torch.tensor(list(token_ids), dtype=torch.long)
        self.saver.flush()
        with self._lock:
            in_memory = self.engine.lookup(
                tokens, ["Hot"], cache_salt=cache_salt, request_id=request_id, pin=True, pin_from=computed
            )
            rest = [(end, key) for end, key in self.engine.token_database.prefix_keys(tokens, cache_salt=cache_salt)
                    if end > in_memory]
            found = self.engine.storage_manager.contains_prefix([key for _, key in rest])
            total = rest[found - 1][0] if found else in_memory
        if total > in_memory:
            self.unpin([request_id])
            return total, True
        return in_memory, False

    def pop_async_loaded(self, req_id: str) -> Optional[int]:
        """Leading tokens a finished background load left in the request's blocks (None: none)."""
        return None if self.async_loader is None else self.async_loader.pop_loaded(req_id)

    def unpin(self, request_ids: Sequence[str]) -> None:
        """Release the pins of these requests' lookups (ids without pins are ignored)."""
        self.engine.lookup_unpin(list(request_ids))

    def pop_request_counters(self, req_id: str) -> RequestCounters:
        """What this worker loaded and stored for a request, forgetting it."""
        with self._lock:
            return self._counters.pop(req_id, None) or RequestCounters()

    def _count(self, req_id: str, loaded: int = 0, stored: int = 0) -> None:
        with self._lock:
            counters = self._counters.setdefault(req_id, RequestCounters())
            counters.loaded_tokens += loaded
            counters.stored_tokens += stored

    def held(self) -> dict[str, int]:
        """What this worker holds for requests now (the status API's `/held`; all 0 at idle)."""
        with self._lock:
            held = {"queued_stores": self.saver.queued(), "request_counters": len(self._counters)}
        if self.async_loader is not None:
            held.update(self.async_loader.held())
        return held

    # ----- per step --------------------------------------------------------------------------------

    def _ensure_kv_caches(self, forward_context: Optional["ForwardContext"]) -> list[torch.Tensor]:
        if self._kv_caches is None:
            if forward_context is None:
                from vllm.forward_context import get_forward_context

                forward_context = get_forward_context()
            caches = attention_kv_caches(forward_context)
            check_kv_caches(caches, self.engine.metadata, self.layout, self.block_size)
            self._kv_caches = caches
        return self._kv_caches

    def register_kv_caches(self, kv_caches: Union[Sequence[torch.Tensor], Mapping[str, torch.Tensor]]) -> None:
        """Use these KV cache tensors instead of the forward context's: one per layer in model
        order, or vLLM 0.3x's `{layer name: cache}`."""
        caches = kv_caches_in_layer_order(kv_caches) if isinstance(kv_caches, Mapping) else list(kv_caches)
        check_kv_caches(caches, self.engine.metadata, self.layout, self.block_size)
        self._kv_caches = caches

    def bind_step(self) -> None:
        """A step's metadata is bound, its forward pass is next: the last step's stores finish
        copying out of blocks this step may write (blocks of a request that ended since)."""
        self.saver.flush()

    def start_load_kv(self, metadata: Any, forward_context: Optional["ForwardContext"]) -> None:
        """Retrieve every request's promised tokens into vLLM's blocks (before the forward pass);
        first, the last step's stores finish copying out of blocks vLLM may since have reused
        (where `bind_step` did not already)."""
        self.saver.flush()
        self._nothing_scheduled = isinstance(metadata, LMCacheConnectorMetadata) and metadata.nothing_scheduled
        if not isinstance(metadata, LMCacheConnectorMetadata):
            return
        if metadata.release_after_load and self.async_loader is not None:
            self.async_loader.release_when_done(metadata.release_after_load)
        loads = [req for req in metadata.requests if req.load_spec is not None]
        if self.blender is not None:
            loads = self._blend_loads(loads, forward_context)
        if not loads:
            return
        background = [req for req in loads if req.load_spec is not None and req.load_spec.is_async]
        if background:
            assert self.async_loader is not None, "a background load without enable_async_loading"
            kv_caches = self._ensure_kv_caches(forward_context)
            for req in background:
                self.async_loader.submit(req, kv_caches)
            loads = [req for req in loads if req.load_spec is not None and not req.load_spec.is_async]
            if not loads:
                return
        if self.layerwise is not None:
            self.layerwise.start_loads(loads, self._ensure_kv_caches(forward_context))  # unpins when done
            return
        try:
            kv_caches = self._ensure_kv_caches(forward_context)
            for req in loads:
                self._load(req, kv_caches)
        finally:
            # Loaded, short, or failed: the promise is settled and the pins have done their job.
            self.unpin([req.req_id for req in loads])

    def _load(self, req: ReqMeta, kv_caches: list[torch.Tensor]) -> None:
        tokens, mask, slots = load_arguments(req, self.chunk_size)
        got: Optional[torch.Tensor] = None
        try:
            with self._lock:
                got = self.engine.retrieve(tokens, mask, kvcaches=kv_caches, slot_mapping=slots, cache_salt=req.cache_salt)
        except Exception:  # a cache tier must not fail serving: the tokens count as not loaded
            logger.exception("request %s: LMCache load failed", req.req_id)
        self.settle_load(req, slots, got)

    def settle_load(self, req: ReqMeta, slots: torch.Tensor, got: Optional[torch.Tensor]) -> None:
        """Count what a load wrote (`got`: its token mask, None when it failed) and report the
        promised blocks it did not fill as load errors."""
        spec = req.load_spec
        assert spec is not None
        num_tokens, vllm_cached = spec.lmcache_cached_tokens, spec.vllm_cached_tokens
        if got is None:
            got = torch.zeros(num_tokens, dtype=torch.bool)
        loaded = int(got[vllm_cached:num_tokens].sum())
        self._count(req.req_id, loaded=loaded)
        expected = num_tokens - vllm_cached
        if loaded < expected:
            missing = slots[:num_tokens][~got[:num_tokens].bool() & (slots[:num_tokens] >= 0)]
            with self._lock:
                self._load_error_blocks.update((missing // self.block_size).tolist())
            logger.error(
                "request %s: LMCache promised %d tokens but loaded %d (chunks evicted or unreadable since the "
                "lookup); their blocks are reported as load errors (vLLM 0.3x recomputes them, vLLM 0.9 "
                "treats them as computed)",
                req.req_id, expected, loaded,
            )

    def wait_for_layer_load(self) -> None:
        """Layer-wise: block until the next layer of this step's loads is in vLLM's cache."""
        if self.layerwise is not None:
            self.layerwise.wait_layer_loaded()

    def save_kv_layer(self, metadata: Any) -> None:
        """Layer-wise: copy the layer vLLM just computed out for this step's stores."""
        if self.layerwise is None or not isinstance(metadata, LMCacheConnectorMetadata):
            return

        def saves() -> list[ReqMeta]:
            return [req for req in metadata.requests if req.save_spec is not None]

        self.layerwise.save_layer(saves, self._ensure_kv_caches(None))

    def _blend_loads(self, loads: list[ReqMeta], forward_context: Optional["ForwardContext"]) -> list[ReqMeta]:
        """CacheBlend the loads that blend (its own layer loop, whatever `use_layerwise` does for
        the others); returns the other loads."""
        blends = [req for req in loads if req.blend is not None and req.blend.load]
        if not blends:
            return loads
        try:
            kv_caches = self._ensure_kv_caches(forward_context)
            for req in blends:
                self._blend(req, kv_caches, forward_context)
        finally:
            self.unpin([req.req_id for req in blends])
        return [req for req in loads if req.blend is None or not req.blend.load]

    def _blend(self, req: ReqMeta, kv_caches: list[torch.Tensor], forward_context: Optional["ForwardContext"]) -> None:
        """CacheBlend writes every promised token; if it fails, they are load errors like a short load."""
        assert self.blender is not None and req.load_spec is not None
        try:
            with self._lock:
                reused = self.blender.blend(req, kv_caches, forward_context)
            self._count(req.req_id, loaded=reused)
        except Exception:  # a cache tier must not fail serving
            logger.exception("request %s: CacheBlend failed", req.req_id)
            spec = req.load_spec
            slots = req.slot_mapping[spec.vllm_cached_tokens : spec.lmcache_cached_tokens]
            with self._lock:
                self._load_error_blocks.update((slots // self.block_size).tolist())

    def get_block_ids_with_load_errors(self) -> set[int]:
        """The vLLM blocks that loads since the last call promised but did not fill."""
        with self._lock:
            blocks, self._load_error_blocks = self._load_error_blocks, set()
        return blocks

    def wait_for_save(self, metadata: Any) -> None:
        """Store every request's planned tokens (after the forward pass wrote their KV); layer-wise,
        wait for the layers' copies and puts. CacheBlend's segment stores run here in either mode."""
        if self.blender is not None and isinstance(metadata, LMCacheConnectorMetadata):
            self._store_blend_segments(metadata)
        if self.layerwise is not None:
            self.layerwise.finish_loads()
            self.layerwise.finish_saves()
            return
        if not isinstance(metadata, LMCacheConnectorMetadata):
            return
        saves = [req for req in metadata.requests if req.save_spec is not None]
        if not saves:
            return
        kv_caches = self._ensure_kv_caches(None)
        jobs = [(req, store_arguments(req, self.chunk_size)) for req in saves]

        def store() -> None:
            for req, (tokens, mask, slots) in jobs:
                with self._lock:
                    self.engine.store(tokens, mask, kvcaches=kv_caches, slot_mapping=slots, cache_salt=req.cache_salt,
                                      block_names=req.block_names)
                if req.disagg_spec is not None and self.pd_sender is not None:
                    self._push(req, mask)

        for req in saves:  # before the store takes the lock
            self.count_store(req)
        if self.pd_sender is not None and any(req.disagg_spec is not None for req in saves):
            # PD: the decoder must hold the pushed KV before the prefiller answers the proxy, which
            # then sends the request on; so a step that pushes stores and pushes in the step.
            self.saver.flush()
            store()
        else:
            self.saver.submit(store, ", ".join(req.req_id for req in saves))

    def _store_blend_segments(self, metadata: LMCacheConnectorMetadata) -> None:
        """Store each finished blendable prompt's segments under their own tokens (in the step)."""
        assert self.blender is not None
        blend_saves = [req for req in metadata.requests if req.blend is not None and req.blend.store]
        if not blend_saves:
            return
        kv_caches = self._ensure_kv_caches(None)
        for req in blend_saves:
            with self._lock:
                stored = self.blender.store_segments(req, kv_caches, None)
            self._count(req.req_id, stored=stored)

    def count_store(self, req: ReqMeta) -> None:
        """Count a request's planned store as done."""
        spec = req.save_spec
        assert spec is not None
        self._count(req.req_id, stored=spec.num_tokens - spec.skip_leading_tokens)

    def _push(self, req: ReqMeta, mask: torch.Tensor) -> None:
        """PD prefiller: send the chunks this store covered to the request's decoder."""
        spec, save = req.disagg_spec, req.save_spec
        assert spec is not None and save is not None and self.pd_sender is not None
        began = time.perf_counter()
        try:
            with self._lock:
                pushed = self.pd_sender.push_stored(
                    self.engine, spec, req.token_ids[: save.num_tokens], mask, req.cache_salt
                )
        except Exception:  # the decoder recomputes what it lacks; the prefill must not fail for it
            logger.exception("PD: request %s: push failed", spec.req_id)
            pushed = 0
        logger.info("PD: request %s pushed %d tokens to %s in %.1f ms (tokens %d..%d%s)", spec.req_id, pushed,
                    spec.receiver_id, (time.perf_counter() - began) * 1000, save.skip_leading_tokens,
                    save.num_tokens, ", last prefill" if spec.is_last_prefill else "")

    def get_finished(self, finished_req_ids: set[str]) -> tuple[Optional[set[str]], Optional[set[str]]]:
        """`(ended requests no background load writes into any more, background loads that ended)`;
        drop counters nobody asked for and the pins of
        requests that ended (aborted, or finished) before their load."""
        if finished_req_ids:
            self.unpin(list(finished_req_ids))
        with self._lock:
            for req_id in finished_req_ids:
                self._counters.pop(req_id, None)
        if self.async_loader is None:
            return None, None
        if self._nothing_scheduled:
            # vLLM's loop would call again at once, holding the GIL the loader needs between its
            # reads and copies (a 3000-token disk hit took 3.2 s against 0.08 s synchronously).
            self.async_loader.wait_for_a_finish(IDLE_STEP_WAIT_S)
        self.async_loader.forget(finished_req_ids)
        return self.async_loader.pop_released() or None, self.async_loader.pop_finished() or None

    def close(self) -> None:
        """Stop serving the channel (the engine is closed at process exit, it may be shared)."""
        if self._server is not None:
            self._server.close()
            self._server = None
        if self.pd_sender is not None:
            self.pd_sender.close()
        if self.layerwise is not None:
            self.layerwise.close()
        if self.async_loader is not None:
            self.async_loader.close()
        self.saver.close()
