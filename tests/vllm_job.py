"""Run one real vLLM generation job in its own process and print its result as JSON.

Tests start this script in a fresh interpreter because vLLM reads its engine choice (`VLLM_USE_V1`)
and other settings at import time, and the v1 engine spawns an engine-core process, which needs a
`__main__` guard. The job comes as JSON on stdin:

    {"model": PATH, "prompts": [[token ids], ...], "max_tokens": 16, "rounds": 1,
     "llm_kwargs": {...},                 # over dtype float32, seed 0, enforce_eager (below)
     "vllm_module": "vllm" | "lmcache_vllm.vllm",
     "sampling_extra_args": {...} | null,
     "prompt_extra_args": [{...} | null per prompt] | null,   # replaces sampling_extra_args
     "logprobs": false | true,                                # also report the sampled logprobs
     "close_engine": false | true,        # end with the old wrapper's `close_lmcache_engine()`
     "count_preemptions": false | true,   # v1 engine: report vLLM's own preemption counter
     "kv_events_config": {...} | null,    # vLLM's `--kv-events-config` (LLM takes no dict for it)
     "gate_dir": PATH, "gate_before": [prompt index, ...]}   # one round only (below)

Each round sends every prompt once, one prompt per `generate` call, in order, so a later prompt can
hit what an earlier one stored. An entry of "prompts" that is itself a list of prompts goes to vLLM
as one batch (one `generate` call); its outputs (and logprobs) entry is then a list per prompt.
The last stdout line is `RESULT {"outputs": [[[ids]...]...], "latencies": [[seconds]...]}`
(indexed [round][prompt]); with `"logprobs": true` it also has
`"logprobs": [[[logprob of each sampled token]...]...]`; with `"count_preemptions": true`,
`"num_preemptions": N`, vLLM's `vllm:num_preemptions` counter at the end (the job turns vLLM's
stat logging on for it).

Before each prompt index in "gate_before" the job creates `ready-<index>` in "gate_dir" and waits
for `go-<index>` there: the test acts on the world meanwhile (`run_vllm_job(..., at_gate=...)`),
so one engine serves before, during and after a fault. A gate at `len(prompts)` comes after the
last prompt, before the engine exits: the engine (and what it serves to others) stays up meanwhile.
"""

from __future__ import annotations

import importlib
import json
import sys
import time
from pathlib import Path

GATE_TIMEOUT_S = 300


def wait_at_gate(gate_dir: str, index: int) -> None:
    Path(gate_dir, f"ready-{index}").touch()
    deadline = time.monotonic() + GATE_TIMEOUT_S
    while not Path(gate_dir, f"go-{index}").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no go-{index} in {gate_dir} after {GATE_TIMEOUT_S} s")
        time.sleep(0.05)


def run(job: dict) -> dict:
    vllm = importlib.import_module(job.get("vllm_module", "vllm"))
    llm_kwargs = {
        "model": job["model"],
        "dtype": "float32",
        "max_model_len": 4096,
        "seed": 0,
        # vLLM's torch.compile warm-up costs 15-25 s per engine on this CPU and touches none of the
        # connector's hooks (they run outside the compiled graph). vLLM's compiled default is kept
        # by the smoke test (0.9.2's v1 engine), `make serve`'s path on 0.32 (test_latest_e2e),
        # DeepSeek-V2's MLA family test and the benchmark.
        "enforce_eager": True,
        **job.get("llm_kwargs", {}),
    }
    if job.get("kv_events_config") is not None:
        from vllm.config import KVEventsConfig

        llm_kwargs["kv_events_config"] = KVEventsConfig(**job["kv_events_config"])
    count_preemptions = bool(job.get("count_preemptions", False))
    if count_preemptions:
        llm_kwargs["disable_log_stats"] = False  # vLLM's counters are kept only with stat logging
    llm = vllm.LLM(**llm_kwargs)
    with_logprobs = bool(job.get("logprobs", False))
    per_prompt = job.get("prompt_extra_args") or [job.get("sampling_extra_args")] * len(job["prompts"])
    if len(per_prompt) != len(job["prompts"]):
        raise ValueError(f"prompt_extra_args has {len(per_prompt)} entries for {len(job['prompts'])} prompts")
    params = [
        vllm.SamplingParams(
            temperature=0.0,
            max_tokens=job.get("max_tokens", 16),
            ignore_eos=True,
            extra_args=extra,
            logprobs=0 if with_logprobs else None,
        )
        for extra in per_prompt
    ]
    gates = set(job.get("gate_before", []))
    if gates and job.get("rounds", 1) != 1:
        raise ValueError(f"gate_before needs rounds=1, got rounds={job['rounds']}")
    outputs, latencies, logprobs = [], [], []
    for _ in range(job.get("rounds", 1)):
        round_out, round_lat, round_lp = [], [], []
        for index, (ids, prompt_params) in enumerate(zip(job["prompts"], params)):
            if index in gates:
                wait_at_gate(job["gate_dir"], index)
            batch = bool(ids) and isinstance(ids[0], list)
            prompts = [{"prompt_token_ids": p} for p in (ids if batch else [ids])]
            start = time.perf_counter()
            results = llm.generate(prompts, prompt_params, use_tqdm=False)
            round_lat.append(time.perf_counter() - start)
            completions = [r.outputs[0] for r in results]
            outs = [list(c.token_ids) for c in completions]
            round_out.append(outs if batch else outs[0])
            if with_logprobs:
                lps = [[step[tok].logprob for tok, step in zip(c.token_ids, c.logprobs)] for c in completions]
                round_lp.append(lps if batch else lps[0])
        outputs.append(round_out)
        latencies.append(round_lat)
        logprobs.append(round_lp)
    if len(job["prompts"]) in gates:
        wait_at_gate(job["gate_dir"], len(job["prompts"]))
    if job.get("close_engine", False):
        from lmcache_vllm import close_lmcache_engine

        close_lmcache_engine()
    result = {"outputs": outputs, "latencies": latencies}
    if with_logprobs:
        result["logprobs"] = logprobs
    if count_preemptions:
        (counter,) = [m for m in llm.get_metrics() if m.name == "vllm:num_preemptions"]
        result["num_preemptions"] = counter.value
    return result


if __name__ == "__main__":
    result = run(json.load(sys.stdin))
    print("RESULT " + json.dumps(result), flush=True)
