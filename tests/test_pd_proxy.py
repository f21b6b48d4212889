"""The PD proxy as one class, against small in-process HTTP stand-ins for the instances (the
real-engine path is tests/test_pd_e2e.py): what the prefill hop sends, round robin over repeated
flags, streaming passthrough, and the error answers when an instance is down, slow or refuses."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Optional

import aiohttp
import pytest
from aiohttp import web
from redis_fixture import free_port

from lmcache.integration.vllm.disagg_proxy import DisaggProxy, Instance, ProxySettings, parse_args


class Stand:
    """An instance stand-in: records request bodies and answers from a script."""

    def __init__(self, name: str, answer: Optional[dict] = None, stream: bool = False, delay: float = 0.0,
                 status: int = 200) -> None:
        self.name, self.answer, self.stream, self.delay, self.status = name, answer, stream, delay, status
        self.bodies: list[dict] = []
        self.port = free_port()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        await asyncio.sleep(self.delay)
        if body.get("stream") and self.stream:
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            for piece in ("a", "b", "c"):
                await out.write(f"data: {json.dumps({'from': self.name, 'piece': piece})}\n\n".encode())
            await out.write(b"data: [DONE]\n\n")
            return out
        return web.json_response(self.answer or {"from": self.name}, status=self.status)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.handle)
        app.router.add_post("/v1/chat/completions", self.handle)
        return app


async def _serve(app: web.Application, port: int) -> web.AppRunner:
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


def _run(prefillers: list[Stand], decoders: list[Stand], requests: list[tuple[str, dict]],
         dead_decoder: bool = False, **timeouts: float) -> list[tuple[int, Any]]:
    async def main() -> list[tuple[int, Any]]:
        runners = [await _serve(s.app(), s.port) for s in prefillers + ([] if dead_decoder else decoders)]
        settings = ProxySettings(
            prefillers=tuple(Instance("prefiller", "127.0.0.1", s.port) for s in prefillers),
            decoders=tuple(Instance("decoder", "127.0.0.1", s.port, 7300 + i, 7400 + i) for i, s in enumerate(decoders)),
            **timeouts,
        )
        port = free_port()
        runners.append(await _serve(DisaggProxy(settings).app(), port))
        results = []
        try:
            async with aiohttp.ClientSession() as session:
                for path, body in requests:
                    async with session.post(f"http://127.0.0.1:{port}{path}", json=body) as resp:
                        text = await resp.text()
                        results.append((resp.status, text if body.get("stream") else json.loads(text)))
        finally:
            for runner in runners:
                await runner.cleanup()
        return results

    return asyncio.run(main())


def test_prefill_hop_sends_one_token_and_the_spec_then_the_decoder_gets_the_request() -> None:
    prefiller, decoder = Stand("p"), Stand("d")
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 9, "stream": False, "stream_options": {"x": 1},
            "kv_transfer_params": {"lmcache.skip_save": False}}
    [(status, reply)] = _run([prefiller], [decoder], [("/v1/completions", body)])
    assert status == 200 and reply == {"from": "d"}
    [sent] = prefiller.bodies
    assert sent["max_tokens"] == 1 and sent["stream"] is False and "stream_options" not in sent
    spec = sent["kv_transfer_params"]["disagg_spec"]
    assert spec["receiver_host"] == "127.0.0.1" and spec["receiver_init_port"] == 7300
    assert spec["receiver_alloc_port"] == 7400 and spec["req_id"].startswith("pd-")
    assert sent["kv_transfer_params"]["lmcache.skip_save"] is False
    assert decoder.bodies == [body]


def test_round_robin_over_several_prefillers_and_decoders() -> None:
    prefillers, decoders = [Stand("p0"), Stand("p1")], [Stand("d0"), Stand("d1"), Stand("d2")]
    results = _run(prefillers, decoders, [("/v1/completions", {"prompt": "x"})] * 6)
    assert [r[1]["from"] for r in results] == ["d0", "d1", "d2", "d0", "d1", "d2"]
    assert [len(p.bodies) for p in prefillers] == [3, 3]
    ports = [b["kv_transfer_params"]["disagg_spec"]["receiver_init_port"] for b in prefillers[0].bodies]
    assert ports == [7300, 7302, 7301]


def test_chat_stream_passes_through_from_the_decoder() -> None:
    prefiller, decoder = Stand("p"), Stand("d", stream=True)
    [(status, text)] = _run([prefiller], [decoder], [("/v1/chat/completions", {"messages": [], "stream": True})])
    assert status == 200 and text.count('"from": "d"') == 3 and text.endswith("data: [DONE]\n\n")
    assert prefiller.bodies[0]["stream"] is False and prefiller.bodies[0]["max_tokens"] == 1


def test_decoder_down_is_503_naming_it() -> None:
    [(status, reply)] = _run([Stand("p")], [Stand("d")], [("/v1/completions", {"prompt": "x"})], dead_decoder=True)
    assert status == 503 and reply["error"]["instance"].startswith("decoder http://127.0.0.1:")


def test_slow_decoder_is_504() -> None:
    [(status, reply)] = _run([Stand("p")], [Stand("d", delay=3)], [("/v1/completions", {"prompt": "x"})],
                             decode_timeout_s=0.5)
    assert status == 504 and "decoder" in reply["error"]["instance"]


def test_prefiller_failure_only_costs_the_push_but_its_4xx_and_spec_refusal_are_answers() -> None:
    results = _run([Stand("p", status=500)], [Stand("d")], [("/v1/completions", {"prompt": "x"})])
    assert results == [(200, {"from": "d"})]
    results = _run([Stand("p", delay=3)], [Stand("d")], [("/v1/completions", {"prompt": "x"})], prefill_timeout_s=0.5)
    assert results == [(200, {"from": "d"})]
    bad = {"object": "error", "message": "prompt too long"}
    assert _run([Stand("p", answer=bad, status=400)], [Stand("d")], [("/v1/completions", {"prompt": "x"})]) == [
        (400, bad)
    ]
    refused = {"kv_transfer_params": {"disagg_error": "disagg_spec['receiver_host']='h' is not this prefiller's peer"}}
    [(status, reply)] = _run([Stand("p", answer=refused)], [Stand("d")], [("/v1/completions", {"prompt": "x"})])
    assert status == 502 and "receiver_host" in reply["error"]["message"] and "prefiller" in reply["error"]["instance"]


def test_not_json_is_400() -> None:
    async def main() -> int:
        settings = ProxySettings((Instance("prefiller", "127.0.0.1", 1),), (Instance("decoder", "127.0.0.1", 2),))
        port = free_port()
        runner = await _serve(DisaggProxy(settings).app(), port)
        try:
            async with aiohttp.ClientSession() as session:
                async with session.post(f"http://127.0.0.1:{port}/v1/completions", data=b"{nope") as resp:
                    return resp.status
        finally:
            await runner.cleanup()

    assert asyncio.run(main()) == 400


@pytest.mark.parametrize("argv,message", [
    (["--prefiller-host", "a", "--prefiller-port", "1", "--prefiller-port", "2",
      "--decoder-host", "b", "--decoder-port", "3"], "--prefiller-host given 1 times"),
    (["--prefiller-host", "a", "--prefiller-port", "1", "--decoder-host", "b", "--decoder-port", "3",
      "--decoder-init-port", "7", "--decoder-init-port", "8"], "--decoder-init-port given 2 times"),
    (["--prefiller-host", "a", "--prefiller-port", "70000", "--decoder-host", "b", "--decoder-port", "3"],
     "70000"),
    (["--prefiller-host", "a", "--prefiller-port", "1", "--decoder-host", "b", "--decoder-port", "3",
      "--decode-timeout", "0"], "--decode-timeout"),
])
def test_bad_flags_are_named(argv: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


def test_repeated_flags_pair_up() -> None:
    _, settings = parse_args(["--prefiller-host", "a", "--prefiller-port", "1", "--prefiller-host", "b",
                              "--prefiller-port", "2", "--decoder-host", "c", "--decoder-port", "3"])
    assert [(p.host, p.port) for p in settings.prefillers] == [("a", 1), ("b", 2)]
    assert [(d.init_port, d.alloc_port) for d in settings.decoders] == [(7300, 7400)]
