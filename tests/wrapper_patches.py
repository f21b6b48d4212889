"""The wrapper's patches on either vLLM line (tests/test_wrapper_hook.py, tests/latest/test_latest_wrapper.py).

Each patch goes on when vLLM imports the module that defines its function, so the order of imports
must not matter: `ORDERS` imports vLLM's modules before the wrapper, after it, and through
`lmcache_vllm.vllm.X` names, each in a fresh interpreter, and every patch point of the running
line must carry our wrapper exactly once. In-process, the injection comes off again
(`remove_injection`) leaving vLLM's own functions where they were.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import os
import subprocess
import sys
from typing import Any, Iterator

import pytest
import wrapt
from conftest import ROOT, VLLM_TEST_ENV

from lmcache.integration.vllm.vllm_compat import PLUGIN_PATCH_POINTS, WRAPPER_PATCH_POINTS, PatchPoint
from lmcache_vllm.vllm_injection import (
    INJECT_ENV,
    apply_injection,
    injection_requested,
    is_ours,
    remove_injection,
    stored_function,
)

ORDERS = ("vllm first", "wrapper first", "through the proxy")

# argv: the modules to import (JSON), the order. Prints the modules vLLM's own import of the
# wrapper brought in, and how many of our wrappers each imported patch point carries.
ORDER_PROBE = r"""
import importlib, json, sys
import wrapt
modules, order = json.loads(sys.argv[1]), sys.argv[2]
if order == "vllm first":
    for name in modules:
        importlib.import_module(name)
    import lmcache_vllm.vllm
elif order == "wrapper first":
    import lmcache_vllm.vllm
    early = [name for name in modules if name in sys.modules]
    for name in modules:
        importlib.import_module(name)
else:
    for name in modules:
        importlib.import_module("lmcache_vllm." + name)
from lmcache.integration.vllm.vllm_compat import PLUGIN_PATCH_POINTS, WRAPPER_PATCH_POINTS
from lmcache_vllm import plugin, vllm_injection
plugin.general_plugin()  # as vLLM calls it in each of its processes
vllm_injection.apply_injection()
counts = {}
for point in WRAPPER_PATCH_POINTS + PLUGIN_PATCH_POINTS:
    try:
        stored = wrapt.resolve_path(sys.modules[point.module], point.path)[2]
    except (KeyError, AttributeError):
        continue  # a module or name of the other vLLM line
    counts[str(point)] = sum(map(vllm_injection.is_ours, wrapt.wrapper_chain(stored)))
print("PATCHES " + json.dumps({"early": early if order == "wrapper first" else [], "counts": counts}))
"""


def running_points() -> list[PatchPoint]:
    return [p for p in WRAPPER_PATCH_POINTS + PLUGIN_PATCH_POINTS if p.applies()]


@functools.lru_cache(maxsize=None)
def patches_after_each_order() -> dict[str, dict[str, Any]]:
    """Run `ORDER_PROBE` for the running line's patch points, one fresh interpreter per order, all
    at once (each imports vLLM: ~15 s apiece one after another on two cores)."""
    modules = sorted({p.module for p in running_points()})
    env = {k: v for k, v in os.environ.items() if k != INJECT_ENV}
    env.update(VLLM_TEST_ENV)
    probes = {
        order: subprocess.Popen([sys.executable, "-c", ORDER_PROBE, json.dumps(modules), order], cwd=str(ROOT),
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for order in ORDERS
    }
    found = {}
    for order, proc in probes.items():
        stdout, stderr = proc.communicate(timeout=600)
        lines = [ln for ln in stdout.splitlines() if ln.startswith("PATCHES ")]
        assert proc.returncode == 0 and lines, f"{order}: " + stdout[-3000:] + stderr[-3000:]
        found[order] = json.loads(lines[-1][len("PATCHES "):])
    return found


def check_import_order(order: str) -> None:
    """Every patch point of the running line wrapped once, the other line's not at all, and no
    patched module imported by the wrapper before vLLM asked for it."""
    found = patches_after_each_order()[order]
    assert found["early"] == []
    want = {str(p): 1 for p in running_points()}
    assert {k: v for k, v in found["counts"].items() if v or k in want} == want


def our_wrappers(point: PatchPoint) -> int:
    return sum(map(is_ours, wrapt.wrapper_chain(stored_function(sys.modules[point.module], point))))


@contextlib.contextmanager
def injected() -> Iterator[None]:
    """The wrapper's injection in this process for the block, taken off after it."""
    apply_injection()
    try:
        yield
    finally:
        remove_injection()


def check_injection_comes_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """Applied twice, every wrapper patch point carries one wrapper; removed, vLLM's own function is
    back in the very slot it was (an inherited method leaves no copy on the subclass)."""
    monkeypatch.delenv(INJECT_ENV, raising=False)
    points = [p for p in WRAPPER_PATCH_POINTS if p.applies()]

    def slots() -> dict[str, tuple[Any, bool]]:
        found = {}
        for p in points:
            parent, name, stored = wrapt.resolve_path(importlib.import_module(p.module), p.path)
            found[str(p)] = (stored, name in vars(parent))
        return found

    before = slots()
    with injected():
        apply_injection()
        assert injection_requested()
        assert {str(p): our_wrappers(p) for p in points} == {str(p): 1 for p in points}
    assert not injection_requested()
    after = slots()
    assert all(after[k][0] is v[0] and after[k][1] == v[1] for k, v in before.items())


def check_missing_patch_point_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """A patch point this vLLM lacks is an ImportError naming it (here: the engine-args method each
    line's wrapper turns its connector on in, which no base class of `EngineArgs` has)."""
    monkeypatch.delenv(INJECT_ENV, raising=False)
    point = next(p for p in WRAPPER_PATCH_POINTS if p.module == "vllm.engine.arg_utils" and p.applies())
    owner, name, _ = wrapt.resolve_path(importlib.import_module(point.module), point.path)
    with monkeypatch.context() as patch:
        patch.delattr(owner, name)
        with pytest.raises(ImportError, match=f"vLLM .* has no {point.module}.{point.path} to wrap"):
            apply_injection()
    remove_injection()


# The tests themselves, collected by each line's test module that imports them
# (test_wrapper_hook.py on 0.9.2, latest/test_latest_wrapper.py on 0.32).
@pytest.mark.parametrize("order", ORDERS)
def test_every_patch_is_applied_once_whatever_is_imported_first(order):
    check_import_order(order)


def test_the_injection_comes_off_again(monkeypatch):
    check_injection_comes_off(monkeypatch)


def test_a_patch_point_vllm_lacks_is_an_import_error_naming_it(monkeypatch):
    check_missing_patch_point_is_named(monkeypatch)
