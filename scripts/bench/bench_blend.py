"""CacheBlend benchmark: answer quality on the trained tiny model, TTFT on a benchmark-size one.

Quality (`scripts/train_tiny_model.py`'s model and task, `blend_task.py`): each document of a
held-out example is first sent in an earlier prompt of its own (after another document that
shares one of its items: the context it was cached in), then the example's prompt with its
documents in a shuffled order; the answer is the first greedy
token. Three engines: cache off (full recompute), CacheBlend at the default ratio, and naive
reuse (ratio 0: only the tokens no document covers are computed, the documents' cached KV is used
at every layer). `--layers` picks the trained model's depth (4: `.cache/blend-trained-model`).
`--ablations` adds two CacheBlend engines whose token choice is replaced in their worker, to show
what the choice contributes: `no_selection` (the first layer and the check layer in full as
always, then none of the reused tokens) and `random_selection` (the default ratio's share of
reused tokens drawn at random instead of the most deviating).

TTFT: a random-weight model of benchmark size, a prompt of 4 documents of `--doc-tokens` tokens;
cache off vs CacheBlend at the default ratio, the documents cached from a prompt with another
order first. TTFT is the time of a `generate` call for one token. Both engines stay up and are
asked in turn, `--reps` times each (the machine is shared: load must fall on both sides alike);
the medians and the median of the per-pair ratios are reported, with the load average.

    python scripts/bench/bench_blend.py [--examples 400] [--layers 4] [--ablations] [--doc-tokens 1000] [--reps 6]

Writes `bench/results/blend-<time>.json` and a plot beside it (`--replot JSON...` redraws plots only).
Each engine runs in a child process (`--job`: the job's JSON on the first stdin line, then one prompt
per line) because vLLM's v1 engine spawns its core process.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

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

def replace_selection(ablation: str) -> None:
    """Swap CacheBlend's token choice in this process (the engine core runs in it: see `Engine`)."""
    import torch

    from lmcache.experimental.blend.selection import select_recompute
    from lmcache.integration.vllm.blend import runner as blend_runner

    if ablation == "no_selection":
        blend_runner.select_recompute = lambda deviation, reused, ratio: select_recompute(deviation, reused, 0.0)
    elif ablation == "random_selection":
        gen = torch.Generator().manual_seed(0)
        blend_runner.select_recompute = lambda deviation, reused, ratio: select_recompute(
            torch.rand(deviation.shape, generator=gen), reused, ratio)
    else:
        raise ValueError(f"unknown ablation {ablation!r}")


def serve_job(job: dict) -> None:
    """The child: build the engine, send the warm-up prompts (not timed), then answer one prompt
    per stdin line with a RESULT line (first greedy token, seconds of the `generate` call)."""
    import vllm

    if job.get("ablation"):
        replace_selection(job["ablation"])

    llm = vllm.LLM(model=job["model"], dtype="float32", seed=0, max_model_len=job["max_model_len"],
                   enable_prefix_caching=False, **job.get("llm_kwargs", {}))
    params = vllm.SamplingParams(temperature=0.0, max_tokens=1)
    for ids in job["warm"]:
        llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
    print("READY", flush=True)
    for line in sys.stdin:
        start = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": json.loads(line)}], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        print("RESULT " + json.dumps({"token": out[0].outputs[0].token_ids[0], "seconds": seconds}), flush=True)


