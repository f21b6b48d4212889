"""Build a random-weight model in Hugging Face format, with no network.

There is no model hub on these machines, so tests and benchmarks run vLLM on a model this script
makes: a byte-level BPE tokenizer trained on a corpus generated here from a fixed word list, and a
causal LM with seeded random weights saved as safetensors. The same arguments give the same
files (the weights' SHA-256 is printed and stored in `lmcache_tiny_model.json`), so a run is
reproducible and a folder can be reused when its recorded arguments match.

`--family` picks the architecture (default `llama`; see `FAMILIES`): the tests' family matrix
runs each through the connector. Families whose config class the installed transformers lacks
(DeepSeek-V2 under transformers 4.53, vLLM 0.9.2's venv) are refused, naming the class.

    python scripts/make_tiny_model.py OUT_DIR [--family llama --hidden 128 --layers 4 --heads 4
                                               --kv-heads 2 --vocab 1024 --seed 0]
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
from typing import Any, Callable, Dict

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
    family: str = "llama"

    def validate(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"--family {self.family!r} is not one of {', '.join(FAMILIES)}")
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


def _common(spec: TinyModelSpec) -> Dict[str, Any]:
    """The config keys every decoder family shares (the Llama naming)."""
    return dict(
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


def _gpt2(spec: TinyModelSpec) -> Dict[str, Any]:
    """GPT-2 names its sizes differently and has learned positions (no rotary), no GQA."""
    return dict(vocab_size=spec.vocab, n_embd=spec.hidden, n_layer=spec.layers, n_head=spec.heads,
                n_positions=min(spec.max_position, 1024), bos_token_id=1, eos_token_id=2, pad_token_id=3,
                torch_dtype="float32", tie_word_embeddings=False)


# The window of the Gemma 2 family: smaller than the tests' prompts, so its sliding-window
# layers really drop tokens.
GEMMA2_SLIDING_WINDOW = 32

# family -> (transformers config class, model class, config keys of the spec). The extra keys keep
# each family tiny and make it show its feature: Gemma 2 a window smaller than the prompts and
# alternating global layers, the MoEs 4 experts (2 per token), DeepSeek-V2 MLA with vLLM's MLA
# head size 576 (kv_lora_rank 512 + rope 64) and dense MLPs only (with routed experts, vLLM 0.32's
# CPU MoE runner stopped at a torch.compile data-dependent assert; Mixtral is the MoE),
# GraniteMoeHybrid a Mamba layer then an attention one.
FAMILIES: Dict[str, tuple] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", _common),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", _common),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", lambda spec: {
        **_common(spec), "head_dim": spec.hidden // spec.heads, "sliding_window": GEMMA2_SLIDING_WINDOW,
        "query_pre_attn_scalar": spec.hidden // spec.heads, "tie_word_embeddings": True,
        "hidden_activation": "gelu_pytorch_tanh", "hidden_act": "gelu_pytorch_tanh"}),  # vLLM 0.9.2 reads the old name
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", lambda spec: {
        **_common(spec), "num_local_experts": 4, "num_experts_per_tok": 2}),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", _gpt2),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", lambda spec: {
        **_common(spec), "num_key_value_heads": spec.heads, "kv_lora_rank": 512, "q_lora_rank": None,
        "qk_rope_head_dim": 64, "qk_nope_head_dim": 32, "v_head_dim": 32, "first_k_dense_replace": spec.layers}),
    "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", lambda spec: {
        **_common(spec), "layer_types": (["mamba", "attention"] * spec.layers)[: spec.layers],
        "num_local_experts": 4, "num_experts_per_tok": 2, "shared_intermediate_size": spec.hidden,
        "mamba_n_heads": 4, "mamba_d_head": spec.hidden // 2, "mamba_d_state": 16, "mamba_n_groups": 1,
        "mamba_chunk_size": 64}),
}


def family_classes(family: str) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The installed transformers' config and model classes of `family`."""
    import transformers

    config_name, model_name, _ = FAMILIES[family]
    if not hasattr(transformers, config_name):
        raise ValueError(
            f"--family {family}: transformers {transformers.__version__} has no {config_name}"
        )
    return getattr(transformers, config_name), getattr(transformers, model_name)


def config_keys(spec: TinyModelSpec) -> Dict[str, Any]:
    """The transformers config keys of this spec's family (recorded in the marker too)."""
    return FAMILIES[spec.family][2](spec)


def build_weights(spec: TinyModelSpec, out: Path) -> str:
    import torch

    config_class, model_class = family_classes(spec.family)
    config = config_class(**config_keys(spec))
    torch.manual_seed(spec.seed)
    model = model_class(config).to(torch.float32)
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
    same = recorded.get("spec") == asdict(spec) and recorded.get("config") == config_keys(spec)
    return recorded.get("weights_sha256") if same else None


def make_tiny_model(out: Path, spec: TinyModelSpec, force: bool = False) -> str:
    """Build (or reuse) the model in OUT and return the SHA-256 of its weights file. Builders of
    one OUT take turns (a lock file beside it), so parallel test workers never read a half-built
    model."""
    spec.validate()
    family_classes(spec.family)  # refuse a family this transformers cannot build, before any file
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not force and (digest := existing_build(spec, out)):
            return digest
        out.mkdir(parents=True, exist_ok=True)
        (out / MARKER).unlink(missing_ok=True)
        build_tokenizer(spec, out)
        digest = build_weights(spec, out)
        marker = {"spec": asdict(spec), "config": config_keys(spec), "weights_sha256": digest}
        (out / MARKER).write_text(json.dumps(marker, indent=1))
        return digest


def parse_args(argv: list[str]) -> tuple[Path, TinyModelSpec, bool]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir", type=Path)
    defaults = TinyModelSpec()
    for field, value in asdict(defaults).items():
        p.add_argument(f"--{field.replace('_', '-')}", type=type(value), default=value, dest=field)
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
