"""Shared fixtures: the tiny model (built once per run into .cache/) and a runner for real vLLM jobs."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, List, Optional

import pytest

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache"
sys.path.insert(0, str(ROOT / "scripts"))

from make_tiny_model import TinyModelSpec, make_tiny_model  # noqa: E402
from netns_fixture import in_netns  # noqa: E402

from lmcache_vllm.compat import installed_vllm_release  # noqa: E402

# One checkout, two vLLM lines, two venvs: .venv (vLLM 0.9.2) runs every test but tests/latest;
# .venv-latest (vLLM 0.32) runs tests/latest and the kernel tests (its own torch build of c_ops).
LATEST_LINE_TESTS = {"latest", "test_kernels.py", "test_kernels_errors.py", "test_kernels_layout.py"}
if (installed_vllm_release() or "0.9.").startswith("0.9."):
    collect_ignore = ["latest"]
else:
    collect_ignore = [p.name for p in Path(__file__).parent.iterdir()
                      if p.name not in LATEST_LINE_TESTS and (p.suffix == ".py" or p.is_dir())]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test that uses the tiny model runs vLLM (marker `vllm`, left out by `make test-unit`);
    tests/latest named explicitly under vLLM 0.9: skipped, saying what it needs."""
    skip = pytest.mark.skip(reason="needs vLLM's current line (make setup-latest; .venv-latest)")
    for item in items:
        if "tiny_model" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.vllm)
        if "latest" in collect_ignore and "latest" in item.path.relative_to(Path(__file__).parent).parts[:1]:
            item.add_marker(skip)
    # Files that start vLLM first, the longest of them first (stable otherwise): with `-n 2 --dist
    # loadfile --no-loadscope-reorder` the longest files start at once and the short ones fill in
    # beside them, instead of a long one running alone last.
    slow_files = {item.path for item in items if item.get_closest_marker("vllm")}
    items.sort(key=lambda item: (item.path not in slow_files, _LONGEST_FIRST.get(item.path.name, len(_LONGEST_FIRST))))


# The files that take longest in `make test` (seconds of test time measured on 2 cores, 2026-11-27):
# test_v1_e2e 275, test_remote_vllm 270, test_bench_serving 126, test_families 106, test_v0_e2e 104,
# test_pd_e2e 104, test_blend_vllm 84; test_request_kinds ~140 (2026-11-28, alone); vLLM 0.32:
# test_latest_e2e, test_latest_request_kinds (~110), test_latest_families first.
_LONGEST_FIRST = {
    name: rank
    for rank, name in enumerate(
        ("test_v1_e2e.py", "test_remote_vllm.py", "test_request_kinds.py", "test_latest_e2e.py",
         "test_latest_request_kinds.py", "test_latest_families.py",
         "test_bench_serving.py", "test_families.py", "test_v0_e2e.py", "test_pd_e2e.py", "test_blend_vllm.py")
    )
}

