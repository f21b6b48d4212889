"""Remote tier throughput over loopback, measured beside raw socket bandwidth in the same run.

    .venv/bin/python scripts/bench/bench_remote.py [--chunks 8 --layers 32 --kv-heads 8 --head-size 128
                                              --dtype float16 --repeats 3]

Prints, for 256-token chunks of the given geometry:
- raw loopback TCP bandwidth (one connection, sendall/recv_into between two processes, 1 MiB
  per receive, into memory already touched, as our own receivers do);
- `lm://` (our server, its own process), Redis (`redis-server`, if installed) and Mooncake Store
  (`mooncake_master` + a `mooncake_client` lending the segment, if the wheel is installed; we are
  a pure client, as a vLLM instance is): pipelined put GB/s of encoded chunks and get GB/s of them
  into memory objects of a pool (checksum checked, as the remote tier reads them), through each
  tier's own connector, and each as a ratio of the raw bandwidth;
- `lm://` with a token, and `lms://` (token + TLS, a throwaway CA made with `openssl`), each
  as a ratio of plain `lm://` in the same run (`--no-secure` leaves them out);
- `naive` vs `cachegen`: bytes on the wire per chunk, encode time, and end-to-end get time
  (fetch from `lm://` + check + decode into a memory object) per chunk;
- as root, peer-to-peer (`p2p get`) against its own limit, the `raw link`: one TCP connection
  between the same two network namespaces, carrying the same bytes the same way as raw loopback
  (`bench_p2p.py`'s measurement, run as a child; the links unshaped by default, `--p2p-rate
  10gbit` shapes them; only for bench_p2p.py's geometry, the default one; `--no-p2p` leaves it out).
The KV is synthetic (Gaussian with per-channel scales, as real K has outlier channels); the
tiny model's real KV compression is measured in tests/test_remote_serde.py. The machine is
shared and noisy: raw loopback and every store run in turn in each of `--rounds` rounds and
the ratios are of medians (`--json` keeps every round); the token/TLS and serde rows are best of
`--repeats`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import multiprocessing as mp
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import numpy
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "scripts" / "bench"))

from lmcache.experimental.memory_management import HostMemoryAllocator, MemoryFormat, MemoryObj  # noqa: E402
from lmcache.experimental.remote.lm_connector import LMServerConnector  # noqa: E402
from lmcache.experimental.remote.redis_connector import RedisConnector  # noqa: E402
from lmcache.server.security import client_tls_context  # noqa: E402
from lmcache.experimental.remote.serde import CacheGenSerde, NaiveSerde  # noqa: E402
from bench_engine import interleaved, timed  # noqa: E402
from bench_p2p import rate_arg  # noqa: E402
import mooncake_store  # noqa: E402

TOKENS = 256
RAW_BLOCK = 8 << 20
# Bytes one raw `recv_into` asks for: what our receivers ask for (a checksum piece). One 8 MiB
# call per read held the socket while it copied and ran at ~0.75 GB/s where 1 MiB calls ran at
# 0.9-1.5 on the same loaded machine: a limit our own gets beat by up to 2.4x.
RAW_RECV = 1 << 20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on port {port} after {timeout} s")


def _raw_peer(port: int, total: int, ready) -> None:
    """Child process: receive `total` bytes, ack, then send `total` bytes back; repeat."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(1)
    ready.set()
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as our server's connections
    buf = memoryview(bytearray(RAW_RECV))
    block = memoryview(bytes(RAW_BLOCK))  # slices of a memoryview: no copy per send
    while True:
        got = 0
        while got < total:
            n = conn.recv_into(buf, min(len(buf), total - got))
            if n == 0:
                return
            got += n
        conn.sendall(b"k")
        sent = 0
        while sent < total:
            conn.sendall(block[: min(RAW_BLOCK, total - sent)])
            sent += RAW_BLOCK


