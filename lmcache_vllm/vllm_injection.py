"""The changes the wrapper makes to vLLM, in one place.

`apply_injection()` (idempotent) patches, in the current process:
- `ModelRunner.execute_model` (v0, GPU) and `CPUModelRunner.execute_model` (v0, CPU): wrapped,
  not copied. The wrapper hands the step to `lmcache.integration.vllm.vllm_adapter.
  execute_with_cache`, which retrieves and rebuilds the input, calls vLLM's own
  `execute_model` with it, and stores afterwards.
- `load_model` of the same two runners: after vLLM's own, the LMCache engine starts
  (`vllm_adapter.start_engine_for_runner`), so a bad LMCache config fails while the `LLM` or
  engine is built, not at the first request. The engine is closed when the process exits.
- vLLM's model-class inspection (`vllm_compat.wrapper_patch_points`), on the CPU platform only:
  vLLM inspects a model's class in a fresh Python process so that this one never initialises
  CUDA; a CPU platform has no CUDA, and that process (importing torch and vLLM again) took
  17-22 s of every server start on a 2-core machine.
- the method vLLM calls exactly when it picks the v1 engine (`vllm_compat.wrapper_patch_points`;
  on vLLM 0.32, which has only the v1 engine, the engine-config build): when the user gave no KV
  transfer config, ours becomes `LMCacheConnectorV1` (vLLM's built-in shell around
  `lmcache.integration.vllm.vllm_v1_adapter`). A user's own setting is left alone.
- vLLM's `LMCacheConnectorV1` shell, for `enable_async_loading`: its lookup answer carries our
  "load in the background" flag (the shell always says "not async") and our side gets the
  blocks vLLM allocated; on vLLM 0.9.2 the scheduler's "remote KV arrived" step takes a load that
  fell short as the tokens that arrived (`vllm_compat.finish_short_remote_load`). Connectors
  other than ours go through vLLM's own code.
- vLLM 0.9.2's v0 server client: its startup handshake keeps one socket across retries
  (`wrap_startup_socket`), so a server never waits forever for an engine that already answered.

vLLM runs engines and workers in processes it starts with `spawn`, where patches made here do
not exist. `mark_environment()` records the intent in an environment variable those processes
inherit; `lmcache_vllm.plugin.general_plugin` (a `vllm.general_plugins` entry point, which vLLM
loads in each of its processes) applies the same injection when it sees the mark and does
nothing otherwise, so plain `vllm` users are untouched.

`install_kv_spec_guard()` is the one change made for every vLLM user with LMCache installed, not
only the wrapper's: vLLM's engine-core call that first sees the layers' KV cache specs
(`vllm_compat.kv_spec_guard_point`) checks them first when the engine runs LMCache's connector
(`lmcache.integration.vllm.model_support`), so a model with Mamba / linear-attention state stops in
our words rather than vLLM's "Failed to promote local KV cache specs"; for other engines it only
calls vLLM's own. The plugin installs it in each vLLM process.

`quiet_telemetry_by_default()` turns the OpenTelemetry SDK off for the wrapper's processes unless
the user configured OpenTelemetry (see its docstring).

This module imports vLLM only inside `apply_injection`.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import types
from typing import Any, Callable, Iterator, Optional, Sequence

from lmcache.logging import init_logger

logger = init_logger(__name__)

# Set to "1" by the wrapper; inherited by every process vLLM starts. Not `LMCACHE_`-prefixed:
# it is the wrapper's own switch, not an engine setting.
INJECT_ENV = "_LMCACHE_VLLM_INJECT"
V1_CONNECTOR = "LMCacheConnectorV1"
# Marks functions this module produced, so a second `apply_injection` changes nothing.
_WRAPPED_MARK = "__lmcache_wrapped__"
# The v0 server client's attribute holding its startup socket between tries (`wrap_startup_socket`).
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


def mark_environment() -> None:
    """Ask every vLLM process started from here on to apply the injection."""
    os.environ[INJECT_ENV] = "1"


def injection_requested() -> bool:
    return os.environ.get(INJECT_ENV) == "1"


def is_wrapped(func: Any) -> bool:
    return bool(getattr(func, _WRAPPED_MARK, False))


def wrap_execute_model(original: Callable[..., Any]) -> Callable[..., Any]:
    """`execute_model` that runs vLLM's own one with LMCache around it."""

    @functools.wraps(original)
    def execute_model(self: Any, model_input: Any, kv_caches: Any, *args: Any, **kwargs: Any) -> Any:
        from lmcache.integration.vllm.vllm_adapter import execute_with_cache

        return execute_with_cache(
            self, model_input, kv_caches, lambda step_input: original(self, step_input, kv_caches, *args, **kwargs)
        )

    setattr(execute_model, _WRAPPED_MARK, True)
    return execute_model


