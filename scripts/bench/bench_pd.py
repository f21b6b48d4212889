"""PD benchmark: push bandwidth beside raw loopback in the same run, and the TTFT split.

    .venv/bin/python scripts/bench/bench_pd.py [--prompts 1024,4096] [--push-mb 256] [--no-serve]

1. Transport, in this process over 127.0.0.1 (bench-model geometry: 8 layers, 8 KV heads,
   head 64, float32, 256-token chunks):
   - raw loopback: ZeroMQ DEALER -> ROUTER, the same payload sizes, one reply per message;
   - PD push: `PDSender.push_stored` from an engine's CPU tier into a decoder engine's
     `PDReceiveBuffer` (header, checksum on both sides, copy into the buffer, reply);
   - PD push with a token (`pd_token_file`): the handshake once, then a MAC per push;
   - PD push with a token and `pd_encrypt` (ZeroMQ CURVE);
   reported as GB/s and as the ratios push / raw, token / no token and encrypted / no token (best
   of `--repeats`; the three pushes take turns, so load falls on all alike).
2. TTFT split (unless `--no-serve`): a prefiller and a decoder (`lmcache_vllm serve`, the
   bench-size random model: hidden 1024, 8 layers) on this machine; for each prompt length,
   the prefill hop (POST to the prefiller with max_tokens=1 and a disagg_spec; wall time, push
   included), the push alone (the prefiller's `PD: ... pushed` log lines), the decode hop's first
   token (POST to the decoder, max_tokens=1, loading the pushed KV), and the decoder computing
   the same prompt itself for comparison.

Writes `bench/results/pd-<stamp>.json` and `.png`. Both instances share this machine's cores.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch
import zmq

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "scripts" / "bench"))

from lmcache.config import LMCacheEngineMetadata  # noqa: E402
from lmcache.experimental.cache_engine import LMCacheEngine  # noqa: E402
from lmcache.experimental.config import LMCacheEngineConfig  # noqa: E402
from lmcache.experimental.gpu_connector import VLLMPagedMemGPUConnectorV2  # noqa: E402
from lmcache.experimental.kv_layout import KVLayout  # noqa: E402
from lmcache.experimental.memory_management import HostMemoryAllocator  # noqa: E402
from lmcache.experimental.pd.auth import pd_token  # noqa: E402
from lmcache.experimental.pd.disagg_spec import DisaggSpec  # noqa: E402
from lmcache.experimental.pd.sender import PDSender  # noqa: E402
from lmcache.experimental.token_database import ChunkedTokenDatabase  # noqa: E402
from make_tiny_model import TinyModelSpec, make_tiny_model  # noqa: E402
from pd_servers import free_port, pd_env, post, start_vllm  # noqa: E402

LAYERS, KV_HEADS, HEAD, CHUNK = 8, 8, 64, 256
BENCH_MODEL = TinyModelSpec(hidden=1024, layers=8, heads=16, kv_heads=8, max_position=8192)
PUSH_LINE = re.compile(r"PD: request (\S+) pushed (\d+) tokens to \S+ in ([\d.]+) ms")


def _engine(cfg: LMCacheEngineConfig, pool_bytes: int) -> LMCacheEngine:
    meta = LMCacheEngineMetadata("bench/pd", 1, 0, "vllm", torch.float32, (LAYERS, 2, CHUNK, KV_HEADS, HEAD))
    conn = VLLMPagedMemGPUConnectorV2(KV_HEADS * HEAD, LAYERS, layout=KVLayout.FLASH, num_kv_heads=KV_HEADS)
    return LMCacheEngine(cfg, meta, HostMemoryAllocator(pool_bytes), ChunkedTokenDatabase(cfg, meta), conn)


def raw_loopback(num: int, nbytes: int) -> float:
    """GB/s of `num` messages of `nbytes` DEALER -> ROUTER with a reply each (the push's pattern)."""
    ctx = zmq.Context.instance()
    port = free_port()
    server, client = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    server.bind(f"tcp://127.0.0.1:{port}")
    client.connect(f"tcp://127.0.0.1:{port}")
    payload = torch.randn(nbytes // 4).numpy().tobytes()
    import threading

    def serve() -> None:
        for _ in range(num):
            ident, data = server.recv_multipart(copy=False)
            bytearray(data.buffer)  # the receiver copies the payload out, as the buffer does
            server.send_multipart([ident, b"ok"])

    thread = threading.Thread(target=serve)
    thread.start()
    began = time.perf_counter()
    for _ in range(num):
        client.send(payload, copy=False)
        client.recv()
    elapsed = time.perf_counter() - began
    thread.join()
    server.close(linger=0)
    client.close(linger=0)
    return num * nbytes / elapsed / 1e9


def pd_push(num_chunks: int, token_file: Optional[Path] = None, encrypt: bool = False) -> tuple[float, float]:
    """GB/s of `PDSender.push_stored` for a prompt of `num_chunks` chunks (and its seconds),
    both sides taking the token in `token_file` when given (and encrypting with `encrypt`)."""
    port = free_port()
    tokens = num_chunks * CHUNK
    chunk_bytes = 2 * LAYERS * CHUNK * KV_HEADS * HEAD * 4
    pool = (num_chunks + 2) * chunk_bytes
    base = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK, remote_url=None, max_local_cpu_size=pool / 2**30,
                                             pd_token_file=None if token_file is None else str(token_file),
                                             pd_encrypt=encrypt)
    sender_engine = _engine(base, pool)
    decoder = _engine(base.with_overrides({"enable_pd": True, "pd_role": "receiver", "pd_peer_host": "127.0.0.1",
                                           "pd_peer_init_port": port, "pd_buffer_size": pool}), pool)
    sender = PDSender(worker_id=0, token=pd_token(base), encrypt=encrypt)
    try:
        num_blocks = tokens // 16 + 1
        caches = [torch.randn(2, num_blocks, 16, KV_HEADS, HEAD) for _ in range(LAYERS)]
        ids = torch.randint(0, 1000, (tokens,))
        sender_engine.store(ids, kvcaches=caches, slot_mapping=torch.arange(tokens))
        mask = torch.ones(tokens, dtype=torch.bool)
        began = time.perf_counter()
        pushed = sender.push_stored(sender_engine, DisaggSpec("bench", "127.0.0.1", port, port + 1), ids, mask, "")
        elapsed = time.perf_counter() - began
        assert pushed == tokens, f"pushed {pushed} of {tokens}"
        assert decoder.lookup(ids) == tokens
        return tokens // CHUNK * chunk_bytes / elapsed / 1e9, elapsed
    finally:
        sender.close()
        sender_engine.close()
        decoder.close()


def transport(push_mb: int, repeats: int) -> dict:
    chunk_bytes = 2 * LAYERS * CHUNK * KV_HEADS * HEAD * 4
    num = max(1, push_mb * 2**20 // chunk_bytes)
    raw = max(raw_loopback(num, chunk_bytes) for _ in range(repeats))
    with tempfile.TemporaryDirectory(prefix="bench-pd-token-") as tmp:
        token_file = Path(tmp) / "token"
        token_file.write_text("bench-pd-token\n")
        runs = [(pd_push(num)[0], pd_push(num, token_file)[0], pd_push(num, token_file, encrypt=True)[0])
                for _ in range(repeats)]
    push, with_token, encrypted = (max(r[i] for r in runs) for i in range(3))
    print(f"transport: {num} chunks of {chunk_bytes / 2**20:.1f} MiB: raw zmq loopback {raw:.2f} GB/s, "
          f"PD push {push:.2f} GB/s, push/raw {push / raw:.2f}; with a token {with_token:.2f} GB/s "
          f"({with_token / push:.2f}x of no token), encrypted {encrypted:.2f} GB/s ({encrypted / push:.2f}x)")
    return {"chunk_bytes": chunk_bytes, "chunks": num, "raw_loopback_gbps": raw, "pd_push_gbps": push,
            "push_over_raw": push / raw, "pd_push_token_gbps": with_token, "token_over_plain": with_token / push,
            "pd_push_encrypted_gbps": encrypted, "encrypted_over_plain": encrypted / push}


def _prompt(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(10, 1000, (n,), generator=gen).tolist()


def ttft_split(prompts: list[int], workdir: Path) -> list[dict]:
    model = workdir / "model"
    make_tiny_model(model, BENCH_MODEL)
    init_port = free_port()
    env = {"LMCACHE_CHUNK_SIZE": str(CHUNK), "LMCACHE_MAX_LOCAL_CPU_SIZE": "1"}
    decoder = start_vllm("decoder", str(model), "kv_consumer",
                         {**env, **pd_env("receiver", init_port, 1 << 30), "LMCACHE_LOCAL_CPU": "False"},
                         workdir / "decoder.log", max_model_len=8192)
    prefiller = start_vllm("prefiller", str(model), "kv_producer", {**env, **pd_env("sender", init_port)},
                           workdir / "prefiller.log", max_model_len=8192)
    rows = []
    try:
        decoder.wait_healthy()
        prefiller.wait_healthy()
        for i, n in enumerate([64, *prompts]):  # the first, short, one warms both up
            prompt = _prompt(n, seed=i)
            spec = {"req_id": f"bench-{i}", "receiver_host": "127.0.0.1", "receiver_init_port": init_port,
                    "receiver_alloc_port": init_port + 100}
            body = {"model": str(model), "prompt": prompt, "max_tokens": 1, "temperature": 0.0}
            began = time.perf_counter()
            status, _ = post(f"{prefiller.url}/v1/completions", {**body, "kv_transfer_params": {"disagg_spec": spec}},
                             timeout=900)
            prefill_s = time.perf_counter() - began
            assert status == 200
            began = time.perf_counter()
            status, _ = post(f"{decoder.url}/v1/completions", body, timeout=900)
            decode_s = time.perf_counter() - began
            assert status == 200
            began = time.perf_counter()
            status, _ = post(f"{decoder.url}/v1/completions", body, timeout=900)  # nothing pushed now: computed
            compute_s = time.perf_counter() - began
            pushes = [m for m in PUSH_LINE.finditer(prefiller.log_text()) if m[1] == f"bench-{i}"]
            push_s = sum(float(m[3]) for m in pushes) / 1000
            pushed = sum(int(m[2]) for m in pushes)
            if n == 64:
                continue
            row = {"prompt_tokens": n, "pushed_tokens": pushed, "prefill_hop_s": prefill_s, "push_s": push_s,
                   "prefill_compute_s": prefill_s - push_s, "decode_first_token_s": decode_s,
                   "pd_ttft_s": prefill_s + decode_s, "decoder_computes_s": compute_s}
            print(f"TTFT {n} tokens: prefill hop {prefill_s:.2f} s (push {push_s * 1000:.0f} ms for {pushed} tokens), "
                  f"decode first token {decode_s * 1000:.0f} ms; decoder computing it itself {compute_s:.2f} s")
            rows.append(row)
    finally:
        prefiller.stop()
        decoder.stop()
    return rows


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    t = result["transport"]
    axes[0].bar(["raw zmq loopback", "PD push", "PD push, token", "PD push, encrypted"],
                [t["raw_loopback_gbps"], t["pd_push_gbps"], t["pd_push_token_gbps"], t["pd_push_encrypted_gbps"]],
                color=["grey", "C0", "C1", "C2"])
    axes[0].set_ylabel("GB/s")
    axes[0].set_title(f"push bandwidth ({t['chunks']} chunks of {t['chunk_bytes'] / 2**20:.0f} MiB)")
    rows = result["ttft"]
    if rows:
        labels = [f"{r['prompt_tokens']} tok" for r in rows]
        x = range(len(rows))
        prefill = [r["prefill_compute_s"] for r in rows]
        push = [r["push_s"] for r in rows]
        decode = [r["decode_first_token_s"] for r in rows]
        axes[1].bar([i - 0.2 for i in x], prefill, 0.4, label="prefill (prefiller)")
        axes[1].bar([i - 0.2 for i in x], push, 0.4, bottom=prefill, label="push")
        axes[1].bar([i - 0.2 for i in x], decode, 0.4, bottom=[a + b for a, b in zip(prefill, push)],
                    label="first decode step (decoder)")
        axes[1].bar([i + 0.2 for i in x], [r["decoder_computes_s"] for r in rows], 0.4, color="grey",
                    label="decoder computes it alone")
        axes[1].set_xticks(list(x), labels)
        axes[1].set_ylabel("seconds")
        axes[1].set_title("TTFT split")
        axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", default="1024,4096", help="prompt lengths for the TTFT split")
    parser.add_argument("--push-mb", type=int, default=256, help="MiB pushed per transport run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-serve", action="store_true", help="transport only (no vLLM servers)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args()
    result = {"transport": transport(args.push_mb, args.repeats), "ttft": []}
    if not args.no_serve:
        with tempfile.TemporaryDirectory(prefix="bench-pd-") as tmp:
            result["ttft"] = ttft_split([int(n) for n in args.prompts.split(",")], Path(tmp))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (out / f"pd-{stamp}.json").write_text(json.dumps(result, indent=2))
    plot(result, out / f"pd-{stamp}.png")
    print(f"wrote {out / f'pd-{stamp}.json'} and .png")


if __name__ == "__main__":
    main()