class RawLoopback:
    """The limit: one loopback TCP connection to another process, `total` bytes each way."""

    def __init__(self, total: int) -> None:
        self.total = total
        port = _free_port()
        ready = mp.get_context("spawn").Event()
        self.peer = mp.get_context("spawn").Process(target=_raw_peer, args=(port, total, ready), daemon=True)
        self.peer.start()
        if not ready.wait(timeout=60):
            raise RuntimeError("raw socket peer did not start")
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as our clients' sockets
        self.block = memoryview(bytes(RAW_BLOCK))
        # Received into memory as large as the batch and already touched, as gets into the pool are.
        buf = numpy.empty(total, dtype=numpy.uint8)
        buf.fill(0)
        self.buf = memoryview(buf)
        self._down_s = 0.0

    def up(self) -> float:
        """Seconds to send `total` bytes (and, untimed, to read them back for `down`)."""
        start = time.perf_counter()
        sent = 0
        while sent < self.total:
            self.sock.sendall(self.block[: min(RAW_BLOCK, self.total - sent)])
            sent += RAW_BLOCK
        assert self.sock.recv(1) == b"k"
        mid = time.perf_counter()
        got = 0
        while got < self.total:
            got += self.sock.recv_into(self.buf[got:], min(RAW_RECV, self.total - got))
        self._down_s = time.perf_counter() - mid
        return mid - start

    def down(self) -> float:
        """Seconds the last `up` round took to receive `total` bytes."""
        return self._down_s

    def close(self) -> None:
        self.sock.close()
        self.peer.terminate()
        self.peer.join()


def make_chunks(n: int, shape: Tuple[int, ...], dtype: torch.dtype, alloc: HostMemoryAllocator) -> List[MemoryObj]:
    gen = torch.Generator().manual_seed(0)
    chunks = []
    for _ in range(n):
        obj = alloc.allocate(torch.Size(shape), dtype, MemoryFormat.KV_BLOB)
        assert obj is not None and obj.tensor is not None
        scale = torch.rand(1, 1, 1, shape[-1], generator=gen) * 4
        obj.tensor.copy_((torch.randn(shape, generator=gen) * scale).to(dtype))
        chunks.append(obj)
    return chunks


def best(repeats: int, fn: Callable[[], None]) -> float:
    """Shortest wall time of `repeats` calls."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def blob_key(i: int) -> str:
    """The key naive blob `i` was encoded under (its header names it; a get checks it)."""
    return f"bench@m@1@0@{i:032x}"


def store_rounds(
    connector, blobs: List[bytes], tag: str, alloc: HostMemoryAllocator,
    forget: Optional[Callable[[List[str]], None]] = None,
) -> Dict[str, Callable[[], float]]:
    """Timed pipelined put of encoded `blobs`, and get of them as the remote tier does it: each
    into a memory object of the pool, checked (naive serde), then freed (for `interleaved`).

    `forget`, for a store that keeps the first value put under a key (Mooncake Store answers a put
    of a present key at once, sending nothing): the gets' keys are put once here, and every put
    round puts under keys of its own, handed to `forget` after the round, untimed."""
    keys = [f"bench-{tag}@m@1@0@{i:032x}" for i in range(len(blobs))]
    items = list(zip(keys, blobs))
    serde = NaiveSerde()
    round_no = itertools.count()

    def put_items(batch: List[Tuple[str, bytes]]) -> None:
        assert all(connector.batched_put(batch)), "a put was refused"

    def put() -> float:
        if forget is None:
            return timed(lambda: put_items(items))
        n = next(round_no)
        fresh = [(f"{key}-put{n}", blob) for key, blob in items]
        seconds = timed(lambda: put_items(fresh))
        forget([key for key, _ in fresh])
        return seconds

    if forget is not None:
        put_items(items)

    def get() -> None:
        got: List[MemoryObj] = []
        connector.batched_get_into(keys, lambda i, reader: got.append(serde.receive(blob_key(i), reader, alloc.allocate)))
        assert len(got) == len(blobs) and all(obj is not None for obj in got), "a get missed"
        for obj in got:
            obj.ref_count_down()

    return {f"{tag} put": put, f"{tag} get": lambda: timed(get)}


def store_bandwidth(connector, blobs: List[bytes], repeats: int, alloc: HostMemoryAllocator) -> Tuple[float, float]:
    """Best (put, get) GB/s of pipelined batches of `blobs`."""
    total = sum(len(b) for b in blobs)
    fns = store_rounds(connector, blobs, "best", alloc)
    put_s = best(repeats, lambda: fns["best put"]())
    get_s = best(repeats, lambda: fns["best get"]())
    return total / put_s / 1e9, total / get_s / 1e9


def serde_costs(
    serde, chunks: List[MemoryObj], connector: LMServerConnector, alloc: HostMemoryAllocator, repeats: int
) -> Tuple[float, float, float]:
    """(bytes on the wire per chunk, encode s per chunk, end-to-end get s per chunk) over lm://."""
    keys = [f"serde-{serde.name}@m@1@0@{i:032x}" for i in range(len(chunks))]
    encoded: List[bytes] = []
    encode_s = best(repeats, lambda: encoded.__setitem__(slice(None), [serde.encode(k, c) for k, c in zip(keys, chunks)]))
    assert all(connector.batched_put(list(zip(keys, encoded))))

    def fetch_and_decode() -> None:
        got: List[MemoryObj] = []
        connector.batched_get_into(keys, lambda i, reader: got.append(serde.receive(keys[i], reader, alloc.allocate)))
        assert len(got) == len(keys) and all(obj is not None for obj in got)
        for obj in got:
            obj.ref_count_down()

    get_s = best(repeats, fetch_and_decode)
    n = len(chunks)
    return sum(len(b) for b in encoded) / n, encode_s / n, get_s / n


