"""CacheBlend benchmark: answer quality on the trained tiny model, TTFT on a benchmark-size one.

Quality (`scripts/train_tiny_model.py`'s model and task, `blend_task.py`): each document of a
held-out example is first sent in an earlier prompt of its own (after another document that
shares one of its items: the context it was cached in), then the example's prompt with its
documents in a shuffled order; the answer is the first greedy
token. Three engines: cache off (full recompute), CacheBlend at the default ratio, and naive
reuse (ratio 0: only the tokens no document covers are recomputed).

TTFT: a random-weight model of benchmark size, a prompt of 4 documents of `--doc-tokens` tokens;
cache off vs CacheBlend at the default ratio, the documents cached from a prompt with another
order first. TTFT is the time of a `generate` call for one token (median of `--reps`).

    python scripts/bench_blend.py [--examples 100] [--doc-tokens 1000] [--reps 3]

Writes `bench/results/blend-<time>.json` and a plot beside it. Each engine runs in a child
process (`--job`, JSON on stdin) because vLLM's v1 engine spawns its core process.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from blend_task import BlendTask  # noqa: E402
from make_tiny_model import TinyModelSpec, make_tiny_model  # noqa: E402
from train_tiny_model import SEPARATOR as TASK_SEPARATOR  # noqa: E402
from train_tiny_model import TrainSpec, separator_ids, trained_model  # noqa: E402

RESULTS = ROOT / "bench" / "results"
BENCH_MODEL = ROOT / ".cache" / "blend-bench-model"
# Prefill of a 4k-token prompt costs seconds on two cores with this size (see the env notes).
BENCH_SPEC = TinyModelSpec(hidden=512, layers=16, heads=16, kv_heads=4, intermediate=1536, max_position=8192, seed=0)
DEFAULT_RATIO = 0.15


# ----- one engine, in a child process -------------------------------------------------------------

def run_job(job: dict) -> None:
    """Warm-up prompts (not timed), then the measured ones; prints RESULT with first tokens and seconds."""
    import vllm

    llm = vllm.LLM(model=job["model"], dtype="float32", seed=0, max_model_len=job["max_model_len"],
                   enable_prefix_caching=False, **job.get("llm_kwargs", {}))
    params = vllm.SamplingParams(temperature=0.0, max_tokens=1)
    for ids in job["warm"]:
        llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
    tokens, seconds = [], []
    for ids in job["prompts"]:
        start = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        seconds.append(time.perf_counter() - start)
        tokens.append(out[0].outputs[0].token_ids[0])
    print("RESULT " + json.dumps({"tokens": tokens, "seconds": seconds}), flush=True)


def engine(model: Path, warm: list, prompts: list, blend: Optional[dict], max_model_len: int) -> dict:
    """Run one engine job: cache off (`blend` None) or CacheBlend with these LMCACHE_ settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_")}
    env.update({"VLLM_USE_V1": "1", "VLLM_CPU_KVCACHE_SPACE": "2", "TOKENIZERS_PARALLELISM": "false"})
    job = {"model": str(model), "warm": warm, "prompts": prompts, "max_model_len": max_model_len}
    if blend is not None:
        env.update({"LMCACHE_ENABLE_BLENDING": "true", "LMCACHE_USE_LAYERWISE": "true",
                    "LMCACHE_MAX_LOCAL_CPU_SIZE": "2", "LMCACHE_LOG_LEVEL": "INFO"})
        env.update({f"LMCACHE_{k.upper()}": str(v) for k, v in blend.items()})
        job["llm_kwargs"] = {"kv_transfer_config": {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}}
    proc = subprocess.run([sys.executable, __file__, "--job"], input=json.dumps(job), capture_output=True,
                          text=True, env=env, cwd=str(ROOT), timeout=1800)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.exit(f"bench_blend: engine job failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    result = json.loads(lines[-1][len("RESULT "):])
    result["blend_lines"] = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "CacheBlend reused" in ln]
    return result


# ----- the two measurements -------------------------------------------------------------------------

