"""The changes the wrapper makes to vLLM, in one place.

`apply_injection()` (idempotent) wraps, in the current process, the vLLM functions
`vllm_compat.WRAPPER_PATCH_POINTS` names for the running vLLM line:
- `ModelRunner.execute_model` (v0, GPU) and `CPUModelRunner.execute_model` (v0, CPU): wrapped,
  not copied. The wrapper hands the step to `lmcache.integration.vllm.vllm_adapter.
  execute_with_cache`, which retrieves and rebuilds the input, calls vLLM's own
  `execute_model` with it, and stores afterwards.
- `load_model` of the same two runners: after vLLM's own, the LMCache engine starts
  (`vllm_adapter.start_engine_for_runner`), so a bad LMCache config fails while the `LLM` or
  engine is built, not at the first request. The engine is closed when the process exits.
- the method vLLM calls exactly when it picks the v1 engine (on vLLM 0.32, which has only the v1 engine, the engine-config build): when the user gave no KV
  transfer config, ours becomes `LMCacheConnectorV1` (vLLM's built-in shell around
  `lmcache.integration.vllm.vllm_v1_adapter`). A user's own setting is left alone.
- vLLM's `LMCacheConnectorV1` shell, for `enable_async_loading`: its lookup answer carries our
  "load in the background" flag (the shell always says "not async") and our side gets the
  blocks vLLM allocated; on vLLM 0.9.2 the scheduler's "remote KV arrived" step takes a load that
  fell short as the tokens that arrived (`vllm_compat.finish_short_remote_load`), and its engine
  loop keeps stepping while a request aborted during its load holds its blocks
  (`vllm_compat.holds_delayed_frees`), so they are freed once the load stops, not at the next
  request. Connectors other than ours go through vLLM's own code.
- vLLM 0.9.2's v0 server client: its startup handshake keeps one socket across retries
  (`startup_socket`), so a server never waits forever for an engine that already answered.

vLLM runs engines and workers in processes it starts with `spawn`, where patches made here do
not exist. `apply_injection()` records the intent in an environment variable those processes
inherit; `lmcache_vllm.plugin.general_plugin` (a `vllm.general_plugins` entry point, which vLLM
loads in each of its processes) applies the same injection when it sees the mark and does
nothing otherwise, so plain `vllm` users are untouched.

`install_plugin_patches()` makes the three changes made for every vLLM user with LMCache installed,
not only the wrapper's (`vllm_compat.PLUGIN_PATCH_POINTS`; the plugin installs them in each vLLM
process):
- vLLM's engine-core call that first sees the layers' KV cache specs
  (`vllm_compat.KV_SPEC_GUARD_POINTS`) checks them first when the engine runs LMCache's connector
  (`lmcache.integration.vllm.model_support`), so a model with Mamba / linear-attention state stops
  in our words rather than vLLM's "Failed to promote local KV cache specs"; for other engines it
  only calls vLLM's own.
- vLLM's model-class inspection runs in-process on the CPU platform: vLLM inspects a model's class
  in a fresh Python process so that this one never initialises CUDA; a CPU platform has no CUDA,
  and that process (importing torch, IPEX and vLLM again) cost every engine start 6.4 s on an idle
  2-core machine and 17-22 s on a busy one. vLLM 0.32 caches the answer on disk after its first
  inspection; vLLM 0.9.2 paid it at every start. The answer is the same either way.
- vLLM 0.32's shell hands the worker's KV events to the scheduler as `BlockStored` only
  (`vllm_compat.KV_EVENTS_POINTS`); with our connector it hands over LMCache's events as they are,
  removals included (`kv_cache_events`), for vLLM's `--kv-events-config` publisher.

`quiet_telemetry_by_default()` turns the OpenTelemetry SDK off for the wrapper's processes unless
the user configured OpenTelemetry (see its docstring).

Each patch is a wrapt function wrapper (`LMCachePatch`) put on from a wrapt post-import hook on
the module that defines the function: nothing here imports a vLLM module, a module vLLM imports
later is patched as its import ends, and the original stays the wrapper's `__wrapped__`, which
makes a second application a no-op and `remove_injection()` possible. A name this vLLM lacks
fails the import of its module with an ImportError naming it.
"""

from __future__ import annotations