def start_lm_server(max_gb: float, extra_args: List[str] = (), env: Optional[dict] = None) -> Tuple[subprocess.Popen, int]:
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "lmcache.server", "127.0.0.1", str(port), "--max-size-gb", str(max_gb), *extra_args],
        env={**os.environ, "PYTHONPATH": str(ROOT), "LMCACHE_LOG_LEVEL": "WARNING", **(env or {})},
    )
    _wait_port(port)
    return proc, port


def make_tls_files(workdir: str) -> Tuple[str, str, str]:
    """(CA, certificate, key) for 127.0.0.1, made with the openssl CLI."""
    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=workdir, check=True, capture_output=True)

    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj", "/CN=bench-ca")
    openssl("req", *ec, "-keyout", "srv.key", "-out", "srv.csr", "-subj", "/CN=127.0.0.1")
    Path(workdir, "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    openssl("x509", "-req", "-in", "srv.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", "srv.pem", "-days", "1", "-extfile", "san.ext")
    return tuple(os.path.join(workdir, name) for name in ("ca.pem", "srv.pem", "srv.key"))  # type: ignore[return-value]


def secure_rows(
    naive_blobs: List[bytes], plain: Tuple[float, float], max_gb: float, repeats: int, workdir: str,
    alloc: HostMemoryAllocator,
) -> None:
    """Put/get GB/s with a token, and with a token over TLS, as ratios of plain lm://."""
    token = "bench-token"
    ca, cert, key = make_tls_files(workdir)
    setups = {
        "lm:// + token": ([], None),
        "lms:// + token":  (["--tls-cert", cert, "--tls-key", key], client_tls_context(ca)),
    }
    for name, (args, tls) in setups.items():
        proc, port = start_lm_server(max_gb, args, env={"LMCACHE_SERVER_TOKEN": token})
        try:
            conn = LMServerConnector("127.0.0.1", port, timeout=120, token=token, tls=tls)
            put, get = store_bandwidth(conn, naive_blobs, repeats, alloc)
            print(f"{name + ':':18s} put    {put:6.2f} GB/s ({put / plain[0]:5.1%} of lm://)  "
                  f"get      {get:6.2f} GB/s ({get / plain[1]:5.1%} of lm://)")
            conn.close()
        finally:
            proc.terminate()
            proc.wait()


def start_redis(workdir: str) -> Optional[Tuple[subprocess.Popen, int]]:
    binary = shutil.which("redis-server")
    if binary is None:
        print("redis-server not installed: Redis rows skipped (apt-get install redis-server)")
        return None
    port = _free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", workdir],
        stdout=subprocess.DEVNULL,
    )
    _wait_port(port)
    return proc, port


