"""A third process pushing KV for a prompt into a running decoder, as any peer that reaches its
port could: for the PD e2e tests.

    python tests/pd_intruder.py '{"address": "tcp://127.0.0.1:PORT", "model": PATH, "chunk": 128,
                                  "prompt": [...], "attempts": [{"token": null | "...", "hostile": false}]}'

The chunks are keyed as the decoder keys them (`ChunkedTokenDatabase` with the model's geometry
from its `config.json`), one per whole chunk of the prompt, and hold garbage: a decoder that
took them would answer differently. Each attempt pushes them all:
- not hostile: through the prefiller's own `PushClient`, with the attempt's token (what a
  prefiller with no token or another token does);
- hostile: by hand, ignoring the decoder's proof: a hello, a proof and pushes signed under the
  attempt's token.
Prints one JSON line: per attempt, the chunks taken and the first refusal or error.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import zmq

from lmcache.config import LMCacheEngineMetadata
from lmcache.experimental.config import LMCacheEngineConfig
from lmcache.experimental.memory_management import HostMemoryAllocator, MemoryObj
from lmcache.experimental.pd.auth import PD_AUTH_LABEL
from lmcache.experimental.pd.sender import PushClient, PushError
from lmcache.experimental.pd.wire import auth_frames, push_frames, push_mac, read_reply
from lmcache.experimental.storage_backend import LocalCPUBackend
from lmcache.experimental.token_database import ChunkedTokenDatabase
from lmcache.server.security import NONCE_BYTES, proof
from lmcache.utils import CacheEngineKey


def _chunks(job: dict) -> tuple[list[CacheEngineKey], MemoryObj]:
    spec = json.loads((Path(job["model"]) / "config.json").read_text())
    layers, heads, head = spec["num_hidden_layers"], spec["num_key_value_heads"], spec["head_dim"]
    metadata = LMCacheEngineMetadata(job["model"], 1, 0, "vllm", torch.float32, (layers, 2, job["chunk"], heads, head))
    database = ChunkedTokenDatabase(LMCacheEngineConfig.from_defaults(chunk_size=job["chunk"]), metadata)
    keys = [key for start, end, key in database.process_tokens(job["prompt"]) if end - start == job["chunk"]]
    cpu = LocalCPUBackend(HostMemoryAllocator(2 * 2 * layers * job["chunk"] * heads * head * 4))
    obj = cpu.allocate(torch.Size([2, layers, job["chunk"], heads * head]), torch.float32)
    assert obj is not None
    obj.tensor.fill_(3.0)
    return keys, obj


def _as_client(address: str, token: str | None, keys: list[CacheEngineKey], obj: MemoryObj) -> dict:
    client = PushClient(address, 10.0, token.encode() if token else None)
    taken = 0
    try:
        for key in keys:
            refusal = client.push(lambda seq: push_frames(seq, "intruder", key, obj))
            if refusal is not None:
                return {"taken": taken, "refused": refusal}
            taken += 1
    except PushError as err:
        return {"taken": taken, "refused": str(err)}
    finally:
        client.close()
    return {"taken": taken, "refused": None}


def _hostile(address: str, token: str, keys: list[CacheEngineKey], obj: MemoryObj) -> dict:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10000)
    sock.connect(address)
    secret, nonce = token.encode(), b"\1" * NONCE_BYTES

    def send(frames):
        sock.send_multipart([bytes(f) for f in frames])
        return read_reply(sock.recv())

    try:
        hello = send(auth_frames(1, "hello", nonce))
        server_nonce = hello.auth[:NONCE_BYTES]
        refusals = [send(auth_frames(2, "proof", proof(secret, b"client", nonce, server_nonce, PD_AUTH_LABEL)))]
        session_key = proof(secret, b"session", nonce, server_nonce, PD_AUTH_LABEL)
        taken = 0
        for seq, key in enumerate(keys, start=3):
            frames = push_frames(seq, "intruder", key, obj)
            reply = send([*frames, push_mac(session_key, frames)])
            taken += reply.ok
            refusals.append(reply)
        return {"taken": taken, "refused": "; ".join(r.error for r in refusals if not r.ok) or None}
    finally:
        sock.close()


def main() -> None:
    job = json.loads(sys.argv[1])
    keys, obj = _chunks(job)
    results = []
    for attempt in job["attempts"]:
        if attempt.get("hostile"):
            results.append(_hostile(job["address"], attempt["token"], keys, obj))
        else:
            results.append(_as_client(job["address"], attempt["token"], keys, obj))
    print(json.dumps({"chunks": len(keys), "results": results}))


if __name__ == "__main__":
    main()