import contextlib
import os
import sys
from types import ModuleType
from typing import Any, Callable, Iterator, Optional, Sequence

import wrapt

from lmcache.integration.vllm.vllm_compat import (
    PLUGIN_PATCH_POINTS,
    WRAPPER_PATCH_POINTS,
    PatchPoint,
    connector_impl_of,
    finish_short_remote_load,
    holds_delayed_frees,
    kv_cache_block_ids,
    shell_kv_events,
    wrapper_kv_transfer_config,
)
from lmcache.logging import init_logger

logger = init_logger(__name__)

# Set to "1" by the wrapper; inherited by every process vLLM starts. Not `LMCACHE_`-prefixed:
# it is the wrapper's own switch, not an engine setting.
INJECT_ENV = "_LMCACHE_VLLM_INJECT"
V1_CONNECTOR = "LMCacheConnectorV1"
# The v0 server client's attribute holding its startup socket between tries (`startup_socket`).
_STARTUP_SOCKET = "_lmcache_startup_socket"


OTEL_SWITCH = "OTEL_SDK_DISABLED"
# vLLM's own flag that exports traces through OpenTelemetry.
OTLP_TRACES_FLAG = "--otlp-traces-endpoint"


def quiet_telemetry_by_default(argv: Optional[Sequence[str]] = None) -> bool:
    """Set `OTEL_SDK_DISABLED=true` unless the user configured OpenTelemetry; True if it did.

    transformers (imported by vLLM) sets up OTLP exporters to `localhost:4318` at import time
    whenever the OpenTelemetry SDK and OTLP exporter are installed, and vLLM's
    `fastapi[standard]` installs them: with no collector running, a server logs an export error
    every second or two and waits 20-35 s for the exporters to give up when stopped. Any
    `OTEL_*` variable, or vLLM's `--otlp-traces-endpoint` in `argv` (default `sys.argv`), counts
    as configuring OpenTelemetry and leaves everything as it is."""
    args = sys.argv if argv is None else argv
    if any(name.startswith("OTEL_") for name in os.environ) or any(a.startswith(OTLP_TRACES_FLAG) for a in args):
        return False
    os.environ[OTEL_SWITCH] = "true"
    logger.info(
        "lmcache_vllm: no OTEL_* variable set, so OpenTelemetry is off (%s=true); set any OTEL_* "
        "variable to configure it yourself", OTEL_SWITCH,
    )
    return True


def injection_requested() -> bool:
    return os.environ.get(INJECT_ENV) == "1"


