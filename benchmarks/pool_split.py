"""A shallow conv before a windowed pool: whole on FFMA, or split (the conv on tensor cores into T0,
the pool in a second kernel).

    python benchmarks/pool_split.py [--precision tf32 fp32] [--min-k 128]

The planner splits a layer before its first windowed pool when the conv's K (input channels x
taps) is at least `tail.POOL_SPLIT_MIN_K`. Each row times the same layer both ways (the constant
set past every K, then to 0), with eager PyTorch in the same precision beside them: median of CUDA
events over calls on fresh random inputs, ms. Needs a CUDA GPU (sm_90).
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

from specgen import bench, pipeline, reference, tail
from specgen.module import FusedLayer
from specgen.spec import validate

REPS = 15
# name: (batch, input channels, size, conv, epilogue)
LAYERS = {
    "8->64 3x3 256^2, tanh, max pool 4": (128, 8, [256, 256], {"out_channels": 64, "kernel": 3}, ["tanh", {"mul": {"value": 2.0}}, {"max_pool": {"kernel": 4}}]),
    "8->64 3x3 128^2, relu, max pool 2": (128, 8, [128, 128], {"out_channels": 64, "kernel": 3, "padding": 1}, ["relu", {"max_pool": {"kernel": 2}}]),
    "8->32 3x3 128^2, gelu, avg pool 2": (128, 8, [128, 128], {"out_channels": 32, "kernel": 3}, ["gelu", {"avg_pool": {"kernel": 2}}]),
    "3->16 3x3x3 16x32x32, max pool 2": (128, 3, [16, 32, 32], {"out_channels": 16, "kernel": 3}, [{"max_pool": {"kernel": 2}}]),
    "3->64 3x3x3 16x64x64, max pool 2": (32, 3, [16, 64, 64], {"out_channels": 64, "kernel": 3}, ["relu", {"max_pool": {"kernel": 2}}]),
    "16->64 3x3 128^2, sub, max pool 2, mish": (128, 16, [128, 128], {"out_channels": 64, "kernel": 3}, [{"sub": {"value": 0.5}}, {"max_pool": {"kernel": 2}}, "mish"]),
    "3->64 7x7 s2 224^2, relu, max pool 3 s2": (64, 3, [224, 224], {"out_channels": 64, "kernel": 7, "stride": 2, "padding": 3}, ["relu", {"max_pool": {"kernel": 3, "stride": 2, "padding": 1}}]),
}


def _layer(spec, min_k: int) -> tuple[FusedLayer, str]:
    tail.POOL_SPLIT_MIN_K = min_k
    pipeline._memo.clear()  # the memo is keyed by the spec alone
    layer = FusedLayer(spec).cuda()
    plan = layer.specialize().plan
    return layer, plan["engine"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--precision", nargs="+", default=["tf32", "fp32"], choices=["tf32", "fp32"])
    args = ap.parse_args(argv)
    default = tail.POOL_SPLIT_MIN_K
    print(f"POOL_SPLIT_MIN_K = {default}; ms per call (median of {REPS})", flush=True)
    for precision in args.precision:
        torch.backends.cudnn.allow_tf32 = precision == "tf32"
        print(f"\n{precision}: {'layer':44}{'K':>5}{'eager':>9}{'whole':>9}{'engine':>10}{'split':>9}{'engine':>10}  best", flush=True)
        for name, (batch, cin, size, conv, epilogue) in LAYERS.items():
            spec = validate({"name": "pool_split_bench", "input": {"channels": cin, "size": size}, "conv": conv,
                             "epilogue": epilogue, "precision": precision})
            k = cin * math.prod(spec.conv_geometry()["kernel"])
            xs = [torch.rand(batch, cin, *size, device="cuda") for _ in range(2)]
            ref = reference.Reference(spec).cuda()
            times, engines = {}, {}
            with torch.no_grad():
                times["eager"] = bench._time(lambda: ref(xs[0]), REPS)
                for way, min_k in (("whole", 1 << 30), ("split", 0)):
                    layer, engines[way] = _layer(spec, min_k)
                    layer.load_state_dict(ref.state_dict())
                    want = ref(xs[1]).double()
                    got = layer(xs[1]).double()
                    rel = ((got - want).norm() / want.norm()).item()
                    assert rel < 1e-2, f"{name} {way}: rel L2 {rel:.1e}"
                    times[way] = bench._time(lambda: layer(xs[0]), REPS)
            tail.POOL_SPLIT_MIN_K = default
            best = min(("whole", "split"), key=times.get)
            print(f"{precision}: {name:44}{k:5d}{times['eager']:9.3f}{times['whole']:9.3f}{engines['whole']:>10}"
                  f"{times['split']:9.3f}{engines['split']:>10}  {best}", flush=True)
            xs = None
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
