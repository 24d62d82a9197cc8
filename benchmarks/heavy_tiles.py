"""Layers of few outputs and a deep K before a pool: v47's planner rules (whole on FFMA, the planner's
register tile; v48's spill retry applies to both ways) against today's (split before the pool,
`tail.POOL_SPLIT_FEW_CHANNELS_MIN_K`, the conv on the TMA engine or, where its layout pass does not
pay, on the implicit GEMM (v49); FFMA tiles spread over more threads where FFMA keeps a layer,
`plan._spread_heavy_tiles`), with eager PyTorch in the same precision beside them. (The last row,
an avg pool after a strided conv, splits both ways since v49: its v48 time was 2.33 ms at batch 64.)

    python benchmarks/heavy_tiles.py [--batch 8 64]

Each row builds the layer both ways (the constants set to their pre-v48 values, then back; each
way under its own name, so each caches apart), checks both against PyTorch's float64 output and
times each: median of CUDA events over calls on fresh random inputs, ms. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import sys

import torch

from specgen import bench, pipeline, plan, reference, tail
from specgen.module import FusedLayer
from specgen.spec import validate

REPS = 15
# name: (input channels, size, conv, epilogue, precision); from a sweep of random layer specs
LAYERS = {
    "384->16 7x7 s2 32^2, relu, max 2 (fp16)": (384, [32, 32], {"out_channels": 16, "kernel": 7, "stride": 2, "padding": 3},
                                                ["relu", {"max_pool": {"kernel": 2}}], "fp16"),
    "384->24 5x5 32^2, hardswish, max 2 (bf16)": (384, [32, 32], {"out_channels": 24, "kernel": 5, "padding": 2},
                                                  ["hardswish", {"max_pool": {"kernel": 2}}], "bf16"),
    "512->24 3x3x3 4x12x12, silu, max 2 (tf32)": (512, [4, 12, 12], {"out_channels": 24, "kernel": 3, "padding": 1},
                                                  ["silu", {"max_pool": {"kernel": 2}}], "tf32"),
    "512->16 3x3 28^2, gelu, max 2 (tf32)": (512, [28, 28], {"out_channels": 16, "kernel": 3, "padding": 1},
                                             [{"gelu": {"approximate": "none"}}, {"max_pool": {"kernel": 2}}], "tf32"),
    "384->24 5x5 17^2, add, max 2 (fp32)": (384, [17, 17], {"out_channels": 24, "kernel": 5, "padding": 2},
                                            [{"add": {"param": "b2"}}, {"max_pool": {"kernel": 2}}], "fp32"),
    "512->16 3x3 56^2, mul, avg 2 (fp32)": (512, [56, 56], {"out_channels": 16, "kernel": 3, "padding": 1},
                                            [{"mul": {"value": 0.5}}, {"avg_pool": {"kernel": 2}}], "fp32"),
    "256->8 3x3 64^2, avg 2 (fp32)": (256, [64, 64], {"out_channels": 8, "kernel": 3, "padding": 1},
                                      [{"avg_pool": {"kernel": 2}}], "fp32"),
    "64->64 3x3 s2 112^2, avg 2 (fp16)": (64, [112, 112], {"out_channels": 64, "kernel": 3, "stride": 2, "padding": 1},
                                          [{"avg_pool": {"kernel": 2}}], "fp16"),
}
BEFORE = {"FFMA_SPREAD_TILES": 0, "POOL_SPLIT_FEW_CHANNELS_MIN_K": 1 << 30}  # the plans before v48


def _set(values: dict) -> None:
    plan.FFMA_SPREAD_TILES = values["FFMA_SPREAD_TILES"]
    tail.POOL_SPLIT_FEW_CHANNELS_MIN_K = values["POOL_SPLIT_FEW_CHANNELS_MIN_K"]


def _describe(layer: FusedLayer) -> str:
    p = layer.specialize().plan
    if p["engine"] == "sequence":
        return "split"
    return f"{p['engine']} {p['ct']}x{p['pt']} {p['threads']}t {p['blocks_per_sample']}b"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", nargs="+", type=int, default=[8, 64])
    args = ap.parse_args(argv)
    now = {"FFMA_SPREAD_TILES": plan.FFMA_SPREAD_TILES, "POOL_SPLIT_FEW_CHANNELS_MIN_K": tail.POOL_SPLIT_FEW_CHANNELS_MIN_K}
    print(f"ms per call (median of {REPS}); before = {BEFORE}, now = {now}", flush=True)
    print(f"{'layer':46}{'batch':>6}{'eager':>9}{'before':>9}  {'plan':22}{'now':>9}  {'plan':22}{'x before':>9}{'x eager':>8}", flush=True)
    for name, (cin, size, conv, epilogue, precision) in LAYERS.items():
        torch.backends.cudnn.allow_tf32 = precision == "tf32"
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
        layers, plans = {}, {}
        for way, values in (("before", BEFORE), ("now", now)):
            _set(values)
            pipeline._memo.clear()
            spec = validate({"name": f"heavy_{way}", "input": {"channels": cin, "size": size}, "conv": conv,
                             "epilogue": epilogue, "precision": precision})
            layers[way] = FusedLayer(spec).cuda().to(dtype)
            plans[way] = _describe(layers[way])
        _set(now)
        ref = reference.Reference(layers["now"].spec).cuda()
        ref.load_state_dict({k: v.float() for k, v in layers["now"].state_dict().items()}, strict=False)
        layers["before"].load_state_dict(layers["now"].state_dict())
        for batch in args.batch:
            xs = [torch.randn(batch, cin, *size, device="cuda").to(dtype) for _ in range(2)]
            times = {}
            with torch.no_grad():
                ref64 = reference.Reference(layers["now"].spec).cuda().double()
                ref64.load_state_dict({k: v.double() for k, v in layers["now"].state_dict().items()}, strict=False)
                want = ref64(xs[1].double())
                for way in ("before", "now"):
                    got = layers[way](xs[1]).double()
                    rel = ((got - want).norm() / want.norm()).item()
                    assert rel < 2e-2, f"{name} {way}: rel L2 {rel:.1e}"
                    times[way] = bench._time(lambda: layers[way](xs[0]), REPS)
                eager = ref.to(dtype)
                times["eager"] = bench._time(lambda: eager(xs[0]), REPS)
            print(f"{name:46}{batch:6d}{times['eager']:9.3f}{times['before']:9.3f}  {plans['before']:22}{times['now']:9.3f}  "
                  f"{plans['now']:22}{times['before'] / times['now']:9.2f}{times['eager'] / times['now']:8.2f}", flush=True)
            xs = None
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
