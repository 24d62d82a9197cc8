"""A depthwise conv's FFMA box with four register tiles stacked on each thread (the planner's box)
against one tile a thread and four times the blocks (`plan.Settings.stacked_tiles` false), in one
run: GPU time per call at several batches, and which of the two the small-batch rule
(`pipeline.small_batch_settings`) gives each batch.

    python benchmarks/depthwise_stacking.py [--batch 1 8 64]

The layers: MobileNetV2's 3x3 depthwise shapes (conv + batch norm + ReLU6, tf32 as a model runs
them, which an FFMA engine computes in fp32) and a 5x5 one. Each is built both ways (under its own
name; the spread box taken at every batch by standing in for the rule), checked against the float64
reference (rel. L2) and timed from the profiler's kernel
durations (mean of 20 calls over four inputs in turn): the time it costs inside a CUDA graph,
where a small batch's host time is gone. Also eager PyTorch's kernels for the same layer (cuDNN's
depthwise conv, batch norm and clamp). Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specgen import bench, pipeline, reference  # noqa: E402
from specgen.measured import batch_bucket  # noqa: E402
from specgen.module import FusedLayer  # noqa: E402
from specgen.plan import Settings  # noqa: E402
from specgen.spec import validate  # noqa: E402

CALLS = 20
# (channels, size, kernel, stride)
LAYERS = [
    (32, 112, 3, 1), (96, 112, 3, 2), (144, 56, 3, 1), (144, 56, 3, 2), (192, 28, 3, 1), (192, 28, 3, 2),
    (384, 14, 3, 1), (576, 14, 3, 1), (576, 14, 3, 2), (960, 7, 3, 1), (240, 28, 5, 1),
]


def _spec(name: str, c: int, size: int, k: int, stride: int):
    return validate({"name": name, "input": {"channels": c, "size": [size, size]},
                     "conv": {"out_channels": c, "kernel": k, "stride": stride, "padding": k // 2, "groups": c,
                              "bias": False},
                     "epilogue": [{"batch_norm": {}}, {"hardtanh": {"min_val": 0.0, "max_val": 6.0}}],
                     "precision": "tf32"})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 8, 64])
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    rule = pipeline.small_batch_settings
    print(f"GPU ms per call (profiler, mean of {CALLS}); stacked = four tiles a thread, spread = one; "
          f"rule = the one the small-batch rule takes")
    print(f"{'layer':28}{'batch':>6}{'eager':>9}{'stacked':>9}{'spread':>9}{'x stacked':>10}{'x eager':>9}"
          f"{'rule':>8}  blocks/sample  rel L2 stacked / spread")
    try:
        for c, size, k, stride in LAYERS:
            eager = torch.nn.Sequential(
                torch.nn.Conv2d(c, c, k, stride, k // 2, groups=c, bias=False), torch.nn.BatchNorm2d(c),
                torch.nn.Hardtanh(0.0, 6.0)).cuda().eval()
            layers = []
            for name in ("stacked", "spread"):
                layer = FusedLayer(_spec(f"dw_{name}_{c}_{size}_k{k}_s{stride}", c, size, k, stride)).cuda().eval()
                layers.append(layer)
            layers[1].load_state_dict(layers[0].state_dict())
            sp = layers[0].specialize()
            eager[0].weight.data.copy_(layers[0].conv.weight)
            for name, value in layers[0].spec_params().items():  # bn_weight, bn_bias, bn_running_mean, ...
                getattr(eager[1], name.removeprefix("bn_")).data.copy_(value.reshape(-1))
            for batch in args.batch:
                xs = [torch.randn(batch, c, size, size, device="cuda") for _ in range(4)]
                picked = "spread" if rule(sp.spec, sp.plan, sp.arch, batch_bucket(batch)) is not None else "stacked"
                times, rels, blocks = [], [], []
                with torch.no_grad():
                    ref = reference.forward64(layers[0].spec, xs[0], layers[0].conv.weight, None, layers[0].spec_params())
                    times.append(bench.gpu_ms(eager, xs, CALLS))
                    for layer, spread in zip(layers, (False, True)):
                        # the spread box at every batch, the stacked one at none
                        pipeline.small_batch_settings = (lambda *a: Settings(stacked_tiles=False)) if spread \
                            else (lambda *a: None)
                        kernel = pipeline.batch_variant(layer.specialize(), batch)
                        blocks.append(kernel.plan["blocks_per_sample"])
                        rels.append(((layer(xs[0]).double() - ref).norm() / ref.norm()).item())
                        times.append(bench.gpu_ms(layer, xs, CALLS))
                        pipeline.small_batch_settings = rule
                label = f"dw {c} ch {size}^2 k{k} s{stride}"
                print(f"{label:28}{batch:>6}{times[0]:9.4f}{times[1]:9.4f}{times[2]:9.4f}{times[1] / times[2]:10.2f}"
                      f"{times[0] / times[2]:9.2f}{picked:>8}  {blocks[0]:>5} / {blocks[1]:<5}  {rels[0]:.1e} / {rels[1]:.1e}",
                      flush=True)
    finally:
        pipeline.small_batch_settings = rule
    return 0


if __name__ == "__main__":
    sys.exit(main())
