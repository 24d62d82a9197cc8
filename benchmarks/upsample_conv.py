"""Upsample (nearest, x2) then a conv, batch norm and ReLU, as a U-Net or GAN decoder writes it:
eager PyTorch (the upsampled tensor made, then cuDNN's conv over it), torch.compile of the same,
and specgen's layer (`conv: {upsample: 2}`, run as the transposed conv it equals: 4 taps per
output of a 3x3 conv instead of 9, the upsampled tensor never made). PyTorch's default flags
(TF32 convolutions) and the tf32 precision; `--precision fp32` turns TF32 off for PyTorch too.

    python benchmarks/upsample_conv.py [--batch 16 64] [--precision tf32] [--no-compile]

Each row: ms per call (CUDA events, median of 20, two inputs alternating), x eager, x torch.compile,
and specgen's rel. L2 against the float64 module. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specgen import bench  # noqa: E402
from specgen.module import FusedLayer  # noqa: E402
from specgen.spec import validate  # noqa: E402

REPS = 20
# name: (input channels, output channels, input size, kernel)
LAYERS = {
    "64->64 3x3, 28^2 -> 56^2": (64, 64, 28, 3),
    "128->64 3x3, 32^2 -> 64^2": (128, 64, 32, 3),
    "256->128 3x3, 16^2 -> 32^2": (256, 128, 16, 3),
    "512->256 3x3, 8^2 -> 16^2": (512, 256, 8, 3),
    "128->64 1x1, 32^2 -> 64^2": (128, 64, 32, 1),
}


def run(name: str, batch: int, precision: str, compile: bool) -> dict:
    cin, cout, size, k = LAYERS[name]
    spec = validate({"name": "upconv", "input": {"channels": cin, "size": [size, size]},
                     "conv": {"out_channels": cout, "kernel": k, "padding": k // 2, "bias": False, "upsample": 2},
                     "epilogue": ["batch_norm", "relu"], "precision": precision})
    torch.manual_seed(0)
    layer = FusedLayer(spec).cuda().eval()
    model = nn.Sequential(nn.Upsample(scale_factor=2), nn.Conv2d(cin, cout, k, padding=k // 2, bias=False),
                          nn.BatchNorm2d(cout), nn.ReLU()).cuda().eval()
    with torch.no_grad():  # a batch norm that is no identity, the same in both
        bn = model[2]
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 1.5)
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
        layer.conv.weight.copy_(model[1].weight)
        for mine, theirs in ((layer.bn_running_mean, bn.running_mean), (layer.bn_running_var, bn.running_var),
                             (layer.bn_weight, bn.weight), (layer.bn_bias, bn.bias)):
            mine.copy_(theirs.reshape(mine.shape))
    xs = [torch.randn(batch, cin, size, size, device="cuda") for _ in range(2)]
    with torch.no_grad():
        ref64 = copy.deepcopy(model).double()(xs[0].double())
        rel = ((layer(xs[0]).double() - ref64).norm() / ref64.norm()).item()
    contenders = [("eager", model)] + ([("torch.compile", torch.compile(model))] if compile else []) + [("specgen", layer)]
    row = {"name": name, "batch": batch, "rel_l2": rel}
    with torch.no_grad():
        for label, fn in contenders:
            calls = [0]

            def step():
                calls[0] += 1
                return fn(xs[calls[0] % 2])

            row[label] = bench._time(step, REPS)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--precision", choices=["tf32", "fp32"], default="tf32")
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.backends.cudnn.allow_tf32 = args.precision == "tf32"
    print(f"{'layer':<30} {'batch':>5} {'eager':>8} {'compile':>8} {'specgen':>8} {'x eager':>8} {'x compile':>9}  rel L2")
    for name in LAYERS:
        for batch in args.batch:
            r = run(name, batch, args.precision, not args.no_compile)
            ms = r["specgen"]
            comp = r.get("torch.compile")
            comp_ms, vs_comp = ("-", "-") if comp is None else (f"{comp:.3f}", f"{comp / ms:.2f}")
            print(f"{name:<30} {batch:>5} {r['eager']:8.3f} {comp_ms:>8} {ms:8.3f} {r['eager'] / ms:8.2f} {vs_comp:>9}  "
                  f"{r['rel_l2']:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
