"""The controller's HTTP API, by upstream's paths and JSON fields; every call is a POST of JSON.

- `/lookup {tokens, cache_salt?}` -> `{event_id, layout_info: {instance_id: [location,
  matched_prefix_len]}}`, the longest prefix first (JSON objects keep their order).
- `/query_worker_info {instance_id, worker_ids?}` -> `{event_id, worker_infos: [...]}`.
- `/health {instance_id}` -> `{event_id, error_codes: {worker_id: 0}}` (0: heard from within
  its heartbeat period; 1: late; 2: stale, a resync under way).
- `/clear {instance_id, location}` -> `{event_id, num_tokens, num_chunks}`: forwarded to each of
  the instance's workers (`commands.py`); needs the token. It releases the controller's pins of
  that location too.
- `/pin {instance_id, location, tokens, cache_salt?}` -> `{event_id, num_tokens}`: each worker
  keeps the longest prefix of `tokens` that `location` holds from eviction (held in CPU memory,
  `worker_pins.py`), within its bound; `num_tokens` is the prefix every worker pinned (a load
  needs every worker's part). Needs the token.
- `/unpin {instance_id, location, tokens, cache_salt?}` -> `{event_id, num_tokens}`: releases what
  a `/pin` of the same tokens and location held (upstream lists it as work in progress). Needs
  the token.
- `/check_finish {event_id}` -> `{status}`: "finished" or "failed" for a `/clear`'s, `/pin`'s
  or `/unpin`'s event.

A state-changing call needs `Authorization: Bearer <token>`, compared in constant time; a
controller started without a token refuses them. Errors answer `{"error": why}` with 400 (bad
JSON or fields), 401/403 (token), 404 (unknown path, instance or event), 413 (body too large),
502 (a worker failed the command); nothing a client sends stops the server.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import uuid
from collections import OrderedDict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Annotated, Any, Callable, Dict, List, Optional, Tuple

import msgspec

from lmcache.controller.commands import CommandResult
from lmcache.controller.index import ControllerIndex
from lmcache.controller.messages import MAX_BODY_BYTES, ClearCommand, CommandMessage, PinCommand, UnpinCommand
from lmcache.experimental.api_server import bearer_matches, send_json
from lmcache.logging import init_logger

logger = init_logger(__name__)

# Events `/check_finish` remembers, oldest forgotten first.
MAX_EVENTS = 10_000
# Paths that change state, and so need the token.
STATE_CHANGING = ("/clear", "/pin", "/unpin")

Reply = Tuple[int, Dict[str, Any]]
# (instance_id, command) -> one result per worker of that instance (`CommandSender.send`)
SendFn = Callable[[str, CommandMessage], List[CommandResult]]


class BadRequest(ValueError):
    """A request whose JSON or fields are wrong: answered 400 with the message."""


def _field(body: Dict[str, Any], name: str, kind: type, what: str) -> Any:
    value = body.get(name)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise BadRequest(f"field {name!r}: expected {what}, got {json.dumps(value)[:80]}")
    return value


# Token ids as the instances take them; checked by msgspec in C (a `/lookup` of 6.4k tokens spent
# 0.7 ms in a Python check, a third of its time).
TOKEN_IDS = List[Annotated[int, msgspec.Meta(ge=0, lt=2**31)]]


def _tokens(body: Dict[str, Any]) -> List[int]:
    tokens = _field(body, "tokens", list, "a list of token ids")
    try:
        return msgspec.convert(tokens, TOKEN_IDS)
    except msgspec.ValidationError as err:
        raise BadRequest(f"field 'tokens': expected token ids, integers in 0..2^31-1 ({err})") from None


def _salt(body: Dict[str, Any]) -> str:
    salt = body.get("cache_salt", "")
    if not isinstance(salt, str):
        raise BadRequest("field 'cache_salt': expected a string")
    return salt


class ControllerAPI:
    """The routes over one `ControllerIndex`; `serve(host, port)` starts the HTTP server."""

    def __init__(self, index: ControllerIndex, send: SendFn, token: Optional[str]) -> None:
        self._index = index
        self._send = send
        self._token = token
        self._events: "OrderedDict[str, str]" = OrderedDict()  # event_id -> status
        self._events_lock = threading.Lock()
        self._server: Optional[ThreadingHTTPServer] = None
        self._routes: Dict[str, Callable[[Dict[str, Any]], Reply]] = {
            "/lookup": self.lookup,
            "/query_worker_info": self.query_worker_info,
            "/health": self.health,
            "/clear": self.clear,
            "/pin": self.pin,
            "/unpin": self.unpin,
            "/check_finish": self.check_finish,
        }

    # ----- routes -----------------------------------------------------------------------------

    def lookup(self, body: Dict[str, Any]) -> Reply:
        tokens = _tokens(body)
        matches = self._index.lookup(tokens, _salt(body))
        layout = {m.instance_id: [m.location, m.matched_prefix_len] for m in matches}
        return 200, {"event_id": _event_id(), "layout_info": layout}

    def query_worker_info(self, body: Dict[str, Any]) -> Reply:
        instance_id = _field(body, "instance_id", str, "an instance id")
        worker_ids = body.get("worker_ids")
        if worker_ids is not None and not (isinstance(worker_ids, list)
                                           and all(isinstance(w, int) and not isinstance(w, bool) for w in worker_ids)):
            raise BadRequest("field 'worker_ids': expected a list of worker ids")
        infos = self._index.workers(instance_id, worker_ids)
        if not infos:
            return 404, {"error": f"instance {instance_id!r} has no registered worker{'s' if worker_ids is None else ' of those ids'}"}
        return 200, {"event_id": _event_id(), "worker_infos": [dataclasses.asdict(i) for i in infos]}

    def health(self, body: Dict[str, Any]) -> Reply:
        instance_id = _field(body, "instance_id", str, "an instance id")
        infos = self._index.workers(instance_id)
        if not infos:
            return 404, {"error": f"instance {instance_id!r} has no registered worker"}
        codes = {str(i.worker_id): 2 if i.stale else (0 if i.seconds_since_heard <= i.heartbeat_s * 1.5 else 1)
                 for i in infos}
        return 200, {"event_id": _event_id(), "error_codes": codes}

    def clear(self, body: Dict[str, Any]) -> Reply:
        def cleared(instance_id: str, results: List[CommandResult]) -> Dict[str, Any]:
            chunk_size = max((i.chunk_size for i in self._index.workers(instance_id)), default=0)
            chunks = max(r.num_chunks for r in results)  # every worker holds its part of each chunk
            return {"num_tokens": chunks * chunk_size, "num_chunks": chunks}

        return self._forward("clear", body, lambda event_id, location: ClearCommand(event_id, location), cleared)

    def pin(self, body: Dict[str, Any]) -> Reply:
        tokens, salt = _tokens(body), _salt(body)
        return self._forward("pin", body, lambda event_id, location: PinCommand(event_id, location, tokens, salt),
                             _common_prefix)

    def unpin(self, body: Dict[str, Any]) -> Reply:
        tokens, salt = _tokens(body), _salt(body)
        return self._forward("unpin", body, lambda event_id, location: UnpinCommand(event_id, location, tokens, salt),
                             _common_prefix)

    def _forward(self, what: str, body: Dict[str, Any], command: Callable[[str, str], CommandMessage],
                 answer: Callable[[str, List[CommandResult]], Dict[str, Any]]) -> Reply:
        """The state-changing calls' one path: `command(event_id, location)` to every worker of
        the body's instance, its event remembered for /check_finish, 502 naming each worker that
        failed, else `answer(instance_id, results)` beside the event id."""
        instance_id = _field(body, "instance_id", str, "an instance id")
        location = _field(body, "location", str, "a location (tier name, e.g. Hot or LocalDiskBackend)")
        if not self._index.command_urls(instance_id):
            return 404, {"error": f"instance {instance_id!r} has no registered worker"}
        event_id = _event_id()
        results = self._send(instance_id, command(event_id, location))
        failed = [r for r in results if not r.ok]
        self._remember(event_id, "failed" if failed else "finished")
        if failed:
            errors = "; ".join(f"worker {r.worker_id}: {r.error}" for r in failed)
            return 502, {"event_id": event_id, "error": f"{what} of {location!r} on {instance_id!r} failed: {errors}"}
        return 200, {"event_id": event_id, **answer(instance_id, results)}

    def check_finish(self, body: Dict[str, Any]) -> Reply:
        event_id = _field(body, "event_id", str, "an event id")
        with self._events_lock:
            status = self._events.get(event_id)
        if status is None:
            return 404, {"error": f"event {event_id!r} is unknown (or older than the last {MAX_EVENTS})"}
        return 200, {"status": status}

    def _remember(self, event_id: str, status: str) -> None:
        with self._events_lock:
            self._events[event_id] = status
            while len(self._events) > MAX_EVENTS:
                self._events.popitem(last=False)

    # ----- dispatch ---------------------------------------------------------------------------

    def handle(self, path: str, authorization: Optional[str], raw: bytes) -> Reply:
        """One POST: route, token, JSON; never raises."""
        route = self._routes.get(path)
        if route is None:
            return 404, {"error": f"no such path {path!r}; paths: {sorted(self._routes)}"}
        if path in STATE_CHANGING:
            refused = self._refused(authorization)
            if refused is not None:
                return refused
        try:
            body = msgspec.json.decode(raw or b"{}")  # 5x json.loads' speed: /lookup bodies are long
        except (ValueError, UnicodeDecodeError) as err:
            return 400, {"error": f"the body is not JSON: {err}"}
        if not isinstance(body, dict):
            return 400, {"error": f"the body must be a JSON object, got {type(body).__name__}"}
        try:
            return route(body)
        except BadRequest as err:
            return 400, {"error": str(err)}
        except Exception as err:  # a bug answers 500 and is logged; the server goes on
            logger.exception("controller: %s failed", path)
            return 500, {"error": f"{path} failed: {err!r}"}

    def _refused(self, authorization: Optional[str]) -> Optional[Reply]:
        if self._token is None:
            return 403, {"error": "this controller was started without --token (or LMCACHE_CONTROLLER_TOKEN): "
                                  "state-changing calls are refused"}
        if authorization is None or not authorization.startswith("Bearer "):
            return 401, {"error": "missing 'Authorization: Bearer <token>'"}
        if not bearer_matches(authorization, self._token):
            return 403, {"error": "wrong token"}
        return None

    def serve(self, host: str, port: int) -> Tuple[str, int]:
        """Start serving on daemon threads; the bound address (port 0: one the system picked)."""
        self._server = ThreadingHTTPServer((host, port), self._handler_class())
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="lmcache-controller-http", daemon=True).start()
        bound = self._server.server_address
        return str(bound[0]), int(bound[1])

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def _handler_class(self) -> type:
        api = self

        class Handler(BaseHTTPRequestHandler):
            server_version = "lmcache-controller"

            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                length = self.headers.get("Content-Length", "0")
                if not length.isdigit():
                    return self._send(400, {"error": f"Content-Length {length!r} is not a number"})
                if int(length) > MAX_BODY_BYTES:
                    return self._send(413, {"error": f"body of {length} bytes; at most {MAX_BODY_BYTES}"})
                raw = self.rfile.read(int(length))
                path = self.path.split("?", 1)[0]
                self._send(*api.handle(path, self.headers.get("Authorization"), raw))

            def do_GET(self) -> None:  # noqa: N802
                self._send(405, {"error": "every controller call is a POST with a JSON body"})

            def _send(self, status: int, body: Dict[str, Any]) -> None:
                send_json(self, status, body)

            def log_message(self, fmt: str, *args: Any) -> None:
                logger.debug("controller http: " + fmt, *args)

        return Handler


def _event_id() -> str:
    return uuid.uuid4().hex


def _common_prefix(instance_id: str, results: List[CommandResult]) -> Dict[str, Any]:
    """A pin's or unpin's answer: the prefix every worker did (a load needs every worker's part)."""
    return {"num_tokens": min(r.num_tokens for r in results)}
