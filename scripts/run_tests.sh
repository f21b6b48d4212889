#!/usr/bin/env bash
# `make test`: both vLLM lines' suites on both cores (pytest-xdist, whole files per worker), with
# vLLM 0.32's venv and the CUDA compile check prepared in the background while the 0.9.2 suite
# runs, instead of before it. Expects .venv ready (`make setup`); arguments go to both pytest runs.
# Exits non-zero if a suite, the background setup or the CUDA check failed.
set -uo pipefail
cd "$(dirname "$0")/.."
mkdir -p .cache
LOG=.cache/test-background.log
say() { printf '[test] %s\n' "$*"; }

# Workers: both cores; one where the machine has one.
WORKERS=$(( $(nproc) >= 2 ? 2 : 1 ))
PYTEST=(-m pytest -n "$WORKERS" --dist loadfile "$@")
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}

say "preparing vLLM 0.32 (.venv-latest) and the CUDA compile check in the background: $LOG"
( bash scripts/setup_env.sh --latest && bash scripts/check_cuda.sh ) > "$LOG" 2>&1 &
background=$!

start=$SECONDS
say "vLLM 0.9.2 suite (.venv), $WORKERS workers"
.venv/bin/python "${PYTEST[@]}"
rc_old=$?
say "vLLM 0.9.2 suite: exit $rc_old after $((SECONDS - start)) s"

wait "$background"
rc_bg=$?
if [ "$rc_bg" -ne 0 ]; then
    say "background setup or CUDA check failed (exit $rc_bg):"
    tail -n 40 "$LOG"
    exit "$rc_bg"
fi
grep -E '^\[setup\] ready|^check_cuda:' "$LOG"

start=$SECONDS
say "vLLM 0.32 suite (.venv-latest), $WORKERS workers"
.venv-latest/bin/python "${PYTEST[@]}"
rc_new=$?
say "vLLM 0.32 suite: exit $rc_new after $((SECONDS - start)) s"

# pytest's own code of the first failing suite (5 = no tests collected, which CI treats as failure).
[ "$rc_old" -ne 0 ] && exit "$rc_old"
exit "$rc_new"
