"""The engine of one vLLM worker process: built for vLLM's config in one place, closed at exit.

Both doors (v0 `v0.connector.init_lmcache_engine`, v1 `LMCacheWorkerSide.from_vllm_config`) call
`open_worker_engine`; it builds the engine's metadata, finds the paged KV layout, creates the
connector and registers the engine under `ENGINE_NAME` (an engine that exists already is reused),
starts its status API, KV events publisher and controller client when the config asks for them
(`api_server.py`, `kv_events.py`, `lmcache/controller/worker.py`), then has
`close_worker_engine` run when the process exits (`close_at_exit`). vLLM has no shutdown hook
for either door, and it runs workers in children it starts itself: `multiprocessing.util.Finalize`
runs in the main process and in those children alike.
"""

from __future__ import annotations

import functools
import multiprocessing.util
import signal
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, List, Mapping, Optional

from lmcache.background_threads import at_thread_shutdown
from lmcache.controller.worker import ControllerClient, start_controller_client
from lmcache.experimental.api_server import StatusAPI, start_status_api
from lmcache.experimental.cache_engine import LMCacheEngine, LMCacheEngineBuilder
from lmcache.experimental.config import LMCacheEngineConfig
from lmcache.experimental.kv_layout import KVLayout
from lmcache.integration.vllm.kv_events import (
    KVEventsPublisher,
    KVEventsTranslator,
    check_kv_events_config,
    connector_kv_events,
    start_kv_events,
)
from lmcache.integration.vllm.utils import (
    ENGINE_NAME,
    create_engine_metadata,
    create_gpu_connector,
    detect_kv_layout,
    worker_rank,
)
from lmcache.logging import init_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)

# Exit finalizers run highest priority first: the engine closes (flushing pending disk and remote
# writes) before multiprocessing's own unprioritized finalizers tear down shared state. Whatever
# must stop before the engine closes (the v1 worker channel) uses a higher one.
ENGINE_EXIT_PRIORITY = 50
# This process's status API, when the config enables it; closed with the engine.
_status_api: Optional[StatusAPI] = None
# This process's KV events publisher, when the config enables it with an endpoint; closed after the
# engine, so the writes the engine's close flushes are published too. Without an endpoint (vLLM
# 0.32), the translator vLLM's connector hook drains each step (`take_step_kv_events`).
_kv_events: Optional[KVEventsPublisher] = None
_step_kv_events: Optional[KVEventsTranslator] = None
# This process's controller client (`enable_controller`); closed after the engine for the same reason.
_controller: Optional[ControllerClient] = None
# Whether threading's exit hook runs our exit closes (`close_at_exit`), once per process.
_exit_hooked = False
# How long an exit close in a process vLLM started waits for the tiers' queued writes: vLLM kills
# its engine-core process 5 s after asking it to stop, and a close still waiting then would die
# before saying what it did not write. A main process (an offline v0 `LLM`, an explicit
# `close_lmcache_engine()`) waits for each tier's own bound instead.
CHILD_CLOSE_TIMEOUT_S = 4.0


@dataclass(frozen=True)
class WorkerEngine:
    """This process's engine and what it was built for."""

    engine: LMCacheEngine
    layout: KVLayout  # paged layout of vLLM's KV cache
    world_size: int
    rank: int


def open_worker_engine(vllm_config: "VllmConfig", config: LMCacheEngineConfig, door: str) -> WorkerEngine:
    """This worker's engine for vLLM's model, parallel place and KV layout (reused if it exists).

    `door` names the caller in the engine's log lines ("v0 door", "v1 worker")."""
    world_size, rank = worker_rank(vllm_config)
    metadata = create_engine_metadata(vllm_config, config, world_size, rank)
    layout = detect_kv_layout(vllm_config)
    existing = LMCacheEngineBuilder.get(ENGINE_NAME)
    if existing is not None:
        return WorkerEngine(existing, layout, world_size, rank)
    check_kv_events_config(config)
    connector = create_gpu_connector(vllm_config, metadata, layout)
    engine = LMCacheEngineBuilder.get_or_create(ENGINE_NAME, config, metadata, connector)
    global _status_api, _kv_events, _step_kv_events, _controller
    _step_kv_events = connector_kv_events(engine)
    _status_api = start_status_api(engine, rank)
    _kv_events = start_kv_events(engine, rank)
    _controller = start_controller_client(engine)
    close_at_exit(door)
    logger.info(
        "LMCache %s: engine ready (worker %d of %d, layout %s, chunk size %d, KV %s %s)",
        door, rank, world_size, layout.name, config.chunk_size, metadata.kv_dtype, metadata.kv_shape,
    )
    return WorkerEngine(engine, layout, world_size, rank)


