"""One engine in its own process, for the remote-sharing tests: `store` a prompt's KV into the
remote tier, or `retrieve` it with an empty CPU tier and report how it compares.

    python tests/remote_engine_job.py '{"role": "store"|"retrieve", "url": ..., "serde": ...[, "config": {...}]}'

`config`: further config fields (a Mooncake client's `mooncake_*` settings).

Prints one JSON line: for `store` the remote tier's put counters, for `retrieve` the lookup
length, the retrieved token count, whether the loaded KV is bit-exact and the largest error.
`store` then exits as a vLLM worker does, leaving its puts queued to the engine's exit close
(`worker_engine.close_at_exit`), and prints the counters after it.
Both processes rebuild the same source KV from fixed seeds, so nothing but the remote store
connects them.
"""

from __future__ import annotations

import json
import multiprocessing.util
import sys
from dataclasses import asdict

import torch

from kv_reference import Geometry, gather, make_kvcaches
from lmcache.config import LMCacheEngineMetadata
from lmcache.experimental.cache_engine import LMCacheEngine, LMCacheEngineBuilder
from lmcache.experimental.config import LMCacheEngineConfig
from lmcache.experimental.gpu_connector import VLLMPagedMemGPUConnectorV2
from lmcache.experimental.kv_layout import KVLayout
from lmcache.experimental.memory_management import HostMemoryAllocator
from lmcache.experimental.storage_backend.remote_backend import RemoteBackend
from lmcache.experimental.token_database import ChunkedTokenDatabase
from lmcache.integration.vllm.utils import ENGINE_NAME
from lmcache.integration.vllm.worker_engine import ENGINE_EXIT_PRIORITY, close_at_exit

CHUNK = 16
TOKENS = 56  # three full chunks and a partial one
GEO = Geometry(KVLayout.CPU_IPEX, num_layers=2, num_blocks=32, block_size=4, num_heads=2, head_size=32, dtype=torch.float16)


def _engine(url: str, serde: str, fields: dict) -> LMCacheEngine:
    config = LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK, remote_url=url, remote_serde=serde, max_local_cpu_size=0.01, **fields
    )
    meta = LMCacheEngineMetadata(
        "shared/model", 1, 0, "vllm", GEO.dtype, (GEO.num_layers, 2, CHUNK, GEO.num_heads, GEO.head_size)
    )
    connector = VLLMPagedMemGPUConnectorV2(
        GEO.hidden, GEO.num_layers, layout=GEO.layout, num_kv_heads=GEO.num_heads, use_mla=False
    )
    allocator = HostMemoryAllocator(int(config.max_local_cpu_size * 1024**3))
    return LMCacheEngineBuilder.get_or_create(ENGINE_NAME, config, meta, connector, memory_allocator=allocator,
                                              token_database=ChunkedTokenDatabase(config, meta))


def _remote(engine: LMCacheEngine) -> RemoteBackend:
    return next(t for t in engine.storage_manager.tiers if isinstance(t, RemoteBackend))


def main() -> None:
    job = json.loads(sys.argv[1])
    tokens = torch.randint(0, 1000, (TOKENS,), generator=torch.Generator().manual_seed(5))
    source = make_kvcaches(GEO, seed=1)
    src_slots = torch.randperm(GEO.num_slots, generator=torch.Generator().manual_seed(1))[:TOKENS]
    engine = _engine(job["url"], job["serde"], job.get("config", {}))
    remote = _remote(engine)
    if job["role"] == "store":
        close_at_exit("store job")
        multiprocessing.util.Finalize(None, lambda: print(json.dumps(asdict(remote.remote_stats())), flush=True),
                                      exitpriority=ENGINE_EXIT_PRIORITY - 1)
        engine.store(tokens, kvcaches=source, slot_mapping=src_slots)
        return
    hit = engine.lookup(tokens)
    target = make_kvcaches(GEO, seed=2)
    dst_slots = torch.randperm(GEO.num_slots, generator=torch.Generator().manual_seed(2))[:TOKENS]
    ret = engine.retrieve(tokens, kvcaches=target, slot_mapping=dst_slots)
    n = int(ret.sum())
    want = gather(GEO, source, src_slots[:n].tolist())
    got = gather(GEO, target, dst_slots[:n].tolist())
    result = {
        "lookup": hit,
        "retrieved": n,
        "exact": bool(torch.equal(want.contiguous().view(torch.uint8), got.contiguous().view(torch.uint8))),
        "max_abs_err": float((want.float() - got.float()).abs().max()) if n else 0.0,
        "max_abs_value": float(want.float().abs().max()) if n else 0.0,
        "remote_hits": remote.remote_stats().gets_hit,
    }
    engine.close()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
