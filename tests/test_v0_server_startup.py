"""vLLM 0.9.2's v0 server handshake with its engine process, with and without the wrapper's fix.

vLLM's own client (`MQLLMEngineClient.setup`) and engine (`MQLLMEngine.run_startup_loop`) talk
over a real ZeroMQ IPC socket; the engine answers the first "ready?" only after the client's
timeout has passed, as when the engine process finishes starting just as the client gives up
on its first question. vLLM alone then waits forever; with the wrapper's injection
(`vllm_injection.startup_socket`) the retry receives the answer. The timeout is shortened from vLLM's 10 s to keep the test short.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
import wrapt
import zmq
import zmq.asyncio
from vllm.engine.multiprocessing import IPC_DATA_EXT, client, engine
from wrapper_patches import injected

from lmcache_vllm.vllm_injection import is_ours

TIMEOUT_MS = 300
TRIES = 4


class SlowToAnswer:
    """The engine's one call while answering: slower than the client's timeout."""

    def is_tracing_enabled(self) -> bool:
        time.sleep(2 * TIMEOUT_MS / 1000)
        return False


def start_engine_side(ipc_path: str) -> threading.Thread:
    server = engine.MQLLMEngine.__new__(engine.MQLLMEngine)
    server.ctx = zmq.Context()
    server.data_ipc_path = f"{ipc_path}{IPC_DATA_EXT}"
    server.engine = SlowToAnswer()

    def run() -> None:
        try:
            server.run_startup_loop()
        finally:
            server.ctx.destroy(linger=0)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


async def tries_until_ready(ipc_path: str) -> int:
    """What vLLM's server does (`build_async_engine_client_from_engine_args`): `setup()` until
    it returns, at most TRIES times here; how many it took (0: never answered)."""
    frontend = client.MQLLMEngineClient.__new__(client.MQLLMEngineClient)
    frontend.context = zmq.asyncio.Context()
    frontend.data_ipc_path = f"{ipc_path}{IPC_DATA_EXT}"
    frontend.output_loop = frontend.health_loop = object()  # not started here
    try:
        for attempt in range(1, TRIES + 1):
            try:
                await frontend.setup()
                return attempt
            except TimeoutError:
                continue
        return 0
    finally:
        frontend.context.destroy(linger=0)


@pytest.fixture
def short_rpc_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client, "VLLM_RPC_TIMEOUT", TIMEOUT_MS)


@pytest.fixture
def ipc_path(tmp_path: Any) -> str:
    return f"ipc://{tmp_path}/engine"


def test_vllm_alone_never_hears_an_answer_given_to_a_closed_socket(short_rpc_timeout, ipc_path):
    thread = start_engine_side(ipc_path)
    assert asyncio.run(tries_until_ready(ipc_path)) == 0
    thread.join(timeout=5)
    assert not thread.is_alive()  # the engine answered once and stopped listening


def test_the_wrapper_keeps_the_socket_so_the_retry_hears_the_first_answer(short_rpc_timeout, ipc_path):
    with injected():
        assert wrapt.is_wrapped_by(vars(client.MQLLMEngineClient)["get_data_socket"], predicate=is_ours)
        thread = start_engine_side(ipc_path)
        # A later try hears the answer the engine gave to the first (the 2nd on a quiet machine;
        # a busy one can answer after the 2nd timeout too).
        assert asyncio.run(tries_until_ready(ipc_path)) >= 2
    thread.join(timeout=5)


def test_the_wrapper_answers_on_the_first_try_when_the_engine_is_quick(short_rpc_timeout, ipc_path, monkeypatch):
    monkeypatch.setattr(SlowToAnswer, "is_tracing_enabled", lambda self: False)
    thread = start_engine_side(ipc_path)
    with injected():
        assert asyncio.run(tries_until_ready(ipc_path)) == 1
    thread.join(timeout=5)


def test_the_startup_socket_is_closed_once_setup_is_done(short_rpc_timeout, ipc_path, monkeypatch):
    opened: list = []
    original = client.MQLLMEngineClient.get_data_socket

    def recording(self: Any) -> Any:
        cm = original(self)
        opened.append(cm)
        return cm

    monkeypatch.setattr(client.MQLLMEngineClient, "get_data_socket", recording)
    thread = start_engine_side(ipc_path)
    with injected():
        assert asyncio.run(tries_until_ready(ipc_path)) >= 2
    thread.join(timeout=5)
    assert vars(client.MQLLMEngineClient)["get_data_socket"] is recording  # the injection came off
    assert len(opened) == 1  # one socket for every try
    assert opened[0].gen.gi_frame is None  # vLLM's context manager ran to its end: socket closed
