"""One forward of chosen family problems (examples/family/), fused, for a profiler to read.

    ncu --clock-control none -k regex:specgen --section SpeedOfLight ... python benchmarks/ncu_family.py 5 18 --batch 32

Each problem is specialized first (every chain fused, nothing timed), then runs once under an NVTX
range named after it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
import kernelbench_problems as kb  # noqa: E402

from specgen.importer import from_module  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("numbers", nargs="+", type=int)
    ap.add_argument("--batch", type=int, default=32)
    args = ap.parse_args(argv)
    paths = {int(p.name.split("_")[0]): p for p in kb.family()}
    runs = []
    for n in args.numbers:
        model, inputs = kb.load(paths[n], batch=args.batch)
        model = model.cuda().eval()
        inputs = [torch.rand_like(t).cuda() if isinstance(t, torch.Tensor) else t for t in inputs]
        runs.append((paths[n].stem, from_module(model, *inputs, keep_slower=True), inputs))
    torch.cuda.synchronize()
    with torch.no_grad():
        for name, fused, inputs in runs:
            torch.cuda.nvtx.range_push(name)
            fused(*inputs)
            torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
