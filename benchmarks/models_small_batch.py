"""Whole models (examples/models.py) at small batches through from_module, with PyTorch's default
flags (TF32 convolutions), under no_grad: what a user running inference sees.

    python benchmarks/models_small_batch.py [--batch 1 8] [--model ResNet18 ...] [--no-split]

Per model and batch: the chains fused (the never-slower rule keeps PyTorch for the others), wall
time per forward with a sync (best of 10 loops of 20 calls; what the user waits for), the GPU's
kernel time per forward (the profiler's summed kernel durations: no host time), for eager PyTorch
and the fused model, their ratios, and the fused output's rel. L2 against eager's. Needs a GPU.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import models  # noqa: E402
from host import kernels  # noqa: E402  (GPU time per call: the kernels' durations, from the profiler)

from specgen.importer import from_module  # noqa: E402

MODELS = [cls.__name__ for cls in models.MODELS]


def wall_us(fn, calls: int = 20, loops: int = 10) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    best = math.inf
    for _ in range(loops):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t) / calls)
    return best * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--model", nargs="+", default=MODELS, choices=MODELS)
    ap.add_argument("--no-split", action="store_true",
                    help="never take the TMA engine's split kernel (for comparison; use a fresh SPECGEN_CACHE_DIR, "
                         "since the never-slower choices are cached)")
    args = ap.parse_args(argv)
    if args.no_split:
        from specgen import tmarun

        tmarun.uses_split = lambda *a: False
    print("model, batch, chains fused / fusable, from_module s, wall us: eager, fused, x; "
          "GPU kernel us: eager, fused, x; rel. L2 against eager", flush=True)
    walls, gpus = [], []
    for name in args.model:
        cls = getattr(models, name)
        model = cls.make().cuda()
        for batch in args.batch:
            x = cls.example_input(batch, device="cuda", seed=batch)
            t = time.perf_counter()
            fused = from_module(model, x)
            built = time.perf_counter() - t
            choices = fused.specgen_report.choices
            with torch.no_grad():
                want, got = model(x), fused(x)
                err = ((got.double() - want.double()).norm() / want.double().norm()).item()
                we, wf = wall_us(lambda: model(x)), wall_us(lambda: fused(x))
                ke, kf = kernels(lambda: model(x)), kernels(lambda: fused(x))
            walls.append(we / wf)
            gpus.append(ke / kf)
            print(f"  {name:14} {batch:3}  {sum(c.fused for c in choices):3} / {len(choices):3}  {built:5.1f}  "
                  f"{we:9.1f} {wf:9.1f} {we / wf:5.2f}x  {ke:9.1f} {kf:9.1f} {ke / kf:5.2f}x  {err:.1e}", flush=True)
    geo = lambda v: math.exp(sum(map(math.log, v)) / len(v))  # noqa: E731
    print(f"geomean over {len(walls)} rows: wall {geo(walls):.2f}x eager, GPU kernel time {geo(gpus):.2f}x eager")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
