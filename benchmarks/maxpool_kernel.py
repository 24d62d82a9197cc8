"""The max-pool kernel (`specgen.maxpool`) against PyTorch's max pool (which also writes each
maximum's int64 index), on a UNet encoder's three 2x2 pools, a ResNet stem's padded 3x3 / 2 pool
and a ceil-mode pool (GoogLeNet's 3x3 / 2): GPU time per call from the profiler
(as `concat_join.py`), in each layout, with the floor: the input read once and the output written
once at the measured copy rate.

    python benchmarks/maxpool_kernel.py [--batch 64] [--dtype bf16]

Needs a CUDA GPU.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from concat_join import _gpu_ms, arguments  # noqa: E402
from specgen.standalone import dtype_name  # noqa: E402
from specgen.maxpool import MaxPoolLayer, MaxPoolPlan  # noqa: E402

# (channels, size, kernel, stride, padding, ceil_mode): a UNet at 128^2 with base width 32, then the others
POOLS = [(32, 128, 2, 2, 0, False), (64, 64, 2, 2, 0, False), (128, 32, 2, 2, 0, False), (64, 112, 3, 2, 1, False),
         (192, 55, 3, 2, 0, True)]


def main() -> int:
    parsed = arguments(__doc__)
    if parsed is None:
        return 2
    batch, dtype = parsed
    print(f"{'pool':26}{'MB':>7}{'floor':>8}{'PyTorch':>9}{'specgen':>9}{'PT cl':>9}{'sg cl':>9}  x PyTorch (as given / cl), % of floor")
    for c, size, k, st, pad, ceil in POOLS:
        def pytorch(x):
            return F.max_pool2d(x, k, st, pad, ceil_mode=ceil)

        xs = [torch.randn(batch, c, size, size, device="cuda").to(dtype) for _ in range(4)]
        xs_cl = [x.contiguous(memory_format=torch.channels_last) for x in xs]
        item = xs[0].element_size()
        moved = (xs[0].numel() + pytorch(xs[0]).numel()) * item
        buffers = [(torch.empty(moved // 2, dtype=torch.uint8, device="cuda"), torch.empty(moved // 2, dtype=torch.uint8, device="cuda"))
                   for _ in range(4)]
        floor = _gpu_ms(lambda a, b: b.copy_(a), buffers)  # (a copy of half the bytes moves them all)
        layer = MaxPoolLayer(MaxPoolPlan(c, (size, size), (k, k), (st, st), dtype_name(dtype), (pad, pad), None, ceil))
        with torch.no_grad():
            assert torch.equal(layer(xs[0]), pytorch(xs[0])) and torch.equal(layer(xs_cl[0]), pytorch(xs_cl[0]))
            times = [_gpu_ms(pytorch, [(x,) for x in xs]), _gpu_ms(layer, [(x,) for x in xs]),
                     _gpu_ms(pytorch, [(x,) for x in xs_cl]), _gpu_ms(layer, [(x,) for x in xs_cl])]
        name = f"{c} ch @ {size}^2" + (f" {k}/{st}/{pad}" if (k, st, pad) != (2, 2, 0) else "") + (" ceil" if ceil else "")
        print(f"{name:26}{moved / 1e6:7.0f}{floor:8.4f}" + "".join(f"{t:9.4f}" for t in times)
              + f"  {times[0] / times[1]:.2f}x / {times[2] / times[3]:.2f}x, {100 * floor / times[1]:.0f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
