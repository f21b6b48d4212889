"""One P2P engine in its own process (and perhaps its own network namespace), for `test_p2p.py`.

    python tests/p2p_engine_job.py '{"role": "store"|"retrieve", "lookup_url": ..., "distributed_url": ...[, "config": {...}]}'

`store`: stores the test prompt's KV, prints `{"stored": true}` once its five chunks are
recorded, then serves them until its stdin closes (or it is killed). `retrieve`: a pinned lookup
and a retrieve with nothing of its own; prints the lookup length, the loaded length and whether
the loaded KV is A's bytes. Both rebuild the same source KV from fixed seeds, so only the peer
connects them.
"""

from __future__ import annotations

import json
import sys
import time

import redis
import torch
from helpers import bits, config, geometry, make_engine, prompt, slots_for
from kv_reference import gather, make_kvcaches

from lmcache.experimental.p2p.records import CHUNK_PREFIX

TOKENS = 4 * 8 + 3  # helpers.CHUNK = 8: five chunks
GEO = geometry()


def main() -> None:
    job = json.loads(sys.argv[1])
    cfg = config(enable_p2p=True, lookup_url=job["lookup_url"], distributed_url=job["distributed_url"],
                 **job.get("config", {}))
    engine = make_engine(GEO, cfg)
    tokens = prompt(TOKENS, seed=3)
    source = make_kvcaches(GEO, seed=1)
    src_slots = slots_for(GEO, TOKENS, seed=1)
    if job["role"] == "store":
        engine.store(tokens, kvcaches=source, slot_mapping=src_slots)
        url = job["lookup_url"]
        client = redis.Redis.from_url(url if "://" in url else f"redis://{url}")
        while sum(1 for _ in client.scan_iter(CHUNK_PREFIX + "*")) < 5:
            time.sleep(0.02)
        print(json.dumps({"stored": True}), flush=True)
        sys.stdin.read()
        engine.close()
        return
    hit = engine.lookup(tokens, request_id="r", pin=True)
    target = make_kvcaches(GEO, seed=2)
    dst = slots_for(GEO, TOKENS, seed=2)
    loaded = int(engine.retrieve(tokens, kvcaches=target, slot_mapping=dst).sum())
    engine.lookup_unpin(["r"])
    exact = torch.equal(bits(gather(GEO, target, dst[:loaded].tolist())), bits(gather(GEO, source, src_slots[:loaded].tolist())))
    engine.close()
    print(json.dumps({"lookup": hit, "loaded": loaded, "exact": bool(exact)}), flush=True)


if __name__ == "__main__":
    main()
