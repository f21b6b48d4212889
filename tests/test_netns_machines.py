"""The simulated machines' plan (`scripts/netns_machines.py`) without making anything: names,
addresses, the shaping and the teardown; the multi-machine benchmark's placement on it."""

from __future__ import annotations

import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts" / "bench"))

from bench_multi_machine import Placement, machine_plan  # noqa: E402
from bench_serving_servers import LaunchSpec, describe  # noqa: E402
from netns_machines import ROOT_ADDRESS, NetPlan, gbit_of, stale_namespaces, tbf_burst_bytes  # noqa: E402


def test_a_plan_puts_each_machine_on_the_switch_with_its_link_shaped_both_ways():
    plan = NetPlan("lmmi42", ("store", "m0", "m1"), gbit=10.0, root_link=True)
    assert [plan.address(m) for m in plan.machines] == ["198.18.0.1", "198.18.0.2", "198.18.0.3"]
    assert plan.namespaces == ["lmmi42-sw", "lmmi42-store", "lmmi42-m0", "lmmi42-m1"]
    cmds = plan.setup_commands()
    assert cmds[:4] == [["ip", "netns", "add", ns] for ns in plan.namespaces]
    names = {c[c.index("add") + 1] for c in cmds if "link" in c and "add" in c}
    assert all(len(n) <= 15 for n in names)  # Linux's interface name limit
    tbf = [c for c in cmds if c[0] == "tc"]
    assert len(tbf) == 6 and {c[2] for c in tbf} == {"lmmi42-sw", "lmmi42-store", "lmmi42-m0", "lmmi42-m1"}
    assert all(c[c.index("rate") + 1] == "10gbit" and c[c.index("burst") + 1] == "5000000" for c in tbf)
    assert ["ip", "addr", "add", f"{ROOT_ADDRESS}/24", "dev", "lmmi42r"] in cmds
    # The root end goes by name first; every namespace after it, the switch last.
    assert plan.teardown_commands() == [["ip", "link", "del", "lmmi42r"]] + [
        ["ip", "netns", "del", ns] for ns in reversed(plan.namespaces)]
    assert plan.describe()["machines"]["m1"] == {"namespace": "lmmi42-m1", "address": "198.18.0.3"}


def test_an_unshaped_plan_without_a_root_link_has_no_tc_and_no_root_end():
    plan = NetPlan("lmp1", ("a", "b"))
    cmds = plan.setup_commands()
    assert not any(c[0] == "tc" for c in cmds)
    assert all(c[1] in ("netns", "-n") for c in cmds)  # nothing made in the root namespace
    assert plan.teardown_commands() == [["ip", "netns", "del", ns] for ns in ("lmp1-b", "lmp1-a", "lmp1-sw")]
    assert tbf_burst_bytes(1.0) == 500_000 and tbf_burst_bytes(0.01) == 64 << 10
    with pytest.raises(ValueError, match="repeat"):
        NetPlan.make("x", ["a", "a"])
    with pytest.raises(ValueError, match="positive"):
        NetPlan.make("x", ["a"], gbit=0)


def test_a_tc_rate_reads_as_gbit_and_anything_else_is_refused_by_name():
    assert [gbit_of(r) for r in ("10gbit", "1.5gbit", "500mbit", "none")] == [10.0, 1.5, 0.5, None]
    for bad in ("10", "gbit", "0gbit", "-1gbit", "10gbps", ""):
        with pytest.raises(ValueError, match=repr(bad)):
            gbit_of(bad)


def test_only_the_namespaces_of_a_gone_maker_of_the_same_purpose_are_stale():
    import os

    gone = 4194304 + 7  # above any pid_max: no such process
    listed = (f"lmmi{gone}-sw (id: 3)\nlmmi{gone}-m0\nlmmi{os.getpid()}-m0 (id: 1)\nlmcp{gone}-a\n"
              f"lmcb{gone}a (id: 0)\n")
    assert stale_namespaces(f"lmmi{os.getpid()}", listed) == [f"lmmi{gone}-sw", f"lmmi{gone}-m0"]
    assert NetPlan.make("lmmi", ["a"]).tag == f"lmmi{os.getpid()}"


class FakeMachines:
    def __init__(self, plan: NetPlan) -> None:
        self.plan = plan

    def address(self, machine: str) -> str:
        return self.plan.address(machine)

    def argv(self, machine: str, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.plan.namespace(machine), *argv]


def test_placement_runs_the_store_and_each_instance_on_its_machine_and_results_show_no_secret():
    plan = machine_plan(3, 1.0)
    placement = Placement(FakeMachines(plan))
    assert placement.store_host == "198.18.0.1" and placement.instance_host(2) == "198.18.0.4"
    spec = LaunchSpec("redis", ["redis-server", "--requirepass", "pw"], {"LMCACHE_REMOTE_PASSWORD": "pw",
                      "LMCACHE_LOOKUP_URL": "redis://:pw@198.18.0.1:1", "LMCACHE_P2P_TOKEN_FILE": "/t"}, None)
    shown = describe(placement.on_store(spec))
    assert shown["argv"] == ["ip", "netns", "exec", plan.namespace("store"), "redis-server", "--requirepass", "***"]
    assert shown["env"] == {"LMCACHE_LOOKUP_URL": "redis://:***@198.18.0.1:1", "LMCACHE_P2P_TOKEN_FILE": "/t",
                            "LMCACHE_REMOTE_PASSWORD": "***"}
    assert Placement().on_instance(0, spec) is spec and Placement().instance_host(1) == "127.0.0.1"
    assert placement.describe()["link_gbit"] == 1.0 and Placement().describe() is None


def test_the_benchmark_takes_only_kinds_that_run_on_machines():
    from bench_multi_instance import chosen_kinds, parse_args

    assert chosen_kinds(parse_args(["--link-gbit", "10"])) == [
        "lmcache-cpu", "lmcache-p2p", "lmcache-mooncake", "lmcache-redis"]
    assert "lmcache-pool" in chosen_kinds(parse_args([]))
    for bad in (["--link-gbit", "1", "--kinds", "lmcache-pool"], ["--link-gbit", "0"], ["--kinds", "nope"]):
        with pytest.raises(ValueError):
            chosen_kinds(parse_args(bad))
