"""`lmcache.v1`: upstream LMCache's current name for the engine package, as vLLM 0.3x and today's
upstream users import it (`lmcache.v1.cache_engine.LMCacheEngineBuilder`, `lmcache.v1.config
.LMCacheEngineConfig`, ...). vLLM 0.9.2 imports the same package as `lmcache.experimental`.

Every `lmcache.v1.<name>` is the module `lmcache.experimental.<name>` itself, not a copy, so
classes, singletons (the engine builder's registry) and module state are shared by both names.
A finder first on `sys.meta_path` makes the alias lazily, for any module below the package.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from typing import Optional, Sequence

import lmcache.experimental as _target

_ALIAS = __name__ + "."
_TARGET = _target.__name__ + "."


class _AliasLoader(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers `lmcache.v1.X` with the already importable `lmcache.experimental.X`."""

    def find_spec(
        self, fullname: str, path: Optional[Sequence[str]], target: Optional[types.ModuleType] = None
    ) -> Optional[importlib.machinery.ModuleSpec]:
        if not fullname.startswith(_ALIAS):
            return None
        real = _TARGET + fullname[len(_ALIAS) :]
        if importlib.util.find_spec(real) is None:
            return None
        return importlib.util.spec_from_loader(fullname, self, is_package=False)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = importlib.import_module(_TARGET + spec.name[len(_ALIAS) :])
        spec.loader_state = module.__spec__
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        # The import system stamped the alias spec on the shared module: give it back its own.
        module.__spec__ = module.__spec__.loader_state


# First on the path: the aliased packages' __path__ would otherwise let the path finder load a
# second copy of their submodules under the alias name.
if not any(isinstance(f, _AliasLoader) for f in sys.meta_path):
    sys.meta_path.insert(0, _AliasLoader())
