"""A tf32 / fp32 conv on the TMA engine reading its NC(D)HW input in place through a staging
buffer that the producer's warps transpose (1x1 convs: `tma.STAGED_NCHW`, `TmaPlan.a_staged`) or
from tap-shifted boxes the consumers read their A registers from (`--taps`, stride-1 convs keeping
the input's extents: `tma.STAGED_TAPS`, `TmaPlan.a_shifted`; `--everywhere`: past the rule's taps and
channels too) against the same conv behind the layout pass (the switch off), in one run: GPU time
per call at several batches.

    python benchmarks/staged_nchw.py [--batch 1 8 64] [--precision tf32 fp32] [--taps [--everywhere]]

The layers: the 1x1 convs of MobileNetV2 (+ batch norm, ReLU6 where the block has it) and of a
ResNet-50 bottleneck (+ batch norm + ReLU), whose positions are whole 16-byte rows; with `--taps`,
ResNet-18's and issue 13's 3x3 convs (+ batch norm + ReLU) and a 5x5 one. Each is built
both ways (under its own name, the switch set while it specializes), checked against the float64
reference (rel. L2) and timed from the profiler's kernel durations (mean of 20 calls over four
inputs in turn; the layout pass counted where it runs): the time it costs inside a CUDA graph.
Also eager PyTorch's kernels for the same layer (cuDNN's conv, batch norm, clamp) in the same
precision. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specgen import bench, reference, tma  # noqa: E402
from specgen.module import FusedLayer  # noqa: E402
from specgen.spec import validate  # noqa: E402

CALLS = 20
# (input channels, output channels, size, ReLU6 / ReLU after the batch norm)
LAYERS = [
    (32, 16, 112, False), (16, 96, 112, True), (24, 144, 56, True), (144, 24, 56, False), (32, 192, 28, True),
    (192, 32, 28, False), (64, 384, 14, True), (384, 64, 14, False), (96, 576, 14, True), (576, 96, 14, False),
    (256, 64, 56, True), (64, 256, 56, False), (512, 128, 28, True), (1024, 256, 14, True),
]
# --taps: (input channels, output channels, size, kernel)
TAP_LAYERS = [(64, 64, 56, 3), (128, 128, 28, 3), (128, 128, 112, 3), (256, 256, 16, 3), (32, 64, 64, 5)]


def _spec(name: str, cin: int, cout: int, size: int, act: bool, precision: str, mobilenet: bool, kernel: int = 1):
    after = [{"hardtanh": {"min_val": 0.0, "max_val": 6.0}} if mobilenet else "relu"] if act else []
    return validate({"name": name, "input": {"channels": cin, "size": [size, size]},
                     "conv": {"out_channels": cout, "kernel": kernel, "padding": kernel // 2, "bias": False},
                     "epilogue": [{"batch_norm": {}}, *after], "precision": precision})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 8, 64])
    ap.add_argument("--precision", nargs="+", default=["tf32", "fp32"], choices=["tf32", "fp32"])
    ap.add_argument("--taps", action="store_true", help="the convs of several taps (tma.STAGED_TAPS)")
    ap.add_argument("--everywhere", action="store_true",
                    help="--taps: past the taps and channels the rule takes (tma.STAGED_TAPS_MAX_TAPS, _MAX_CIN)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    print(f"GPU ms per call (profiler, mean of {CALLS}); staged = read in place through the staging buffer; "
          f"pass = the layout pass, then the conv")
    print(f"{'layer':34}{'batch':>6}{'eager':>9}{'pass':>9}{'staged':>9}{'x pass':>8}{'x eager':>9}  rel L2 pass / staged")
    if args.everywhere:
        tma.STAGED_TAPS_MAX_TAPS, tma.STAGED_TAPS_MAX_CIN = 10**6, 10**6
    switch_name = "STAGED_TAPS" if args.taps else "STAGED_NCHW"
    switch = getattr(tma, switch_name)
    layers_of = [(cin, cout, size, k, True) for cin, cout, size, k in TAP_LAYERS] if args.taps else \
        [(cin, cout, size, 1, act) for cin, cout, size, act in LAYERS]
    try:
        for precision in args.precision:
            torch.backends.cudnn.allow_tf32 = precision == "tf32"
            for index, (cin, cout, size, k, act) in enumerate(layers_of):
                mobilenet = not args.taps and index < 10
                eager = torch.nn.Sequential(
                    torch.nn.Conv2d(cin, cout, k, padding=k // 2, bias=False), torch.nn.BatchNorm2d(cout),
                    *([torch.nn.Hardtanh(0.0, 6.0) if mobilenet else torch.nn.ReLU()] if act else [])).cuda().eval()
                layers, staged = [], []
                for name in ("pass", "staged"):
                    setattr(tma, switch_name, name == "staged")  # (a FusedLayer specializes as it is made)
                    layer = FusedLayer(_spec(f"nchw_{name}_{precision}_{cin}_{cout}_{size}_k{k}", cin, cout, size, act, precision,
                                             mobilenet, k)).cuda().eval()
                    tp = layer.specialize().plan.get("tma")
                    staged.append(bool(tp and tp.a_staged))
                    layers.append(layer)
                setattr(tma, switch_name, switch)
                layers[1].load_state_dict(layers[0].state_dict())
                eager[0].weight.data.copy_(layers[0].conv.weight)
                for name, value in layers[0].spec_params().items():  # bn_weight, bn_bias, bn_running_mean, ...
                    getattr(eager[1], name.removeprefix("bn_")).data.copy_(value.reshape(-1))
                label = f"{precision} {k}x{k} {cin}->{cout} {size}^2" + ("" if staged == [False, True] else f" (staged {staged})")
                for batch in args.batch:
                    xs = [torch.randn(batch, cin, size, size, device="cuda") for _ in range(4)]
                    with torch.no_grad():
                        ref = reference.forward64(layers[0].spec, xs[0], layers[0].conv.weight, None, layers[0].spec_params())
                        rels = [((layer(xs[0]).double() - ref).norm() / ref.norm()).item() for layer in layers]
                        times = [bench.gpu_ms(eager, xs, CALLS)] + [bench.gpu_ms(layer, xs, CALLS) for layer in layers]
                    print(f"{label:34}{batch:>6}{times[0]:9.4f}{times[1]:9.4f}{times[2]:9.4f}{times[1] / times[2]:8.2f}"
                          f"{times[0] / times[2]:9.2f}  {rels[0]:.1e} / {rels[1]:.1e}", flush=True)
    finally:
        setattr(tma, switch_name, switch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