def take_step_kv_events() -> List[Any]:
    """The vLLM events of what this process's tiers admitted and lost since the last call (none
    unless KV events go through vLLM's connector hook)."""
    return _step_kv_events.take() if _step_kv_events is not None else []


def report_held(name: str, count: Callable[[], Mapping[str, int]]) -> None:
    """Have this process's status API (when on) answer `count()` under `name` in `GET /held`."""
    if _status_api is not None:
        _status_api.add_held(name, count)


def close_at_exit(door: str) -> None:
    """Have this process's exit close the engine, after the closes of higher priority (the saver).

    A process's main thread runs atexit, where `Finalize` runs, only after `threading._shutdown`
    stopped every `ThreadPoolExecutor` (`concurrent.futures` hooks it): an offline v0 `LLM`'s
    engine then closed with the Mooncake connector's calls refused ("cannot schedule new futures
    after shutdown"), its queued puts lost. So the exit closes run from threading's own exit hook,
    ahead of that one (a multiprocessing child runs them before `threading._shutdown` anyway)."""
    multiprocessing.util.Finalize(
        None, close_worker_engine, args=(door, exit_close_timeout()), exitpriority=ENGINE_EXIT_PRIORITY
    )
    shield_exit_closes_from_stop_signals()
    global _exit_hooked
    if not _exit_hooked:
        _exit_hooked = True
        if not at_thread_shutdown(functools.partial(multiprocessing.util._run_finalizers, ENGINE_EXIT_PRIORITY)):
            # an engine opened while the interpreter shuts down: atexit still closes it
            logger.warning("LMCache %s: engine opened during interpreter shutdown; it closes at atexit", door)


def _ignore_stop_signals() -> None:
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)


def shield_exit_closes_from_stop_signals() -> None:
    """At exit, before any of our closes: SIGINT and SIGTERM ignored. vLLM's engine process keeps a
    SIGTERM handler that raises KeyboardInterrupt, and on Ctrl-C its API server sends SIGTERM
    while the engine process is already exiting: the interrupt cut the off-step saver's close
    short and skipped the engine's, losing pending disk writes. Exit is under way, so the signals
    have nothing left to stop; a close that hangs still yields to SIGKILL."""
    multiprocessing.util.Finalize(None, _ignore_stop_signals, exitpriority=ENGINE_EXIT_PRIORITY + 2)


def exit_close_timeout() -> Optional[float]:
    """The bound of this process's exit close: `CHILD_CLOSE_TIMEOUT_S` in a process started
    through multiprocessing (vLLM's engine core and workers), None (each tier's own) otherwise."""
    return CHILD_CLOSE_TIMEOUT_S if multiprocessing.parent_process() is not None else None


def close_worker_engine(door: str, timeout_s: Optional[float] = None) -> bool:
    """Close this process's engine, waiting for its pending writes (at most `timeout_s`; None:
    each tier's own bound); False when there is none."""
    global _status_api, _kv_events, _controller
    if _status_api is not None:
        _status_api.close()
        _status_api = None
    if LMCacheEngineBuilder.get(ENGINE_NAME) is None:
        return False
    LMCacheEngineBuilder.destroy(ENGINE_NAME, timeout_s)
    if _kv_events is not None:
        _kv_events.close()
        _kv_events = None
    if _controller is not None:
        _controller.close()
        _controller = None
    logger.info("LMCache %s: engine closed", door)
    return True
