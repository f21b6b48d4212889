"""`LMCacheConnectorV1Impl`: what vLLM's own `LMCacheConnectorV1` shell builds and calls (vLLM
0.9.2, and vLLM 0.32 in its default, non-native mode).

vLLM builds one per role: `SCHEDULER` (in the engine core, next to the scheduler) and `WORKER`
(in each worker). This class only routes: scheduler calls go to `LMCacheSchedulerSide`, worker
calls to `LMCacheWorkerSide` (see `lmcache/integration/vllm/v1/`).

The scheduler side finds the worker side in its own process when there is one (vLLM's `uni`
executor runs the only worker inside the engine core); otherwise it connects to the channel
worker rank 0 serves on this host.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Sequence

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from lmcache.integration.vllm.utils import extra_config_of, lmcache_get_config
from lmcache.integration.vllm.blend.plan import BlendScheduler
from lmcache.integration.vllm.v1.request_policy import DoorSettings
from lmcache.integration.vllm.v1.request_state import LMCacheConnectorMetadata
from lmcache.integration.vllm.v1.scheduler_side import LMCacheSchedulerSide
from lmcache.integration.vllm.v1.worker_channel import (
    ChannelError,
    InProcessChannel,
    SocketChannel,
    WorkerChannel,
    channel_socket_path,
)
from lmcache.integration.vllm.v1.worker_side import IN_PROCESS_EXECUTORS, LMCacheWorkerSide
from lmcache.integration.vllm.vllm_compat import connector_impl_of, load_failure_policy, step_connector_metadata
from lmcache.integration.vllm.worker_engine import report_held, take_step_kv_events
from lmcache.logging import init_logger

if TYPE_CHECKING:
    import torch
    from vllm.attention.backends.abstract import AttentionMetadata
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)


def in_process_worker_side() -> Optional[LMCacheWorkerSide]:
    """The worker side of this process, found through vLLM's own KV-transfer group (or None)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return None
    impl = connector_impl_of(get_kv_transfer_group())
    if isinstance(impl, LMCacheConnectorV1Impl):
        return impl.worker_side
    return None


def connect_worker_channel(vllm_config: "VllmConfig") -> WorkerChannel:
    """In-process calls when the worker lives here, else the socket worker rank 0 serves."""
    worker = in_process_worker_side()
    if worker is not None:
        return InProcessChannel(worker)
    backend = vllm_config.parallel_config.distributed_executor_backend
    if backend in IN_PROCESS_EXECUTORS:
        raise ChannelError(
            f"distributed_executor_backend={backend!r} runs the worker in this process, but no LMCache "
            "worker side was created here (is kv_transfer_config's kv_connector LMCacheConnectorV1?)"
        )
    return SocketChannel(channel_socket_path(vllm_config))