class Engine:
    """One engine in a child process (vLLM's v1 engine spawns its core process), kept up so two
    engines can be asked in turn: cache off (`blend` None) or CacheBlend with these LMCACHE_ settings."""

    def __init__(self, model: Path, warm: list, blend: Optional[dict], max_model_len: int,
                 ablation: Optional[str] = None) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_")}
        env.update({"VLLM_USE_V1": "1", "VLLM_CPU_KVCACHE_SPACE": "2", "TOKENIZERS_PARALLELISM": "false"})
        job = {"model": str(model), "warm": warm, "max_model_len": max_model_len, "ablation": ablation}
        if ablation:  # the replaced selection must run where the worker does: in this child
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if blend is not None:
            env.update({"LMCACHE_ENABLE_BLENDING": "true", "LMCACHE_USE_LAYERWISE": "true",
                        "LMCACHE_MAX_LOCAL_CPU_SIZE": "2", "LMCACHE_LOG_LEVEL": "INFO"})
            env.update({f"LMCACHE_{k.upper()}": str(v) for k, v in blend.items()})
            job["llm_kwargs"] = {"kv_transfer_config": {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}}
        self._log = tempfile.TemporaryFile(mode="w+")  # vLLM's and LMCache's logs (read at close)
        self._proc = subprocess.Popen([sys.executable, __file__, "--job"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                      cwd=str(ROOT))
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps(job) + "\n")
        self._proc.stdin.flush()
        self._expect("READY")

    def _expect(self, prefix: str) -> str:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix):]
            self._log.write(line)
        self._log.seek(0)
        sys.exit(f"bench_blend: engine job failed (exit {self._proc.wait()}):\n{self._log.read()[-4000:]}")

    def ask(self, ids: list[int]) -> tuple[int, float]:
        """The first greedy token of this prompt and the seconds it took."""
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps(ids) + "\n")
        self._proc.stdin.flush()
        result = json.loads(self._expect("RESULT "))
        return result["token"], result["seconds"]

    def close(self) -> list[str]:
        """Stop the engine; returns its CacheBlend log lines."""
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.close()
        self._log.write(self._proc.stdout.read())
        self._proc.wait(timeout=300)
        self._log.seek(0)
        return [ln for ln in self._log.read().splitlines() if "CacheBlend reused" in ln]


# ----- the two measurements -------------------------------------------------------------------------

def quality(examples: int, seed: int, layers: int, ablations: bool) -> dict:
    spec = TrainSpec(layers=layers)
    model = trained_model(spec=spec)
    task = BlendTask(separator_ids(model), spec.num_docs, spec.items_per_doc)
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
    result: dict = {"quality_model": str(model.relative_to(ROOT)), "quality_model_layers": layers,
                    "quality_examples": examples}
    at_default = {**blend, "blend_recompute_ratio": DEFAULT_RATIO}
    runs = [("full_recompute", None, None), ("blend", at_default, None),
            ("naive_reuse", {**blend, "blend_recompute_ratio": 0.0}, None)]
    if ablations:
        runs += [(name, at_default, name) for name in ("no_selection", "random_selection")]
    for name, settings, ablation in runs:
        engine = Engine(model, [] if settings is None else warm, settings, 512, ablation)
        right = sum(engine.ask(ids)[0] == answer for ids, answer in zip(prompts, answers))
        lines = engine.close()
        if settings is not None and len(lines) != len(prompts):
            sys.exit(f"bench_blend: {name}: {len(lines)} blends for {len(prompts)} prompts")
        accuracy = right / examples
        result[f"accuracy_{name}"] = accuracy
        # Binomial standard error of one accuracy: a difference of two needs ~2x the larger.
        result[f"accuracy_{name}_stderr"] = math.sqrt(accuracy * (1 - accuracy) / examples)
        if settings is not None:
            result[f"{name}_log_example"] = lines[0]
    return result


