"""Background loads for `enable_async_loading`: a request whose cached prefix needs a slow tier
(disk, remote) waits in vLLM's `WAITING_FOR_REMOTE_KVS` state while its chunks are read and
copied into its blocks here, and other requests keep stepping.

```
  step N   scheduler: lookup_async -> (hit, slow)  => vLLM: (n, True), blocks allocated, request parked
           worker:    start_load_kv -> submit(job)      (returns at once)
  thread   pinned lookup (reads the slow tier into CPU memory) -> retrieve into the blocks
           -> unpin -> settle (count, load-error blocks for what fell short) -> finished
  step N+k worker: get_finished() reports the request in `finished_recving`
           scheduler: asks `pop_async_loaded` how much really arrived (vLLM 0.9.2 trusts its blocks)
```

vLLM allocated the request's blocks and will not touch them until the load is reported, so the
copy may run while other requests' forward passes do. Engine calls here are not serialised with
the model thread's: the engine is safe for concurrent store/retrieve, and holding the worker's
lock across a slow-tier read would stall the very steps this mode keeps going.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Optional

import torch

from lmcache.background_threads import thread_initializer
from lmcache.integration.vllm.v1.request_state import ReqMeta
from lmcache.integration.vllm.v1.transfer_arguments import load_arguments
from lmcache.logging import init_logger

if TYPE_CHECKING:
    from lmcache.integration.vllm.v1.worker_side import LMCacheWorkerSide

logger = init_logger(__name__)


def leading_run(mask: torch.Tensor) -> int:
    """How many leading entries of `mask` are set (one vector op: a loop of per-token tensor
    reads needs the GIL thousands of times, while vLLM's loop holds it)."""
    unset = (~mask.bool()).nonzero()
    return int(unset[0, 0]) if len(unset) else len(mask)


class AsyncLoader:
    """Runs one worker's background loads in order on a thread of their own."""

    def __init__(self, side: "LMCacheWorkerSide") -> None:
        self.side = side
        self._thread = ThreadPoolExecutor(  # requests wait for these loads: not background
            max_workers=1, thread_name_prefix="lmcache-async-load",
            initializer=thread_initializer("lmc-async-load", background=False),
        )
        self._lock = threading.Lock()
        self._load_ended = threading.Condition(self._lock)
        self._running = 0  # submitted loads not yet ended
        self._finished: set[str] = set()
        self._loaded: dict[str, int] = {}
        self._jobs: dict[str, Future] = {}
        self._releasing: set[str] = set()  # ended while loading: free once the job is done

    def submit(self, req: ReqMeta, kv_caches: list[torch.Tensor]) -> None:
        """Start loading `req`'s promised tokens into its blocks in the background."""
        with self._lock:
            self._running += 1
        job = self._thread.submit(self._load, req, kv_caches)
        with self._lock:
            self._jobs[req.req_id] = job

    def _load(self, req: ReqMeta, kv_caches: list[torch.Tensor]) -> None:
        try:
            slots, got = self._read(req, kv_caches)
            with self._lock:
                # A request that ended meanwhile gets its blocks back from vLLM once this job is
                # done: nothing is counted for it (its counters are gone), no block of it is a load
                # error (another request may hold that block by then), it is not reported loaded.
                if req.req_id not in self._releasing:
                    self.side.settle_load(req, slots, got)
                    self._loaded[req.req_id] = self._ready(req, got)
                    self._finished.add(req.req_id)
        finally:
            with self._lock:
                self._running -= 1
                self._load_ended.notify_all()

    def _read(self, req: ReqMeta, kv_caches: list[torch.Tensor]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Load `req`'s promised tokens into its blocks: `(slots, mask of the tokens written)`, the
        mask None when the load failed."""
        tokens, mask, slots = load_arguments(req, self.side.chunk_size)
        engine = self.side.engine
        got: Optional[torch.Tensor] = None
        try:
            # Reads every chunk of the prefix into CPU memory and holds it for this request.
            engine.lookup(tokens, cache_salt=req.cache_salt, request_id=req.req_id, pin=True)
            got = engine.retrieve(tokens, mask, kvcaches=kv_caches, slot_mapping=slots, cache_salt=req.cache_salt)
        except Exception:  # a cache tier must not fail serving: the tokens count as not loaded
            logger.exception("request %s: LMCache background load failed", req.req_id)
        finally:
            engine.lookup_unpin([req.req_id])
        return slots, got

    @staticmethod
    def _ready(req: ReqMeta, got: Optional[torch.Tensor]) -> int:
        """The leading tokens vLLM may now treat as computed: its own prefix and the run loaded after it."""
        spec = req.load_spec
        assert spec is not None
        upto = spec.vllm_cached_tokens
        if got is not None:
            upto += leading_run(got[upto:])
        logger.info(
            "request %s: background load done, %d leading tokens ready of %d promised",
            req.req_id, upto, spec.lmcache_cached_tokens,
        )
        return upto

    def wait_for_a_finish(self, timeout: float) -> None:
        """Wait up to `timeout` s for a running load to end (not at all when one has ended
        unreported, or none runs). Waiting releases the GIL, which the load needs."""
        with self._load_ended:
            if self._running and not self._finished:
                self._load_ended.wait(timeout)

    def pop_finished(self) -> set[str]:
        """Requests whose background load ended since the last call."""
        with self._lock:
            finished, self._finished = self._finished, set()
        return finished

    def pop_loaded(self, req_id: str) -> Optional[int]:
        """How many leading tokens a finished background load left in the request's blocks."""
        with self._lock:
            return self._loaded.pop(req_id, None)

    def release_when_done(self, req_ids: list[str]) -> None:
        """These requests ended while loading; `pop_released` reports them once their job is done,
        and they are never reported as loaded: vLLM 0.32 frees an ended request's blocks on that
        report (its engine then dies on the release report, which finds no request) and vLLM 0.9.2
        keeps the id for good."""
        with self._lock:
            self._releasing.update(req_ids)
            self._finished.difference_update(req_ids)
            for req_id in req_ids:
                self._loaded.pop(req_id, None)

    def pop_released(self) -> set[str]:
        """Ended requests whose blocks no background job writes into any more."""
        with self._lock:
            done = {r for r in self._releasing if r not in self._jobs or self._jobs[r].done()}
            self._releasing -= done
            for req_id in done:
                self._jobs.pop(req_id, None)
        return done

    def forget(self, req_ids: set[str]) -> None:
        """Drop results nobody will ask for (the requests ended)."""
        with self._lock:
            for req_id in req_ids:
                self._loaded.pop(req_id, None)
                if req_id not in self._releasing:
                    self._jobs.pop(req_id, None)

    def held(self) -> dict[str, int]:
        """What this loader holds for requests now (the status API's `/held`; all 0 at idle)."""
        with self._lock:
            return {"running_loads": self._running, "unreported_loads": len(self._finished),
                    "load_results": len(self._loaded), "load_jobs": len(self._jobs),
                    "releasing_requests": len(self._releasing)}

    def close(self) -> None:
        self._thread.shutdown(wait=True)
