"""The public KernelBench level-2 conv problems through `from_module`, at their own sizes.

    python benchmarks/kernelbench.py [--dir PATH] [--only 19,92] [--train] [--compile] [--json out.json]

For each problem: the model as constructed (eval mode unless --train), its `get_inputs()` on the
GPU, `from_module(model, *inputs)` (never slower: a chain that is not faster stays PyTorch), then
eager and the fused model timed in one process (CUDA events, median), with the fused model's rel.
L2 error against a float64 copy of the model, and the original's (column `torch`: the error PyTorch
itself makes with the same flags). `--compile` adds torch.compile of the original.
The problems live outside the repository (`SPECGEN_KERNELBENCH_DIR`, else
../shared/kernelbench/level2 beside the checkout).
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REPS = 10  # timed calls per contender (median), after specgen.bench's warm-up


def load(path: Path):
    spec = importlib.util.spec_from_file_location(f"kb_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=os.environ.get("SPECGEN_KERNELBENCH_DIR", str(ROOT.parent / "shared" / "kernelbench" / "level2")))
    ap.add_argument("--only", default=None, help="problem numbers, comma-separated")
    ap.add_argument("--train", action="store_true", help="training mode, as KernelBench runs them")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import torch

    from specgen import explain, from_module
    from specgen.bench import _time

    paths = sorted(Path(args.dir).glob("*.py"), key=lambda p: int(p.name.split("_")[0]))
    if args.only:
        wanted = {int(n) for n in args.only.split(",")}
        paths = [p for p in paths if int(p.name.split("_")[0]) in wanted]
    rows = []
    print(f"{'problem':58}{'chains':>8}{'eager ms':>10}{'specgen':>9}{'x eager':>9}{'rel L2':>9}{'torch':>9}" + ("  x compile" if args.compile else ""))
    for path in paths:
        row = {"problem": path.stem}
        try:
            module = load(path)
            torch.manual_seed(0)
            model = module.Model(*module.get_init_inputs()).cuda()
            model.train(args.train)
            inputs = [t.cuda() if isinstance(t, torch.Tensor) else t for t in module.get_inputs()]
            with torch.no_grad():
                ref64 = copy.deepcopy(model).double()(*[t.double() if isinstance(t, torch.Tensor) else t for t in inputs])
                report = explain(model, *inputs)
                t0 = time.perf_counter()
                fused = from_module(model, *inputs)
                row["specialize_s"] = time.perf_counter() - t0
                out = fused(*inputs)
                row["rel_l2"] = ((out.double() - ref64).norm() / ref64.norm().clamp_min(1e-30)).item()
                # PyTorch's own error with the same flags: where the output is ill-conditioned (23's
                # mean of a group norm is a sum of values that cancel to ~0), both are large
                row["torch_rel_l2"] = ((model(*inputs).double() - ref64).norm() / ref64.norm().clamp_min(1e-30)).item()
                row["eager_ms"] = _time(lambda: model(*inputs), REPS)
                row["specgen_ms"] = _time(lambda: fused(*inputs), REPS)
                if args.compile:
                    compiled = torch.compile(model)
                    row["compile_ms"] = _time(lambda: compiled(*inputs), REPS)
            final = getattr(fused, "specgen_report", report)
            row["fused_chains"] = sum(c.fused for c in final.choices) if final.choices else 0
            if final.whole_model and final.whole_model[0] >= final.whole_model[1]:
                row["fused_chains"] = 0  # the whole fused model was not faster: the original runs
            row["chains"] = len(report.specs)
            row["fallbacks"] = [f"{f.node}: {f.reason}" for f in report.fallbacks]
            row["whole_model"] = getattr(final, "whole_model", None)
            x = row["eager_ms"] / row["specgen_ms"]
            extra = f"{row['compile_ms'] / row['specgen_ms']:11.2f}" if args.compile else ""
            print(f"{path.stem[:58]:58}{row['fused_chains']:>4}/{row['chains']:<3}{row['eager_ms']:10.3f}{row['specgen_ms']:9.3f}"
                  f"{x:9.2f}{row['rel_l2']:9.1e}{row['torch_rel_l2']:9.1e}{extra}", flush=True)
        except Exception as err:  # noqa: BLE001  (a problem that fails is a row saying why)
            row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
            print(f"{path.stem[:58]:58}  failed: {row['error']}", flush=True)
        rows.append(row)
        torch.cuda.empty_cache()
    speedups = [r["eager_ms"] / r["specgen_ms"] for r in rows if "specgen_ms" in r]
    if speedups:
        print(f"geomean x eager over {len(speedups)} problems: {math.exp(sum(map(math.log, speedups)) / len(speedups)):.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
