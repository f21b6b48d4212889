"""Train the tiny Llama on CacheBlend's synthetic RAG task (`blend_task.py`), so blending quality
can be measured without a model hub.

The model is `make_tiny_model.py`'s (same tokenizer, config and safetensors format, so vLLM
loads it), its random weights trained on the task until it answers the held-out set or the step
budget runs out. Deterministic for a seed (one thread, seeded data and init): the same install
gives bit-identical weights; the record names the torch and transformers versions, since another
build may round differently. The result is cached under `.cache/` with its spec and reused when
the spec matches.

    python scripts/train_tiny_model.py [OUT_DIR] [--steps 3000 --seed 0 --layers 4]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from blend_task import BlendTask  # noqa: E402
from make_tiny_model import TinyModelSpec, make_tiny_model  # noqa: E402

DEFAULT_OUT = ROOT / ".cache" / "blend-trained-model"
MARKER = "lmcache_blend_training.json"
# One token with the tiny tokenizer, so the prompts stay short enough to train on two cores
# (the bench passes it as blend_separator).
SEPARATOR = "|"


@dataclass(frozen=True)
class TrainSpec:
    """Everything that determines the trained weights."""

    steps: int = 3000
    batch: int = 64
    lr: float = 1e-3
    seed: int = 0
    num_docs: int = 4
    items_per_doc: int = 8
    eval_examples: int = 256
    target_accuracy: float = 0.99  # stop early once the held-out accuracy reaches it
    layers: int = 4  # decoder layers; records written before this field existed had 4

    def out_dir(self) -> Path:
        """The cache folder for this spec: the default's, suffixed with each field that differs
        from the default (`-layers8`), so another spec never overwrites a model in use."""
        changed = [f"-{k}{v}" for k, v in asdict(self).items() if v != getattr(TrainSpec, k)]
        return DEFAULT_OUT.with_name(DEFAULT_OUT.name + "".join(changed))


def _print(line: str) -> None:
    print(line, flush=True)


def model_spec(spec: TrainSpec) -> TinyModelSpec:
    # Head size 32 (vLLM's CPU attention needs one it supports), as small as that allows.
    return TinyModelSpec(hidden=64, layers=spec.layers, heads=2, kv_heads=1, intermediate=128, seed=spec.seed)


def separator_ids(model_dir: Path) -> tuple[int, ...]:
    from transformers import AutoTokenizer

    return tuple(AutoTokenizer.from_pretrained(model_dir).encode(SEPARATOR, add_special_tokens=False))


def batch_of(task: BlendTask, rng: random.Random, n: int):
    import torch

    examples = [task.sample(rng) for _ in range(n)]
    tokens = torch.tensor([task.prompt(e.docs) for e in examples], dtype=torch.long)
    answers = torch.tensor([e.answer for e in examples], dtype=torch.long)
    return tokens, answers


def last_logits(model, tokens):
    hidden = model.model(input_ids=tokens).last_hidden_state[:, -1]
    return model.lm_head(hidden)


def accuracy(model, tokens, answers) -> float:
    import torch

    with torch.no_grad():
        return float((last_logits(model, tokens).argmax(-1) == answers).float().mean())


def train(out: Path, spec: TrainSpec, log=_print) -> dict:
    """Build the base model in OUT, train it, save the weights; returns the training record."""
    import torch
    from transformers import LlamaForCausalLM

    # One thread: on two shared cores a second one mostly waits, and the sums stay in one order.
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    make_tiny_model(out, model_spec(spec), force=True)
    task = BlendTask(separator_ids(out), spec.num_docs, spec.items_per_doc)
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM.from_pretrained(out, torch_dtype=torch.float32, attn_implementation="sdpa")
    model.train()
    held_out = batch_of(task, random.Random(f"eval-{spec.seed}"), spec.eval_examples)
    rng = random.Random(spec.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.01)
    warmup = max(1, spec.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
    started = time.perf_counter()
    acc, step = 0.0, 0
    for step in range(1, spec.steps + 1):
        tokens, answers = batch_of(task, rng, spec.batch)
        loss = torch.nn.functional.cross_entropy(last_logits(model, tokens), answers)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 100 == 0 or step == spec.steps:
            model.eval()
            acc = accuracy(model, *held_out)
            model.train()
            log(f"step {step} loss {loss.item():.3f} held-out accuracy {acc:.3f} ({time.perf_counter() - started:.0f} s)")
            if acc >= spec.target_accuracy:
                break
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    import transformers

    # Bit-exact for a seed within one install; another torch build may sum in another order.
    record = {"spec": asdict(spec), "steps_run": step, "held_out_accuracy": acc,
              "train_seconds": round(time.perf_counter() - started, 1),
              "versions": {"torch": torch.__version__, "transformers": transformers.__version__}}
    (out / MARKER).write_text(json.dumps(record, indent=1))
    return record


def trained_model(out: Path | None = None, spec: TrainSpec = TrainSpec(), log=_print) -> Path:
    """OUT (default: the spec's cache folder) holding a model trained with `spec` (trained now
    unless already there)."""
    out = spec.out_dir() if out is None else out
    marker = out / MARKER
    if marker.exists():
        try:
            # Fields missing from an older record take their defaults (they had those values).
            if TrainSpec(**json.loads(marker.read_text())["spec"]) == spec:
                return out
        except (ValueError, KeyError, TypeError):
            pass
    train(out, spec, log)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir", type=Path, nargs="?", default=None,
                   help="default: .cache/blend-trained-model, suffixed with the non-default settings")
    p.add_argument("--steps", type=int, default=TrainSpec.steps)
    p.add_argument("--seed", type=int, default=TrainSpec.seed)
    p.add_argument("--layers", type=int, default=TrainSpec.layers)
    p.add_argument("--force", action="store_true", help="train again even if OUT_DIR holds this spec")
    args = p.parse_args(argv)
    spec = TrainSpec(steps=args.steps, seed=args.seed, layers=args.layers)
    if args.steps <= 0 or args.layers <= 0:
        sys.exit(f"train_tiny_model: --steps and --layers must be positive, got {args.steps}, {args.layers}")
    out = spec.out_dir() if args.out_dir is None else args.out_dir
    if args.force:
        (out / MARKER).unlink(missing_ok=True)
    out = trained_model(out, spec)
    print(f"trained model in {out}: {(out / MARKER).read_text()}")


if __name__ == "__main__":
    main()
