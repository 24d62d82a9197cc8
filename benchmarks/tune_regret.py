"""How far the planner's tile is from the fastest one `specgen tune` timed, from `specgen tune`'s
printed output (a record such as benchmarks/2026-12-07-h100-v64-tune-before.txt); with a second
record of the same layers, also what the change of planner between them bought.

    python benchmarks/tune_regret.py RECORD [AFTER_RECORD]

Per layer: the planner's choice (the "heuristic" line), its time over the fastest candidate's;
then the geomean and the largest of those ratios. With AFTER_RECORD (the same layers tuned again
after a change of the planner): the layers whose choice changed, and for each the former choice's
time over the new one's, both read from AFTER_RECORD (one run, so the machine's run-to-run noise
stays out of the ratio). Reads text only: no GPU needed.
"""

from __future__ import annotations

import math
import re
import sys

LAYER = re.compile(r"^(\S+) \((\w+), batch (\d+)")
# "   heuristic (tma 256x64 s2 kb1 2 blocks/SM)       0.1355 ms ..." or " * tma 128x128 s4 kb1   0.0635 ms ..."
CANDIDATE = re.compile(r"^\s+\*?\s*(heuristic \()?(.+?)\)?\s+([0-9.]+) ms")


def parse(text: str) -> dict[str, dict]:
    """{layer: {"heuristic": its candidate's name, "times": {candidate: ms}}} of a tune output."""
    layers: dict[str, dict] = {}
    current = None
    for line in text.splitlines():
        head = LAYER.match(line)
        if head:
            current = layers[head.group(1)] = {"heuristic": None, "times": {}}
            continue
        row = CANDIDATE.match(line)
        if row and current is not None:
            name = row.group(2).strip()
            current["times"][name] = float(row.group(3))
            if row.group(1):
                current["heuristic"] = name
    return {k: v for k, v in layers.items() if v["heuristic"] is not None}


def geomean(values: list[float]) -> float:
    return math.exp(sum(map(math.log, values)) / len(values)) if values else float("nan")


def regrets(layers: dict[str, dict]) -> dict[str, float]:
    """Each layer's planner time over its fastest candidate's."""
    return {k: v["times"][v["heuristic"]] / min(v["times"].values()) for k, v in layers.items()}


def changes(before: dict[str, dict], after: dict[str, dict]) -> dict[str, tuple[str, str, float]]:
    """Layers whose planner choice changed: (former, new, former's time / new's), both times from
    `after`'s run; layers whose former choice `after` did not time are left out."""
    out = {}
    for name, b in before.items():
        a = after.get(name)
        if a is None or a["heuristic"] == b["heuristic"] or b["heuristic"] not in a["times"]:
            continue
        out[name] = (b["heuristic"], a["heuristic"], a["times"][b["heuristic"]] / a["times"][a["heuristic"]])
    return out


def main(argv: list[str]) -> int:
    if not 1 <= len(argv) <= 2:
        print(__doc__, file=sys.stderr)
        return 2
    runs = [parse(open(path, encoding="utf-8").read()) for path in argv]
    for path, layers in zip(argv, runs):
        r = regrets(layers)
        print(f"{path}: {len(r)} layers; the planner's tile over the fastest: geomean {geomean(list(r.values())):.3f}, "
              f"largest {max(r.values()):.3f} ({max(r, key=r.get)})")
    if len(runs) == 2:
        moved = changes(*runs)
        for name, (former, new, ratio) in moved.items():
            print(f"  {name:42} {former:32} -> {new:32} x{ratio:.3f}")
        ratios = [m[2] for m in moved.values()]
        if ratios:
            print(f"{len(ratios)} layers changed; the new choice {geomean(ratios):.3f}x faster geomean in the second run "
                  f"({min(ratios):.3f}x-{max(ratios):.3f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
