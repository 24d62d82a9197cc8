"""Whole models (examples/models.py) at batch 1, 8 and 64 against eager PyTorch and torch.compile,
with PyTorch's default flags (TF32 convolutions), under no_grad: what a user running inference sees.

    python benchmarks/models_batches.py [--batch 1 8 64] [--model ResNet18 ...] [--memory-format auto]
                                        [--dtype bf16] [--no-tf32] [--json FILE]

Each (model, batch) is one `specgen.bench.bench_model` run: ms per forward (CUDA events around one
forward, median of 20, two inputs alternating), for eager, torch.compile (default mode and
reduce-overhead, its CUDA graphs), `from_module` with its defaults (a CUDA graph where it measures
faster) and the fused model without the graph; rel. L2 of each against the float64 model.
`--dtype bf16` / `fp16` converts the model and its input first (`.to(dtype)`), as a user running a
16-bit model would: from_module then specializes its chains in that precision. `--no-tf32` turns
PyTorch's TF32 flags off first (cuDNN and matmul), as a user asking for strict fp32 would: eager and
torch.compile then run in fp32, and from_module specializes in fp32 mode (3xTF32). The
summary gives the geomean ratios of specgen over eager and over each torch.compile mode. Needs a GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

import models  # noqa: E402

from specgen import bench  # noqa: E402

MODELS = [cls.__name__ for cls in models.MODELS]


def geomean(values: list) -> float:
    values = [v for v in values if v]
    return math.exp(sum(map(math.log, values)) / len(values)) if values else float("nan")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 8, 64])
    ap.add_argument("--model", nargs="+", default=MODELS, choices=MODELS)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--memory-format", default="as_given", choices=["as_given", "channels_last", "auto"],
                    help="from_module's memory_format (default: as_given)")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"],
                    help="the model's and its input's dtype (default fp32: its convs in TF32, PyTorch's default)")
    ap.add_argument("--no-tf32", action="store_true",
                    help="PyTorch's TF32 flags off: strict fp32 for every contender (from_module in fp32 mode)")
    args = ap.parse_args(argv)
    if args.no_tf32:
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
    results = []
    env = bench.environment()
    for name in args.model:
        cls = getattr(models, name)
        for batch in args.batch:
            torch.manual_seed(batch)
            dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
            label = name if args.dtype == "fp32" else f"{name} {args.dtype}"
            label += " strict fp32" if args.no_tf32 else ""
            result = bench.bench_model(cls.make().to(dtype), cls.example_input(batch, seed=batch).to(dtype), label=label,
                                       compile_fused=False,
                                        memory_format=args.memory_format)
            print(bench.format_model_table(result), flush=True)
            results.append(result)
            if args.json:  # (after every model: a run cut short keeps what it measured)
                Path(args.json).write_text(json.dumps({"environment": env, "results": results}, indent=1, default=str))
            torch.compiler.reset()
            torch.cuda.empty_cache()
    print("\nmodel           batch   eager ms  compile  c.r-o   specgen  x eager  x compile  x c.r-o  graph")
    ratios: dict[str, list] = {"eager": [], "torch.compile": [], "torch.compile reduce-overhead": []}
    for r in results:
        ms = {row["name"]: row.get("ms") for row in r["rows"]}
        s = ms.get("specgen")
        cells = []
        for peer in ratios:
            ratio = ms[peer] / s if ms.get(peer) and s else None
            ratios[peer].append(ratio)
            cells.append(f"{ratio:7.2f}x" if ratio else "      -")
        graph = "yes" if "specgen, no CUDA graph" in ms else "no"
        fmt = lambda v: f"{v:8.3f}" if v else "       -"  # noqa: E731
        print(f"{r['model']:15} {r['batch']:5} {fmt(ms.get('eager'))} {fmt(ms.get('torch.compile'))} "
              f"{fmt(ms.get('torch.compile reduce-overhead'))} {fmt(s)} {'  '.join(cells)}  {graph}")
    print("geomean: " + ", ".join(f"{geomean(v):.2f}x {k}" for k, v in ratios.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
