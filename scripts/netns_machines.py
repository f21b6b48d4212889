"""Simulated machines: Linux network namespaces on one switch, optionally shaped links, removed at the end.

The peer-to-peer tests (`tests/netns_fixture.py`), the multi-machine benchmark
(`scripts/bench/bench_multi_instance.py --link-gbit`) and the P2P benchmarks (`bench_p2p.py`,
`bench_p2p_ttft.py`) run processes on "machines" of their own:

                          root namespace (this shell; 198.18.0.254, with `root_link`)
                                 |
    switch namespace: bridge ----+---- veth ---- machine 0 namespace (198.18.0.1)
                                 +---- veth ---- machine 1 namespace (198.18.0.2)
                                 +---- ...

Addresses come from 198.18.0.0/15 (the benchmarking range, RFC 2544) and exist only inside the
namespaces made here. The bridge lives in a namespace of its own, so the root namespace gets one
interface and no forwarding or firewall change. With a rate, each machine's veth has a `tc tbf`
qdisc at that rate on both ends (this kernel has tbf, not netem): what a machine sends and what
it receives each pass one shaper, as on a switch port of that speed. The root link is not shaped.

`NetPlan` is the plan (names, addresses, the `ip` / `tc` commands: pure, tested without root);
`Machines` carries it out and removes every namespace on `close`, which also runs at exit, so a
crash leaves nothing behind (deleting a namespace removes its veth ends and their peers). Only a
SIGKILL skips both: names carry the maker's process id, and `Machines` first removes the
namespaces of its purpose whose maker is gone.
"""

from __future__ import annotations

import atexit
import os
import re
import subprocess
from dataclasses import dataclass
from typing import Optional, Sequence

SUBNET_PREFIX = "198.18.0."
PREFIX_LEN = 24
ROOT_ADDRESS = SUBNET_PREFIX + "254"  # the root namespace's end of `root_link`
# tbf's queue: packets wait at most this long before being dropped (TCP then backs off).
TBF_LATENCY = "5ms"


def root_missing(what: str) -> Optional[str]:
    """Why `what` cannot make namespaces here (None: it can, we are root)."""
    return None if os.geteuid() == 0 else f"{what} needs root: it makes network namespaces (ip netns) and shapes links (tc)"


def in_netns(ns: str) -> list[str]:
    """The command prefix that runs a command inside network namespace `ns` ("": none)."""
    return ["ip", "netns", "exec", ns] if ns else []


def gbit_of(rate: str) -> Optional[float]:
    """A link rate in tc's words (`10gbit`, `500mbit`, `100kbit`) in Gbit/s; None for `none` (unshaped)."""
    if rate == "none":
        return None
    for unit, scale in (("gbit", 1.0), ("mbit", 1e-3), ("kbit", 1e-6)):
        number = rate[: -len(unit)] if rate.endswith(unit) else ""
        if number.replace(".", "", 1).isdigit() and float(number) > 0:
            return float(number) * scale
    raise ValueError(f"link rate {rate!r}: expected a positive rate in tc's words (10gbit, 500mbit) or none")


def tbf_burst_bytes(gbit: float) -> int:
    """tbf's bucket: 4 ms at the rate (the kernel refills at timer ticks; a smaller bucket caps the
    rate below the one asked), at least 64 KiB (a GSO packet)."""
    return max(64 << 10, int(gbit * 1e9 / 8 * 0.004))


