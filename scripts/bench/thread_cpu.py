"""Per-thread CPU time of the serving benchmark's servers: where the no-reuse cost could go.

py-spy cannot sample processes on the 2-core dev machine (docs/benchmarks.md, "Tools"), so
this reads the kernel's per-thread accounting instead:

    .venv/bin/python scripts/bench/thread_cpu.py sample <bench_serving pid> samples.jsonl   # while it runs
    .venv/bin/python scripts/bench/thread_cpu.py table samples.jsonl bench/results/serving-<ts>.json

`sample` writes, once a second, every thread of every process under the benchmark (utime+stime,
name, nice, CPU mask) and every process's user/system time and minor faults. `table` prints, for
each side-by-side `unique` pair, the CPU-seconds each thread group used between the pair's first
request and its last answer: the main and OpenMP threads of both engine cores, our named threads
(`lmc-*`, lmcache/background_threads.py), the API servers and the `lm://` server.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import time
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def _stat_fields(path: str) -> list[str]:
    """/proc stat fields after the command name (field 3 of proc(5) is index 0)."""
    with open(path) as f:
        return f.read().rsplit(")", 1)[1].split()


def _descendants(root: int) -> list[int]:
    kids: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                kids.setdefault(int(_stat_fields(f"/proc/{name}/stat")[1]), []).append(int(name))
            except OSError:
                continue
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += kids.get(pid, [])
    return found


def _thread(pid: int, tid: str) -> list:
    """[name, CPU seconds, nice, CPU mask] of one thread."""
    with open(f"/proc/{pid}/task/{tid}/comm") as f:
        comm = f.read().strip()
    fields = _stat_fields(f"/proc/{pid}/task/{tid}/stat")
    with open(f"/proc/{pid}/task/{tid}/status") as f:
        cpus = next((line.split()[1] for line in f if line.startswith("Cpus_allowed_list")), "")
    return [comm, (int(fields[11]) + int(fields[12])) / TICK, int(fields[16]), cpus]


def _process(pid: int) -> dict:
    with open(f"/proc/{pid}/cmdline") as f:
        cmd = f.read().replace("\0", " ")[:200]
    fields = _stat_fields(f"/proc/{pid}/stat")
    threads = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            threads[tid] = _thread(pid, tid)
        except OSError:  # ended meanwhile
            continue
    return {"cmd": cmd, "ppid": int(fields[1]), "utime": int(fields[11]) / TICK, "stime": int(fields[12]) / TICK,
            "minflt": int(fields[7]), "threads": threads}


def sample(root: int, out: Path, every_s: float) -> None:
    """Append one snapshot a line until `root` exits."""
    while True:
        try:
            os.kill(root, 0)
        except OSError:
            return
        snap = {"t": time.time(), "procs": {}}
        for pid in _descendants(root):
            try:
                snap["procs"][str(pid)] = _process(pid)
            except OSError:
                continue
        with out.open("a") as f:
            f.write(json.dumps(snap) + "\n")
        time.sleep(every_s)


def _role(procs: dict, parents: dict, pid: str) -> str | None:
    cmd = procs[pid]["cmd"]
    if "lmcache.server" in cmd:
        return "lm:// server"
    if "multiprocessing.spawn" in cmd:  # an engine core: named after its API server
        api = _role(procs, parents, parents[pid]) if parents.get(pid) in procs else None
        return api.replace("API", "engine core") if api else None
    if "lmcache_vllm" in cmd:
        return "ours API"
    if "vllm.entrypoints" in cmd:
        return "alone API"
    return None


def _label(role: str, pid: str, tid: str, thread: list) -> str:
    comm, cpus = thread[0], thread[3]
    if tid == pid:
        return "main"
    if role == "lm:// server":
        return "connection threads"
    if comm.startswith("lmc"):
        return comm
    if "," not in cpus and "-" not in cpus:  # vLLM pinned it (core 1: the OpenMP worker)
        return f"other, pinned to core {cpus}"
    return "other threads"


def table(samples: Path, bench_json: Path) -> None:
    snaps = [json.loads(line) for line in samples.open()]
    bench = json.loads(bench_json.read_text())
    started = datetime.datetime.fromisoformat(bench["started"]).replace(tzinfo=datetime.timezone.utc).timestamp()
    parents, first = {}, {}
    for s in snaps:  # samples without "ppid": the API server seen last before the process
        for pid, proc in s["procs"].items():
            first.setdefault(pid, s["t"])
            if "ppid" in proc:
                parents[pid] = str(proc["ppid"])
            elif pid not in parents and "multiprocessing.spawn" in proc["cmd"]:
                apis = [q for q, p in s["procs"].items() if "lmcache_vllm" in p["cmd"] or "vllm.entrypoints" in p["cmd"]]
                parents[pid] = max(apis, key=lambda q: first[q]) if apis else None
    for ours in [k for k in bench["servers"] if k != "vllm"]:
        recs = [r for r in bench["requests"] if r["server"] in (ours, f"vllm-beside-{ours}") and r["workload"] == "unique"]
        if not recs:
            continue
        a = started + min(r["start_s"] for r in recs) - 0.5
        b = started + max(r["start_s"] + r["latency_s"] for r in recs) + 0.5
        start = min(snaps, key=lambda s: abs(s["t"] - a))
        window = [s for s in snaps if start["t"] <= s["t"] <= b + 1.5]
        procs: dict = {}
        for s in window:
            procs.update(s["procs"])  # the last snapshot of each process (threads that ended at stop included below)
        rows: dict = collections.defaultdict(float)
        per_process: dict = collections.defaultdict(lambda: collections.defaultdict(float))
        for pid, proc in procs.items():
            role = _role(procs, parents, pid)
            if role is None:
                continue
            before = start["procs"].get(pid, {"threads": {}, "utime": 0, "stime": 0, "minflt": 0})
            last: dict = {}
            for s in window:
                if pid in s["procs"]:
                    last.update(s["procs"][pid]["threads"])
            for tid, thread in last.items():
                rows[(role, _label(role, pid, tid, thread))] += thread[1] - before["threads"].get(tid, [0, 0])[1]
            for field in ("utime", "stime", "minflt"):
                if field in proc:  # (not in the first samples taken)
                    per_process[role][field] += proc[field] - before.get(field, 0)
        passes = sum(1 for r in recs if r["server"] == ours)
        print(f"\n{ours}: {window[-1]['t'] - start['t']:.0f} s, {passes} passes on each server; CPU-seconds")
        for key in sorted(rows):
            if rows[key] >= 0.005:
                print(f"  {key[0]:18} {key[1]:26} {rows[key]:8.2f}")
        for role, v in sorted(per_process.items()):
            print(f"  {role:18} user {v['utime']:7.2f}  system {v['stime']:6.2f}  minor faults {v['minflt']:9.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("sample")
    s.add_argument("root_pid", type=int)
    s.add_argument("out", type=Path)
    s.add_argument("--every-s", type=float, default=1.0)
    t = sub.add_parser("table")
    t.add_argument("samples", type=Path)
    t.add_argument("bench_json", type=Path)
    args = parser.parse_args()
    if args.command == "sample":
        sample(args.root_pid, args.out, args.every_s)
    else:
        table(args.samples, args.bench_json)


if __name__ == "__main__":
    main()
