"""Plots of a `specgen bench` record: a roofline and a bar chart of speedups.

    python -m specgen.plot RECORD.json -o FILE.png      (or `specgen plot`, `specgen bench --plot`)

Left, the roofline of the machine's ceilings measured in the same run (copy bandwidth; FFMA
rate, TF32 off; the TF32 tensor-core rate and a third of it, the 3xTF32 rate): each spec is
placed at its arithmetic intensity (the layer's FLOPs over the fewest bytes it must move) and
each contender (specgen, eager, torch.compile) at the FLOP rate it reached. Right, specgen's
speedup over eager and over torch.compile per spec. Needs matplotlib (`pip install
'specgen[plot]'`); nothing else in specgen imports it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

CONTENDERS = {"specgen": ("o", "tab:red"), "eager": ("s", "tab:blue"), "torch.compile": ("^", "tab:green")}
_FIX = "Fix: pip install 'specgen[plot]' (matplotlib)."


class PlotUnavailable(FileNotFoundError):
    """matplotlib is not installed; the message says how to fix it."""


class RecordError(ValueError):
    """A bench record that is not what `specgen bench --json` writes; names the field."""


def require_matplotlib():
    """The pyplot module on the file-only Agg backend; PlotUnavailable with the fix when missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise PlotUnavailable(f"plots need matplotlib ({error}). {_FIX}") from None
    return plt


