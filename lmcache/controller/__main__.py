"""`lmcache_controller` (or `python -m lmcache.controller`), started as upstream starts it:

    lmcache_controller --host 127.0.0.1 --port 9000 --monitor-ports '{"pull": 8300, "reply": 8400}'

`--monitor-port P` (upstream's older flag) means pull on P and reply on P + 1. `--token`, or
`LMCACHE_CONTROLLER_TOKEN`, is what state-changing calls (`/clear`, `/pin`, `/unpin`) must send
as a bearer token.
A bad flag exits with status 2 and a message naming it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from typing import List, Optional, Tuple

from lmcache.controller.index import DEFAULT_MISSED_HEARTBEATS
from lmcache.controller.server import (
    DEFAULT_HOST,
    DEFAULT_PORT,
    DEFAULT_PULL_PORT,
    DEFAULT_REPLY_PORT,
    Controller,
    ControllerSettings,
)
from lmcache.logging import init_logger

logger = init_logger(__name__)

TOKEN_ENV = "LMCACHE_CONTROLLER_TOKEN"
MIN_TOKEN_CHARS = 8


def _port(value: object, flag: str, parser: argparse.ArgumentParser, allow_zero: bool = False) -> int:
    """A port from a flag (text) or from JSON (an int); 0 (any free port) only where allowed."""
    text, low = str(value), 0 if allow_zero else 1
    if isinstance(value, bool) or not (text.isascii() and text.isdigit()) or not low <= int(text) <= 65535:
        parser.error(f"{flag}: {value!r} is not a port in {low}..65535")
    return int(text)


def monitor_ports(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Tuple[int, int]:
    """(pull, reply) from `--monitor-ports` JSON or the older `--monitor-port`."""
    if args.monitor_ports is not None and args.monitor_port is not None:
        parser.error("--monitor-ports and --monitor-port: give one (--monitor-port P means pull P, reply P+1)")
    if args.monitor_port is not None:
        pull = _port(args.monitor_port, "--monitor-port", parser, allow_zero=False)
        return pull, _port(str(pull + 1), "--monitor-port (+1 for reply)", parser)
    if args.monitor_ports is None:
        return DEFAULT_PULL_PORT, DEFAULT_REPLY_PORT
    try:
        ports = json.loads(args.monitor_ports)
    except ValueError as err:
        parser.error(f"--monitor-ports: not JSON ({err}); expected e.g. '{{\"pull\": 8300, \"reply\": 8400}}'")
    if not isinstance(ports, dict) or set(ports) != {"pull", "reply"}:
        parser.error(f"--monitor-ports: expected a JSON object with keys pull and reply, got {args.monitor_ports!r}")
    pull = _port(ports["pull"], "--monitor-ports pull", parser, allow_zero=True)
    reply = _port(ports["reply"], "--monitor-ports reply", parser, allow_zero=True)
    if pull == reply and pull != 0:
        parser.error(f"--monitor-ports: pull and reply must differ, both are {pull}")
    return pull, reply


def parse_settings(argv: Optional[List[str]] = None) -> ControllerSettings:
    parser = argparse.ArgumentParser(prog="lmcache_controller", description="LMCache's controller: which instance "
                                     "holds which prefix, learned from the instances' admits and evictions.")
    parser.add_argument("--host", default=DEFAULT_HOST, help="address of the HTTP API and the workers' sockets "
                        f"(default {DEFAULT_HOST}; 0.0.0.0 lets other machines' workers and clients in)")
    parser.add_argument("--port", default=str(DEFAULT_PORT), help=f"HTTP API port (default {DEFAULT_PORT})")
    parser.add_argument("--monitor-ports", default=None,
                        help='the workers\' sockets as JSON, e.g. \'{"pull": 8300, "reply": 8400}\' (the default)')
    parser.add_argument("--monitor-port", default=None, help="upstream's older flag: pull on this port, reply on the next")
    parser.add_argument("--token", default=None,
                        help=f"bearer token of /clear, /pin and /unpin (default: ${TOKEN_ENV}; none refuses them)")
    parser.add_argument("--missed-heartbeats", default=str(DEFAULT_MISSED_HEARTBEATS),
                        help=f"heartbeat periods a worker may miss before it is dropped (default {DEFAULT_MISSED_HEARTBEATS})")
    args = parser.parse_args(argv)
    if not args.host.strip():
        parser.error("--host: empty")
    port = _port(args.port, "--port", parser, allow_zero=True)
    pull, reply = monitor_ports(args, parser)
    if port != 0 and port in (pull, reply):
        parser.error(f"--port {port} is also a monitor port")
    token = args.token if args.token is not None else (os.environ.get(TOKEN_ENV) or None)
    if token is not None and len(token) < MIN_TOKEN_CHARS:
        parser.error(f"--token / {TOKEN_ENV}: at least {MIN_TOKEN_CHARS} characters (value not shown)")
    misses = args.missed_heartbeats
    if not (misses.isascii() and misses.isdigit() and int(misses) >= 1):
        parser.error(f"--missed-heartbeats: {misses!r} is not an integer >= 1")
    return ControllerSettings(args.host.strip(), port, pull, reply, token, int(misses))


def main(argv: Optional[List[str]] = None) -> int:
    settings = parse_settings(argv)
    try:
        controller = Controller(settings).start()
    except OSError as err:  # zmq.ZMQError is an OSError too
        print(f"lmcache_controller: cannot listen on {settings.host} ({err})", file=sys.stderr)
        return 1
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"lmcache_controller: HTTP on http://{settings.host}:{controller.http_address[1]}, "
          f"workers' pull/reply ports {controller.worker_ports}", flush=True)
    stop.wait()
    controller.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
