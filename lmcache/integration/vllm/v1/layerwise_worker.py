"""The v1 door's layer-wise path (`use_layerwise: true`): loads and stores one layer at a time on a
thread of their own, so the copies overlap the forward pass (loads only where a core is spare).

vLLM calls, per step:
- `start_load_kv` -> `start_loads`: one `retrieve_layer` generator per request with a load; the
  copy thread advances all of them layer by layer (layer 0 first) and marks each layer done
  (with no spare core, see below, the model thread advances them here instead);
- `wait_for_layer_load(layer)` (before layer i's attention) -> `wait_layer_loaded`: waits until
  the thread has written layer i; layer i + 1 is being copied while layer i computes;
- `save_kv_layer(layer)` (after layer i's attention wrote its KV) -> `save_layer`: at the step's
  first layer one `store_layer` generator per request with a store; the thread copies layer i of
  each out of vLLM's cache while layer i + 1 computes;
- `wait_for_save` -> `finish_saves`: waits for the copies and the puts into the tiers.

```
  model thread : | attn 0 | attn 1 | attn 2 | ... | wait_for_save
  copy thread  : |ld 0|ld 1|ld 2|...                (loads run ahead, waited on per layer)
                          |st 0    |st 1    |st 2 ... (stores follow the layers written)
```

The copy thread only helps where it has a core the forward pass does not use. When the model's
OpenMP team already covers every CPU the process may use (vLLM's CPU worker on a machine of its
own), a hit's copy on that thread runs on one core and competes with the team, while the model
thread waits with its team idle: layer-wise hits took 1.16x a whole-chunk load's TTFT so. There
the model thread copies each layer itself when it asks for it (`wait_for_layer_load`), with its
team, as a whole-chunk load does; a second OpenMP team on the copy thread is no way out (while it
exists, libgomp throttles every spin-wait in the process: `lmcache/background_threads.py`).

A load that fails part-way (a tier read raising) leaves later layers unwritten: the whole
request's promised blocks are reported as load errors, as a short synchronous load is. The step
never fails because of the cache: a storer that raises stores nothing.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Generator, Optional

import torch

from lmcache.background_threads import process_cpus, thread_initializer
from lmcache.integration.vllm.v1.request_state import ReqMeta
from lmcache.integration.vllm.v1.transfer_arguments import load_arguments, store_arguments
from lmcache.logging import init_logger

if TYPE_CHECKING:
    from lmcache.integration.vllm.v1.worker_side import LMCacheWorkerSide

logger = init_logger(__name__)


@dataclass
class _Load:
    req: ReqMeta
    slots: torch.Tensor
    retriever: Optional[Generator[Optional[torch.Tensor], None, None]]  # None once it failed
    got: Optional[torch.Tensor] = None


@dataclass
class _Save:
    req: ReqMeta
    storer: Optional[Generator[None, None, None]]  # None once it failed or finished


class LayerwiseWorker:
    """One worker's layer-wise loads and stores, advanced on one copy thread (FIFO, so a layer's
    store never runs before the loads queued ahead of it) or, loads with no spare core, on the
    model thread (which has copied layer i before it computes and stores it)."""

    def __init__(self, side: "LMCacheWorkerSide") -> None:
        self.side = side
        self._thread = ThreadPoolExecutor(  # the next layer waits for its copy: not background
            max_workers=1, thread_name_prefix="lmcache-layerwise",
            initializer=thread_initializer("lmc-layerwise", background=False),
        )
        self._layer_done: list[threading.Event] = []
        self._loads_done: Optional[Future] = None
        self._inline_loads: Optional[list[_Load]] = None  # copied by the model thread, layer by layer
        self._next_load_layer = 0
        self._spare_core: Optional[bool] = None  # known at the first load, on the model thread
        self._saves: list[_Save] = []
        self._save_futures: list[Future] = []
        self._step_has_saved = False  # save_layer ran this step (the storers exist)

    # ----- loads -------------------------------------------------------------------------------

    def start_loads(self, loads: list[ReqMeta], kv_caches: list[torch.Tensor]) -> None:
        """Start copying every request's promised chunks, layer by layer, on the copy thread (or
        get them ready for the model thread to copy)."""
        self.finish_loads()  # a previous step's loads nobody waited for (no attention hooks ran)
        side = self.side
        jobs: list[_Load] = []
        for req in loads:
            tokens, mask, slots = load_arguments(req, side.chunk_size)
            try:
                retriever = side.engine.retrieve_layer(
                    tokens, mask, kvcaches=kv_caches, slot_mapping=slots, cache_salt=req.cache_salt
                )
            except Exception:
                logger.exception("request %s: LMCache layer-wise load failed to start", req.req_id)
                retriever = None
            jobs.append(_Load(req, slots, retriever))
        num_layers = len(kv_caches)
        self._layer_done = [threading.Event() for _ in range(num_layers)]
        self._next_load_layer = 0
        if self._spare_core is None:
            self._spare_core = len(process_cpus()) > torch.get_num_threads()
            logger.info(
                "layer-wise loads are copied %s",
                "on a thread of their own, overlapping the forward pass" if self._spare_core
                else "by the model thread, layer by layer (its OpenMP team covers every CPU: no core to overlap on)",
            )
        if self._spare_core:
            self._loads_done = self._thread.submit(self._run_loads, jobs, num_layers)
        else:
            self._inline_loads = jobs

    def _run_loads(self, jobs: list[_Load], num_layers: int) -> None:
        try:
            for layer in range(num_layers):
                self._load_layer(jobs)
                self._layer_done[layer].set()
            self._load_layer(jobs)  # the last next() yields the token mask
        finally:
            for event in self._layer_done:
                event.set()
            self._settle(jobs)

    def _load_layer(self, jobs: list[_Load]) -> None:
        for job in jobs:
            self._advance_load(job)

    def _settle(self, jobs: list[_Load]) -> None:
        for job in jobs:
            self.side.settle_load(job.req, job.slots, job.got)
        self.side.unpin([job.req.req_id for job in jobs])

    def _advance_load(self, job: _Load) -> None:
        if job.retriever is None:
            return
        try:
            with self.side.engine_lock:
                out = next(job.retriever)
            if out is not None:
                job.got = out
                job.retriever = None
        except Exception:
            logger.exception("request %s: LMCache layer-wise load failed", job.req.req_id)
            job.retriever, job.got = None, None

    def wait_layer_loaded(self) -> None:
        """Block until the next layer (in model order) of this step's loads is written (or, with
        no spare core, write it)."""
        if self._loads_done is None and self._inline_loads is None:
            return
        layer = self._next_load_layer
        self._next_load_layer += 1
        if self._inline_loads is not None:
            if layer < len(self._layer_done):
                self._load_layer(self._inline_loads)
        elif layer < len(self._layer_done):
            self._layer_done[layer].wait()
        if self._next_load_layer >= len(self._layer_done):
            self.finish_loads()

    def finish_loads(self) -> None:
        """Finish this step's loads and settle them (counted, errors reported, pins released):
        wait for the copy thread, or copy the layers no `wait_for_layer_load` asked for."""
        jobs, self._inline_loads = self._inline_loads, None
        if jobs is not None:
            try:
                while self._next_load_layer < len(self._layer_done):
                    self._next_load_layer += 1
                    self._load_layer(jobs)
                self._load_layer(jobs)  # the last next() yields the token mask
            finally:
                self._settle(jobs)
        done, self._loads_done = self._loads_done, None
        if done is not None:
            done.result()

    # ----- stores ------------------------------------------------------------------------------

    def save_layer(self, saves: Callable[[], list[ReqMeta]], kv_caches: list[torch.Tensor]) -> None:
        """Copy the layer just computed out of vLLM's cache for every request with a store (the
        storers are made at the step's first layer, from `saves()`)."""
        first = not self._step_has_saved
        self._step_has_saved = True
        if first:
            side = self.side
            self._saves = []
            for req in saves():
                tokens, mask, slots = store_arguments(req, side.chunk_size)
                with side.engine_lock:
                    storer = side.engine.store_layer(
                        tokens, mask, kvcaches=kv_caches, slot_mapping=slots, cache_salt=req.cache_salt,
                        block_names=req.block_names,
                    )
                self._saves.append(_Save(req, storer))
        if self._saves:
            self._save_futures.append(self._thread.submit(self._advance_saves))

    def _advance_saves(self) -> None:
        for job in self._saves:
            if job.storer is not None:
                self._advance_save(job)

    def finish_saves(self) -> None:
        """Wait for every layer's copy; layers whose `save_kv_layer` did not come are copied now
        (the forward pass is over), then the chunks go to the tiers."""
        for future in self._save_futures:
            future.result()
        for job in self._saves:
            while job.storer is not None:
                self._advance_save(job)
            self.side.count_store(job.req)
        self._saves, self._save_futures, self._step_has_saved = [], [], False

    def _advance_save(self, job: _Save) -> None:
        assert job.storer is not None
        try:
            with self.side.engine_lock:
                next(job.storer)
        except StopIteration:
            job.storer = None
        except Exception:
            logger.exception("request %s: LMCache layer-wise store failed", job.req.req_id)
            job.storer = None

    def close(self) -> None:
        self._thread.shutdown(wait=True)