def start_mooncake(workdir: str, total: int) -> Optional[Tuple[List[subprocess.Popen], object]]:
    """A master, a storage process lending room for the gets' batch and one put round's, and our
    client of them (global segment 0: a pure client, as the serving instances are); None, with a
    line saying why, where Mooncake is not installed."""
    why = mooncake_store.missing()
    if why is not None:
        print(f"Mooncake rows skipped: {why}")
        return None
    from lmcache.experimental.remote.mooncake_connector import MooncakeStoreConnector
    from lmcache.experimental.remote.mooncake_settings import MooncakeSettings

    master_port, storage_port = _free_port(), _free_port()
    procs: List[subprocess.Popen] = []
    for name, argv, port in (
        ("master", mooncake_store.master_argv(master_port), master_port),
        ("storage", mooncake_store.storage_argv(master_port, storage_port, f"{(3 * total >> 20) + 64}MB"), storage_port),
    ):
        log = open(os.path.join(workdir, f"mooncake-{name}.log"), "ab")
        procs.append(subprocess.Popen(argv, stdout=log, stderr=log))
        _wait_port(port)
    # The local buffer bounds the largest value a put sends (the tier's default, 1 GiB, would do).
    settings = MooncakeSettings(global_segment_size=0, local_buffer_size=2 * total)
    connector = MooncakeStoreConnector(("127.0.0.1", master_port), settings, timeout=120)
    connector.ping()
    return procs, connector


def forget_mooncake(connector) -> Callable[[List[str]], None]:
    """Remove a put round's keys (never read, so no lease holds them), keeping the segment's room."""
    def forget(keys: List[str]) -> None:
        assert all(connector.delete(key) for key in keys), "Mooncake kept a put round's key"
    return forget


# bench_p2p.py's KV geometry (layers, KV heads, head size, dtype): the P2P rows only for it.
P2P_GEOMETRY = (32, 8, 128, "float16")


