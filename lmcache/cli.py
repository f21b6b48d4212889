"""`lmcache server ...`: upstream LMCache's command line for its one-cache-process-per-node mode,
served by this package's `lm://` server and its node pool.

`lmcache server --port 5555 --l1-size-gb 8` listens on 127.0.0.1:5555 (`lm://`, this machine
only unless `--host` says otherwise) and on the node pool's unix socket, named by the port
(`pool_address.pool_socket_path`): vLLM's `LMCacheMPConnector` with `lmcache.mp.port: 5555` finds
it there and shares the server's memory in place. `lmcache_server` stays the full-featured form.

Upstream's flags that mean something here are accepted (`--host`, `--port`, `--l1-size-gb`,
`--eviction-policy LRU`); the others are refused by name, with the reason, rather than ignored:
a setting that silently does nothing is worse than an error.
"""

from __future__ import annotations

import argparse
import sys
from typing import Mapping, Optional, Sequence

from lmcache.server.__main__ import GB, add_security_arguments, add_socket_group_argument, security_options, serve
from lmcache.server.pool_address import ensure_runtime_dir, pool_socket_path, runtime_dir
from lmcache.server.server import ServerConfig

DEFAULT_PORT = 5555
LOOPBACK_NAMES = ("localhost", "127.0.0.1")
EVICTION_POLICIES = ("LRU",)

_THREADS = "this server's threads are fixed (one event loop; clients copy their own data)"
_LAZY = "memory is faulted in as chunks arrive and reused after eviction (--prefault faults it all in at start)"
_WATERMARK = "this server evicts least recently used chunks as a put needs room, not in batches at a watermark"
# Upstream `lmcache server` flags with no counterpart here, and why (matched by name or prefix).
REFUSED_FLAGS: Mapping[str, str] = {
    "--chunk-size": "chunks are cut by the vLLM side here (lmcache.chunk_size / LMCACHE_CHUNK_SIZE); "
    "this server stores the chunks clients send",
    "--max-workers": _THREADS,
    "--max-gpu-workers": _THREADS,
    "--max-cpu-workers": _THREADS,
    "--hash-algorithm": "chunk keys are hashed by the clients, not by this server",
    "--engine-type": "CacheBlend runs inside vLLM here (lmcache.enable_blending)",
    "--supported-transfer-mode": "clients on this machine always copy into and out of the shared arena "
    "themselves (the node pool); other machines use lm://",
    "--shm-name": "the arena is an anonymous sealed memfd handed over the pool's socket; it has no name",
    "--l1-use-lazy": _LAZY,
    "--no-l1-use-lazy": _LAZY,
    "--l1-init-size-gb": _LAZY,
    "--eviction-trigger-watermark": _WATERMARK,
    "--eviction-ratio": _WATERMARK,
    "--l2-adapter": "there is no tier behind the pool; a vLLM instance can add its own disk tier (LMCACHE_LOCAL_DISK)",
    "--http-host": "this server has no HTTP frontend (--metrics-port serves its Prometheus counters)",
    "--http-port": "this server has no HTTP frontend (--metrics-port serves its Prometheus counters)",
    "--p2p-": "peer-to-peer transfer between servers is not implemented",
    "--coordinator-": "there is no coordinator; each machine's server stands alone",
}


def _refusal(flag: str) -> Optional[str]:
    """Why an upstream flag is refused (None: not one of upstream's that we know)."""
    name = flag.split("=", 1)[0]
    for refused, reason in REFUSED_FLAGS.items():
        if name == refused or (refused.endswith("-") and name.startswith(refused)):
            return reason
    return None


def _server_parser(verbs: "argparse._SubParsersAction") -> argparse.ArgumentParser:
    parser = verbs.add_parser(
        "server",
        help="run the KV-chunk server with its node pool (upstream's multiprocess-mode server)",
        description="KV-chunk server: lm:// on HOST:PORT, and the node pool (shared memory for vLLM "
        "instances on this machine) on a unix socket named by PORT.",
    )
    parser.add_argument("--host", default="localhost",
                        help="interface for lm:// clients (default localhost: this machine only; any other "
                        "needs a token, see --token-file)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT,
                        help=f"TCP port; it also names the node pool's socket (default {DEFAULT_PORT})")
    parser.add_argument("--l1-size-gb", type=float, default=ServerConfig().max_size_bytes / GB,
                        help="memory for stored chunks (GiB); least recently used chunks are evicted beyond it")
    parser.add_argument("--eviction-policy", default="LRU",
                        help="only LRU (the one policy of this server)")
    parser.add_argument("--prefault", action="store_true",
                        help="fault all of --l1-size-gb in at start (see lmcache_server --help)")
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="serve the counters in Prometheus text format on http://127.0.0.1:PORT/metrics")
    add_socket_group_argument(parser, "0660 and its runtime dir 0750, both owned by NAME")
    add_security_arguments(parser)
    return parser


def parse_server_args(argv: Sequence[str]) -> ServerConfig:
    """`lmcache server` arguments -> the server's config (exits with a usage error naming the flag)."""
    top = argparse.ArgumentParser(prog="lmcache", description="LMCache command line.")
    verbs = top.add_subparsers(dest="verb", required=True, metavar="VERB")
    parser = _server_parser(verbs)
    args, unknown = top.parse_known_args(list(argv))
    for word in unknown:
        reason = _refusal(word) if word.startswith("--") else None
        if reason is not None:
            parser.error(f"{word.split('=', 1)[0]} (an upstream LMCache flag) is not supported here: {reason}")
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.eviction_policy not in EVICTION_POLICIES:
        parser.error(f"--eviction-policy {args.eviction_policy!r} is not supported here: this server evicts LRU only")
    if not 1 <= args.port <= 65535:
        parser.error(f"--port must be in 1..65535 (it names the node pool's socket), got {args.port}")
    if not args.l1_size_gb > 0:
        parser.error(f"--l1-size-gb must be positive, got {args.l1_size_gb}")
    try:
        return ServerConfig(
            host="127.0.0.1" if args.host in LOOPBACK_NAMES else args.host,
            port=args.port,
            unix_socket=pool_socket_path(args.port),
            socket_group=args.socket_group,
            max_size_bytes=int(args.l1_size_gb * GB),
            metrics_port=args.metrics_port,
            prefault=args.prefault,
            **security_options(args),
        )
    except ValueError as err:
        parser.error(str(err))
    raise AssertionError("unreachable")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console-script entry point (`lmcache`); returns the process exit code."""
    config = parse_server_args(sys.argv[1:] if argv is None else argv)
    try:
        ensure_runtime_dir(runtime_dir(), config.socket_group)
    except OSError as err:
        print(f"lmcache server: {err}", file=sys.stderr)
        return 1
    return serve(config)


if __name__ == "__main__":
    sys.exit(main())
