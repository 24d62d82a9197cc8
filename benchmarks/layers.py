"""The real-layer benchmark: every layer of examples/layers.yaml at the batch its comment gives,
in each precision asked, through `specgen.bench.bench` (peers measured in the same run).

    python benchmarks/layers.py --precision tf32 bf16 fp32 [--no-compile fp32] [--json out.json] [--name NAME ...]
                                [--file examples/transposed.yaml]

Prints one table per layer and precision, then a summary: specgen's time, its ratios to eager in
the same precision (fp32: cuDNN with TF32 off), to eager on channels-last tensors and to
torch.compile, and the geomeans, each measured two ways (one call from an idle GPU, and calls back
to back: see `specgen.bench`). Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ROOT / "examples" / "layers.yaml"


def batches(path: Path = LAYERS) -> dict[str, int]:
    """Each layer's batch, from its `- name: X   # batch N` line."""
    out = {}
    for line in path.read_text().splitlines():
        m = re.match(r"- name: (\w+)\s+# batch (\d+)", line)
        if m:
            out[m.group(1)] = int(m.group(2))
    return out


def geomean(values) -> float:
    values = [v for v in values if v]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--precision", nargs="+", default=["tf32"], choices=["fp32", "tf32", "bf16", "fp16"])
    ap.add_argument("--no-compile", nargs="*", default=[], help="precisions to bench without torch.compile")
    ap.add_argument("--name", nargs="*", default=None, help="only these layers")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None)
    ap.add_argument("--file", type=Path, default=LAYERS, help="the layers (default examples/layers.yaml)")
    args = ap.parse_args(argv)

    from specgen import bench
    from specgen.spec import load_specs

    sizes = batches(args.file)
    specs = [s for s in load_specs(args.file) if args.name is None or s.name in args.name]
    ceil = bench.ceilings()
    print(f"ceilings: copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s, fp32 {ceil['fp32_flops_per_s'] / 1e12:.1f}, "
          f"tf32 {ceil['tf32_flops_per_s'] / 1e12:.0f}, bf16 {ceil['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s", flush=True)
    results = []
    for precision in args.precision:
        for spec in specs:
            s = spec.model_copy(update={"precision": precision})
            result = bench.bench(s, sizes.get(spec.name, 64), reps=args.reps,
                                 compile=precision not in args.no_compile, ceil=ceil)
            results.append(result)
            print(bench.format_table(result), flush=True)
    print("\nsummary (ms; ratios are the other's time over specgen's; 'idle': one call from an idle GPU,"
          " 'streamed': calls back to back)")
    for precision in args.precision:
        rows = [r for r in results if r["precision"] == precision]
        ratios = {f"{k} {how}": [] for how in ("idle", "streamed") for k in ("x eager", "x eager cl", "x compile")}
        print(f"{precision}: {'layer':28}{'engine':34}{'idle':>8}{'streamed':>9}  {'x eager':>13}{'x eager cl':>13}"
              f"{'x compile':>13}{'% floor':>8}")
        print(f"      {'':62}{'':17}  {'idle / str.':>13}{'idle / str.':>13}{'idle / str.':>13}")
        for r in rows:
            by = {row["name"]: row for row in r["rows"]}
            me = by["specgen"]
            cells = []
            for key, peer in (("x eager", "eager"), ("x eager cl", "eager channels_last"), ("x compile", "torch.compile")):
                if peer not in by:
                    cells.append(f"{'-':>13}")
                    continue
                idle, streamed = by[peer]["ms"] / me["ms"], by[peer]["ms_stream"] / me["ms_stream"]
                ratios[f"{key} idle"].append(idle)
                ratios[f"{key} streamed"].append(streamed)
                cells.append(f"{idle:7.2f}/{streamed:5.2f}")
            mark = bench.slower_mark(me) if me["slower_than_eager"] else ""
            print(f"      {r['spec']:28}{r['engine'][:33]:34}{me['ms']:8.3f}{me['ms_stream']:9.3f}  {''.join(cells)}"
                  f"{me['pct_of_floor']:8.0f}{mark}")
        print("      geomean: " + ", ".join(f"{k} {geomean(v):.2f}" for k, v in ratios.items() if any(v)))
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": bench.environment(), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
