"""A round-robin HTTP proxy in front of N OpenAI-compatible servers, for the multi-instance benchmark.

    .venv/bin/python scripts/bench/round_robin_proxy.py --port 9000 http://127.0.0.1:8001 http://127.0.0.1:8002
    # routed by an lmcache_controller's /lookup (backend i is the instance named i-th):
    .venv/bin/python scripts/bench/round_robin_proxy.py --port 9000 --controller-url http://127.0.0.1:9001 \
        --instance-ids vllm-0,vllm-1 --tokenizer MODEL_DIR http://127.0.0.1:8001 http://127.0.0.1:8002

Every POST to `/v1/...` goes to the next backend in turn (request k to backend k mod N), whatever
it asks for: a user's next turn lands on another instance unless the turns in between add up to a
multiple of N, which is the load the node pool is for. With a `router` (`kv_aware_router.py`) a
request goes where the router says, and round robin is what the router falls back to. The answer
is streamed through chunk by chunk as it arrives (server-sent events pass unchanged, so a
client's TTFT is the backend's plus one local hop), with `X-Served-By: <backend index>` added so
the benchmark can tell where each request ran. `GET /health` answers 200 once every backend's `/health` does.

Bounded: at most `max_in_flight` requests are forwarded at once (more wait their turn, no longer
than `queue_timeout_s`, then get 503), the client session holds at most that many connections,
each backend request has a connect timeout and a read timeout between chunks, and a body larger
than `max_body_bytes` is refused with 413.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import threading
from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Sequence

import aiohttp
from aiohttp import web

from bench_serving_client import SERVED_BY_HEADER
from kv_aware_router import DEFAULT_THRESHOLD, KvAwareRouter
# Request headers passed on to the backend (the rest are hop-by-hop or aiohttp's own business).
FORWARDED_HEADERS = ("Content-Type", "Accept", "Authorization", "X-Request-Id")
# Answer headers not copied back (the proxy frames its own answer).
HOP_HEADERS = frozenset(h.lower() for h in ("Content-Length", "Transfer-Encoding", "Connection", "Keep-Alive",
                                            "Content-Encoding", "Date", "Server"))


ROUTED_KEPT = 100_000


class Router(Protocol):
    """Picks a request's backend; `fallback()` is the proxy's round robin."""

    async def choose(self, session: aiohttp.ClientSession, body: bytes, fallback: Callable[[], int]) -> int: ...


@dataclass(frozen=True)
class ProxyLimits:
    """How much the proxy takes on at once and how long it waits."""

    max_in_flight: int = 64  # requests forwarded at once (and connections to the backends)
    queue_timeout_s: float = 60.0  # how long a request may wait for a slot before 503
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 900.0  # between two chunks of a backend's answer (a long prefill)
    max_body_bytes: int = 64 << 20


class RoundRobinProxy:
    """The proxy's routing and forwarding; `start`/`stop` run it on the current event loop."""

    def __init__(self, backends: Sequence[str], limits: ProxyLimits = ProxyLimits(),
                 router: Optional[Router] = None) -> None:
        if not backends:
            raise ValueError("round_robin_proxy: no backends")
        self.backends = [b.rstrip("/") for b in backends]
        self.limits = limits
        self.router = router
        # The backend index of each forwarded request, in order: the latest ROUTED_KEPT (a proxy
        # run from the command line serves for as long as it is left running).
        self.routed: collections.deque[int] = collections.deque(maxlen=ROUTED_KEPT)
        self._turn = itertools.cycle(range(len(self.backends)))
        self._slots: Optional[asyncio.Semaphore] = None
        self._session: Optional[aiohttp.ClientSession] = None
        self._runner: Optional[web.AppRunner] = None
        self.port: Optional[int] = None

    def next_backend(self) -> int:
        """The next backend in turn."""
        return next(self._turn)

    async def choose_backend(self, body: bytes) -> int:
        assert self._session is not None
        if self.router is None:
            index = self.next_backend()
        else:
            index = await self.router.choose(self._session, body, self.next_backend)
        self.routed.append(index)
        return index

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Listen on `host`:`port` (0: any free port); return the port."""
        self._slots = asyncio.Semaphore(self.limits.max_in_flight)
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=self.limits.max_in_flight),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.limits.connect_timeout_s,
                                          sock_read=self.limits.read_timeout_s),
            auto_decompress=False,
        )
        app = web.Application(client_max_size=self.limits.max_body_bytes)
        app.router.add_get("/health", self._health)
        app.router.add_post("/v1/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def _health(self, request: web.Request) -> web.Response:
        assert self._session is not None
        for url in self.backends:
            try:
                async with self._session.get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=5)) as resp:
                    if resp.status != 200:
                        return web.Response(status=503, text=f"{url}: HTTP {resp.status}")
            except (aiohttp.ClientError, asyncio.TimeoutError) as err:
                return web.Response(status=503, text=f"{url}: {type(err).__name__}")
        return web.Response(text="ok")

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None and self._slots is not None
        body = await request.read()
        try:
            await asyncio.wait_for(self._slots.acquire(), self.limits.queue_timeout_s)
        except asyncio.TimeoutError:
            return web.Response(status=503, text="round_robin_proxy: too many requests in flight")
        try:
            index = await self.choose_backend(body)
            headers = {h: request.headers[h] for h in FORWARDED_HEADERS if h in request.headers}
            url = f"{self.backends[index]}{request.path_qs}"
            try:
                async with self._session.post(url, data=body, headers=headers) as upstream:
                    answer = web.StreamResponse(status=upstream.status)
                    for name, value in upstream.headers.items():
                        if name.lower() not in HOP_HEADERS:
                            answer.headers[name] = value
                    answer.headers[SERVED_BY_HEADER] = str(index)
                    await answer.prepare(request)
                    async for chunk in upstream.content.iter_any():
                        await answer.write(chunk)
                    await answer.write_eof()
                    return answer
            except (aiohttp.ClientError, asyncio.TimeoutError) as err:
                return web.Response(status=502, text=f"round_robin_proxy: backend {index} ({url}): "
                                                     f"{type(err).__name__}: {err}")
        finally:
            self._slots.release()


class ProxyThread:
    """The proxy on an event loop of its own in a daemon thread (for a synchronous driver)."""

    def __init__(self, backends: Sequence[str], limits: ProxyLimits = ProxyLimits(),
                 router: Optional[Router] = None) -> None:
        self.proxy = RoundRobinProxy(backends, limits, router)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="round-robin-proxy", daemon=True)

    def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Start it; return its base URL."""
        self._thread.start()
        bound = asyncio.run_coroutine_threadsafe(self.proxy.start(host, port), self._loop).result(30)
        return f"http://{host}:{bound}"

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        asyncio.run_coroutine_threadsafe(self.proxy.stop(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)
        self._loop.close()


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("backends", nargs="+", help="base URLs, e.g. http://127.0.0.1:8001")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9000)
    p.add_argument("--max-in-flight", type=int, default=ProxyLimits.max_in_flight)
    p.add_argument("--controller-url", help="route by this lmcache_controller's /lookup (kv_aware_router.py)")
    p.add_argument("--instance-ids", default="", help="with --controller-url: each backend's lmcache_instance_id, "
                                                      "comma-separated, in backend order")
    p.add_argument("--tokenizer", help="with --controller-url: the served model's directory (its tokenizer)")
    p.add_argument("--kv-aware-threshold", type=int, default=DEFAULT_THRESHOLD,
                   help="with --controller-url: route to the holder when it leaves at most this many tokens")
    args = p.parse_args(argv)
    router = None
    if args.controller_url:
        ids = [x.strip() for x in args.instance_ids.split(",") if x.strip()]
        if len(ids) != len(args.backends) or not args.tokenizer:
            p.error(f"--controller-url needs --tokenizer and one --instance-ids entry per backend "
                    f"({len(args.backends)} backends, {len(ids)} ids)")
        router = KvAwareRouter(args.controller_url, ids, args.tokenizer, args.kv_aware_threshold)

    async def serve() -> None:
        proxy = RoundRobinProxy(args.backends, ProxyLimits(max_in_flight=args.max_in_flight), router)
        port = await proxy.start(args.host, args.port)
        print(f"round_robin_proxy: http://{args.host}:{port} -> {', '.join(proxy.backends)}", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await proxy.stop()

    try:
        asyncio.run(serve())
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