def wrap_load_model(original: Callable[..., Any]) -> Callable[..., Any]:
    """A v0 runner's `load_model` that also starts the LMCache engine once the model is loaded."""

    @functools.wraps(original)
    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        from lmcache.integration.vllm.vllm_adapter import start_engine_for_runner

        start_engine_for_runner(self)
        return result

    setattr(load_model, _WRAPPED_MARK, True)
    return load_model


def wrap_run_in_subprocess(original: Callable[..., Any]) -> Callable[..., Any]:
    """vLLM's model-class inspection in this process on the CPU platform, in a subprocess elsewhere."""

    @functools.wraps(original)
    def _run_in_subprocess(fn: Callable[[], Any]) -> Any:
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            return fn()
        return original(fn)

    setattr(_run_in_subprocess, _WRAPPED_MARK, True)
    return _run_in_subprocess


def use_v1_connector(engine_args: Any) -> None:
    """Give `engine_args` our v1 connector unless the user set a KV transfer config."""
    if engine_args.kv_transfer_config is None:
        from lmcache.integration.vllm.vllm_compat import wrapper_kv_transfer_config

        engine_args.kv_transfer_config = wrapper_kv_transfer_config()
        logger.info("lmcache_vllm: v1 engine selected, using KV connector %s", V1_CONNECTOR)
    else:
        logger.info(
            "lmcache_vllm: v1 engine with the user's KV transfer config (%s) left as given",
            engine_args.kv_transfer_config.kv_connector,
        )