def _number(value, where: str, positive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or (positive and value <= 0):
        raise RecordError(f"{where}: expected a {'positive ' if positive else ''}number, got {value!r}")
    return float(value)


def _check(record: object) -> list[dict]:
    """The record's results, each checked for what the plots read."""
    if not isinstance(record, dict) or not isinstance(record.get("results"), list) or not record["results"]:
        raise RecordError("results: expected a non-empty list of bench results (a `specgen bench --json` record)")
    for i, result in enumerate(record["results"]):
        where = f"results[{i}]"
        if not isinstance(result, dict):
            raise RecordError(f"{where}: expected an object, got {type(result).__name__}")
        if not isinstance(result.get("spec"), str):
            raise RecordError(f"{where}.spec: expected a name, got {result.get('spec')!r}")
        for key in ("flops", "fewest_bytes"):
            _number(result.get(key), f"{where}.{key}")
        ceilings = result.get("ceilings")
        if not isinstance(ceilings, dict):
            raise RecordError(f"{where}.ceilings: expected an object, got {ceilings!r}")
        for key in ("copy_bytes_per_s", "fp32_flops_per_s", "tf32_flops_per_s"):
            _number(ceilings.get(key), f"{where}.ceilings.{key}")
        rows = result.get("rows")
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise RecordError(f"{where}.rows: expected a list of objects, got {rows!r}")
        for j, row in enumerate(rows):
            if not isinstance(row.get("name"), str):
                raise RecordError(f"{where}.rows[{j}].name: expected a name, got {row.get('name')!r}")
            _number(row.get("ms"), f"{where}.rows[{j}].ms")
        if not any(r["name"] == "specgen" for r in rows):
            raise RecordError(f"{where}.rows: no 'specgen' row")
    return record["results"]


def points(record: dict) -> list[dict]:
    """One point per (spec, contender): intensity (FLOP/byte) and achieved FLOP/s."""
    out = []
    for result in _check(record):
        intensity = result["flops"] / result["fewest_bytes"]
        for row in result["rows"]:
            if row["name"] in CONTENDERS:
                out.append(
                    {
                        "spec": result["spec"],
                        "contender": row["name"],
                        "intensity": intensity,
                        "flops_per_s": result["flops"] / (row["ms"] * 1e-3),
                    }
                )
    return out


def speedups(record: dict) -> list[dict]:
    """Per spec: specgen's speedup over eager and over torch.compile (None where not measured)."""
    out = []
    for result in _check(record):
        ms = {row["name"]: row["ms"] for row in result["rows"]}
        out.append(
            {
                "spec": result["spec"],
                "vs_eager": ms["eager"] / ms["specgen"] if "eager" in ms else None,
                "vs_compile": ms["torch.compile"] / ms["specgen"] if "torch.compile" in ms else None,
            }
        )
    return out


def plot_record(record: dict, path: str | Path, title: str | None = None) -> Path:
    """Draw the roofline and the speedups of a bench record into `path` (PNG, SVG, PDF: by suffix)."""
    pts, ups = points(record), speedups(record)
    plt = require_matplotlib()
    ceil = record["results"][0]["ceilings"]
    meta = record.get("meta") if isinstance(record.get("meta"), dict) else {}
    fig, (roof, bars) = plt.subplots(1, 2, figsize=(15, 6.5), gridspec_kw={"width_ratios": [1.1, 1]})

    xs = [p["intensity"] for p in pts]
    lo, hi = min(xs) / 4, max(xs) * 4
    grid = [lo * (hi / lo) ** (k / 200) for k in range(201)]
    bw = ceil["copy_bytes_per_s"]
    roofs = (
        ("TF32 tensor cores", ceil["tf32_flops_per_s"], ":"),
        ("3xTF32 (a third of TF32)", ceil["tf32_flops_per_s"] / 3, "--"),
        ("FFMA (fp32, TF32 off)", ceil["fp32_flops_per_s"], "-"),
    )
    for label, peak, style in roofs:
        roof.plot(grid, [min(peak, bw * x) / 1e12 for x in grid], style, color="0.35", lw=1.2)
        roof.annotate(f"{label} {peak / 1e12:.0f} TFLOP/s", (hi, peak / 1e12), ha="right", va="bottom", fontsize=8)
    roof.annotate(f"copy {bw / 1e12:.2f} TB/s", (lo * 1.3, bw * lo * 1.3 / 1e12), rotation=30, fontsize=8, va="bottom")
    for contender, (marker, color) in CONTENDERS.items():
        mine = [p for p in pts if p["contender"] == contender]
        if mine:
            roof.scatter(
                [p["intensity"] for p in mine], [p["flops_per_s"] / 1e12 for p in mine],
                marker=marker, color=color, label=contender, zorder=3, s=36,
            )
    if len(ups) <= 4:
        for p in pts:
            if p["contender"] == "specgen":
                roof.annotate(p["spec"], (p["intensity"], p["flops_per_s"] / 1e12), fontsize=8, xytext=(4, -10), textcoords="offset points")
    roof.set_xscale("log")
    roof.set_yscale("log")
    roof.set_xlabel("arithmetic intensity: layer FLOPs / fewest bytes moved (FLOP/byte)")
    roof.set_ylabel("achieved TFLOP/s (layer FLOPs / time)")
    roof.set_title("roofline, ceilings measured in the same run")
    roof.legend(loc="lower right")
    roof.grid(True, which="both", alpha=0.25)

    names = [u["spec"] for u in ups]
    series = [("x eager", "vs_eager", "tab:blue"), ("x torch.compile", "vs_compile", "tab:green")]
    series = [s for s in series if any(u[s[1]] is not None for u in ups)]
    width = 0.8 / max(1, len(series))
    for k, (label, key, color) in enumerate(series):
        ys = [u[key] or 0.0 for u in ups]
        pos = [i + (k - (len(series) - 1) / 2) * width for i in range(len(ups))]
        drawn = bars.bar(pos, ys, width, label=f"specgen {label}", color=color)
        bars.bar_label(drawn, labels=[f"{y:.2f}" if y else "" for y in ys], fontsize=7, padding=1)
    bars.axhline(1.0, color="0.2", lw=0.8)
    bars.set_xticks(range(len(names)))
    bars.set_xticklabels(names, rotation=35 if len(names) > 3 else 0, ha="right" if len(names) > 3 else "center", fontsize=8)
    bars.set_ylabel("speedup (higher is better)")
    bars.set_title("specgen's speedup")
    bars.legend()
    bars.grid(True, axis="y", alpha=0.25)

    batch = record["results"][0].get("batch")
    fig.suptitle(
        title
        or " | ".join(
            str(x) for x in (meta.get("gpu"), f"batch {batch}" if batch else None, meta.get("date"), f"torch {meta.get('torch')}" if meta.get("torch") else None) if x
        )
    )
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def load_record(path: str | Path) -> dict:
    """A bench record from a JSON file; RecordError (a ValueError) when it is not JSON."""
    try:
        return json.loads(Path(path).read_text())
    except json.JSONDecodeError as error:
        raise RecordError(f"{path}: not JSON ({error})") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("record", metavar="RECORD.json", help="a `specgen bench --json` record")
    p.add_argument("-o", "--output", required=True, metavar="FILE.png", help="the image to write (.png, .svg, .pdf)")
    p.add_argument("--title", default=None)


def run(args) -> int:
    out = plot_record(load_record(args.record), args.output, args.title)
    print(f"wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specgen.plot", description="Plot a specgen bench record.")
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        return run(args)
    except (ValueError, OSError) as error:
        print(f"specgen plot: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
