"""How long specializing a whole model's chains takes: cold (an empty cache: plan, render, nvcc)
and warm (every kernel a cache hit), for a target arch, without loading anything onto a GPU.

    SPECGEN_CACHE_DIR=$(mktemp -d) python benchmarks/specialize_time.py [--model ResNet18] [--batch 8] [--arch sm_90]

The model comes from examples/models.py in eval mode, in tf32 (PyTorch's default for convs). The
cold and the warm pass each run in a fresh process, so the warm one pays what a new Python process
pays on a cache hit (the request index: no planning or rendering, nothing memoized).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def one_pass(model_name: str, batch: int, arch: str) -> None:
    sys.path.insert(0, str(ROOT / "examples"))
    import models

    from specgen import explain, pipeline

    t0 = time.perf_counter()
    cls = getattr(models, model_name)
    model, x = cls.make(), cls.example_input(batch)
    specs = [s.model_copy(update={"precision": "tf32"}) for s in explain(model, x).specs]
    t1 = time.perf_counter()
    pipeline.specialize_many(specs, arch, tuned=False)
    t2 = time.perf_counter()
    distinct = len({s.canonical_json() for s in specs})
    print(f"{len(specs)} chains ({distinct} distinct specs): import {t1 - t0:.2f} s, specialize {t2 - t1:.2f} s", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="ResNet18")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--one-pass", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one_pass:
        one_pass(args.model, args.batch, args.arch)
        return 0
    for label in ("cold", "warm"):
        cmd = [sys.executable, __file__, "--one-pass", "--model", args.model, "--batch", str(args.batch), "--arch", args.arch]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()
        print(f"{label}: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
