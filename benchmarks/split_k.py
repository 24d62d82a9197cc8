"""Deep layers at small batches: the split kernel against the plain kernel and cuDNN.

    python benchmarks/split_k.py [--precision tf32 bf16 fp32] [--batch 1 4 16] [--engine tma|igemm]

At batch 1 a deep layer late in a CNN (ResNet's 512 channels at 7 x 7) is a handful of output tiles
for 132 SMs; the split kernel spreads K over more blocks. `--engine igemm` runs every layer on the
implicit-GEMM engine (what fp32 layers of few multiply-adds per input byte, and other GPUs, get). Each row: GPU time per call, the kernels'
durations summed by the profiler over 50 calls (no host time, no gaps; unlike a CUDA-graph replay,
which remakes specgen's prepared weights on every replay, this keeps them cached as eager use does), for specgen as the launch chooses (split where
`splitk.pays`), specgen with the plain kernel forced, eager PyTorch (contiguous and channels-last
tensors) in the same precision; and the floor (the larger of the FLOPs at the measured tensor-core
rate and the fewest bytes at the measured copy rate). Needs a CUDA GPU (sm_90).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from host import kernels  # noqa: E402  (GPU time per call: the kernels' durations, from the profiler)

from specgen import bench, tmarun, torchop  # noqa: E402
from specgen.module import FusedLayer  # noqa: E402
from specgen.spec import validate  # noqa: E402

# name: (input channels, size, conv)
LAYERS = {
    "resnet stage 4, 3x3 512 at 7x7": (512, [7, 7], {"out_channels": 512, "kernel": 3, "padding": 1}),
    "resnet stage 3, 3x3 256 at 14x14": (256, [14, 14], {"out_channels": 256, "kernel": 3, "padding": 1}),
    "resnet stage 2, 3x3 128 at 28x28": (128, [28, 28], {"out_channels": 128, "kernel": 3, "padding": 1}),
    "3x3 s2 256 -> 512, 14x14": (256, [14, 14], {"out_channels": 512, "kernel": 3, "stride": 2, "padding": 1}),
    "3x3 512 at 14x14": (512, [14, 14], {"out_channels": 512, "kernel": 3, "padding": 1}),
    "1x1 512 -> 2048 at 7x7": (512, [7, 7], {"out_channels": 2048, "kernel": 1}),
    "conv1d k3 512, length 64": (512, [64], {"out_channels": 512, "kernel": 3, "padding": 1}),
}
DTYPE = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16}
RATE = {"fp32": "tf32_flops_per_s", "tf32": "tf32_flops_per_s", "bf16": "bf16_flops_per_s"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--precision", nargs="+", default=["tf32", "bf16", "fp32"], choices=sorted(DTYPE))
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 4, 16])
    ap.add_argument("--engine", default="tma", choices=["tma", "igemm"])
    args = ap.parse_args(argv)
    if args.engine == "igemm":
        args.precision = [p for p in args.precision if p != "bf16"]  # (no 16-bit implicit GEMM)
    ceil = bench.ceilings()
    print(f"ceilings: copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s, tf32 {ceil['tf32_flops_per_s'] / 1e12:.0f}, "
          f"bf16 {ceil['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s; times: us of kernels per call (profiler)", flush=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    chosen, chosen_ig = tmarun.uses_split, torchop.igemm_uses_split
    ratios = {p: [] for p in args.precision}
    for precision in args.precision:
        dtype = DTYPE[precision]
        print(f"\n{precision}: layer, batch, split parts (used?), specgen, plain kernel, eager, eager channels-last, "
              f"x eager (best layout), % of floor", flush=True)
        for name, (cin, size, conv) in LAYERS.items():
            spec = validate({"name": "split_bench", "input": {"channels": cin, "size": size}, "conv": conv,
                             "epilogue": ["relu"], "precision": precision, "tile": {"engine": args.engine}})
            layer = FusedLayer(spec).cuda()
            sp = layer.specialize()
            tp = sp.plan.get(args.engine)
            ref = (torch.nn.Conv1d if len(size) == 1 else torch.nn.Conv2d)(
                cin, conv["out_channels"], conv["kernel"], conv.get("stride", 1), conv.get("padding", 0)).cuda().to(dtype)
            with torch.no_grad():
                ref.weight.copy_(layer.conv.weight)
                ref.bias.copy_(layer.conv.bias)
            torch.backends.cudnn.allow_tf32 = precision != "fp32"
            ref_cl = None
            if len(size) == 2:
                ref_cl = torch.nn.Conv2d(cin, conv["out_channels"], conv["kernel"], conv.get("stride", 1),
                                         conv.get("padding", 0)).cuda().to(dtype).to(memory_format=torch.channels_last)
                with torch.no_grad():
                    ref_cl.weight.copy_(ref.weight)
                    ref_cl.bias.copy_(ref.bias)
            for batch in args.batch:
                x = torch.randn((batch, cin, *size), device="cuda").to(dtype)
                x_cl = x.contiguous(memory_format=torch.channels_last) if ref_cl is not None else None
                with torch.no_grad():
                    got = layer(x)
                    want = torch.relu(ref(x))
                    err = ((got.double() - want.double()).norm() / want.double().norm()).item()
                    if args.engine == "tma":
                        used = tp is not None and chosen(tp, batch, sms)
                    else:
                        lp = torchop._launch_plan(sp)
                        used = lp.igemm_split is not None and chosen_ig(lp, batch, sms)
                    t_auto = kernels(lambda: layer(x))
                    tmarun.uses_split = torchop.igemm_uses_split = lambda *a: False
                    try:
                        t_plain = kernels(lambda: layer(x))
                    finally:
                        tmarun.uses_split, torchop.igemm_uses_split = chosen, chosen_ig
                    t_eager = kernels(lambda: torch.relu(ref(x)))
                    t_cl = kernels(lambda: torch.relu(ref_cl(x_cl))) if ref_cl is not None else float("nan")
                flops = 2 * math.prod(got.shape) * cin * math.prod([conv["kernel"]] * len(size))
                nbytes = (x.numel() + got.numel() + layer.conv.weight.numel()) * x.element_size()
                floor = max(flops * (3 if precision == "fp32" else 1) / ceil[RATE[precision]],
                            nbytes / ceil["copy_bytes_per_s"]) * 1e6
                best_eager = min(t_eager, t_cl) if not math.isnan(t_cl) else t_eager
                ratios[precision].append(best_eager / t_auto)
                parts = f"{tp.split_k} ({'yes' if used else 'no'})" if tp is not None else f"- ({sp.plan['engine']})"
                print(f"  {name:36} {batch:3}  {parts:9} {t_auto:8.1f} {t_plain:8.1f} {t_eager:8.1f} {t_cl:8.1f} "
                      f"{best_eager / t_auto:6.2f}x {100 * floor / t_auto:5.0f}%   (rel. L2 vs eager {err:.1e})", flush=True)
    for precision, r in ratios.items():
        print(f"{precision}: geomean x eager (best layout) {math.exp(sum(map(math.log, r)) / len(r)):.2f} over {len(r)} rows")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