def execute_model(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """A v0 runner's step: vLLM's own `execute_model` with LMCache around it."""
    from lmcache.integration.vllm.vllm_adapter import execute_with_cache

    def step(model_input: Any, kv_caches: Any, *rest: Any, **options: Any) -> Any:
        return execute_with_cache(
            instance, model_input, kv_caches, lambda step_input: wrapped(step_input, kv_caches, *rest, **options)
        )

    return step(*args, **kwargs)


def load_model(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """A v0 runner's `load_model` that also starts the LMCache engine once the model is loaded."""
    result = wrapped(*args, **kwargs)
    from lmcache.integration.vllm.vllm_adapter import start_engine_for_runner

    start_engine_for_runner(instance)
    return result


def inspect_model_in_process(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """vLLM's model-class inspection in this process on the CPU platform, in a subprocess elsewhere."""
    from vllm.platforms import current_platform

    def run(fn: Callable[[], Any]) -> Any:
        return fn() if current_platform.is_cpu() else wrapped(fn)

    return run(*args, **kwargs)


def use_v1_connector(engine_args: Any) -> None:
    """Give `engine_args` our v1 connector unless the user set a KV transfer config."""
    if engine_args.kv_transfer_config is None:
        engine_args.kv_transfer_config = wrapper_kv_transfer_config()
        logger.info("lmcache_vllm: v1 engine selected, using KV connector %s", V1_CONNECTOR)
    else:
        logger.info(
            "lmcache_vllm: v1 engine with the user's KV transfer config (%s) left as given",
            engine_args.kv_transfer_config.kv_connector,
        )


def set_default_args_v1(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """vLLM 0.9's v1 engine-args defaults that also turn on our v1 connector by default."""
    result = wrapped(*args, **kwargs)
    use_v1_connector(instance)
    return result


def create_engine_config(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """vLLM 0.32's engine-config build, with our v1 connector turned on before it reads it."""
    use_v1_connector(instance)
    return wrapped(*args, **kwargs)


def _our_impl(shell: Any) -> Any:
    """The `LMCacheConnectorV1Impl` inside vLLM's shell, or None (another connector)."""
    from lmcache.integration.vllm.vllm_v1_adapter import LMCacheConnectorV1Impl

    impl = connector_impl_of(shell)
    return impl if isinstance(impl, LMCacheConnectorV1Impl) else None


def async_match(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """The shell's lookup answer with our async flag instead of a constant False."""
    impl = _our_impl(instance)
    if impl is None:
        return wrapped(*args, **kwargs)

    def match(request: Any, num_computed_tokens: int) -> Any:
        return impl.match_tokens(request, num_computed_tokens)

    return match(*args, **kwargs)


def async_alloc(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """The shell's allocation callback, handing our side the allocated blocks too."""
    impl = _our_impl(instance)
    if impl is None:
        return wrapped(*args, **kwargs)

    def allocated(request: Any, blocks: Any, num_external_tokens: int) -> Any:
        return impl.update_state_after_alloc(request, num_external_tokens, kv_cache_block_ids(blocks))

    return allocated(*args, **kwargs)


def remote_kv_ready(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """vLLM 0.9.2's scheduler taking a finished background load at the tokens that arrived."""

    def ready(request: Any) -> Any:
        impl = _our_impl(instance.connector) if instance.connector is not None else None
        if impl is not None and request.request_id in instance.finished_recving_kv_req_ids:
            loaded = impl.async_loaded_tokens(request.request_id)
            if loaded is not None and finish_short_remote_load(instance, request, loaded):
                return True
        return wrapped(request)

    return ready(*args, **kwargs)


def delayed_free_steps(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """vLLM 0.9.2's scheduler counting a request whose blocks our connector still holds as a
    finished request, so the engine steps (and the worker reports the blocks free) until it is gone."""

    def has_finished_requests() -> Any:
        ours = instance.connector is not None and _our_impl(instance.connector) is not None
        return wrapped() or (ours and holds_delayed_frees(instance))

    return has_finished_requests(*args, **kwargs)


@contextlib.contextmanager
def startup_socket(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Iterator[Any]:
    """vLLM 0.9.2's v0 server client keeping one startup socket until the engine has answered.

    The server asks the engine process "ready?" on a fresh socket and, after `VLLM_RPC_TIMEOUT`
    (10 s) without an answer, closes it and asks again on a new one. The engine answers only the
    first question it receives and then stops listening for more, so when that question arrived
    just before the client gave up, the answer goes to a closed socket and the server waits
    forever with a healthy engine (a 2-core machine's engine start, ~10 s, sits right at that
    boundary). Kept across the retries, the socket receives the first answer whichever question
    it answers; it is closed once `setup` succeeds or fails for another reason.
    """
    opened = getattr(instance, _STARTUP_SOCKET, None)
    if opened is None:
        opened = wrapped(*args, **kwargs)
        socket = opened.__enter__()
        setattr(instance, _STARTUP_SOCKET, (opened, socket))
    else:
        opened, socket = opened
        logger.info("vLLM's engine process has not answered yet; still waiting for it")
    try:
        yield socket
    except TimeoutError:
        raise  # still waiting for the engine: the next try polls this socket again
    except BaseException:
        _close_startup_socket(instance)
        raise
    _close_startup_socket(instance)


def _close_startup_socket(client: Any) -> None:
    opened = getattr(client, _STARTUP_SOCKET, None)
    if opened is not None:
        setattr(client, _STARTUP_SOCKET, None)
        opened[0].__exit__(None, None, None)


def check_kv_specs_first(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """vLLM's `get_kv_cache_config(s)(vllm_config, kv_cache_specs, ...)`, after
    `model_support.check_kv_cache_specs` (which lets every engine but LMCache's through)."""
    from lmcache.integration.vllm.model_support import check_kv_cache_specs

    def guarded(vllm_config: Any, kv_cache_specs: Any, *rest: Any, **options: Any) -> Any:
        check_kv_cache_specs(vllm_config, kv_cache_specs)
        return wrapped(vllm_config, kv_cache_specs, *rest, **options)

    return guarded(*args, **kwargs)


def kv_cache_events(wrapped: Callable[..., Any], instance: Any, args: Any, kwargs: Any) -> Any:
    """The shell's worker-side KV events: ours as built (`BlockStored` and `BlockRemoved`), None
    when there are none; another connector's through vLLM's own."""
    impl = _our_impl(instance)
    if impl is None:
        return wrapped(*args, **kwargs)
    events = impl.take_kv_cache_events()
    return shell_kv_events(events) if events else None


# wrapt's wrapper signature: (vLLM's function, the instance it is bound to or None, args, kwargs).
Wrapper = Callable[[Callable[..., Any], Any, Any, Any], Any]

# What each `PatchPoint.role` puts around vLLM's function.
_WRAPPERS: dict[str, Wrapper] = {
    "v0_execute_model": execute_model,
    "v1_default_args": set_default_args_v1,
    "v0_load_model": load_model,
    "model_inspection": inspect_model_in_process,
    "v1_engine_config": create_engine_config,
    "v1_async_match": async_match,
    "v1_async_alloc": async_alloc,
    "v1_async_ready": remote_kv_ready,
    "v1_delayed_free_steps": delayed_free_steps,
    "v0_startup_socket": startup_socket,
    "kv_spec_guard": check_kv_specs_first,
    "v1_kv_events": kv_cache_events,
}


class LMCachePatch(wrapt.FunctionWrapper):
    """A vLLM function wrapped by this module: its type tells a second application, and
    `remove_injection`, which wrapper in the attribute's chain is ours."""


def is_ours(wrapper: Any) -> bool:
    return isinstance(wrapper, LMCachePatch)


def stored_function(module: ModuleType, point: PatchPoint) -> Any:
    """`point`'s attribute as stored (unbound, with any wrappers); ImportError naming it when this
    vLLM has no such name."""
    try:
        return wrapt.resolve_path(module, point.path)[2]
    except wrapt.PathResolutionError as exc:
        from vllm.version import __version__

        raise ImportError(
            f"lmcache_vllm: vLLM {__version__} has no {point} to wrap (role {point.role}, read from "
            f"vLLM {', '.join(point.lines)}); this vLLM is not one lmcache_vllm supports"
        ) from exc


def _wrap_when_imported(point: PatchPoint, wanted: Callable[[], bool]) -> None:
    """Wrap `point` once vLLM has imported its module (at once if it has), while `wanted()`, on the
    vLLM lines it applies to, unless our wrapper is in its chain already."""

    def wrap(module: ModuleType) -> None:
        if wanted() and point.applies() and not wrapt.is_wrapped_by(stored_function(module, point), predicate=is_ours):
            wrapt.wrap_object(module, point.path, LMCachePatch, (_WRAPPERS[point.role],))

    wrapt.register_post_import_hook(wrap, point.module)


def install_plugin_patches() -> None:
    """The KV spec guard, the in-process model inspection and the KV events hook (idempotent;
    see above)."""
    for point in PLUGIN_PATCH_POINTS:
        _wrap_when_imported(point, lambda: True)




def apply_injection() -> None:
    """Mark the environment and wrap `vllm_compat.WRAPPER_PATCH_POINTS` in this process (idempotent).

    A hook that fires later (vLLM imports the module then) wraps only while the environment is
    still marked: `remove_injection` withdraws the whole injection, and wrapt cannot unregister a
    hook."""
    os.environ[INJECT_ENV] = "1"
    for point in WRAPPER_PATCH_POINTS:
        _wrap_when_imported(point, injection_requested)


def remove_injection() -> None:
    """Undo `apply_injection` in this process: unmark the environment and put vLLM's own functions
    back (wrapt keeps each as the wrapper's `__wrapped__`), so the patches can be tested in-process."""
    os.environ.pop(INJECT_ENV, None)
    for point in WRAPPER_PATCH_POINTS:
        module = sys.modules.get(point.module)
        if module is None or not point.applies():
            continue
        ours = wrapt.find_wrapper(stored_function(module, point), predicate=is_ours)
        if ours is not None:
            wrapt.unwrap_object(module, point.path, ours)