def p2p_rows(rate: str, tokens: int, rounds: int) -> List[dict]:
    """`p2p get` (B's pinned lookup reading `tokens` of A's chunks from its peer server) and the
    `raw link` it runs on, each round of bench_p2p.py run in turn, as rows."""
    with tempfile.TemporaryDirectory(prefix="bench-remote-p2p-") as tmp:
        out = Path(tmp) / "p2p.json"
        subprocess.run([sys.executable, str(ROOT / "scripts" / "bench" / "bench_p2p.py"), "--rate", rate,
                        "--tokens", str(tokens), "--rounds", str(rounds), "--json", str(out)],
                       check=True, stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(ROOT)})
        got = json.loads(out.read_text())
    nbytes = got["bytes"]
    where = "two network namespaces on one switch" + ("" if rate == "none" else f", links shaped to {rate}")
    seconds = {name: [nbytes / (gbps * 1e9) for gbps in got[key]]
               for name, key in (("raw link", "raw_gb_s"), ("p2p get", "p2p_gb_s"))}
    med = {name: statistics.median(t) for name, t in seconds.items()}
    return [{"name": name, "bytes": nbytes, "seconds": seconds[name], "gbps": nbytes / med[name] / 1e9,
             "limit": None if name == "raw link" else "raw link",
             "ratio": None if name == "raw link" else med["raw link"] / med[name], "where": where}
            for name in seconds]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], default="float16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-secure", action="store_true", help="skip the token and TLS rows")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds of raw loopback and each store")
    parser.add_argument("--no-serde", action="store_true", help="skip the naive-vs-cachegen rows")
    parser.add_argument("--json", default=None, help="write the interleaved rows (every round's seconds) here")
    parser.add_argument("--p2p-rate", type=rate_arg, default="none", help="tc rate of the P2P rows' link (10gbit, 1gbit), or none")
    parser.add_argument("--no-p2p", action="store_true", help="skip the peer-to-peer rows")
    args = parser.parse_args()

    dtype = getattr(torch, args.dtype)
    shape = (2, args.layers, TOKENS, args.kv_heads * args.head_size)
    chunk_bytes = 2 * args.layers * TOKENS * args.kv_heads * args.head_size * dtype.itemsize
    total = chunk_bytes * args.chunks
    alloc = HostMemoryAllocator(int(total * 3.5) + (64 << 20))
    chunks = make_chunks(args.chunks, shape, dtype, alloc)
    naive_blobs = [NaiveSerde().encode(blob_key(i), c) for i, c in enumerate(chunks)]
    print(f"chunk: {TOKENS} tokens, shape {list(shape)} {args.dtype} = {chunk_bytes / 2**20:.1f} MiB; "
          f"{args.chunks} chunks per batch ({total / 2**20:.0f} MiB); best of {args.repeats}")

    raw = RawLoopback(total)
    lm_proc, lm_port = start_lm_server(max_gb=max(1.0, total * 3 / 1e9))
    tmp = tempfile.mkdtemp(prefix="bench-redis-")
    redis_started = start_redis(tmp)
    mooncake_started = start_mooncake(tmp, total)
    try:
        lm = LMServerConnector("127.0.0.1", lm_port, timeout=120)
        contenders: Dict[str, Callable[[], float]] = {"raw up": raw.up, "raw down": raw.down}
        contenders.update(store_rounds(lm, naive_blobs, "lm://", alloc))
        rc = None
        if redis_started is not None:
            rc = RedisConnector([("127.0.0.1", redis_started[1])], timeout=120)
            contenders.update(store_rounds(rc, naive_blobs, "redis://", alloc))
        mc = None
        if mooncake_started is not None:
            mc = mooncake_started[1]
            contenders.update(store_rounds(mc, naive_blobs, "mooncake", alloc, forget=forget_mooncake(mc)))
        load_before = os.getloadavg()
        times = interleaved(args.rounds, contenders)
        raw.close()
        med = {name: statistics.median(t) for name, t in times.items()}
        rows = []
        for name in times:
            limit = None if name.startswith("raw") else ("raw up" if name.endswith("put") else "raw down")
            ratio = None if limit is None else med[limit] / med[name]
            rows.append({"name": name, "bytes": total, "seconds": times[name], "gbps": total / med[name] / 1e9,
                         "limit": limit, "ratio": ratio})
        geometry = (args.layers, args.kv_heads, args.head_size, args.dtype)
        if args.no_p2p:
            pass
        elif os.geteuid() != 0:
            print("P2P rows skipped: bench_p2p.py makes network namespaces, which needs root")
        elif geometry != P2P_GEOMETRY:
            print(f"P2P rows skipped: bench_p2p.py's geometry is {P2P_GEOMETRY}, not {geometry}")
        else:
            rows += p2p_rows(args.p2p_rate, args.chunks * TOKENS, args.rounds)
        load_after = os.getloadavg()
        for row in rows:
            print(f"{row['name']:14s} {row['gbps']:6.2f} GB/s"
                  + ("" if row["ratio"] is None else f"  {row['ratio']:5.2f} of {row['limit']}"))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({
                    "bench": "remote", "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "machine": f"{os.cpu_count()} CPUs, shared with other developers' jobs",
                    "load_average_1_5_15_min": {"before": load_before, "after": load_after},
                    "chunk_bytes": chunk_bytes, "chunks_per_batch": args.chunks,
                    "method": f"median of {args.rounds} rounds; raw loopback and every store run alternately in every "
                              "round; the P2P rows' raw link and P2P get alternately in rounds of their own (`where`)",
                    "rows": rows,
                }, f, indent=1)
            print(f"wrote {args.json}")
        put, get = total / med["lm:// put"] / 1e9, total / med["lm:// get"] / 1e9
        if not args.no_secure:
            secure_rows(naive_blobs, (put, get), max(1.0, total * 3 / 1e9), args.repeats, tmp, alloc)
        if rc is not None:
            rc.close()
        if mc is not None:
            mc.close()

        serde_rows = {}
        for serde in () if args.no_serde else (NaiveSerde(), CacheGenSerde()):
            serde_rows[serde.name] = serde_costs(serde, chunks, lm, alloc, args.repeats)
        n_bytes, n_enc, n_get = serde_rows.get("naive", (1, 1, 1))
        for name, (wire, enc, get_s) in serde_rows.items():
            print(f"{name:9s} over lm://: {wire / 2**20:7.2f} MiB/chunk on the wire ({n_bytes / wire:4.2f}x less than naive), "
                  f"encode {enc * 1e3:7.1f} ms/chunk, end-to-end get {get_s * 1e3:7.1f} ms/chunk "
                  f"({get_s / n_get:4.2f}x naive)")
        lm.close()
    finally:
        lm_proc.terminate()
        lm_proc.wait()
        if redis_started is not None:
            redis_started[0].terminate()
            redis_started[0].wait()
        for proc in reversed(mooncake_started[0] if mooncake_started is not None else []):
            proc.terminate()
            proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
