"""`lmcache_server [HOST] PORT [DEVICE]` / `python -m lmcache.server ...`: run the `lm://` server.

HOST defaults to 127.0.0.1: the server has no authentication, so listening on other
interfaces is something to ask for explicitly (`lmcache_server 0.0.0.0 65432`). DEVICE is the
old server's storage device; only `cpu` (where chunks always live) is accepted.
"""

from __future__ import annotations

import argparse
import signal
import sys
from typing import Optional, Sequence, Tuple

from lmcache.logging import init_logger
from lmcache.server.protocol import DEFAULT_MAX_PAYLOAD_BYTES, HARD_MAX_PAYLOAD_BYTES
from lmcache.server.metrics import METRICS_HOST, serve_metrics
from lmcache.server.server import LMCacheServer, ServerConfig

logger = init_logger(__name__)

DEFAULT_HOST = "127.0.0.1"
# The old `lmcache_server HOST PORT [DEVICE]` form: the devices this server can store chunks on.
SUPPORTED_DEVICES = ("cpu",)
# Sizes in "GB" are GiB, as everywhere in LMCache's config (max_local_cpu_size, ...).
GB = 1024**3


def _parse_args(argv: Optional[Sequence[str]]) -> ServerConfig:
    parser = argparse.ArgumentParser(
        prog="lmcache_server",
        description="KV-chunk server for LMCache's lm:// remote tier.",
    )
    parser.add_argument(
        "address",
        nargs="+",
        metavar="[HOST] PORT [DEVICE]",
        help=f"interface to bind (default {DEFAULT_HOST}), TCP port (0 = any free port) and, as the old "
        "server took it, the storage device (only 'cpu')",
    )
    parser.add_argument(
        "--max-size-gb",
        type=float,
        default=4.0,
        help="memory for stored chunks; least recently used chunks are evicted beyond it",
    )
    parser.add_argument(
        "--max-frame-mb",
        type=float,
        default=DEFAULT_MAX_PAYLOAD_BYTES / (1 << 20),
        help="largest payload one frame may carry; larger frames close the connection",
    )
    parser.add_argument("--max-connections", type=int, default=256)
    parser.add_argument(
        "--frame-timeout",
        type=float,
        default=30.0,
        help="seconds a started frame may stall before the connection is closed",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve the server's counters in Prometheus text format on http://127.0.0.1:PORT/metrics",
    )
    args = parser.parse_args(argv)
    host, port_text = _split_address(parser, args.address)
    try:
        port = int(port_text)
    except ValueError:
        parser.error(f"PORT must be an integer, got {port_text!r}")
    max_payload = int(args.max_frame_mb * (1 << 20))
    if not 0 < max_payload <= HARD_MAX_PAYLOAD_BYTES:
        parser.error(
            f"--max-frame-mb must be in (0, {HARD_MAX_PAYLOAD_BYTES >> 20}], got {args.max_frame_mb}"
        )
    if args.max_size_gb <= 0:
        parser.error(f"--max-size-gb must be positive, got {args.max_size_gb}")
    try:
        return ServerConfig(
            host=host,
            port=port,
            max_size_bytes=int(args.max_size_gb * GB),
            max_payload_bytes=max_payload,
            max_connections=args.max_connections,
            frame_timeout_s=args.frame_timeout,
            metrics_port=args.metrics_port,
        )
    except ValueError as err:
        parser.error(str(err))
    raise AssertionError("unreachable")


def _split_address(parser: argparse.ArgumentParser, words: Sequence[str]) -> Tuple[str, str]:
    """`[HOST] PORT [DEVICE]` -> (host, port text); a DEVICE other than `cpu` is refused."""
    if len(words) == 1:
        return DEFAULT_HOST, words[0]
    if len(words) == 3:
        device = words[2]
        if device.lower() not in SUPPORTED_DEVICES:
            parser.error(
                f"DEVICE {device!r} is not supported: this server keeps chunks in CPU memory only "
                f"(give 'cpu' or leave DEVICE out)"
            )
    if len(words) in (2, 3):
        return words[0], words[1]
    parser.error(f"expected [HOST] PORT [DEVICE], got {' '.join(words)}")
    raise AssertionError("unreachable")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console-script entry point; returns the process exit code."""
    config = _parse_args(argv)
    server = LMCacheServer(config)
    try:
        server.start()
        if config.metrics_port is not None:
            serve_metrics(server, config.metrics_port)
            logger.info("metrics on http://%s:%d/metrics", METRICS_HOST, config.metrics_port)
    except OSError as err:
        logger.error("%s", err)
        return 1

    def _stop(signum: int, _frame: object) -> None:
        logger.info("signal %d: shutting down", signum)
        server.shutdown()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    server.serve_forever()
    server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
