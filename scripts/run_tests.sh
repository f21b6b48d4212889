#!/usr/bin/env bash
# `make test`: both vLLM lines' suites. In each, the tests that start vLLM run on both cores
# (pytest-xdist, whole files per worker, the longest first: tests/conftest.py) and the rest after them on their own: those include
# bounded-wait checks (a dead server answered within 0.5 s) that a busy second worker can starve.
# vLLM 0.32's venv is prepared in the background during the 0.9.2 engines, the CUDA compile check
# (one compiler process) beside the 0.9.2 tests that run on one core; both at the lowest priority,
# on the cycles the tests leave. Expects .venv ready
# (`make setup`); arguments go to every pytest run. Exits non-zero if a run, the background setup
# or the CUDA check failed.
set -uo pipefail
cd "$(dirname "$0")/.."
mkdir -p .cache
SETUP_LOG=.cache/test-setup-latest.log
CUDA_LOG=.cache/test-check-cuda.log
say() { printf '[test] %s\n' "$*"; }
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
WORKERS=$(( $(nproc) >= 2 ? 2 : 1 ))
status=0
ran=0
ARGS=("$@")

# count RC: pytest's 5 (nothing selected) counts only when no part of any suite ran a test.
count() {
    case $1 in
        0) ran=1 ;;
        5) ;;
        *) [ "$status" -eq 0 ] && status=$1 ;;
    esac
}

# engines PYTHON NAME / others PYTHON NAME: a suite's two parts.
engines() {
    say "$2: tests that start vLLM, $WORKERS workers"
    "$1" -m pytest -m vllm -n "$WORKERS" --dist loadfile --no-loadscope-reorder --durations=12 "${ARGS[@]}"
    count $?
}
others() {
    say "$2: the other tests"
    "$1" -m pytest -m "not vllm" "${ARGS[@]}"
    count $?
}

# finish PID LOG WHAT: wait for a background job; on failure show its log and stop.
finish() {
    if ! wait "$1"; then
        say "$3 failed:"
        tail -n 40 "$2"
        exit 1
    fi
}

# The CPU's name and vector extensions: vLLM's CPU kernels (and their rounding) differ by them;
# and whether CAP_SYS_NICE is held (bit 23 of CapEff): LMCache's background threads run at idle
# priority only with it, so a CPU tier is faulted in at start or in a window as it fills.
nice_cap=$(( 0x$(sed -n 's/^CapEff:[[:space:]]*//p' /proc/self/status) >> 23 & 1 ))
say "machine: $(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -n 1), $(nproc) cores, $(grep -o -w -E 'avx2|avx512f|avx512_bf16|amx_tile' /proc/cpuinfo | sort -u | tr '\n' ' ')CAP_SYS_NICE $([ "$nice_cap" -eq 1 ] && echo yes || echo no)"
say "preparing vLLM 0.32 (.venv-latest) in the background: $SETUP_LOG"
nice -n 19 bash scripts/setup_env.sh --latest > "$SETUP_LOG" 2>&1 &
setup_latest=$!

start=$SECONDS
engines .venv/bin/python "vLLM 0.9.2 suite (.venv)"
say "the CUDA compile check in the background: $CUDA_LOG"
nice -n 19 bash scripts/check_cuda.sh > "$CUDA_LOG" 2>&1 &
check_cuda=$!
others .venv/bin/python "vLLM 0.9.2 suite (.venv)"
say "vLLM 0.9.2 suite (.venv): $((SECONDS - start)) s"

finish "$setup_latest" "$SETUP_LOG" "background setup of .venv-latest"
finish "$check_cuda" "$CUDA_LOG" "CUDA compile check"
grep -E '^\[setup\] ready' "$SETUP_LOG"
grep -E '^check_cuda:' "$CUDA_LOG"

start=$SECONDS
engines .venv-latest/bin/python "vLLM 0.32 suite (.venv-latest)"
others .venv-latest/bin/python "vLLM 0.32 suite (.venv-latest)"
say "vLLM 0.32 suite (.venv-latest): $((SECONDS - start)) s"

if [ "$status" -eq 0 ] && [ "$ran" -eq 0 ]; then
    exit 5  # nothing collected anywhere: .ci/run fails on it
fi
exit "$status"
