"""Stores that run after the step instead of inside it (both doors).

A door hands the step's stores to `OffStepSaver.submit` once the forward pass wrote their KV and
returns to vLLM, which samples, sends outputs and schedules the next step while a thread of ours
copies the KV out of vLLM's blocks and hands it to the tiers. `flush()` is the barrier: the door
calls it before anything can write into vLLM's KV cache again (the next step's loads and forward
pass), so blocks freed meanwhile - a finished request, or a preempted one, which vLLM frees
without telling the connector - are only reused once their KV was copied out. Lookups flush too,
so a prompt stored by the last step is found by the next one.

```
  model thread : | forward N | wait_for_save: submit | sample, schedule N+1 | start_load_kv: flush | forward N+1
  saver thread :                                     | copy out + put ........ |
```
"""

from __future__ import annotations

import concurrent.futures
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from lmcache.background_threads import thread_initializer
from lmcache.logging import init_logger

logger = init_logger(__name__)


class OffStepSaver:
    """One thread running the submitted stores in order; `flush` waits for all of them."""

    def __init__(self, name: str) -> None:
        # Not a background priority: the next step's flush waits for this copy.
        self._thread = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"lmcache-{name}-save",
            initializer=thread_initializer(f"lmc-{name}-save", background=False),
        )
        self._pending: list[Future] = []
        self._lock = threading.Lock()  # submit (model thread) and flush (also channel threads)

    def submit(self, store: Callable[[], None], what: str) -> None:
        """Run `store` on the saver thread; an exception is logged (a cache tier never fails serving)."""

        def run() -> None:
            try:
                store()
            except Exception:
                logger.exception("LMCache off-step store failed (%s): not stored", what)

        with self._lock:
            self._pending.append(self._thread.submit(run))

    def queued(self) -> int:
        """Submitted stores that have not finished."""
        with self._lock:
            return sum(not job.done() for job in self._pending)

    def flush(self) -> None:
        """Wait until every submitted store finished copying out of vLLM's blocks."""
        with self._lock:
            pending, self._pending = self._pending, []
        concurrent.futures.wait(pending)  # `run` catches every exception: nothing to re-raise

    def close(self) -> None:
        self.flush()
        self._thread.shutdown(wait=True)