class LMCacheConnectorV1Impl:
    """Routes vLLM's `KVConnectorBase_V1` calls to the side for this object's role."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, parent: "KVConnectorBase_V1") -> None:
        self._parent = parent
        self.role = role
        config = lmcache_get_config(extra_config_of(vllm_config))
        settings = DoorSettings.from_vllm(vllm_config, config)  # checks the door's own keys in both roles
        if load_failure_policy(vllm_config) == "fail":
            logger.warning(
                "kv_transfer_config.kv_load_failure_policy is 'fail': a request whose LMCache load comes back "
                "short (a chunk evicted or a tier unreadable since the lookup) fails instead of recomputing; "
                "set it to 'recompute' to serve it anyway"
            )
        self.scheduler_side: Optional[LMCacheSchedulerSide] = None
        self.worker_side: Optional[LMCacheWorkerSide] = None
        if role == KVConnectorRole.SCHEDULER:
            blend = BlendScheduler.from_config(vllm_config, config)
            self.scheduler_side = LMCacheSchedulerSide(settings, connect_worker_channel(vllm_config), blend)
            report_held("v1 scheduler", self.scheduler_side.held)  # where the worker's engine runs here
        else:
            self.worker_side = LMCacheWorkerSide.from_vllm_config(vllm_config, config)

    def _worker(self, call: str) -> LMCacheWorkerSide:
        if self.worker_side is None:
            raise RuntimeError(f"{call} is a worker-side call; this LMCache connector has role {self.role.name}")
        return self.worker_side

    def _scheduler(self, call: str) -> LMCacheSchedulerSide:
        if self.scheduler_side is None:
            raise RuntimeError(f"{call} is a scheduler-side call; this LMCache connector has role {self.role.name}")
        return self.scheduler_side

    # ----- worker side -----------------------------------------------------------------------------

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        """vLLM 0.32 binds each step's metadata before the forward pass and calls `start_load_kv`
        after it on steps without synchronous loads, so this is the step's last hook before vLLM
        writes its KV cache (vLLM 0.9.2 does not call it; its `start_load_kv` precedes the forward)."""
        self._worker("bind_connector_metadata").bind_step()

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        self._worker("start_load_kv").start_load_kv(step_connector_metadata(self._parent), forward_context)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Layer-wise: the next layer's load is in; otherwise loads finished in `start_load_kv`."""
        self._worker("wait_for_layer_load").wait_for_layer_load()

    def save_kv_layer(
        self, layer_name: str, kv_layer: "torch.Tensor", attn_metadata: "AttentionMetadata", **kwargs: Any
    ) -> None:
        """Layer-wise: copy out the layer just computed; otherwise stores happen in `wait_for_save`."""
        self._worker("save_kv_layer").save_kv_layer(step_connector_metadata(self._parent))

    def wait_for_save(self) -> None:
        self._worker("wait_for_save").wait_for_save(step_connector_metadata(self._parent))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[Optional[set[str]], Optional[set[str]]]:
        return self._worker("get_finished").get_finished(finished_req_ids)

    def register_kv_caches(self, kv_caches: dict[str, "torch.Tensor"]) -> None:
        """vLLM 0.3x hands over `{layer name: KV cache}` once the caches are allocated."""
        self._worker("register_kv_caches").register_kv_caches(kv_caches)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """vLLM 0.3x: blocks promised by this step's loads but not filled (vLLM recomputes them)."""
        return self._worker("get_block_ids_with_load_errors").get_block_ids_with_load_errors()

    def get_kv_events(self) -> list[Any]:
        """vLLM 0.3x's shell asks every step and turns the answer into `BlockStored` only; our events,
        removals included, reach vLLM through `take_kv_cache_events` instead (the shell's
        `get_kv_connector_kv_cache_events`, patched by `lmcache_vllm`), so this answers none."""
        return []

    def take_kv_cache_events(self) -> list[Any]:
        """vLLM events of what this worker's tiers admitted and lost since the last step."""
        self._worker("take_kv_cache_events")
        return take_step_kv_events()

    # ----- scheduler side --------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> int:
        return self._scheduler("get_num_new_matched_tokens").get_num_new_matched_tokens(request, num_computed_tokens)

    def match_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        """`(tokens, load in the background)`: what the wrapper's patched shell answers vLLM."""
        return self._scheduler("match_tokens").match_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: "Request", num_external_tokens: int, block_ids: Optional[Sequence[Sequence[int]]] = None
    ) -> None:
        self._scheduler("update_state_after_alloc").update_state_after_alloc(request, num_external_tokens, block_ids)

    def async_loaded_tokens(self, req_id: str) -> Optional[int]:
        """Leading tokens a finished background load left in the request's blocks (None: unknown)."""
        return self._scheduler("async_loaded_tokens").async_loaded_tokens(req_id)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> LMCacheConnectorMetadata:
        return self._scheduler("build_connector_meta").build_connector_meta(scheduler_output)

    def request_finished(self, request: "Request", block_ids: Sequence[int]) -> tuple[bool, Optional[dict[str, Any]]]:
        return self._scheduler("request_finished").request_finished(request, block_ids)
