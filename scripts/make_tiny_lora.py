"""Build a random LoRA adapter in PEFT's format for a tiny model of `make_tiny_model.py`, with no network.

vLLM's `--lora-modules NAME=PATH` reads a folder with `adapter_config.json` and
`adapter_model.safetensors`. The adapter here adapts every layer's `q_proj` and `v_proj` with
seeded random A and B matrices (PEFT starts B at zero, which would make an adapter that changes
nothing), so two seeds give two adapters whose outputs differ from the base model and each other.
The same arguments give the same files.

    python scripts/make_tiny_lora.py MODEL_DIR OUT_DIR [--seed 1 --rank 8]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import save_file

TARGETS = ("q_proj", "v_proj")


def make_tiny_lora(model_dir: Path, out: Path, seed: int = 1, rank: int = 8) -> str:
    """Write the adapter for the model in `model_dir` into `out` (kept when already built with the
    same arguments); returns `out` as a string."""
    config = json.loads((model_dir / "config.json").read_text())
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    out_features = {"q_proj": heads * head_dim, "v_proj": config["num_key_value_heads"] * head_dim}
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model_dir),
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": list(TARGETS),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        "lmcache_tiny_lora_seed": seed,
    }
    config_path = out / "adapter_config.json"
    if config_path.exists() and json.loads(config_path.read_text()) == adapter_config:
        return str(out)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for target in TARGETS:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{target}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, hidden, generator=gen) * 0.1
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features[target], rank, generator=gen) * 0.1
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config_path.write_text(json.dumps(adapter_config, indent=2) + "\n")  # last: a half-built folder is rebuilt
    return str(out)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--rank", type=int, default=8)
    args = parser.parse_args(argv)
    print(make_tiny_lora(args.model_dir, args.out, args.seed, args.rank))


if __name__ == "__main__":
    main()
