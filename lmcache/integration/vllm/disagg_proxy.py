"""The PD proxy: each OpenAI request goes to a prefiller (one token, with a `disagg_spec` naming
the decoder), then to that decoder, whose answer (streamed or not) goes back to the client.

    python -m lmcache.integration.vllm.disagg_proxy --prefiller-host H --prefiller-port P \\
        --decoder-host H --decoder-port P [--decoder-init-port N] --port N

Repeat `--prefiller-*` / `--decoder-*` for several instances: each list is round-robined. A
decoder's `--decoder-init-port` is its `pd_peer_init_port` (the port its receiver listens on;
default 7300) and `--decoder-alloc-port` its `pd_peer_alloc_port` (default: init port + 100).

Faults: a prefiller that is down, times out or fails (5xx) only costs the push (the decoder
computes the prompt itself); a prefiller's 4xx is the client's answer (the request is bad); a
prefiller that refuses the `disagg_spec` is a 502 naming it. A decoder that is down answers 503,
one that times out 504, both with a JSON body naming the instance; every hop has a bounded
connect and total timeout, so the proxy never hangs.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import uuid
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import aiohttp
from aiohttp import web

logger = logging.getLogger("lmcache.disagg_proxy")

ROUTES = ("/v1/completions", "/v1/chat/completions")
DEFAULT_INIT_PORT = 7300
ALLOC_PORT_OFFSET = 100
MAX_BODY_BYTES = 64 * 1024 * 1024
# Token-count keys a prefill request caps at 1 (completions use the first, chat either).
MAX_TOKEN_KEYS = ("max_tokens", "max_completion_tokens")


@dataclass(frozen=True)
class Instance:
    role: str  # "prefiller" / "decoder"
    host: str
    port: int
    init_port: int = 0  # decoders: the PD receiver's port
    alloc_port: int = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __str__(self) -> str:
        return f"{self.role} {self.url}"


@dataclass(frozen=True)
class ProxySettings:
    prefillers: tuple[Instance, ...]
    decoders: tuple[Instance, ...]
    connect_timeout_s: float = 5.0
    prefill_timeout_s: float = 300.0
    decode_timeout_s: float = 600.0


def disagg_spec_for(req_id: str, decoder: Instance) -> dict[str, Any]:
    return {"req_id": req_id, "receiver_host": decoder.host,
            "receiver_init_port": decoder.init_port, "receiver_alloc_port": decoder.alloc_port}


def prefill_body(body: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    """The prefiller's copy of the request: one token, not streamed, carrying the spec."""
    out = dict(body)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out.pop("stream_options", None)
    params = out.get("kv_transfer_params")
    out["kv_transfer_params"] = {**(params if isinstance(params, dict) else {}), "disagg_spec": spec}
    return out


def _error(status: int, message: str, instance: Optional[Instance] = None) -> web.Response:
    body: dict[str, Any] = {"error": {"message": message, "code": status}}
    if instance is not None:
        body["error"]["instance"] = str(instance)
    return web.json_response(body, status=status)