def quality(examples: int, seed: int) -> dict:
    model = trained_model(spec=TrainSpec())
    task = BlendTask(separator_ids(model), TrainSpec.num_docs, TrainSpec.items_per_doc)
    rng = random.Random(f"bench-{seed}")  # not the training stream (seeded by the int seed)
    held_out = [task.sample(rng) for _ in range(examples)]
    warm = [task.earlier_context(doc, rng) for ex in held_out for doc in ex.docs]
    prompts, answers = [], []
    for ex in held_out:
        docs = list(ex.docs)
        rng.shuffle(docs)
        prompts.append(task.prompt(docs))
        answers.append(task.answer(docs))  # the later partner in this order
    blend = {"blend_separator": TASK_SEPARATOR, "blend_min_tokens": 1}

    def accuracy(result: dict) -> float:
        return sum(t == a for t, a in zip(result["tokens"], answers)) / len(answers)

    full = engine(model, [], prompts, None, 512)
    blended = engine(model, warm, prompts, {**blend, "blend_recompute_ratio": DEFAULT_RATIO}, 512)
    naive = engine(model, warm, prompts, {**blend, "blend_recompute_ratio": 0.0}, 512)
    for name, result in (("blend", blended), ("naive", naive)):
        if len(result["blend_lines"]) != len(prompts):
            sys.exit(f"bench_blend: {name}: {len(result['blend_lines'])} blends for {len(prompts)} prompts")
    return {
        "quality_model": str(model.relative_to(ROOT)),
        "quality_examples": examples,
        "accuracy_full_recompute": accuracy(full),
        "accuracy_blend": accuracy(blended),
        "accuracy_naive_reuse": accuracy(naive),
        "blend_log_example": blended["blend_lines"][0],
    }


def ttft(doc_tokens: int, reps: int) -> dict:
    from transformers import AutoTokenizer

    make_tiny_model(BENCH_MODEL, BENCH_SPEC)
    sep = AutoTokenizer.from_pretrained(BENCH_MODEL).encode("[BLEND_SEP]", add_special_tokens=False)
    rng = random.Random(7)

    def text(n: int) -> list[int]:
        return [rng.randrange(100, BENCH_SPEC.vocab) for _ in range(n)]

    system, question = text(64), text(32)
    docs = [text(doc_tokens) for _ in range(4)]

    def prompt(order: list[int]) -> list[int]:
        ids = system + sep
        for i in order:
            ids += docs[i] + sep
        return ids + question

    cached_order, asked = prompt([0, 1, 2, 3]), prompt([2, 0, 3, 1])
    warm_up = text(64)  # the first generate call of an engine pays one-time costs
    full = engine(BENCH_MODEL, [warm_up], [asked] * reps, None, 8192)
    blended = engine(BENCH_MODEL, [warm_up, cached_order], [asked] * reps,
                     {"blend_recompute_ratio": DEFAULT_RATIO}, 8192)
    # The first send of the other order stores the documents; each measured send blends them.
    if len(blended["blend_lines"]) != reps or not all("reused 4 of 4" in ln for ln in blended["blend_lines"]):
        sys.exit(f"bench_blend: the TTFT prompt did not blend all 4 documents: {blended['blend_lines']}")
    full_s, blend_s = statistics.median(full["seconds"]), statistics.median(blended["seconds"])
    return {
        "ttft_model": {"hidden": BENCH_SPEC.hidden, "layers": BENCH_SPEC.layers, "heads": BENCH_SPEC.heads,
                       "kv_heads": BENCH_SPEC.kv_heads},
        "ttft_prompt_tokens": len(asked),
        "ttft_full_s": full_s,
        "ttft_blend_s": blend_s,
        "ttft_speedup": full_s / blend_s,
        "ttft_full_all_s": full["seconds"],
        "ttft_blend_all_s": blended["seconds"],
        "ttft_blend_log": blended["blend_lines"][-1],
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    if "accuracy_blend" in result:
        names = ["full recompute", f"CacheBlend {DEFAULT_RATIO}", "naive reuse"]
        values = [result["accuracy_full_recompute"], result["accuracy_blend"], result["accuracy_naive_reuse"]]
        left.bar(names, values, color=["grey", "tab:blue", "tab:red"])
        left.set_ylim(0, 1)
        left.set_title(f"answer accuracy ({result['quality_examples']} held-out prompts)")
    if "ttft_full_s" in result:
        right.bar(["full prefill", f"CacheBlend {DEFAULT_RATIO}"], [result["ttft_full_s"], result["ttft_blend_s"]],
                  color=["grey", "tab:blue"])
        right.set_ylabel("seconds")
        right.set_title(f"TTFT, {result['ttft_prompt_tokens']}-token prompt, 4 documents")
    fig.tight_layout()
    fig.savefig(path)


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--examples", type=int, default=100)
    p.add_argument("--doc-tokens", type=int, default=1000)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-quality", action="store_true")
    p.add_argument("--skip-ttft", action="store_true")
    p.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.job:
        run_job(json.load(sys.stdin))
        return
    for name in ("examples", "doc_tokens", "reps"):
        if getattr(args, name) <= 0:
            sys.exit(f"bench_blend: --{name.replace('_', '-')} must be positive")
    result: dict = {"command": "python scripts/bench_blend.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    if not args.skip_quality:
        result.update(quality(args.examples, args.seed))
    if not args.skip_ttft:
        result.update(ttft(args.doc_tokens, args.reps))
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    out = RESULTS / f"blend-{stamp}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out.with_suffix(".png"))
    print(json.dumps(result, indent=1))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
