# The two commands of the README: `make serve` (the main job) and `make test` (the tests).
# Every target starts from `make setup`, which is idempotent and quick on a ready machine.
PY := .venv/bin/python
PYTEST_ARGS ?=

.PHONY: setup test serve bench check-cuda tiny-model

setup:
	@bash scripts/setup_env.sh

tiny-model: setup
	@$(PY) scripts/make_tiny_model.py .cache/tiny-model

# Compile-only check of the CUDA kernels (nothing built for CUDA can run on these machines).
check-cuda: setup
	@bash scripts/check_cuda.sh

test: setup check-cuda
	@OMP_NUM_THREADS=2 $(PY) -m pytest $(PYTEST_ARGS)

serve: setup
	@$(PY) scripts/serve_demo.py

bench: setup
	@$(PY) scripts/bench_kernels.py
	@$(PY) scripts/bench_engine.py
	@$(PY) scripts/bench_remote.py
	@$(PY) scripts/bench_serving.py
