"""`lmcache_vllm`: the `vllm` command line with LMCache injected.

Every subcommand and flag goes to vLLM's own CLI (`serve`, `chat`, `complete`, `bench`,
`run-batch`, `collect-env`, `--help`); only `lmcache_vllm --version` is answered here, with our
version and vLLM's. Before handing over, the wrapper checks the vLLM version, marks the
environment for vLLM's spawned processes and applies the injection (`import_hook.prepare`).
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence

VERSION_FLAGS = ("-v", "--version")


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