def wrap_set_default_args_v1(original: Callable[..., Any]) -> Callable[..., Any]:
    """vLLM 0.9's v1 engine-args defaults that also turn on our v1 connector by default."""

    @functools.wraps(original)
    def _set_default_args_v1(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        use_v1_connector(self)
        return result

    setattr(_set_default_args_v1, _WRAPPED_MARK, True)
    return _set_default_args_v1


def wrap_create_engine_config(original: Callable[..., Any]) -> Callable[..., Any]:
    """vLLM 0.32's engine-config build, with our v1 connector turned on before it reads it."""

    @functools.wraps(original)
    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        use_v1_connector(self)
        return original(self, *args, **kwargs)

    setattr(create_engine_config, _WRAPPED_MARK, True)
    return create_engine_config


def _our_impl(shell: Any) -> Any:
    """The `LMCacheConnectorV1Impl` inside vLLM's shell, or None (another connector)."""
    from lmcache.integration.vllm.vllm_compat import connector_impl_of
    from lmcache.integration.vllm.vllm_v1_adapter import LMCacheConnectorV1Impl

    impl = connector_impl_of(shell)
    return impl if isinstance(impl, LMCacheConnectorV1Impl) else None


def wrap_async_match(original: Callable[..., Any]) -> Callable[..., Any]:
    """The shell's lookup answer with our async flag instead of a constant False."""

    @functools.wraps(original)
    def get_num_new_matched_tokens(self: Any, request: Any, num_computed_tokens: int) -> Any:
        impl = _our_impl(self)
        if impl is None:
            return original(self, request, num_computed_tokens)
        return impl.match_tokens(request, num_computed_tokens)

    setattr(get_num_new_matched_tokens, _WRAPPED_MARK, True)
    return get_num_new_matched_tokens


def wrap_async_alloc(original: Callable[..., Any]) -> Callable[..., Any]:
    """The shell's allocation callback, handing our side the allocated blocks too."""

    @functools.wraps(original)
    def update_state_after_alloc(self: Any, request: Any, blocks: Any, num_external_tokens: int) -> Any:
        from lmcache.integration.vllm.vllm_compat import kv_cache_block_ids

        impl = _our_impl(self)
        if impl is None:
            return original(self, request, blocks, num_external_tokens)
        return impl.update_state_after_alloc(request, num_external_tokens, kv_cache_block_ids(blocks))

    setattr(update_state_after_alloc, _WRAPPED_MARK, True)
    return update_state_after_alloc


def wrap_remote_kv_ready(original: Callable[..., Any]) -> Callable[..., Any]:
    """vLLM 0.9.2's scheduler taking a finished background load at the tokens that arrived."""

    @functools.wraps(original)
    def _update_waiting_for_remote_kv(self: Any, request: Any) -> Any:
        from lmcache.integration.vllm.vllm_compat import finish_short_remote_load

        impl = _our_impl(self.connector) if self.connector is not None else None
        if impl is not None and request.request_id in self.finished_recving_kv_req_ids:
            loaded = impl.async_loaded_tokens(request.request_id)
            if loaded is not None and finish_short_remote_load(self, request, loaded):
                return True
        return original(self, request)

    setattr(_update_waiting_for_remote_kv, _WRAPPED_MARK, True)
    return _update_waiting_for_remote_kv


def wrap_startup_socket(original: Callable[..., Any]) -> Callable[..., Any]:
    """vLLM 0.9.2's v0 server client keeping one startup socket until the engine has answered.

    The server asks the engine process "ready?" on a fresh socket and, after `VLLM_RPC_TIMEOUT`
    (10 s) without an answer, closes it and asks again on a new one. The engine answers only the
    first question it receives and then stops listening for more, so when that question arrived
    just before the client gave up, the answer goes to a closed socket and the server waits
    forever with a healthy engine (a 2-core machine's engine start, ~10 s, sits right at that
    boundary). Kept across the retries, the socket receives the first answer whichever question
    it answers; it is closed once `setup` succeeds or fails for another reason.
    """

    @functools.wraps(original)
    @contextlib.contextmanager
    def get_data_socket(self: Any) -> Iterator[Any]:
        opened = getattr(self, _STARTUP_SOCKET, None)
        if opened is None:
            opened = original(self)
            socket = opened.__enter__()
            setattr(self, _STARTUP_SOCKET, (opened, socket))
        else:
            opened, socket = opened
            logger.info("vLLM's engine process has not answered yet; still waiting for it")
        try:
            yield socket
        except TimeoutError:
            raise  # still waiting for the engine: the next try polls this socket again
        except BaseException:
            _close_startup_socket(self)
            raise
        _close_startup_socket(self)

    setattr(get_data_socket, _WRAPPED_MARK, True)
    return get_data_socket


def _close_startup_socket(client: Any) -> None:
    opened = getattr(client, _STARTUP_SOCKET, None)
    if opened is not None:
        setattr(client, _STARTUP_SOCKET, None)
        opened[0].__exit__(None, None, None)


_WRAPPERS: dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]] = {
    "v0_execute_model": wrap_execute_model,
    "v1_default_args": wrap_set_default_args_v1,
    "v0_load_model": wrap_load_model,
    "model_inspection": wrap_run_in_subprocess,
    "v1_engine_config": wrap_create_engine_config,
    "v1_async_match": wrap_async_match,
    "v1_async_alloc": wrap_async_alloc,
    "v1_async_ready": wrap_remote_kv_ready,
    "v0_startup_socket": wrap_startup_socket,
}


def _patch(owner: Any, name: str, wrapper: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Wrap `owner.name` (a class's, defined there or inherited, or a module's); the wrapper is
    set on `owner` only."""
    current = getattr(owner, name, None)
    if current is None:
        where = owner.__name__ if isinstance(owner, types.ModuleType) else f"{owner.__module__}.{owner.__qualname__}"
        raise ImportError(f"lmcache_vllm: vLLM has no {where}.{name} to wrap")
    if not is_wrapped(current):
        setattr(owner, name, wrapper(current))


def install_kv_spec_guard() -> None:
    """Check the KV cache specs before vLLM builds caches for them (idempotent; see above)."""
    from lmcache.integration.vllm.model_support import guard_kv_cache_specs
    from lmcache.integration.vllm.vllm_compat import kv_spec_guard_point

    point = kv_spec_guard_point()
    if point is None:  # no engine core is built in this process
        return

    def marked(original: Callable[..., Any]) -> Callable[..., Any]:
        guarded = guard_kv_cache_specs(original)
        setattr(guarded, _WRAPPED_MARK, True)
        return guarded

    _patch(point.owner, point.name, marked)


def apply_injection() -> None:
    """Patch vLLM in this process (idempotent); which methods is `vllm_compat`'s to say."""
    from lmcache.integration.vllm.vllm_compat import wrapper_patch_points

    for point in wrapper_patch_points():
        _patch(point.owner, point.name, _WRAPPERS[point.role])
