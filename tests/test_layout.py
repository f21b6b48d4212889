"""The package's layout keeps the doors apart: the v0 door (`integration/vllm/v0/`, entry
`vllm_adapter.py`) and the v1 door (`integration/vllm/v1/`, entry `vllm_v1_adapter.py`) share only
the modules beside them, and the engine (`lmcache/experimental`, `lmcache/server`) imports neither."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "lmcache"
VLLM = "lmcache.integration.vllm"
DOORS = {
    "v0": (f"{VLLM}.v0", f"{VLLM}.vllm_adapter"),
    "v1": (f"{VLLM}.v1", f"{VLLM}.vllm_v1_adapter"),
    "blend": (f"{VLLM}.blend",),
}


def _imports(path: Path) -> set[str]:
    """Every module a file imports, absolute names (relative imports are not used here)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _module_of(path: Path) -> str:
    return ".".join(path.relative_to(PKG.parent).with_suffix("").parts)


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _violations(sources: list[Path], forbidden: tuple[str, ...]) -> list[str]:
    return sorted(f"{_module_of(p)} imports {n}" for p in sources for n in _imports(p) if _within(n, forbidden))


@pytest.mark.parametrize("door,other", [("v0", "v1"), ("v1", "v0"), ("v0", "blend"), ("blend", "v0")])
def test_a_door_does_not_import_the_other(door, other):
    sources = [p for p in PKG.rglob("*.py") if _within(_module_of(p), DOORS[door])]
    assert sources, door
    assert _violations(sources, DOORS[other]) == []


def test_the_engine_and_server_import_no_vllm_door():
    sources = [p for sub in ("experimental", "server") for p in (PKG / sub).rglob("*.py")]
    assert _violations(sources, (VLLM,)) == []


def test_the_violation_finder_sees_an_import():
    connector = PKG / "integration" / "vllm" / "v0" / "connector.py"
    found = _violations([connector], (f"{VLLM}.v0.step_plan",))
    assert found and all(v.startswith(f"{VLLM}.v0.connector imports {VLLM}.v0.step_plan") for v in found)