class DisaggProxy:
    """The aiohttp application and its one client session."""

    def __init__(self, settings: ProxySettings) -> None:
        if not settings.prefillers or not settings.decoders:
            raise ValueError("the proxy needs at least one prefiller and one decoder")
        self.settings = settings
        self._prefillers: Iterator[Instance] = itertools.cycle(settings.prefillers)
        self._decoders: Iterator[Instance] = itertools.cycle(settings.decoders)
        self._session: Optional[aiohttp.ClientSession] = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        for route in ROUTES:
            app.router.add_post(route, self.handle)
        app.router.add_get("/health", self.health)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, _app: web.Application) -> None:
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256))

    async def _stop(self, _app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    def _timeout(self, total: float) -> aiohttp.ClientTimeout:
        connect = self.settings.connect_timeout_s
        return aiohttp.ClientTimeout(total=total, connect=connect, sock_connect=connect)

    async def health(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def handle(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "the request body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object")
        prefiller, decoder = next(self._prefillers), next(self._decoders)
        req_id = f"pd-{uuid.uuid4().hex}"
        refused = await self._prefill(request.path, body, disagg_spec_for(req_id, decoder), prefiller)
        if refused is not None:
            return refused
        return await self._decode(request, body, decoder)

    async def _prefill(
        self, path: str, body: dict[str, Any], spec: dict[str, Any], prefiller: Instance
    ) -> Optional[web.Response]:
        """Run the prefill hop; a response for the client when the request cannot go on."""
        assert self._session is not None
        try:
            async with self._session.post(prefiller.url + path, json=prefill_body(body, spec),
                                          timeout=self._timeout(self.settings.prefill_timeout_s)) as resp:
                data = await resp.read()
                if 400 <= resp.status < 500:
                    return web.Response(body=data, status=resp.status, content_type="application/json")
                if resp.status >= 500:
                    logger.warning("request %s: %s answered %d; the decoder computes the prompt",
                                   spec["req_id"], prefiller, resp.status)
                    return None
        except (aiohttp.ClientError, TimeoutError) as err:
            logger.warning("request %s: %s failed (%s); the decoder computes the prompt",
                           spec["req_id"], prefiller, err or type(err).__name__)
            return None
        try:
            params = json.loads(data).get("kv_transfer_params") or {}
        except (json.JSONDecodeError, AttributeError):
            params = {}
        if isinstance(params, dict) and params.get("disagg_error"):
            return _error(502, f"the prefiller refused the disagg_spec: {params['disagg_error']}", prefiller)
        return None

    async def _decode(self, request: web.Request, body: dict[str, Any], decoder: Instance) -> web.StreamResponse:
        assert self._session is not None
        try:
            resp = await self._session.post(decoder.url + request.path, json=body,
                                            timeout=self._timeout(self.settings.decode_timeout_s))
        except TimeoutError:  # aiohttp's timeouts are TimeoutErrors (some also connection errors)
            return _error(504, "decoder did not answer in time", decoder)
        except (aiohttp.ClientConnectionError, OSError) as err:
            return _error(503, f"decoder unreachable: {err}", decoder)
        async with resp:
            content_type = resp.headers.get("Content-Type", "application/json")
            if not body.get("stream"):
                try:
                    data = await resp.read()
                except (aiohttp.ClientError, TimeoutError) as err:
                    return _error(504 if isinstance(err, TimeoutError) else 502, f"decoder failed: {err}", decoder)
                return web.Response(body=data, status=resp.status, headers={"Content-Type": content_type})
            out = web.StreamResponse(status=resp.status, headers={"Content-Type": content_type})
            await out.prepare(request)
            try:
                async for piece in resp.content.iter_any():
                    await out.write(piece)
            except (aiohttp.ClientError, TimeoutError) as err:
                logger.warning("%s: stream broken: %s", decoder, err)  # the status is already sent
            await out.write_eof()
            return out


def _instances(role: str, hosts: Sequence[str], ports: Sequence[int],
               init_ports: Sequence[int] = (), alloc_ports: Sequence[int] = ()) -> tuple[Instance, ...]:
    if len(hosts) != len(ports):
        raise ValueError(f"--{role}-host given {len(hosts)} times, --{role}-port {len(ports)} times")
    for flag, values in (("init", init_ports), ("alloc", alloc_ports)):
        if values and len(values) != len(hosts):
            raise ValueError(f"--{role}-{flag}-port given {len(values)} times for {len(hosts)} {role}s")
    out = []
    for i, (host, port) in enumerate(zip(hosts, ports)):
        init = init_ports[i] if init_ports else DEFAULT_INIT_PORT
        alloc = alloc_ports[i] if alloc_ports else init + ALLOC_PORT_OFFSET
        out.append(Instance(role, host, port, init, alloc))
    return tuple(out)


def _port(text: str) -> int:
    value = int(text)
    if not 0 < value <= 65535:
        raise argparse.ArgumentTypeError(f"{text}: not a port in 1..65535")
    return value


def parse_args(argv: Optional[Sequence[str]] = None) -> tuple[argparse.Namespace, ProxySettings]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="disagg_proxy")
    parser.add_argument("--host", default="127.0.0.1", help="address the proxy binds (default 127.0.0.1)")
    parser.add_argument("--port", type=_port, default=9000)
    parser.add_argument("--prefiller-host", action="append", required=True)
    parser.add_argument("--prefiller-port", action="append", type=_port, required=True)
    parser.add_argument("--decoder-host", action="append", required=True)
    parser.add_argument("--decoder-port", action="append", type=_port, required=True)
    parser.add_argument("--decoder-init-port", action="append", type=_port, default=[],
                        help=f"each decoder's pd_peer_init_port (default {DEFAULT_INIT_PORT})")
    parser.add_argument("--decoder-alloc-port", action="append", type=_port, default=[],
                        help="each decoder's pd_peer_alloc_port (default: its init port + 100)")
    parser.add_argument("--connect-timeout", type=float, default=5.0, help="seconds to connect to an instance")
    parser.add_argument("--prefill-timeout", type=float, default=300.0, help="seconds for a prefill answer")
    parser.add_argument("--decode-timeout", type=float, default=600.0, help="seconds for a decode answer")
    args = parser.parse_args(argv)
    try:
        settings = ProxySettings(
            prefillers=_instances("prefiller", args.prefiller_host, args.prefiller_port),
            decoders=_instances("decoder", args.decoder_host, args.decoder_port,
                                args.decoder_init_port, args.decoder_alloc_port),
            connect_timeout_s=args.connect_timeout,
            prefill_timeout_s=args.prefill_timeout,
            decode_timeout_s=args.decode_timeout,
        )
    except ValueError as err:
        parser.error(str(err))
    for name in ("connect_timeout", "prefill_timeout", "decode_timeout"):
        if not getattr(args, name) > 0:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)}: must be above 0")
    return args, settings


def main(argv: Optional[Sequence[str]] = None) -> None:
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(name)s %(levelname)s: %(message)s")
    args, settings = parse_args(argv)
    logger.info("PD proxy on %s:%d: prefillers %s, decoders %s", args.host, args.port,
                [str(p) for p in settings.prefillers], [str(d) for d in settings.decoders])
    web.run_app(DisaggProxy(settings).app(), host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
