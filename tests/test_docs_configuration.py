"""docs/configuration.md cannot drift from the code, and the docs' relative links resolve.

The code's registry of settings is `LMCacheEngineConfig`'s fields, `LEGACY_KEYS` and
`NON_FIELD_ENV_VARS` (lmcache/experimental/config.py). These tests check that the page documents
each of them (a field with its variable and the default `from_env()` starts from), that it
documents nothing else, and that every `LMCACHE_*` variable the sources name is in the registry.
Pure Python: no vLLM engine, no kernels.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

from lmcache.experimental.config import (
    LEGACY_KEYS,
    NON_FIELD_ENV_VARS,
    LMCacheEngineConfig,
    env_var_name,
    field_names,
)

ROOT = Path(__file__).resolve().parent.parent
CONFIG_DOC = ROOT / "docs" / "configuration.md"
VARIABLE = re.compile(r"\bLMCACHE_[A-Z0-9_]*[A-Z0-9]\b")
# A table row whose first two cells are a backticked key and its backticked variable.
KEY_ROW = re.compile(r"^\|\s*`([a-z0-9_]+)`\s*\|\s*`(LMCACHE_[A-Z0-9_]+)`\s*\|(.*)$")
# Names the sources spell like a variable but that are not read from the environment.
NOT_VARIABLES = {"LMCACHE_WITH_CUDA": "a C macro setup.py defines for csrc/ when it builds the CUDA kernels"}


def documented_rows() -> Dict[str, Tuple[str, List[str]]]:
    """key -> (variable, the row's other cells) for every key row of the page."""
    rows: Dict[str, Tuple[str, List[str]]] = {}
    for line in CONFIG_DOC.read_text().splitlines():
        match = KEY_ROW.match(line)
        if match:
            key, var, rest = match.groups()
            assert key not in rows, f"docs/configuration.md documents {key!r} twice"
            rows[key] = (var, [cell.strip() for cell in rest.split("|")])
    return rows


def documented_variables() -> Set[str]:
    """Every `LMCACHE_*` name the page mentions, anywhere."""
    return set(VARIABLE.findall(CONFIG_DOC.read_text()))


def registered_variables() -> Set[str]:
    """Every variable the code accepts: one per field, one per old key, and the others of ours."""
    return {env_var_name(name) for name in (*field_names(), *LEGACY_KEYS)} | set(NON_FIELD_ENV_VARS)


def default_spelling(value: object) -> str:
    """A default as the page writes it (YAML's words for bools and None)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "none"
    return str(value)


def python_string_literals(path: Path) -> Iterator[str]:
    """The string constants of one Python file."""
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.value


def variables_named_in_sources() -> Dict[str, str]:
    """variable -> one file naming it: string literals of our Python, `getenv` calls of csrc/."""
    found: Dict[str, str] = {}
    py_files = [*(ROOT / "lmcache").rglob("*.py"), *(ROOT / "lmcache_vllm").rglob("*.py"), ROOT / "setup.py"]
    for path in py_files:
        for text in python_string_literals(path):
            if re.fullmatch(r"LMCACHE_[A-Z0-9_]*[A-Z0-9]", text):
                found.setdefault(text, str(path.relative_to(ROOT)))
    for path in (ROOT / "csrc").rglob("*"):
        if path.suffix in (".h", ".cpp", ".cu", ".cuh"):
            for var in re.findall(r"getenv\(\s*\"(LMCACHE_[A-Z0-9_]+)\"", path.read_text()):
                found.setdefault(var, str(path.relative_to(ROOT)))
    return found


def test_every_field_and_old_key_is_documented_with_its_variable() -> None:
    rows = documented_rows()
    for name in (*field_names(), *LEGACY_KEYS):
        assert name in rows, f"config key {name!r} ({env_var_name(name)}) is missing from docs/configuration.md"
        assert rows[name][0] == env_var_name(name), (
            f"docs/configuration.md gives {name!r} the variable {rows[name][0]}, the code reads {env_var_name(name)}"
        )


def test_every_documented_key_still_exists() -> None:
    known = set(field_names()) | set(LEGACY_KEYS)
    for key in documented_rows():
        assert key in known, f"docs/configuration.md documents {key!r}, which is no config field or old key any more"


def test_documented_defaults_are_the_code_defaults() -> None:
    """The fields table's default cell starts with the default `from_env()` and YAML files use."""
    rows = documented_rows()
    defaults = LMCacheEngineConfig.cpu_only_defaults()
    for f in dataclasses.fields(LMCacheEngineConfig):
        cells = rows.get(f.name, ("", []))[1]
        cell = cells[1] if len(cells) > 1 else ""
        shown = re.match(r"`([^`]*)`", cell)
        expected = default_spelling(getattr(defaults, f.name))
        assert shown is not None and shown.group(1) == expected, (
            f"docs/configuration.md: default of {f.name!r} is {cell!r}, the code's is `{expected}`"
        )


def test_every_variable_of_ours_is_documented() -> None:
    documented = documented_variables()
    for var in sorted(registered_variables()):
        assert var in documented, f"variable {var} is missing from docs/configuration.md"


def test_every_documented_variable_still_exists() -> None:
    registered = registered_variables()
    for var in sorted(documented_variables()):
        assert var in registered, (
            f"docs/configuration.md documents {var}, which the code no longer reads "
            "(not a field's, an old key's, or in NON_FIELD_ENV_VARS)"
        )


def test_every_variable_the_sources_name_is_registered() -> None:
    """A new `LMCACHE_*` read anywhere must join the registry (and so this page): otherwise
    `from_env()` would warn about it as a typo and nobody could look it up."""
    registered = registered_variables()
    for var, where in sorted(variables_named_in_sources().items()):
        if var in NOT_VARIABLES:
            continue
        assert var in registered, (
            f"{where} names {var}, which is not in NON_FIELD_ENV_VARS (lmcache/experimental/config.py) "
            "nor a field's or an old key's variable; register it and document it in docs/configuration.md"
        )


def test_the_source_scan_finds_what_it_looks_for() -> None:
    """The scan above must see the variables read outside the config module (else it checks nothing)."""
    found = variables_named_in_sources()
    assert {"LMCACHE_LOG_LEVEL", "LMCACHE_SERVER_TOKEN", "LMCACHE_CPU_ISA", "LMCACHE_BUILD_CUDA"} <= set(found)


MARKDOWN_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def heading_anchors(path: Path) -> Set[str]:
    """GitHub's anchors for the headings of a markdown file."""
    anchors = set()
    in_code = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def test_relative_links_in_readme_and_docs_resolve() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "results" / "README.md"]
    broken = []
    for page in pages:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for match in MARKDOWN_LINK.finditer(text):
            target = match.group(1) or match.group(2)
            if re.match(r"[a-z]+:", target):
                continue
            file_part, _, anchor = target.partition("#")
            dest = (page.parent / file_part).resolve() if file_part else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in heading_anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "broken links: " + "; ".join(broken)
