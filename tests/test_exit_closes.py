"""Our exit closes run to the end when a stop signal lands while they run, as vLLM's engine
process gets SIGTERM from its API server while it exits on Ctrl-C (its handler raises
KeyboardInterrupt)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent(
    """
    import multiprocessing.util, os, signal, sys, time
    from lmcache.integration.vllm.worker_engine import ENGINE_EXIT_PRIORITY, shield_exit_closes_from_stop_signals

    def vllm_handler(signum, frame):
        raise KeyboardInterrupt("MQLLMEngine terminated")

    def slow_close(name):
        os.kill(os.getpid(), signal.SIGTERM)  # the API server's SIGTERM, mid-close
        time.sleep(0.2)
        print(name, "closed", flush=True)

    signal.signal(signal.SIGTERM, vllm_handler)
    multiprocessing.util.Finalize(None, slow_close, args=("saver",), exitpriority=ENGINE_EXIT_PRIORITY + 1)
    multiprocessing.util.Finalize(None, slow_close, args=("engine",), exitpriority=ENGINE_EXIT_PRIORITY)
    if sys.argv[1] == "shielded":
        shield_exit_closes_from_stop_signals()
    """
)


@pytest.mark.parametrize("shielded", [True, False], ids=["shielded", "unshielded"])
def test_a_sigterm_during_the_exit_closes_does_not_cut_them_short(shielded):
    proc = subprocess.run([sys.executable, "-c", CHILD, "shielded" if shielded else "bare"],
                          capture_output=True, text=True, timeout=60)
    closed = [ln for ln in proc.stdout.splitlines() if ln.endswith(" closed")]
    if shielded:
        assert closed == ["saver closed", "engine closed"], proc.stdout + proc.stderr
        assert "KeyboardInterrupt" not in proc.stderr
    else:  # what happened before: the interrupt ends the exit with the engine never closed
        assert "engine closed" not in closed and "KeyboardInterrupt" in proc.stderr
