"""A 16-bit conv of several taps reading its NC(H)W input in place (`tma.TAPS_IN_PLACE` on) against
the same layer through the layout pass (off), in one run: what turning the switch on would buy.

    python benchmarks/taps_in_place.py [--batch 8 32] [--dtype bf16 fp16]

Each layer is built both ways (under its own name, so each specializes apart), checked against the
float64 reference (rel. L2, and that both are finite) and timed: ms per call, CUDA events, median of
REPS, two contiguous inputs alternating (each is its layer's whole input, as from the layer before).
Also eager PyTorch in the same dtype, contiguous and channels-last. Needs an sm_90 GPU.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specgen import bench, pipeline, reference, tma  # noqa: E402
from specgen.module import FusedLayer  # noqa: E402
from specgen.spec import validate  # noqa: E402

REPS = 20
CONV3 = {"kernel": 3, "padding": 1}
# name: (input channels, size, conv, epilogue); output rows of whole m64 tiles, or padded to them
LAYERS = {
    "128->128 3x3 at 112^2 relu (rows padded)": (128, [112, 112], {"out_channels": 128, **CONV3}, ["relu"]),
    "64->64 3x3 at 56^2 relu (rows padded)": (64, [56, 56], {"out_channels": 64, **CONV3}, ["relu"]),
    "256->256 3x3 at 56^2 relu (rows padded)": (256, [56, 56], {"out_channels": 256, **CONV3}, ["relu"]),
    "64->64 3x3 at 64^2 relu": (64, [64, 64], {"out_channels": 64, **CONV3}, ["relu"]),
    "32->32 3x3 at 128^2 relu": (32, [128, 128], {"out_channels": 32, **CONV3}, ["relu"]),
    "128->128 3x3 at 128^2 relu": (128, [128, 128], {"out_channels": 128, **CONV3}, ["relu"]),
    "256->256 3x3 at 64^2 relu": (256, [64, 64], {"out_channels": 256, **CONV3}, ["relu"]),
    "128->128 3x3 at 64^2 residual": (128, [64, 64], {"out_channels": 128, **CONV3},
                                      [{"add": {"input": "shortcut"}}, "relu"]),
    "320->320 3x3 at 64^2 silu": (320, [64, 64], {"out_channels": 320, **CONV3}, ["silu"]),
    "256->256 conv1d k3 at 4096 gelu": (256, [4096], {"out_channels": 256, **CONV3}, [{"gelu": {"approximate": "none"}}]),
}
DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _build(name, cin, size, conv, epilogue, precision, on: bool):
    tma.TAPS_IN_PLACE = on
    spec = validate({"name": name, "input": {"channels": cin, "size": size}, "conv": conv, "epilogue": epilogue,
                     "precision": precision, "tile": {"engine": "tma"}})
    pipeline.forget(spec)
    layer = FusedLayer(spec).cuda().to(DTYPE[precision]).eval()
    tp = layer.specialize().plan["tma"]
    return layer, f"{tp.bm}x{tp.bn} s{tp.stages}{' split' if tp.split_k > 1 else ''}", tp.taps_in_place


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", nargs="+", type=int, default=[8, 32])
    ap.add_argument("--dtype", nargs="+", default=["bf16"], choices=sorted(DTYPE))
    args = ap.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("needs an sm_90 GPU", file=sys.stderr)
        return 2
    saved = tma.TAPS_IN_PLACE
    print(f"ms per call (median of {REPS}); pass = the layout pass (TAPS_IN_PLACE off), in place = on")
    print(f"{'layer':42}{'dtype':>6}{'batch':>6}{'eager':>8}{'eager cl':>9}{'pass':>8}{'in place':>9}"
          f"{'x pass':>8}  plan (pass / in place)      rel L2 pass / in place")
    try:
        for precision in args.dtype:
            dtype = DTYPE[precision]
            for label, (cin, size, conv, epilogue) in LAYERS.items():
                off, plan_off, _ = _build("taps_pass", cin, size, conv, epilogue, precision, False)
                on, plan_on, taps = _build("taps_in_place", cin, size, conv, epilogue, precision, True)
                assert taps, f"{label}: not planned in place"
                on.load_state_dict(off.state_dict())
                conv_nd = torch.nn.Conv1d if len(size) == 1 else torch.nn.Conv2d
                eager = conv_nd(cin, conv["out_channels"], 3, padding=1).cuda().to(dtype)
                eager.weight.data.copy_(off.conv.weight)
                eager.bias.data.copy_(off.conv.bias)
                for batch in args.batch:
                    xs = [torch.randn(batch, cin, *size, device="cuda").to(dtype) for _ in range(2)]
                    extras = [torch.randn(batch, conv["out_channels"], *size, device="cuda").to(dtype)
                              for _ in off.spec.inputs()]
                    with torch.no_grad():
                        ref = reference.forward64(off.spec, xs[0], off.conv.weight, off.conv.bias,
                                                  {**off.spec_params(), **dict(zip(off.spec.inputs(), extras))})
                        rels = []
                        for m in (off, on):
                            got = m(xs[0], *extras).double()
                            assert bool(torch.isfinite(got).all()), label
                            rels.append(((got - ref).norm() / ref.norm()).item())
                        times = []
                        # (a 1-D conv has no channels-last format: its row times the same input)
                        fmt = torch.channels_last if len(size) == 2 else torch.contiguous_format
                        cl = [x.to(memory_format=fmt) for x in xs]
                        eager_cl = copy.deepcopy(eager).to(memory_format=fmt)
                        for fn in (lambda i: eager(xs[i]), lambda i: eager_cl(cl[i]),
                                   lambda i: off(xs[i], *extras), lambda i: on(xs[i], *extras)):
                            calls = [0]

                            def step(fn=fn):
                                calls[0] += 1
                                return fn(calls[0] % 2)

                            times.append(bench._time(step, REPS))
                    print(f"{label:42}{precision:>6}{batch:>6}{times[0]:8.3f}{times[1]:9.3f}{times[2]:8.3f}{times[3]:9.3f}"
                          f"{times[2] / times[3]:8.2f}  {plan_off:>12} / {plan_on:<12} {rels[0]:.1e} / {rels[1]:.1e}",
                          flush=True)
    finally:
        tma.TAPS_IN_PLACE = saved
    return 0


if __name__ == "__main__":
    sys.exit(main())
