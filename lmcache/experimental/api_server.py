"""The status API of one engine: a small HTTP server on 127.0.0.1, off by default.

Upstream LMCache runs an "internal API server" per worker (`internal_api_server_enabled`, ports
from `internal_api_server_port_start`, 6999). Ours answers JSON:

- read-only, for anyone who can reach loopback: `GET /health`, `GET /config` (the engine's
  config with secrets masked), `GET /usage` (per-tier bytes held and per-tier counters),
  `GET /requests` (the doors' most recent per-request log lines), `GET /held` (what this
  process holds for requests now: the engine's pins, and each door's own state that `add_held`
  named; all 0 at idle, however the requests ended);
- state-changing, only with `Authorization: Bearer <internal_api_server_token>`:
  `POST /clear?tier=NAME` (drop every chunk of a tier), `POST /loglevel?level=NAME` (the
  `lmcache` loggers' level). Without a configured token, or with a wrong one, they answer 403.

The server runs on daemon threads of the worker process; a port that cannot be bound is logged
and serving goes on without it.
"""

from __future__ import annotations

import collections
import dataclasses
import hmac
import json
import logging
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any, Callable, Deque, Dict, List, Mapping, Optional, Tuple

from lmcache.logging import init_logger

if TYPE_CHECKING:
    from lmcache.experimental.cache_engine import LMCacheEngine
    from lmcache.experimental.config import LMCacheEngineConfig

logger = init_logger(__name__)

API_HOST = "127.0.0.1"
RECENT_LINES = 200  # per-request lines kept for `GET /requests`
# The doors' per-request lines (`integration/vllm/request_log.py`).
_REQUEST_LINE_PREFIXES = ("LMCache request ", "LMCache v0 door: prompt ")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def send_json(handler: BaseHTTPRequestHandler, status: int, body: Any) -> None:
    """Answer `body` as JSON with `status` (this API's and the controller's)."""
    data = json.dumps(body).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


def bearer_matches(authorization: Optional[str], token: Optional[str]) -> bool:
    """Whether `Authorization: Bearer <token>` names `token` (compared in constant time); never
    when no token is configured."""
    if token is None or authorization is None or not authorization.startswith("Bearer "):
        return False
    return hmac.compare_digest(authorization[len("Bearer "):].encode(), token.encode())


class RecentRequestLines(logging.Handler):
    """Keeps the last `RECENT_LINES` per-request lines the `lmcache` loggers emit."""

    def __init__(self, capacity: int = RECENT_LINES) -> None:
        super().__init__(level=logging.INFO)
        self._lines: Deque[str] = collections.deque(maxlen=capacity)

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith(_REQUEST_LINE_PREFIXES):
            self._lines.append(message)

    def lines(self) -> List[str]:
        return list(self._lines)


def masked_config(config: "LMCacheEngineConfig") -> Dict[str, Any]:
    """The config's fields as JSON values, secrets replaced by `***` and URLs masked."""
    return config.shown_fields()


class StatusAPI:
    """The status API of `engine`, listening on 127.0.0.1:`port` once `start()`ed."""

    def __init__(self, engine: "LMCacheEngine", port: int) -> None:
        self._engine = engine
        self._token = engine.config.internal_api_server_token
        self._recent = RecentRequestLines()
        self._server = ThreadingHTTPServer((API_HOST, port), self._handler_class())
        self._server.daemon_threads = True
        self._thread: Optional[threading.Thread] = None
        self._held: Dict[str, Callable[[], Mapping[str, int]]] = {}

    def add_held(self, name: str, count: Callable[[], Mapping[str, int]]) -> None:
        """Answer `count()` under `name` in `GET /held` (a door's per-request state, by what it is)."""
        self._held[name] = count

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    def start(self) -> None:
        logging.getLogger("lmcache").addHandler(self._recent)
        self._thread = threading.Thread(target=self._server.serve_forever, name="lmcache-status-api", daemon=True)
        self._thread.start()
        logger.info("LMCache status API on http://%s:%d", API_HOST, self.port)

    def close(self) -> None:
        logging.getLogger("lmcache").removeHandler(self._recent)
        self._server.shutdown()
        self._server.server_close()

    # ----- endpoints -------------------------------------------------------------------------

    def get(self, path: str, query: Dict[str, str]) -> Tuple[int, Any]:
        if path == "/health":
            return 200, {"status": "ok"}
        if path == "/config":
            return 200, masked_config(self._engine.config)
        if path == "/usage":
            seen = self._engine.observation()
            tiers = {name: dataclasses.asdict(t) for name, t in seen.stats.tiers.items()}
            return 200, {"usage_bytes": dict(seen.usage_bytes), "tiers": tiers}
        if path == "/requests":
            return 200, {"lines": self._recent.lines()}
        if path == "/held":
            stats = self._engine.observation().stats
            held = {"engine": {"live_pins": stats.live_pins, "pinned_requests": stats.pinned_requests}}
            return 200, {**held, **{name: dict(count()) for name, count in self._held.items()}}
        return 404, {"error": f"no endpoint {path}"}

    def post(self, path: str, query: Dict[str, str], authorization: Optional[str]) -> Tuple[int, Any]:
        if path not in ("/clear", "/loglevel"):
            return 404, {"error": f"no endpoint {path}"}
        if not self._authorized(authorization):
            return 403, {"error": "needs Authorization: Bearer <internal_api_server_token>"}
        if path == "/clear":
            return self._clear(query.get("tier", ""))
        level = query.get("level", "").upper()
        if level not in LOG_LEVELS:
            return 400, {"error": f"level={query.get('level')!r}: expected one of {LOG_LEVELS}"}
        logging.getLogger("lmcache").setLevel(level)
        logger.warning("LMCache log level set to %s through the status API", level)
        return 200, {"level": level}

    def _authorized(self, authorization: Optional[str]) -> bool:
        return bearer_matches(authorization, self._token)

    def _clear(self, tier_name: str) -> Tuple[int, Any]:
        try:
            removed = self._engine.storage_manager.clear_tier(tier_name)
        except ValueError as err:
            return 400, {"error": str(err)}
        logger.warning("LMCache tier %s cleared through the status API: %d chunks", tier_name, removed)
        self._engine.publish_metrics()
        return 200, {"tier": tier_name, "removed_chunks": removed}

    def _handler_class(self) -> type:
        api = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, status: int, body: Any) -> None:
                send_json(self, status, body)

            def _split(self) -> Tuple[str, Dict[str, str]]:
                url = urllib.parse.urlsplit(self.path)
                return url.path, dict(urllib.parse.parse_qsl(url.query))

            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                self._answer(*api.get(*self._split()))

            def do_POST(self) -> None:  # noqa: N802
                self._answer(*api.post(*self._split(), self.headers.get("Authorization")))

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                logger.debug("status API: " + format, *args)

        return Handler


def start_status_api(engine: "LMCacheEngine", worker_id: int) -> Optional[StatusAPI]:
    """The engine's status API when its config enables it (None when off or the port is taken)."""
    config = engine.config
    if not config.internal_api_server_enabled:
        return None
    port = config.internal_api_server_port_start + worker_id
    try:
        api = StatusAPI(engine, port)
    except (OSError, OverflowError) as err:  # port taken, or start + worker id beyond 65535
        logger.error("LMCache status API: cannot listen on %s:%d (%s); going on without it", API_HOST, port, err)
        return None
    api.start()
    return api