# vLLM's own settings for every engine the tests start: a small CPU KV space, no usage reporting;
# and Python's fault handler, so a job that crashes prints every thread's stack.
VLLM_TEST_ENV = {
    "PYTHONFAULTHANDLER": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


@pytest.fixture(scope="session")
def tiny_model() -> str:
    """Path of the default tiny model, built once per test run (reused when already built)."""
    out = CACHE / "tiny-model"
    make_tiny_model(out, TinyModelSpec())
    return str(out)


# The family matrix's models: 2 layers, head size 32 (vLLM 0.32's CPU attention takes 32 and up).
FAMILY_SPEC = TinyModelSpec(hidden=128, layers=2, heads=4, kv_heads=2)


def family_model(family: str) -> str:
    """Path of the tiny `family` model (scripts/make_tiny_model.py FAMILIES), built on first use.
    One folder per transformers major version: each venv's vLLM reads the config.json its own
    transformers wrote (transformers 5 renames keys 4 does not know)."""
    import transformers

    major = transformers.__version__.split(".")[0]
    out = CACHE / f"tiny-{family}-tf{major}"
    make_tiny_model(out, dataclasses.replace(FAMILY_SPEC, family=family))
    return str(out)


@pytest.fixture
def warnings_log(caplog: pytest.LogCaptureFixture) -> Iterator[Callable[[], List[str]]]:
    """Reads the warnings of the lmcache loggers (their tree does not propagate to root)."""
    top = logging.getLogger("lmcache")
    top.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger="lmcache"):
            yield lambda: [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    finally:
        top.removeHandler(caplog.handler)


def random_prompt(n_tokens: int, seed: int, vocab: int = 1024) -> list[int]:
    """A prompt of exactly n_tokens ordinary token ids (the special tokens 0-3 are left out)."""
    rng = random.Random(seed)
    return [rng.randrange(4, vocab) for _ in range(n_tokens)]


@dataclass
class VLLMJobResult:
    outputs: list[list[list[int]]]  # [round][prompt] -> generated token ids
    latencies: list[list[float]]  # [round][prompt] -> seconds for that generate call
    log: str  # the job's combined stdout and stderr


def run_vllm_job(
    job: dict,
    env: Optional[dict[str, str]] = None,
    timeout: float = 600,
    at_gate: Optional[Callable[[int, Callable[[], str]], None]] = None,
    netns: str = "",
) -> VLLMJobResult:
    """Run tests/vllm_job.py in a fresh interpreter with `env` over VLLM_TEST_ENV; fail with its log.

    With `at_gate`, the job stops before each prompt index in `job["gate_before"]` and
    `at_gate(index, stderr_so_far)` runs meanwhile (kill a server, wait for a log line), so one
    engine serves before and after a fault. With `netns`, the job runs inside that network
    namespace (`ip netns exec`: another simulated machine, tests/netns_fixture.py)."""
    full_env = {**os.environ, **VLLM_TEST_ENV, **(env or {})}
    with tempfile.TemporaryDirectory(prefix="vllm-job-") as tmp:
        gates = list(job.get("gate_before", [])) if at_gate else []
        job = {**job, "gate_dir": tmp} if gates else job
        out_path, err_path = Path(tmp, "stdout"), Path(tmp, "stderr")
        with open(out_path, "w") as out, open(err_path, "w") as err:
            proc = subprocess.Popen([*in_netns(netns), sys.executable, str(ROOT / "tests" / "vllm_job.py")], stdin=subprocess.PIPE,
                                    stdout=out, stderr=err, text=True, env=full_env, cwd=str(ROOT),
                                    start_new_session=True)
        try:
            proc.stdin.write(json.dumps(job))
            proc.stdin.close()
            deadline = time.monotonic() + timeout
            while gates and proc.poll() is None and time.monotonic() < deadline:
                if Path(tmp, f"ready-{gates[0]}").exists():
                    at_gate(gates[0], err_path.read_text)
                    Path(tmp, f"go-{gates.pop(0)}").touch()
                time.sleep(0.1)
            proc.wait(max(0.0, deadline - time.monotonic()))
        finally:
            if proc.poll() is None:
                # The whole session: vLLM's engine-core process outlives its killed parent (~2 GB, spinning).
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        stdout, stderr = out_path.read_text(), err_path.read_text()
    log = stdout + stderr
    lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        # The end of stderr first and short (a crash at exit comes after a long RESULT line), its
        # last lines first: a report that keeps only a failure's head still shows how it ended.
        said = "printed its RESULT" if lines else "printed no RESULT"
        err = [ln for ln in stderr.splitlines() if not ln.startswith("Extension modules:")]
        pytest.fail(f"vLLM job failed (exit {proc.returncode}, {said}); its last stderr lines:\n"
                    + "\n".join(err[-15:])[-3000:] + "\nthe lines before them:\n" + "\n".join(err[-60:-15])[-3000:])
    result = json.loads(lines[-1][len("RESULT ") :])
    return VLLMJobResult(result["outputs"], result["latencies"], log)
