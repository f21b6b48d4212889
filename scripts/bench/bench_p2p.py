"""Peer-to-peer retrieve throughput between two network namespaces, beside the raw link.

    sudo .venv/bin/python scripts/bench/bench_p2p.py [--rate 10gbit|1gbit|none] [--tokens 1024]
                                                     [--rounds 3] [--json PATH]

Two "machines" (`scripts/netns_machines.py`: network namespaces on one switch, 198.18.0.1 and
198.18.0.2, the benchmarking range, only inside them; each link `tc ... tbf`-shaped at `--rate`
both ways), removed at the end. Redis and instance A (which stores a prompt's KV, 256-token chunks of a 32-layer, 8-KV-head,
128-dim float16 model) in the first; B, with nothing of its own, in the second. Per round:
- raw: one TCP connection from the first namespace to the second carries the same bytes
  (received in 1 MiB pieces into memory already touched, as our readers do);
- p2p: B's pinned lookup of the prompt: a Redis round trip, then A's peer server sends every
  chunk in one pipelined exchange, each checked (checksum) into B's CPU tier. B's tier is
  cleared between rounds, so each round reads from A again.
Prints one JSON object (the run's header, GB/s of each per round, the ratio of the medians) and
the issue's target (p2p >= 0.7 x raw); `--json` writes the object. Needs root (ip netns, tc).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import List

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from netns_machines import Machines, NetPlan, gbit_of  # noqa: E402 (stdlib only: the roles stay light)

A_ADDR, B_ADDR = "198.18.0.1", "198.18.0.2"
REDIS_PORT, PEER_PORT, RAW_PORT = 6390, 8200, 8300
PIECE = 1 << 20
SCHEMA = "lmcache-bench-p2p/1"
TARGET_RATIO = 0.7  # issue 42: a P2P retrieve at >= 0.7x the raw link's throughput


def _engine(role_addr: str, tokens: int):
    import torch

    from lmcache.config import LMCacheEngineMetadata
    from lmcache.experimental.cache_engine import LMCacheEngine
    from lmcache.experimental.config import LMCacheEngineConfig
    from lmcache.experimental.gpu_connector import VLLMPagedMemGPUConnectorV2
    from lmcache.experimental.kv_layout import KVLayout
    from lmcache.experimental.memory_management import HostMemoryAllocator
    from lmcache.experimental.token_database import ChunkedTokenDatabase

    layers, heads, dim, block = 32, 8, 128, 16
    config = LMCacheEngineConfig.from_defaults(
        chunk_size=256, remote_url=None, max_local_cpu_size=2 * tokens * layers * heads * dim * 2 * 2 / 1024**3,
        enable_p2p=True, lookup_url=f"{A_ADDR}:{REDIS_PORT}", distributed_url=f"{role_addr}:{PEER_PORT}",
        p2p_no_auth=True)
    meta = LMCacheEngineMetadata("bench/p2p", 1, 0, "vllm", torch.float16, (layers, 2, 256, heads, dim))
    connector = VLLMPagedMemGPUConnectorV2(heads * dim, layers, layout=KVLayout.CPU_IPEX, num_kv_heads=heads)
    engine = LMCacheEngine(config, meta, HostMemoryAllocator(int(config.max_local_cpu_size * 1024**3)),
                           ChunkedTokenDatabase(config, meta), connector)
    blocks = -(-tokens // block)
    kv = [torch.randn(2, blocks, block * heads * dim).to(torch.float16) for _ in range(layers)]  # vLLM CPU's shape
    return engine, kv, torch.arange(tokens, dtype=torch.long)


def serve(tokens: int) -> None:
    """In the first namespace: store the prompt, then serve it (peer server) and raw bytes."""
    import torch

    engine, kv, slots = _engine(A_ADDR, tokens)
    engine.store(torch.arange(tokens) % 1000, kvcaches=kv, slot_mapping=slots)
    nbytes = tokens * 32 * 8 * 128 * 2 * 2  # K and V, float16: what the prompt's chunks carry
    listener = socket.create_server((A_ADDR, RAW_PORT))
    time.sleep(1.0)  # the recorder writes the records
    print(json.dumps({"ready": True, "bytes": nbytes}), flush=True)
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    block = memoryview(bytes(8 << 20))
    while conn.recv(1) == b"g":
        sent = 0
        while sent < nbytes:
            conn.sendall(block[: min(len(block), nbytes - sent)])
            sent += len(block)
    engine.close()


def read(tokens: int, rounds: int, nbytes: int) -> None:
    """In the second namespace: per round, the raw link's time and a pinned P2P lookup's."""
    import numpy
    import torch

    engine, _, _ = _engine(B_ADDR, tokens)
    sock = socket.create_connection((A_ADDR, RAW_PORT))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = numpy.zeros(nbytes, dtype=numpy.uint8)
    view = memoryview(buf)
    raw: List[float] = []
    p2p: List[float] = []
    prompt = torch.arange(tokens) % 1000
    for _ in range(rounds):
        start = time.perf_counter()
        sock.sendall(b"g")
        got = 0
        while got < nbytes:
            got += sock.recv_into(view[got:], min(PIECE, nbytes - got))
        raw.append(nbytes / (time.perf_counter() - start) / 1e9)
        start = time.perf_counter()
        hit = engine.lookup(prompt, request_id="bench", pin=True)
        p2p.append(nbytes * hit / tokens / (time.perf_counter() - start) / 1e9)
        engine.lookup_unpin(["bench"])
        engine.storage_manager.clear_tier("Hot")
        if hit != tokens:
            print(f"round read {hit} of {tokens} tokens", file=sys.stderr)
    sock.sendall(b"q")
    engine.close()
    print(json.dumps({"raw_gb_s": raw, "p2p_gb_s": p2p}), flush=True)


def rate_arg(text: str) -> str:
    """`--rate`: a tc rate or none, refused at parse time with the reason (not after machines are made)."""
    try:
        gbit_of(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


def two_machines(rate: str) -> Machines:
    """Machines a (A_ADDR) and b (B_ADDR) on links of `rate` (tc's words, or none)."""
    made = Machines(NetPlan.make("p2pb", ["a", "b"], gbit=gbit_of(rate)))
    assert (made.address("a"), made.address("b")) == (A_ADDR, B_ADDR)
    return made


def start_on(machines: Machines, machine: str, *argv: str, **kwargs) -> subprocess.Popen:
    """`argv` started on `machine`, with this checkout on its path and one OpenMP thread."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(machines.argv(machine, argv), env=env, **kwargs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=rate_arg, default="10gbit", help="tbf rate of the link (tc syntax), or none")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--role", choices=["serve", "read"], help=argparse.SUPPRESS)
    parser.add_argument("--bytes", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "serve":
        return serve(args.tokens)
    if args.role == "read":
        return read(args.tokens, args.rounds, args.bytes)
    if os.geteuid() != 0:
        sys.exit("bench_p2p needs root: it makes network namespaces (ip netns) and shapes their link (tc)")
    from bench_serving import machine_header  # the driver only: the roles above stay light

    started, load_before = time.time(), os.getloadavg()
    machines = two_machines(args.rate)
    procs: List[subprocess.Popen] = []
    try:
        procs.append(start_on(machines, "a", "redis-server", "--bind", A_ADDR, "--port", str(REDIS_PORT),
                              "--protected-mode", "no", "--save", "", "--appendonly", "no",
                              stdout=subprocess.DEVNULL))
        me = [sys.executable, str(Path(__file__).resolve()), "--tokens", str(args.tokens)]
        server = start_on(machines, "a", *me, "--role", "serve", stdout=subprocess.PIPE, text=True)
        procs.append(server)
        ready = json.loads(server.stdout.readline())
        reader = start_on(machines, "b", *me, "--role", "read", "--rounds", str(args.rounds),
                          "--bytes", str(ready["bytes"]), stdout=subprocess.PIPE, text=True)
        out, _ = reader.communicate(timeout=600)
        result = json.loads(out.strip().splitlines()[-1])
        ratio = statistics.median(result["p2p_gb_s"]) / statistics.median(result["raw_gb_s"])
        result = {**machine_header(SCHEMA, started, sys.argv[1:], load_before, "scripts/bench/bench_p2p.py"),
                  **result, "rate": args.rate, "tokens": args.tokens, "bytes": ready["bytes"], "ratio": ratio,
                  "target": {"rule": f"P2P / raw link >= {TARGET_RATIO}", "met": ratio >= TARGET_RATIO}}
        print(json.dumps(result, indent=1))
        print(f"target P2P retrieve / raw link >= {TARGET_RATIO}: {'MET' if ratio >= TARGET_RATIO else 'MISSED'} "
              f"({ratio:.3f})")
        if args.json:
            args.json.write_text(json.dumps(result, indent=1))
    finally:
        for proc in reversed(procs):
            proc.terminate()
            proc.wait(timeout=10)
        machines.close()


if __name__ == "__main__":
    main()
