"""`lmcache_server [HOST] PORT [DEVICE]` / `python -m lmcache.server ...`: run the `lm://` server.

`--unix-socket PATH` adds (or, without HOST PORT, is the only) door: the node pool, an
owner-only unix socket whose clients (`lm+shm:///PATH`) share the store's memory (`pool.py`);
`--socket-group NAME` opens it to that group's members (0660).
HOST defaults to 127.0.0.1. Listening on any other interface needs a token
(`LMCACHE_SERVER_TOKEN` or `--token-file PATH`; never a command-line value, which `ps` shows),
or `--no-auth` to insist on none; `--tls-cert`/`--tls-key` serve TLS (`lms://` clients).
DEVICE is the old server's storage device; only `cpu` (where chunks always live) is accepted.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Optional, Sequence, Tuple

from lmcache.logging import init_logger
from lmcache.server.protocol import DEFAULT_MAX_PAYLOAD_BYTES, HARD_MAX_PAYLOAD_BYTES
from lmcache.server.metrics import METRICS_HOST, serve_metrics
from lmcache.server.security import SERVER_TOKEN_ENV, read_token_file
from lmcache.server.server import MAX_GET_DELAY_S, LMCacheServer, ServerConfig

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
        nargs="*",
        metavar="[HOST] PORT [DEVICE]",
        help=f"interface to bind (default {DEFAULT_HOST}), TCP port (0 = any free port) and, as the old "
        "server took it, the storage device (only 'cpu')",
    )
    parser.add_argument(
        "--unix-socket",
        metavar="PATH",
        help="also (or, without HOST PORT, only) listen on this unix socket, created owner-only "
        "(0600): the node pool, where clients on this machine (lm+shm:///PATH) share the store's "
        "memory and values never cross a socket",
    )
    add_socket_group_argument(parser, "0660, owned by NAME")
    parser.add_argument(
        "--max-size-gb",
        type=float,
        default=4.0,
        help="memory for stored chunks; least recently used chunks are evicted beyond it",
    )
    parser.add_argument(
        "--prefault",
        action="store_true",
        help="fault all of --max-size-gb in at start (in the background, at idle priority) so that "
        "no put pays for fresh memory: for a server beside a vLLM engine on the same cores "
        "(default: memory is faulted in as chunks arrive, and reused once they are evicted)",
    )
    parser.add_argument(
        "--max-frame-mb",
        type=float,
        default=DEFAULT_MAX_PAYLOAD_BYTES / (1 << 20),
        help="largest payload one frame may carry; a larger put is refused (its payload is "
        "drained, the connection stays) and clients learn the limit from the refusal",
    )
    _add_limit_arguments(parser)
    add_security_arguments(parser)
    parser.add_argument(
        "--delay-ms",
        type=float,
        default=0.0,
        help="answer every GET and node pool LEASE this many milliseconds late (a slow remote tier for tests and "
        f"benchmarks; 0..{MAX_GET_DELAY_S * 1000:.0f}, default 0: off)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve the server's counters in Prometheus text format on http://127.0.0.1:PORT/metrics",
    )
    args = parser.parse_args(argv)
    if args.address:
        host, port_text = _split_address(parser, args.address)
        port: Optional[int] = _parse_port(parser, port_text)
    elif args.unix_socket is not None:
        host, port = DEFAULT_HOST, None
    else:
        parser.error("give [HOST] PORT, --unix-socket PATH, or both")
    max_payload = int(args.max_frame_mb * (1 << 20))
    if not 0 < max_payload <= HARD_MAX_PAYLOAD_BYTES:
        parser.error(
            f"--max-frame-mb must be in (0, {HARD_MAX_PAYLOAD_BYTES >> 20}], got {args.max_frame_mb}"
        )
    if args.max_size_gb <= 0:
        parser.error(f"--max-size-gb must be positive, got {args.max_size_gb}")
    if not 0 <= args.delay_ms <= MAX_GET_DELAY_S * 1000:
        parser.error(f"--delay-ms must be in 0..{MAX_GET_DELAY_S * 1000:.0f}, got {args.delay_ms}")
    try:
        return ServerConfig(
            host=host,
            port=port,
            unix_socket=args.unix_socket,
            socket_group=args.socket_group,
            max_size_bytes=int(args.max_size_gb * GB),
            max_payload_bytes=max_payload,
            max_connections=args.max_connections,
            frame_timeout_s=args.frame_timeout,
            idle_timeout_s=args.idle_timeout,
            max_pending_bytes=None if args.max_pending_mb is None else int(args.max_pending_mb * (1 << 20)),
            **security_options(args),
            metrics_port=args.metrics_port,
            get_delay_s=args.delay_ms / 1000,
            prefault=args.prefault,
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


def _add_limit_arguments(parser: argparse.ArgumentParser) -> None:
    """What one client, or many hostile ones, may hold of the server."""
    defaults = ServerConfig()
    parser.add_argument(
        "--max-connections",
        type=int,
        default=defaults.max_connections,
        help="open connections at most; at the limit a new connection closes the one that has "
        "been idle, or inside one frame, the longest",
    )
    parser.add_argument(
        "--frame-timeout",
        type=float,
        default=defaults.frame_timeout_s,
        help="seconds a frame may take from its first byte to its last (and a reply to drain) "
        "before the connection is closed",
    )
    parser.add_argument(
        "--idle-timeout",
        type=float,
        default=defaults.idle_timeout_s,
        help="seconds a connection may wait between frames before it is closed",
    )
    parser.add_argument(
        "--max-pending-mb",
        type=float,
        default=None,
        help="payload MiB all unfinished frames together may hold (default: twice "
        "--max-frame-mb, at least --max-frame-mb); a put that would go over is refused",
    )


def add_socket_group_argument(parser: argparse.ArgumentParser, what: str) -> None:
    """`--socket-group`: who besides the owner may use the node pool (`lmcache server` too)."""
    parser.add_argument(
        "--socket-group",
        metavar="NAME",
        help=f"let this group's members (other users, e.g. vLLM in another container) use the node "
        f"pool: its socket becomes {what} (the token still applies; default: owner-only)",
    )


def add_security_arguments(parser: argparse.ArgumentParser) -> None:
    """Token, TLS and protected mode (the token itself is never an argument)."""
    parser.add_argument(
        "--token-file",
        metavar="PATH",
        help=f"file holding the token clients must prove (else {SERVER_TOKEN_ENV}, if set)",
    )
    parser.add_argument("--tls-cert", metavar="PEM", help="certificate chain: serve TLS (lms://)")
    parser.add_argument("--tls-key", metavar="PEM", help="private key of --tls-cert")
    parser.add_argument(
        "--no-auth",
        action="store_true",
        help="listen on a non-loopback HOST without a token (anyone reaching the port can read "
        "and overwrite every chunk)",
    )


def security_options(args: argparse.Namespace) -> dict:
    """ServerConfig's token/TLS fields from the arguments and the environment (ValueError if bad)."""
    if args.token_file is not None:
        token = read_token_file(args.token_file)
    else:
        token = os.environ.get(SERVER_TOKEN_ENV, "").strip().encode() or None
    return dict(token=token, tls_cert=args.tls_cert, tls_key=args.tls_key, no_auth=args.no_auth)


def _parse_port(parser: argparse.ArgumentParser, text: str) -> int:
    """PORT is ASCII digits in 0..65535 (0 = any free port); `int()` would take `+80` or `٨٠`."""
    if not (text.isascii() and text.isdigit()) or int(text) > 65535:
        parser.error(f"PORT must be an integer in 0..65535, got {text!r}")
    return int(text)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console-script entry point; returns the process exit code."""
    return serve(_parse_args(argv))


def serve(config: ServerConfig) -> int:
    """Run a server until SIGTERM or SIGINT (`lmcache_server` and `lmcache server`); the exit code."""
    try:
        server = LMCacheServer(config)  # loads the TLS certificate, if any
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