@dataclass(frozen=True)
class NetPlan:
    """Namespaces for `machines` (in order: 198.18.0.1, .2, ...) on one switch namespace."""

    tag: str  # prefix of every name made: a purpose and the maker's pid (at most 11 characters: interface names)
    machines: tuple[str, ...]  # the machines' names, e.g. ("store", "m0", "m1")
    gbit: Optional[float] = None  # link rate per machine in Gbit/s (None: unshaped veths)
    root_link: bool = False  # join the root namespace to the switch too (ROOT_ADDRESS)

    @classmethod
    def make(cls, purpose: str, machines: Sequence[str], gbit: Optional[float] = None,
             root_link: bool = False) -> "NetPlan":
        """A plan whose names carry `purpose` (2-4 letters) and this process's id."""
        if not 1 <= len(machines) <= 200:
            raise ValueError(f"between 1 and 200 machines, got {len(machines)}")
        if len(set(machines)) != len(machines):
            raise ValueError(f"machine names repeat: {machines}")
        if gbit is not None and gbit <= 0:
            raise ValueError(f"link rate must be positive, got {gbit} Gbit/s")
        return cls(f"{purpose[:4]}{os.getpid()}", tuple(machines), gbit, root_link)

    def namespace(self, machine: str) -> str:
        return f"{self.tag}-{machine}"

    def address(self, machine: str) -> str:
        return f"{SUBNET_PREFIX}{self.machines.index(machine) + 1}"

    @property
    def switch(self) -> str:
        return f"{self.tag}-sw"

    @property
    def namespaces(self) -> list[str]:
        """Every namespace the plan makes, the switch first."""
        return [self.switch, *(self.namespace(m) for m in self.machines)]

    @property
    def rate(self) -> Optional[str]:
        """The link rate in tc's words ("10gbit"), None when unshaped."""
        return None if self.gbit is None else f"{self.gbit:g}gbit"

    def _tbf(self, ns: str, dev: str) -> list[str]:
        return ["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate,
                "burst", str(tbf_burst_bytes(self.gbit)), "latency", TBF_LATENCY]

    def setup_commands(self) -> list[list[str]]:
        """The `ip` and `tc` commands that make the plan, in order."""
        bridge = f"{self.tag}br"
        sw = self.switch
        cmds = [["ip", "netns", "add", ns] for ns in self.namespaces]
        cmds += [["ip", "-n", sw, "link", "add", bridge, "type", "bridge"],
                 ["ip", "-n", sw, "link", "set", bridge, "up"]]
        for i, machine in enumerate(self.machines):
            ns, inner, outer = self.namespace(machine), f"{self.tag}m{i}", f"{self.tag}s{i}"
            cmds += [["ip", "-n", sw, "link", "add", outer, "type", "veth", "peer", "name", inner, "netns", ns],
                     ["ip", "-n", sw, "link", "set", outer, "master", bridge],
                     ["ip", "-n", sw, "link", "set", outer, "up"],
                     ["ip", "-n", ns, "addr", "add", f"{self.address(machine)}/{PREFIX_LEN}", "dev", inner],
                     ["ip", "-n", ns, "link", "set", inner, "up"],
                     ["ip", "-n", ns, "link", "set", "lo", "up"]]
            if self.rate is not None:
                cmds += [self._tbf(ns, inner), self._tbf(sw, outer)]
        if self.root_link:
            root_end, outer = f"{self.tag}r", f"{self.tag}sr"
            cmds += [["ip", "link", "add", root_end, "type", "veth", "peer", "name", outer, "netns", sw],
                     ["ip", "-n", sw, "link", "set", outer, "master", bridge],
                     ["ip", "-n", sw, "link", "set", outer, "up"],
                     ["ip", "addr", "add", f"{ROOT_ADDRESS}/{PREFIX_LEN}", "dev", root_end],
                     ["ip", "link", "set", root_end, "up"]]
        return cmds

    def teardown_commands(self) -> list[list[str]]:
        """Deleting the namespaces takes their veth ends along, and each end's peer with it (the
        root end is deleted first, by name: the kernel removes a namespace's devices later)."""
        root = [["ip", "link", "del", f"{self.tag}r"]] if self.root_link else []
        return root + [["ip", "netns", "del", ns] for ns in reversed(self.namespaces)]

    def describe(self) -> dict:
        """What a results file records about the machines."""
        return {"link_gbit": self.gbit, "tbf_burst_bytes": tbf_burst_bytes(self.gbit) if self.gbit else None,
                "tbf_latency": TBF_LATENCY if self.gbit else None, "switch": self.switch,
                "machines": {m: {"namespace": self.namespace(m), "address": self.address(m)} for m in self.machines},
                "root_address": ROOT_ADDRESS if self.root_link else None}


def stale_namespaces(tag: str, listed: str) -> list[str]:
    """The namespaces in `ip netns list`'s output `listed` made by a plan with `tag`'s purpose
    (its letters) whose maker process no longer runs."""
    purpose = re.sub(r"\d+$", "", tag)
    found = []
    for line in listed.splitlines():
        match = re.match(rf"({re.escape(purpose)}(\d+)-\S+)", line)
        if match and not os.path.exists(f"/proc/{match.group(2)}"):
            found.append(match.group(1))
    return found


class Machines:
    """A plan carried out; `close` (also at exit) removes every namespace it made."""

    def __init__(self, plan: NetPlan) -> None:
        self.plan = plan
        self._made = False
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        for ns in stale_namespaces(plan.tag, listed):  # left by a maker killed with SIGKILL
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        atexit.register(self.close)
        try:
            for cmd in plan.setup_commands():
                self._made = True
                done = subprocess.run(cmd, capture_output=True, text=True)
                if done.returncode != 0:
                    raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()}")
        except BaseException:
            self.close()
            raise

    def namespace(self, machine: str) -> str:
        return self.plan.namespace(machine)

    def address(self, machine: str) -> str:
        return self.plan.address(machine)

    def argv(self, machine: str, argv: Sequence[str]) -> list[str]:
        """`argv` run on `machine` (`ip netns exec` execs it: the process keeps its id)."""
        return [*in_netns(self.namespace(machine)), *argv]

    def run(self, machine: str, argv: Sequence[str], **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(machine, argv), **kwargs)

    def close(self) -> None:
        if not self._made:
            return
        self._made = False
        for cmd in self.plan.teardown_commands():
            subprocess.run(cmd, capture_output=True)

    def __enter__(self) -> "Machines":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