def ttft(doc_tokens: int, reps: int) -> dict:
    """Cache off and CacheBlend both up, asked in turn (off, blend, blend, off, ...) so that the
    shared machine's load falls on both alike."""
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
    full = Engine(BENCH_MODEL, [warm_up], None, 8192)
    # The first send of the other order stores the documents; each measured send blends them.
    blended = Engine(BENCH_MODEL, [warm_up, cached_order], {"blend_recompute_ratio": DEFAULT_RATIO}, 8192)
    seconds: dict = {"full": [], "blend": []}
    tokens: dict = {"full": set(), "blend": set()}
    loads = [os.getloadavg()[0]]
    for rep in range(reps):
        sides = (("full", full), ("blend", blended))
        for name, engine in sides if rep % 2 == 0 else sides[::-1]:
            token, took = engine.ask(asked)
            seconds[name].append(took)
            tokens[name].add(token)
        loads.append(os.getloadavg()[0])
    full.close()
    lines = blended.close()
    if len(lines) != reps or not all("reused 4 of 4" in ln for ln in lines):
        sys.exit(f"bench_blend: the TTFT prompt did not blend all 4 documents: {lines}")
    if len(tokens["full"]) != 1 or len(tokens["blend"]) != 1:
        sys.exit(f"bench_blend: one prompt gave several first tokens: {tokens}")
    full_s, blend_s = statistics.median(seconds["full"]), statistics.median(seconds["blend"])
    ratios = [f / b for f, b in zip(seconds["full"], seconds["blend"])]
    return {
        "ttft_model": {"hidden": BENCH_SPEC.hidden, "layers": BENCH_SPEC.layers, "heads": BENCH_SPEC.heads,
                       "kv_heads": BENCH_SPEC.kv_heads},
        "ttft_prompt_tokens": len(asked),
        "ttft_full_s": full_s,
        "ttft_blend_s": blend_s,
        "ttft_speedup": full_s / blend_s,
        "ttft_speedup_median_pair": statistics.median(ratios),
        "ttft_full_all_s": seconds["full"],
        "ttft_blend_all_s": seconds["blend"],
        "ttft_load_1min": loads,  # os.getloadavg() before the first pair and after each
        "ttft_blend_log": lines[-1],
    }


def plot(result: dict, path: Path) -> None:
    """A panel for each part the run measured (quality, TTFT), nothing for a part it skipped."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = [part for part in ("accuracy_blend", "ttft_full_s") if part in result]
    fig, axes = plt.subplots(1, max(len(parts), 1), figsize=(5 * max(len(parts), 1), 4), squeeze=False,
                             layout="constrained")
    panels = iter(axes[0])
    if "accuracy_blend" in result:
        ax = next(panels)
        bars = [("full\nrecompute", "full_recompute", "grey"), (f"CacheBlend\n{DEFAULT_RATIO}", "blend", "tab:blue"),
                ("naive\nreuse", "naive_reuse", "tab:red"), ("no\nselection", "no_selection", "tab:orange"),
                ("random\nselection", "random_selection", "tab:purple")]
        bars = [(label, result[f"accuracy_{key}"], color) for label, key, color in bars if f"accuracy_{key}" in result]
        ax.bar([b[0] for b in bars], [b[1] for b in bars], color=[b[2] for b in bars])
        ax.set_ylim(0, 1)
        layers = result.get("quality_model_layers")
        ax.set_title(f"accuracy, {f'{layers}-layer model, ' if layers else ''}"
                     f"{result['quality_examples']} held-out prompts")
    if "ttft_full_s" in result:
        ax = next(panels)
        ax.bar(["full prefill", f"CacheBlend {DEFAULT_RATIO}"], [result["ttft_full_s"], result["ttft_blend_s"]],
               color=["grey", "tab:blue"])
        ax.set_ylabel("seconds")
        ax.set_title(f"TTFT, {result['ttft_prompt_tokens']}-token prompt, 4 documents")
    fig.savefig(path)
    plt.close(fig)


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--examples", type=int, default=400)
    p.add_argument("--doc-tokens", type=int, default=1000)
    p.add_argument("--reps", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=TrainSpec.layers, help="depth of the trained quality model")
    p.add_argument("--ablations", action="store_true", help="also CacheBlend with no / random token selection")
    p.add_argument("--skip-quality", action="store_true")
    p.add_argument("--skip-ttft", action="store_true")
    p.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--replot", nargs="+", type=Path, metavar="JSON",
                   help="only redraw the PNG beside each of these result JSONs (no benchmark run)")
    args = p.parse_args(argv)
    if args.replot:
        for path in args.replot:
            plot(json.loads(path.read_text()), path.with_suffix(".png"))
            print(f"wrote {path.with_suffix('.png')}")
        return
    if args.job:
        serve_job(json.loads(sys.stdin.readline()))
        return
    for name in ("examples", "doc_tokens", "reps", "layers"):
        if getattr(args, name) <= 0:
            sys.exit(f"bench_blend: --{name.replace('_', '-')} must be positive")
    result: dict = {"command": "python scripts/bench/bench_blend.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    if not args.skip_quality:
        result.update(quality(args.examples, args.seed, args.layers, args.ablations))
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
