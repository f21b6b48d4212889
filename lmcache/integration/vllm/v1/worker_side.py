"""The worker side of the v1 door: the engine, loads before the forward pass, stores after it.

vLLM calls, per step (inside the forward context):
- `start_load_kv(metadata, forward_context)`: collect each attention layer's KV cache on first
  use, then for every request with a load, retrieve LMCache's chunks into vLLM's blocks and
  release the request's pins;
- `wait_for_save(metadata)`: for every request with a store, store the step's new tokens;
- `get_finished(finished_req_ids)`: nothing is in flight between steps, so `(None, None)`;
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
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence, Union

import torch

from lmcache.experimental.cache_engine import LMCacheEngine
from lmcache.experimental.config import LMCacheEngineConfig
from lmcache.experimental.kv_layout import KVLayout
from lmcache.experimental.token_database import skip_prefix_mask
from lmcache.integration.vllm.blend_runner import Blender
from lmcache.integration.vllm.utils import check_kv_caches
from lmcache.integration.vllm.v1.blend_plan import check_blending
from lmcache.integration.vllm.request_log import RequestCounters
from lmcache.integration.vllm.v1.request_state import LMCacheConnectorMetadata, ReqMeta
from lmcache.integration.vllm.v1.worker_channel import WorkerChannelServer, channel_socket_path
from lmcache.integration.vllm.vllm_compat import attention_kv_caches, kv_caches_in_layer_order
from lmcache.integration.vllm.worker_engine import ENGINE_EXIT_PRIORITY, open_worker_engine
from lmcache.logging import init_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext

logger = init_logger(__name__)

# Executors that run the scheduler and the (only) worker in one process.
IN_PROCESS_EXECUTORS = ("uni", "external_launcher")


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
        self.blender: Optional[Blender] = None  # CacheBlend (enable_blending)

    @classmethod
    def from_vllm_config(cls, vllm_config: "VllmConfig", config: LMCacheEngineConfig) -> "LMCacheWorkerSide":
        """Create (or reuse, by `ENGINE_NAME`) this process's engine for vLLM's model and layout;
        open the worker channel on rank 0 when the scheduler runs in another process."""
        config.check_supported()
        worker = open_worker_engine(vllm_config, config, "v1 worker")
        side = cls(worker.engine, worker.layout, vllm_config.cache_config.block_size)
        if config.enable_blending:
            check_blending(vllm_config)
            side.blender = Blender(worker.engine, worker.layout, side.block_size, config.blend_recompute_ratio)
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

    def lookup(self, token_ids: Sequence[int], cache_salt: str, request_id: str = "") -> int:
        """How many leading tokens of `token_ids` LMCache holds under `cache_salt`; with a
        `request_id`, that prefix is pinned for the request's load."""
        tokens = torch.tensor(list(token_ids), dtype=torch.long)
        with self._lock:
            if request_id:
                return self.engine.lookup(tokens, cache_salt=cache_salt, request_id=request_id, pin=True)
            return self.engine.lookup(tokens, cache_salt=cache_salt)

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

    def start_load_kv(self, metadata: Any, forward_context: Optional["ForwardContext"]) -> None:
        """Retrieve every request's promised tokens into vLLM's blocks (before the forward pass)."""
        if not isinstance(metadata, LMCacheConnectorMetadata):
            return
        loads = [req for req in metadata.requests if req.load_spec is not None]
        if not loads:
            return
        try:
            kv_caches = self._ensure_kv_caches(forward_context)
            for req in loads:
                if req.blend is not None and req.blend.load and self.blender is not None:
                    self._blend(req, kv_caches, forward_context)
                else:
                    self._load(req, kv_caches)
        finally:
            # Loaded, short, or failed: the promise is settled and the pins have done their job.
            self.unpin([req.req_id for req in loads])

    def _load(self, req: ReqMeta, kv_caches: list[torch.Tensor]) -> None:
        spec = req.load_spec
        assert spec is not None
        num_tokens, vllm_cached = spec.lmcache_cached_tokens, spec.vllm_cached_tokens
        mask = skip_prefix_mask(num_tokens, vllm_cached, self.chunk_size)
        # NOTE: vLLM's own cached blocks may be shared with running requests: never write them.
        slots = req.slot_mapping[:num_tokens].clone()
        slots[:vllm_cached] = -1
        try:
            with self._lock:
                got = self.engine.retrieve(
                    req.token_ids[:num_tokens], mask, kvcaches=kv_caches, slot_mapping=slots, cache_salt=req.cache_salt
                )
        except Exception:  # a cache tier must not fail serving: the tokens count as not loaded
            logger.exception("request %s: LMCache load failed", req.req_id)
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
        """Store every request's planned tokens (after the forward pass wrote their KV)."""
        if not isinstance(metadata, LMCacheConnectorMetadata):
            return
        saves = [req for req in metadata.requests if req.save_spec is not None]
        blend_saves = [req for req in metadata.requests if req.blend is not None and req.blend.store]
        if not saves and not blend_saves:
            return
        kv_caches = self._ensure_kv_caches(None)
        if self.blender is not None:
            for req in blend_saves:
                with self._lock:
                    stored = self.blender.store_segments(req, kv_caches, None)
                self._count(req.req_id, stored=stored)
        for req in saves:
            spec = req.save_spec
            assert spec is not None
            mask = skip_prefix_mask(spec.num_tokens, spec.skip_leading_tokens, self.chunk_size)
            with self._lock:
                self.engine.store(
                    req.token_ids[: spec.num_tokens],
                    mask,
                    kvcaches=kv_caches,
                    slot_mapping=req.slot_mapping[: spec.num_tokens],
                    cache_salt=req.cache_salt,
                )
            self._count(req.req_id, stored=spec.num_tokens - spec.skip_leading_tokens)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[Optional[set[str]], Optional[set[str]]]:
        """Nothing is sent or received asynchronously; drop counters nobody asked for and the pins
        of requests that ended (aborted, or finished) before their load."""
        if finished_req_ids:
            self.unpin(list(finished_req_ids))
        with self._lock:
            for req_id in finished_req_ids:
                self._counters.pop(req_id, None)
        return None, None

    def close(self) -> None:
        """Stop serving the channel (the engine is closed at process exit, it may be shared)."""
        if self._server is not None:
            self._server.close()
            self._server = None
