"""Build a random-weight Llama-architecture model in Hugging Face format, with no network.

There is no model hub on these machines, so tests and benchmarks run vLLM on a model this script
makes: a byte-level BPE tokenizer trained on a corpus generated here from a fixed word list, and a
`LlamaForCausalLM` with seeded random weights saved as safetensors. The same arguments give the same
files (the weights' SHA-256 is printed and stored in `lmcache_tiny_model.json`), so a run is
reproducible and a folder can be reused when its recorded arguments match.

    python scripts/make_tiny_model.py OUT_DIR [--hidden 128 --layers 4 --heads 4 --kv-heads 2
                                               --vocab 1024 --seed 0]
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import random
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

MARKER = "lmcache_tiny_model.json"
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but "
    "have an they you were her one all we there their been has when who will more no if out so said "
    "what up its about into than them can only other new some could time these two may then do first "
    "any my now such like our over man me even most made after also did many before must through back "
    "years where much your way well down should because each just those people how too little state "
    "good very make world still own see men work long get here between both life being under never day "
    "same another know while last might us great old year off come since against go came right used "
    "take three cache memory token layer block chunk prefix store retrieve disk remote server request "
    "model engine prompt vector tensor hidden attention value key query batch stream kernel copy"
).split()


@dataclass(frozen=True)
class TinyModelSpec:
    """Everything that determines the model's files; stored beside them to recognise a reusable build."""

    hidden: int = 128
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    vocab: int = 1024
    intermediate: int = 0  # 0 means 2 * hidden
    max_position: int = 4096
    seed: int = 0

    def validate(self) -> None:
        for name in ("hidden", "layers", "heads", "kv_heads", "vocab", "max_position"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.hidden % self.heads:
            raise ValueError(f"--hidden {self.hidden} is not a multiple of --heads {self.heads}")
        if self.heads % self.kv_heads:
            raise ValueError(f"--heads {self.heads} is not a multiple of --kv-heads {self.kv_heads}")
        if self.vocab < 300:
            raise ValueError(f"--vocab {self.vocab} is too small for a byte-level BPE (needs >= 300)")


def corpus(seed: int, sentences: int = 20000) -> list[str]:
    """Deterministic text for training the tokenizer: seeded sentences over a fixed word list."""
    rng = random.Random(seed)
    lines = []
    for _ in range(sentences):
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 16))]
        if rng.random() < 0.2:
            words.append(str(rng.randint(0, 9999)))
        lines.append(" ".join(words).capitalize() + rng.choice([".", ".", "?", "!", ","]))
    return lines


def build_tokenizer(spec: TinyModelSpec, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(spec.seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=spec.max_position,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    # transformers 5 (vLLM 0.32's venv) records its new class name, which transformers 4 (vLLM
    # 0.9.2's) cannot load; the old name loads on both, so one build serves both venvs.
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2) + "\n")


def build_weights(spec: TinyModelSpec, out: Path) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=spec.vocab,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate or 2 * spec.hidden,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        max_position_embeddings=spec.max_position,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        torch_dtype="float32",
        tie_word_embeddings=False,
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    return hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()


def existing_build(spec: TinyModelSpec, out: Path) -> str | None:
    """The recorded weights hash when OUT already holds a complete build of exactly this spec."""
    marker = out / MARKER
    if not marker.exists() or not (out / "model.safetensors").exists():
        return None
    try:
        recorded = json.loads(marker.read_text())
    except (OSError, ValueError):
        return None
    return recorded.get("weights_sha256") if recorded.get("spec") == asdict(spec) else None


def make_tiny_model(out: Path, spec: TinyModelSpec, force: bool = False) -> str:
    """Build (or reuse) the model in OUT and return the SHA-256 of its weights file. Builders of
    one OUT take turns (a lock file beside it), so parallel test workers never read a half-built
    model."""
    spec.validate()
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not force and (digest := existing_build(spec, out)):
            return digest
        out.mkdir(parents=True, exist_ok=True)
        (out / MARKER).unlink(missing_ok=True)
        build_tokenizer(spec, out)
        digest = build_weights(spec, out)
        (out / MARKER).write_text(json.dumps({"spec": asdict(spec), "weights_sha256": digest}, indent=1))
        return digest


def parse_args(argv: list[str]) -> tuple[Path, TinyModelSpec, bool]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir", type=Path)
    defaults = TinyModelSpec()
    for field, value in asdict(defaults).items():
        p.add_argument(f"--{field.replace('_', '-')}", type=int, default=value, dest=field)
    p.add_argument("--force", action="store_true", help="rebuild even if OUT_DIR holds this build")
    args = vars(p.parse_args(argv))
    out, force = args.pop("out_dir"), args.pop("force")
    return out, TinyModelSpec(**args), force


def main(argv: list[str] | None = None) -> None:
    out, spec, force = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        digest = make_tiny_model(out, spec, force)
    except ValueError as exc:
        sys.exit(f"make_tiny_model: {exc}")
    size_mb = (out / "model.safetensors").stat().st_size / 2**20
    print(f"tiny model in {out}: {spec} weights {size_mb:.1f} MB sha256 {digest}")


if __name__ == "__main__":
    main()
