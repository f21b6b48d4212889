"""Builds lmcache.c_ops (as lmcache._c_ops_torch<major><minor>) from csrc/.

The CPU kernels are always built. The CUDA kernels are added when a CUDA toolchain is present and
either a GPU is visible or TORCH_CUDA_ARCH_LIST names the architectures to build for; otherwise
(as on these CPU-only machines) the .cu files are only compile-checked by scripts/check_cuda.sh.
"""

import os
from glob import glob

from setuptools import setup
from torch.utils import cpp_extension

ROOT = os.path.dirname(os.path.abspath(__file__))


def _torch_tag() -> str:
    """`torch26` for torch 2.6.x: the extension is named for the torch it is built against, so the
    builds for .venv (torch 2.6) and .venv-latest (torch 2.13) sit side by side in one checkout;
    `lmcache/c_ops.py` imports the one matching the running torch."""
    import torch

    major, minor = torch.__version__.split(".")[:2]
    return f"torch{major}{minor}"


EXT_NAME = f"lmcache._c_ops_{_torch_tag()}"


class _BuildExt(cpp_extension.BuildExtension):
    """Object files per torch version too, so a build for one venv never reuses the other's."""

    def finalize_options(self):
        super().finalize_options()
        self.build_temp = os.path.join(self.build_temp, _torch_tag())


def _want_cuda() -> bool:
    if os.environ.get("LMCACHE_BUILD_CUDA", "") == "0":
        return False
    if cpp_extension.CUDA_HOME is None:
        return False
    import torch

    return torch.cuda.is_available() or bool(os.environ.get("TORCH_CUDA_ARCH_LIST"))


def _extension():
    # The rpath lets `import lmcache.c_ops` find libc10/libtorch even before torch is imported.
    # -fopenmp compiles only: linking it would load the system libgomp, and kernels imported before
    # torch would then run a second thread pool that ignores torch.set_num_threads.
    link_args = [f"-Wl,-rpath,{d}" for d in cpp_extension.library_paths()]
    cpu_sources = sorted(glob("csrc/*.cpp") + glob("csrc/cpu/*.cpp"))
    cxx_flags = ["-O3", "-std=c++17", "-fopenmp"]
    include_dirs = [os.path.join(ROOT, "csrc")]
    if _want_cuda():
        return cpp_extension.CUDAExtension(
            EXT_NAME,
            cpu_sources + sorted(glob("csrc/cuda/*.cu")),
            include_dirs=include_dirs,
            define_macros=[("LMCACHE_WITH_CUDA", "1")],
            extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3", "-std=c++17"]},
            extra_link_args=link_args,
        )
    return cpp_extension.CppExtension(
        EXT_NAME,
        cpu_sources,
        include_dirs=include_dirs,
        extra_compile_args=cxx_flags,
        extra_link_args=link_args,
    )


setup(
    ext_modules=[_extension()],
    cmdclass={"build_ext": _BuildExt},
)
