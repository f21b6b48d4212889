"""`lmcache_vllm`: the `vllm` command line with LMCache injected.

Every subcommand and flag goes to vLLM's own CLI (`serve`, `chat`, `complete`, `bench`,
`run-batch`, `collect-env`, `--help`); only `lmcache_vllm --version` is answered here, with our
version and vLLM's. Before handing over, the wrapper checks the vLLM version, marks the
environment for vLLM's spawned processes and applies the injection (`import_hook.prepare`).
For `serve` on the v1 engine it also gives the engine core's `lmcache:` metrics a way to vLLM's
`/metrics` (`share_metrics_across_processes`).
"""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Optional, Sequence

VERSION_FLAGS = ("-v", "--version")
METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
# Removed when the server exits (as vLLM does with its own directory for the v0 server).
_metrics_dir: Optional[tempfile.TemporaryDirectory] = None


def share_metrics_across_processes(args: Sequence[str]) -> None:
    """Turn on `prometheus_client`'s multiprocess mode for a v1 `serve`.

    vLLM's v1 server with one API process keeps its metrics in-process, so the engine core's
    process (where LMCache's engine and scheduler side live) would publish into a registry nobody
    serves. With `PROMETHEUS_MULTIPROC_DIR` set before any process imports `prometheus_client`,
    every process writes its metrics there and `/metrics` collects them all (vLLM's own ones
    too). vLLM's v0 server sets the variable itself; a user's own setting is left alone.
    """
    global _metrics_dir
    if args[:1] != ["serve"] or os.environ.get("VLLM_USE_V1") == "0" or METRICS_DIR_ENV in os.environ:
        return
    if "prometheus_client" in sys.modules:  # too late: its processes would not write to the directory
        print("lmcache_vllm: prometheus_client already imported; lmcache: metrics of the engine process "
              "will not reach /metrics", file=sys.stderr)
        return
    _metrics_dir = tempfile.TemporaryDirectory(prefix="lmcache_vllm_metrics_")
    os.environ[METRICS_DIR_ENV] = _metrics_dir.name


def version_text() -> str:
    """`lmcache_vllm <ours> (vLLM <theirs>)`, without importing vLLM."""
    from lmcache_vllm import __version__
    from lmcache_vllm.compat import installed_vllm_version

    found = installed_vllm_version()
    theirs = f"vLLM {found[1]} ({found[0]})" if found is not None else "vLLM not installed"
    return f"lmcache_vllm {__version__} ({theirs})"


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Console entry point; `argv` defaults to the process arguments."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] and args[0] in VERSION_FLAGS:
        print(version_text())
        return
    from lmcache_vllm.compat import vllm_metadata_version_shim
    from lmcache_vllm.import_hook import prepare

    # vLLM's CLI reads sys.argv; `prepare` looks at it too (vLLM's OpenTelemetry flag).
    sys.argv = [sys.argv[0] if sys.argv else "lmcache_vllm", *args]
    share_metrics_across_processes(args)
    try:
        prepare()
    except (ImportError, ValueError) as exc:
        print(f"lmcache_vllm: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    from vllm.entrypoints.cli.main import main as vllm_main

    with vllm_metadata_version_shim():
        vllm_main()


if __name__ == "__main__":
    main()
