"""`lmcache.c_ops`: the kernels built from csrc/ for the torch this process runs.

setup.py names the extension for the torch it was built against (`lmcache._c_ops_torch26`,
`lmcache._c_ops_torch213`, ...), because one checkout serves two venvs with different torch ABIs
(.venv with vLLM 0.9.2, .venv-latest with vLLM 0.32). This module stands in for the built one.
"""

import importlib
import sys

import torch

_TAG = "torch" + "".join(torch.__version__.split(".")[:2])
try:
    _ext = importlib.import_module(f"lmcache._c_ops_{_TAG}")
except ImportError as e:
    raise ImportError(
        f"lmcache.c_ops is not built for torch {torch.__version__} (no lmcache._c_ops_{_TAG}): "
        "run `make setup` (vLLM 0.9.2, .venv) or `make setup-latest` (vLLM 0.32, .venv-latest)"
    ) from e

sys.modules[__name__] = _ext
