"""The concatenation kernel (`specgen.concat`) against PyTorch's upsample and cat, on a UNet
decoder's three joins: GPU time per call from the profiler's kernel durations (mean of 20 calls
over four inputs in turn, larger together than the L2 cache), for each tile size and output
layout, with the floor: the bytes the join must move (each source once, the output once) at the
measured copy rate (a device-to-device copy of the output's size, timed the same way).

    python benchmarks/concat_join.py [--batch 64] [--dtype bf16]

Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specgen.concat import TILES, ConcatLayer, ConcatPlan, Source  # noqa: E402
from specgen.standalone import dtype_name  # noqa: E402

CALLS = 20
# (upsampled source channels, its size, skip channels): a UNet at 128^2 with base width 32
JOINS = [(256, 16, 128), (128, 32, 64), (64, 64, 32)]


def _gpu_ms(fn, inputs) -> float:
    for i in range(5):
        fn(*inputs[i % len(inputs)])
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(CALLS):
            fn(*inputs[i % len(inputs)])
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / CALLS / 1000


def arguments(doc: str):
    """(--batch, the torch dtype of --dtype) of a standalone-kernel benchmark, after printing the
    run's header; None without a GPU (said on stderr)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "fp16"])
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return None
    print(f"{torch.cuda.get_device_name()}, batch {args.batch}, {args.dtype}: GPU ms per call (profiler, mean of {CALLS})")
    return args.batch, {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]


def main() -> int:
    parsed = arguments(__doc__)
    if parsed is None:
        return 2
    batch, dtype = parsed
    variants = [(cl, tile) for cl in (False, True) for tile in TILES]
    labels = [("cl" if cl else "nchw") + f" t{t}" for cl, t in variants]
    print(f"{'join':26}{'MB':>7}{'floor':>8}{'PyTorch':>9}" + "".join(f"{label:>15}" for label in labels)
          + "  best x PyTorch, % of floor")
    for cu, su, cs in JOINS:
        size = 2 * su
        inputs = [(torch.randn(batch, cu, su, su, device="cuda").to(dtype),
                   torch.randn(batch, cs, size, size, device="cuda").to(dtype)) for _ in range(4)]
        item = inputs[0][0].element_size()
        moved = (inputs[0][0].numel() + inputs[0][1].numel() + batch * (cu + cs) * size * size) * item
        out_bytes = batch * (cu + cs) * size * size * item
        buffers = [(torch.empty(out_bytes, dtype=torch.uint8, device="cuda"), torch.empty(out_bytes, dtype=torch.uint8, device="cuda"))
                   for _ in range(4)]
        copy_ms = _gpu_ms(lambda a, b: b.copy_(a), buffers)
        floor = moved / (2 * out_bytes / copy_ms)  # (a copy moves its size twice)
        torch_ms = _gpu_ms(lambda a, b: torch.cat([F.interpolate(a, scale_factor=2.0), b], 1), inputs)
        times = []
        for cl, tile in variants:
            plan = ConcatPlan((Source(cu, (su, su), (2, 2)), Source(cs, (size, size), (1, 1))), (size, size),
                              dtype_name(dtype), cl, tile)
            layer = ConcatLayer(plan)
            with torch.no_grad():
                a, b = inputs[0]
                assert torch.equal(layer(a, b), torch.cat([F.interpolate(a, scale_factor=2.0), b], 1))
                times.append(_gpu_ms(layer, inputs))
        best = min(times)
        print(f"{f'{cu}@{su}^2 up + {cs}@{size}^2':26}{moved / 1e6:7.0f}{floor:8.4f}{torch_ms:9.4f}"
              + "".join(f"{t:15.4f}" for t in times) + f"  {torch_ms / best:.2f}x, {100 * floor / best:.0f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
