#!/usr/bin/env bash
# Compile-only check of every CUDA kernel in csrc/ for sm_80 and sm_90, plus a syntax check of
# the bindings as they are built on CUDA machines.
#
# Nothing built for CUDA can run on these machines (no GPU), so CI proves the .cu files
# compile against torch's headers with the real nvcc; their index arithmetic is shared with the
# CPU kernels (csrc/kv_layout.h), which the tests run. Exits non-zero if any compile fails.
#
# Include path: torch's own include dirs, plus only cusparse/cublas/cusolver from the torch
# wheel's nvidia/ packages (the others clash with nvcc's own headers).
# Env: NVCC (default /usr/local/cuda/bin/nvcc), PYTHON (default .venv/bin/python),
#      CUDA_ARCHS (default "80 90").
set -euo pipefail
cd "$(dirname "$0")/.."

NVCC="${NVCC:-/usr/local/cuda/bin/nvcc}"
PYTHON="${PYTHON:-.venv/bin/python}"
CUDA_ARCHS="${CUDA_ARCHS:-80 90}"

if [ ! -x "$NVCC" ]; then
    echo "check_cuda: nvcc not found at $NVCC" >&2
    exit 1
fi

mapfile -t SOURCES < <(find csrc -name '*.cu' | sort)
if [ "${#SOURCES[@]}" -eq 0 ]; then
    echo "check_cuda: no .cu files under csrc/" >&2
    exit 1
fi

mapfile -t INCLUDES < <("$PYTHON" - <<'EOF'
import os
import torch
from torch.utils import cpp_extension

for d in cpp_extension.include_paths():
    print(d)
nvidia = os.path.join(os.path.dirname(os.path.dirname(torch.__file__)), "nvidia")
for pkg in ("cusparse", "cublas", "cusolver"):
    inc = os.path.join(nvidia, pkg, "include")
    if os.path.isdir(inc):
        print(inc)
EOF
)
PY_INCLUDE="$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
INCLUDE_FLAGS=(-I csrc -I "$PY_INCLUDE")
for d in "${INCLUDES[@]}"; do INCLUDE_FLAGS+=(-I "$d"); done

OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
failed=0
for src in "${SOURCES[@]}"; do
    for arch in $CUDA_ARCHS; do
        obj="$OUT/$(basename "$src" .cu).sm_$arch.o"
        start=$SECONDS
        if "$NVCC" -c "$src" -o "$obj" \
            -gencode "arch=compute_$arch,code=sm_$arch" \
            -std=c++17 -O3 -D_GLIBCXX_USE_CXX11_ABI=0 -Xcompiler -fPIC \
            -DLMCACHE_WITH_CUDA=1 -DTORCH_EXTENSION_NAME=c_ops -DTORCH_API_INCLUDE_EXTENSION_H \
            "${INCLUDE_FLAGS[@]}"; then
            echo "check_cuda: ok     $src sm_$arch ($((SECONDS - start)) s)"
        else
            echo "check_cuda: FAILED $src sm_$arch" >&2
            failed=1
        fi
    done
done
# The bindings' CUDA-only branches (dispatch, pinned-object checks) are host C++: syntax-check
# them with the CUDA define, since setup.py only compiles them that way on CUDA machines.
start=$SECONDS
if g++ -fsyntax-only -std=c++17 -D_GLIBCXX_USE_CXX11_ABI=0 -DLMCACHE_WITH_CUDA=1 \
    -DTORCH_EXTENSION_NAME=c_ops -DTORCH_API_INCLUDE_EXTENSION_H "${INCLUDE_FLAGS[@]}" \
    csrc/bindings.cpp; then
    echo "check_cuda: ok     csrc/bindings.cpp with LMCACHE_WITH_CUDA ($((SECONDS - start)) s)"
else
    echo "check_cuda: FAILED csrc/bindings.cpp with LMCACHE_WITH_CUDA" >&2
    failed=1
fi
exit "$failed"
