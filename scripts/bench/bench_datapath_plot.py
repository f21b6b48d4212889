"""Plot the data-path benchmark JSONs (`bench_engine.py --json`, `bench_remote.py --json`): each
measured path's ratio to its limit, with the issue's target for that path.

Usage: .venv/bin/python scripts/bench/bench_datapath_plot.py bench/results/engine.json bench/results/remote.json \
           --out bench/results/datapath.png
"""

import argparse
import json
from typing import List, Optional, Tuple

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def target(name: str) -> Optional[float]:
    """Issue 18's target ratio for a row, by what it measures."""
    if name.startswith("CPU tier store,") or name.startswith("CPU tier retrieve,"):
        return 0.8
    if name.startswith("disk tier"):
        return 0.8
    if name.startswith("lm://"):
        return 0.7
    if name.startswith("redis://"):
        return 0.5
    return None


def ratios(paths: List[str]) -> List[Tuple[str, float, Optional[float]]]:
    rows = []
    for path in paths:
        with open(path) as f:
            for row in json.load(f)["rows"]:
                if row["ratio"] is not None and target(row["name"]) is not None:
                    rows.append((row["name"], row["ratio"], target(row["name"])))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", nargs="+")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    rows = ratios(args.json)
    fig, ax = plt.subplots(figsize=(9, 0.32 * len(rows) + 1.2))
    names = [r[0] for r in rows][::-1]
    values = [r[1] for r in rows][::-1]
    goals = [r[2] for r in rows][::-1]
    colors = ["tab:green" if v >= g else "tab:red" for v, g in zip(values, goals)]
    ax.barh(names, values, color=colors)
    for i, goal in enumerate(goals):
        ax.plot([goal, goal], [i - 0.4, i + 0.4], color="black", linewidth=1)
    ax.set_xlabel("ratio to the limit measured in the same run (median of interleaved rounds); | = target")
    ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
