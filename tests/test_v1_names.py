"""`lmcache.v1.*` (upstream's current name, what vLLM 0.3x imports) is `lmcache.experimental.*`."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import pytest

import lmcache.experimental


def test_engine_names_are_the_same_objects() -> None:
    from lmcache.experimental.cache_engine import LMCacheEngine, LMCacheEngineBuilder
    from lmcache.experimental.config import LMCacheEngineConfig
    from lmcache.v1.cache_engine import LMCacheEngine as V1Engine
    from lmcache.v1.cache_engine import LMCacheEngineBuilder as V1Builder
    from lmcache.v1.config import LMCacheEngineConfig as V1Config

    assert V1Builder is LMCacheEngineBuilder
    assert V1Engine is LMCacheEngine
    assert V1Config is LMCacheEngineConfig


def test_every_module_has_its_v1_name_without_a_second_copy() -> None:
    """In a fresh interpreter, v1 names first: each is the experimental module itself (its own
    name and spec), and no module is loaded twice."""
    prefix = "lmcache.experimental."
    names = [m.name[len(prefix):] for m in pkgutil.walk_packages(lmcache.experimental.__path__, prefix)]
    assert "cache_engine" in names and "memory_management.allocators" in names
    code = (
        "import importlib, sys\n"
        f"names = {names!r}\n"
        "for n in names:\n"
        "    v1 = importlib.import_module('lmcache.v1.' + n)\n"
        "    real = importlib.import_module('lmcache.experimental.' + n)\n"
        "    assert v1 is real, n\n"
        "    assert real.__name__ == real.__spec__.name == 'lmcache.experimental.' + n, n\n"
        "twins = [m for m in list(sys.modules) if m.startswith('lmcache.v1.') and\n"
        "         sys.modules[m].__name__ == m]\n"
        "assert not twins, twins\n"
        "print('ok', len(names))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("ok")


def test_unknown_v1_module_is_not_found() -> None:
    with pytest.raises(ModuleNotFoundError, match="lmcache.v1.no_such_module"):
        import lmcache.v1.no_such_module  # noqa: F401
