#!/usr/bin/env bash
# `make test`: both vLLM lines' suites. In each, the tests that start vLLM run on both cores
# (pytest-xdist, whole files per worker) and the rest after them on their own: those include
# bounded-wait checks (a dead server answered within 0.5 s) that a busy second worker can starve.
# vLLM 0.32's venv and the CUDA compile check are prepared in the background during the 0.9.2
# engines. Expects .venv ready (`make setup`); arguments go to every pytest run. Exits non-zero if
# a run, the background setup or the CUDA check failed.
set -uo pipefail
cd "$(dirname "$0")/.."
mkdir -p .cache
LOG=.cache/test-background.log
say() { printf '[test] %s\n' "$*"; }
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
WORKERS=$(( $(nproc) >= 2 ? 2 : 1 ))
status=0
ran=0

# suite PYTHON NAME: the vLLM tests on $WORKERS workers, then the others; pytest's 5 (nothing
# selected) counts only when neither part ran a test.
suite() {
    local python=$1 name=$2 start=$SECONDS rc_engines rc_rest
    say "$name: tests that start vLLM, $WORKERS workers"
    "$python" -m pytest -m vllm -n "$WORKERS" --dist loadfile "${ARGS[@]}"
    rc_engines=$?
    say "$name: the other tests"
    "$python" -m pytest -m "not vllm" "${ARGS[@]}"
    rc_rest=$?
    say "$name: exit $rc_engines / $rc_rest after $((SECONDS - start)) s"
    for rc in $rc_engines $rc_rest; do
        case $rc in
            0) ran=1 ;;
            5) ;;
            *) [ "$status" -eq 0 ] && status=$rc ;;
        esac
    done
}
ARGS=("$@")

# The CPU's name and vector extensions: vLLM's CPU kernels (and their rounding) differ by them.
say "machine: $(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n 1), $(nproc) cores, $(grep -o -w -E 'avx2|avx512f|avx512_bf16|amx_tile' /proc/cpuinfo | sort -u | tr '\n' ' ')"
say "preparing vLLM 0.32 (.venv-latest) and the CUDA compile check in the background: $LOG"
( bash scripts/setup_env.sh --latest && bash scripts/check_cuda.sh ) > "$LOG" 2>&1 &
background=$!

suite .venv/bin/python "vLLM 0.9.2 suite (.venv)"

if ! wait "$background"; then
    say "background setup or CUDA check failed:"
    tail -n 40 "$LOG"
    exit 1
fi
grep -E '^\[setup\] ready|^check_cuda:' "$LOG"

suite .venv-latest/bin/python "vLLM 0.32 suite (.venv-latest)"

if [ "$status" -eq 0 ] && [ "$ran" -eq 0 ]; then
    exit 5  # nothing collected anywhere: .ci/run fails on it
fi
exit "$status"
