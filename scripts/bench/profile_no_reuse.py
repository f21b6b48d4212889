"""Where the v1 door's time goes when nothing is reused, measured in one process (issue 12).

    .venv/bin/python scripts/bench/profile_no_reuse.py --tier cpu     # or disk; --prompts 4 --tokens 2048

Runs vLLM's v1 engine in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, so the scheduler, the
worker and our connector share one profile) on the benchmark-size model (`.cache/bench-model`,
built if missing) with our connector storing every prompt in one tier, sends unique prompts under
cProfile, and prints (as JSON) the seconds of `generate` and the cumulative seconds of the door's
calls: `wait_for_save` (the step waiting for stores), `start_load_kv` (which now waits for the
last step's off-step store), the saver's `flush`, and `LMCacheEngine.store` (on whichever thread
runs it; cProfile sees the calling thread only, so a store on the saver thread is not counted).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import random
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # make_tiny_model

from bench_serving import BENCH_MODEL  # noqa: E402
from make_tiny_model import make_tiny_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
WATCHED = {
    "wait_for_save": ("worker_side.py", "wait_for_save"),
    "start_load_kv": ("worker_side.py", "start_load_kv"),
    "saver_flush": ("off_step_saver.py", "flush"),
    "engine_store": ("cache_engine.py", "store"),
}


def cumulative(stats: pstats.Stats, file_suffix: str, name: str) -> float:
    return sum(
        row[3] for (path, _, func), row in stats.stats.items() if func == name and path.endswith(file_suffix)
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tier", choices=("cpu", "disk", "off"), default="cpu", help="off: no connector")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--model-dir", default=".cache/bench-model")
    args = p.parse_args()

    model = str(ROOT / args.model_dir)
    make_tiny_model(Path(model), BENCH_MODEL)
    disk = tempfile.mkdtemp(prefix="lmcache-profile-disk-")
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_USE_V1="1", LMCACHE_CHUNK_SIZE="256",
                      LMCACHE_MAX_LOCAL_CPU_SIZE="2")
    if args.tier == "disk":
        os.environ.update(LMCACHE_LOCAL_CPU="False", LMCACHE_LOCAL_DISK=disk, LMCACHE_MAX_LOCAL_DISK_SIZE="4")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = dict(model=model, dtype="float32", max_model_len=4096, block_size=128, enable_prefix_caching=False,
                  seed=0)
    if args.tier != "off":
        kwargs["kv_transfer_config"] = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
    llm = LLM(**kwargs)
    rng = random.Random(0)
    prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(10, 1000) for _ in range(args.tokens)])
               for _ in range(args.prompts + 1)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts[:1], params)  # warm-up
    profiler = cProfile.Profile()
    profiler.enable()
    for prompt in prompts[1:]:
        llm.generate([prompt], params, use_tqdm=False)
    profiler.disable()
    stats = pstats.Stats(profiler)
    out = {"tier": args.tier, "prompts": args.prompts, "tokens": args.tokens,
           "generate_s": round(cumulative(stats, "llm.py", "generate"), 3)}
    out.update({key: round(cumulative(stats, *where), 3) for key, where in WATCHED.items()})
    print("PROFILE " + json.dumps(out), flush=True)
    shutil.rmtree(disk, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
