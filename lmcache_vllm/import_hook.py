"""`lmcache_vllm.vllm.X.Y` is the real `vllm.X.Y` module object, with LMCache injected first.

A finder on `sys.meta_path` answers only for names under `lmcache_vllm.vllm`. Its loader hands
back the module the real name imports to (so `isinstance` checks and monkeypatches see one
object), and runs `prepare()` before the first such import: check the vLLM version, turn
OpenTelemetry off unless the user configured it (`vllm_injection.quiet_telemetry_by_default`),
and apply the injection in this process, marking the environment so vLLM's spawned processes
inject too (see `vllm_injection.INJECT_ENV`). `get_code` serves `python -m lmcache_vllm.vllm.entrypoints...`.

Installing the finder imports nothing heavy; vLLM is imported only when a proxied name is.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import CodeType, ModuleType
from typing import Optional, Sequence

PROXY_PREFIX = "lmcache_vllm.vllm"
TARGET_PREFIX = "vllm"


def real_name(proxy_name: str) -> str:
    """`lmcache_vllm.vllm.a.b` -> `vllm.a.b`."""
    return TARGET_PREFIX + proxy_name[len(PROXY_PREFIX) :]


def is_proxy_name(fullname: str) -> bool:
    return fullname == PROXY_PREFIX or fullname.startswith(PROXY_PREFIX + ".")


def prepare() -> None:
    """Everything that must happen before a proxied vLLM module is used (idempotent)."""
    from lmcache_vllm.compat import check_vllm_supported
    from lmcache_vllm.vllm_injection import apply_injection, quiet_telemetry_by_default

    check_vllm_supported()
    quiet_telemetry_by_default()  # before vLLM (and so transformers) is imported
    apply_injection()


class ProxyLoader(importlib.abc.Loader):
    """Loads a proxied name as the real module object; executes nothing itself."""

    def __init__(self, target: str, is_package: bool) -> None:
        self.target = target
        self._is_package = is_package

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        prepare()
        # The import system keeps the real module's own __spec__, __file__ and __path__
        # (it only fills attributes that are missing) and files it under the proxy name too.
        return importlib.import_module(self.target)

    def exec_module(self, module: ModuleType) -> None:
        """The real module is already executed by `import_module`."""

    def is_package(self, fullname: str) -> bool:
        return self._is_package

    def get_code(self, fullname: str) -> Optional[CodeType]:
        """The real module's code, for `python -m lmcache_vllm.vllm....` (runpy runs it as __main__)."""
        prepare()
        spec = importlib.util.find_spec(self.target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "get_code"):
            raise ImportError(f"cannot get the code of {self.target} (for {fullname})", name=fullname)
        return spec.loader.get_code(self.target)  # type: ignore[union-attr]

    def get_source(self, fullname: str) -> Optional[str]:
        spec = importlib.util.find_spec(self.target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "get_source"):
            return None
        return spec.loader.get_source(self.target)  # type: ignore[union-attr]


class ProxyFinder(importlib.abc.MetaPathFinder):
    """Finds `lmcache_vllm.vllm[.X...]` wherever the real `vllm[.X...]` is."""

    def find_spec(
        self,
        fullname: str,
        path: Optional[Sequence[str]] = None,
        target: Optional[ModuleType] = None,
    ) -> Optional[importlib.machinery.ModuleSpec]:
        if not is_proxy_name(fullname):
            return None
        name = real_name(fullname)
        if fullname == PROXY_PREFIX:
            # Fail with the supported-versions message rather than "No module named vllm".
            from lmcache_vllm.compat import check_vllm_supported

            check_vllm_supported()
        real_spec = importlib.util.find_spec(name)
        if real_spec is None:
            return None
        is_package = real_spec.submodule_search_locations is not None
        spec = importlib.machinery.ModuleSpec(
            fullname,
            ProxyLoader(name, is_package),
            origin=real_spec.origin,
            is_package=is_package,
        )
        # runpy sets __file__ of a `-m` module from a located spec's origin: the real file.
        spec.has_location = real_spec.has_location
        return spec


def install() -> None:
    """Put one ProxyFinder in front of `sys.meta_path` (no-op when one is there)."""
    if any(isinstance(finder, ProxyFinder) for finder in sys.meta_path):
        return
    sys.meta_path.insert(0, ProxyFinder())
