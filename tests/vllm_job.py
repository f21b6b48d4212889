"""Run one real vLLM generation job in its own process and print its result as JSON.

Tests start this script in a fresh interpreter because vLLM reads its engine choice (`VLLM_USE_V1`)
and other settings at import time, and the v1 engine spawns an engine-core process, which needs a
`__main__` guard. The job comes as JSON on stdin:

    {"model": PATH, "prompts": [[token ids], ...], "max_tokens": 16, "rounds": 1,
     "llm_kwargs": {...}, "vllm_module": "vllm" | "lmcache_vllm.vllm",
     "sampling_extra_args": {...} | null}

Each round sends every prompt once, one prompt per `generate` call, in order, so a later prompt can
hit what an earlier one stored. The last stdout line is `RESULT {"outputs": [[[ids]...]...],
"latencies": [[seconds]...]}` (indexed [round][prompt]).
"""

from __future__ import annotations

import importlib
import json
import sys
import time


def run(job: dict) -> dict:
    vllm = importlib.import_module(job.get("vllm_module", "vllm"))
    llm_kwargs = {
        "model": job["model"],
        "dtype": "float32",
        "max_model_len": 4096,
        "seed": 0,
        **job.get("llm_kwargs", {}),
    }
    llm = vllm.LLM(**llm_kwargs)
    params = vllm.SamplingParams(
        temperature=0.0,
        max_tokens=job.get("max_tokens", 16),
        ignore_eos=True,
        extra_args=job.get("sampling_extra_args"),
    )
    outputs, latencies = [], []
    for _ in range(job.get("rounds", 1)):
        round_out, round_lat = [], []
        for ids in job["prompts"]:
            start = time.perf_counter()
            (result,) = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
            round_lat.append(time.perf_counter() - start)
            round_out.append(list(result.outputs[0].token_ids))
        outputs.append(round_out)
        latencies.append(round_lat)
    return {"outputs": outputs, "latencies": latencies}


if __name__ == "__main__":
    result = run(json.load(sys.stdin))
    print("RESULT " + json.dumps(result), flush=True)
