"""The TMA engine's two-blocks-per-SM default over a deep K, before and after v50: v24 made 256 x N
tiles of two blocks per SM the planner's default up to 64 channels, with as many pipeline stages as
two blocks fit (2 for a 256 x 64 tile of 128-byte K rows); v37 later made every TMA block walk
tiles (its producer loads the next tile while its consumers run the epilogue, the overlap two
blocks had been for). Since v50 a layer that walks `tma.TWO_BLOCK_DEEP_K_STAGES` K-block stages or
more takes two blocks only where each still gets `tma.TWO_BLOCK_DEEP_MIN_STAGES`, else one block
of a deeper pipeline. Each layer is built both ways (under its own name, so each caches apart),
checked against the float64 reference and timed; layers the rule leaves alone are controls (both
columns the same plan: their ratio is the run's noise).

    python benchmarks/two_blocks.py [--batch 32 64]

ms per call, CUDA events, median of 15, fresh inputs. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specgen import bench, pipeline, reference, tma  # noqa: E402
from specgen.module import FusedLayer  # noqa: E402
from specgen.spec import validate  # noqa: E402

REPS = 15
CONV3 = {"kernel": 3, "padding": 1}
# name: (input channels, size, conv, epilogue, precision)
LAYERS = {
    "64->64 3x3 56^2 relu (tf32)": (64, [56, 56], {"out_channels": 64, **CONV3}, ["relu"], "tf32"),
    "64->64 3x3 56^2 relu (bf16)": (64, [56, 56], {"out_channels": 64, **CONV3}, ["relu"], "bf16"),
    "256->64 1x1 56^2 relu (bf16)": (256, [56, 56], {"out_channels": 64, "kernel": 1}, ["relu"], "bf16"),
    "32->64 3x3x3 32x64x64 relu (tf32)": (32, [32, 64, 64], {"out_channels": 64, **CONV3}, ["relu"], "tf32"),
    "unet down2_3 64->64 64^2 bn relu (tf32)": (64, [64, 64], {"out_channels": 64, **CONV3, "bias": False},
                                                ["batch_norm", "relu"], "tf32"),
    "unet up2_0 192->64 64^2 bn relu (tf32)": (192, [64, 64], {"out_channels": 64, **CONV3, "bias": False},
                                               ["batch_norm", "relu"], "tf32"),
    "unet up1_0 96->32 128^2 bn relu (tf32)": (96, [128, 128], {"out_channels": 32, **CONV3, "bias": False},
                                               ["batch_norm", "relu"], "tf32"),
    "16->64 3x3 mish mish (tf32, family 2)": (16, [128, 128], {"out_channels": 64, **CONV3}, ["mish", "mish"], "tf32"),
}
DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _build(name: str, cin, size, conv, epilogue, precision, deep: int, batch: int):
    tma.TWO_BLOCK_DEEP_K_STAGES = deep
    pipeline._memo.clear()
    spec = validate({"name": name, "input": {"channels": cin, "size": size}, "conv": conv, "epilogue": epilogue,
                     "precision": precision})
    layer = FusedLayer(spec).cuda().to(DTYPE.get(precision, torch.float32)).eval()
    plan = layer.specialize().plan
    if plan["engine"] != "tma":
        return layer, plan["engine"]
    cfg = plan["tma"].config
    return layer, f"{cfg.bm}x{cfg.bn} s{cfg.stages} {cfg.blocks_per_sm}b"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", nargs="+", type=int, default=[32, 64])
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    now = tma.TWO_BLOCK_DEEP_K_STAGES
    print(f"ms per call (median of {REPS}); before = two blocks from 2 stages at any K, now = at least "
          f"{tma.TWO_BLOCK_DEEP_MIN_STAGES} stages from {now} K-block stages walked")
    print(f"{'layer':42}{'batch':>6}{'before':>9}  {'plan':16}{'now':>9}  {'plan':16}{'x before':>9}  rel L2 before / now")
    for label, (cin, size, conv, epilogue, precision) in LAYERS.items():
        torch.backends.cudnn.allow_tf32 = precision == "tf32"
        for batch in args.batch:
            before, plan_before = _build("two_before", cin, size, conv, epilogue, precision, 1 << 30, batch)
            after, plan_after = _build("two_now", cin, size, conv, epilogue, precision, now, batch)
            tma.TWO_BLOCK_DEEP_K_STAGES = now
            after.load_state_dict(before.state_dict())
            dtype = DTYPE.get(precision, torch.float32)
            xs = [torch.randn(batch, cin, *size, device="cuda").to(dtype) for _ in range(2)]
            with torch.no_grad():
                ref = reference.forward64(before.spec, xs[0], before.conv.weight, before.conv.bias, before.spec_params())
                rels = [((m(xs[0]).double() - ref).norm() / ref.norm()).item() for m in (before, after)]
                times = []
                for m in (before, after):
                    calls = [0]

                    def step(m=m):
                        calls[0] += 1
                        return m(xs[calls[0] % 2])

                    times.append(bench._time(step, REPS))
            print(f"{label:42}{batch:>6}{times[0]:9.3f}  {plan_before:16}{times[1]:9.3f}  {plan_after:16}"
                  f"{times[0] / times[1]:9.2f}  {rels[0]:.1e} / {rels[1]:.1e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
