"""The TMA split kernel's two ways of adding a tile's parts up, at batch 1: the reduction kernel (a
second launch spread over all SMs) against the split kernel's own reduction (`tmarun.REDUCE_IN_SPLIT`:
the block that finishes a tile's last part sums the tile), on deep 3x3 convs whose batch-1 tiles run
split.

    python benchmarks/split_reduce.py

Per layer and way, microseconds per call of
  wall:  CUDA events around loops of back-to-back no_grad calls (`bench._time_stream`, median of 3);
  gpu:   the profiler's summed kernel durations over 60 calls, per call (the split kernel plus, on
         the default way, the reduction kernel);
  host:  the host's time per call in a loop without a sync (what the launch path costs);
and whether both ways give the same values bit for bit. Needs a GPU.
"""

from __future__ import annotations

import statistics
import time
import warnings

import torch
from torch.profiler import ProfilerActivity, profile

from specgen import tmarun
from specgen.bench import _time_stream
from specgen.module import FusedLayer
from specgen.spec import LayerSpec

LAYERS = [("c512_7", 512, 512, (7, 7)), ("c256_14", 256, 256, (14, 14)), ("c512_14", 512, 512, (14, 14))]


def conv_spec(name: str, cin: int, cout: int, size, precision: str) -> dict:
    return {"name": f"{name}_{precision}", "input": {"channels": cin, "size": list(size)},
            "conv": {"out_channels": cout, "kernel": 3, "padding": 1}, "epilogue": ["relu"], "precision": precision}


def gpu_us(fn, calls: int = 60) -> float:
    """Summed kernel time per call, from the profiler."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return sum(e.device_time_total for e in prof.key_averages()) / calls


def host_us(fn, calls: int = 300) -> float:
    """The host's time per call when it need not wait for the GPU."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    return host


def main() -> None:
    warnings.filterwarnings("ignore", module="torch.profiler")
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}; us per call at batch 1")
    print(f"{'layer':14} | {'in split: wall':>14} {'gpu':>6} {'host':>6} | {'reduction kernel: wall':>22} {'gpu':>6} "
          f"{'host':>6} | same bits")
    for precision in ("fp32", "tf32", "bf16"):
        for name, cin, cout, size in LAYERS:
            layer = FusedLayer(LayerSpec.model_validate(conv_spec(name, cin, cout, size, precision))).cuda().eval()
            split = layer.specialize().plan["tma"].split_k
            dtype = torch.bfloat16 if precision == "bf16" else torch.float32
            x = torch.randn(1, cin, *size, device="cuda").to(dtype)
            runs = {}
            with torch.no_grad():
                for in_split in (True, False):
                    tmarun.REDUCE_IN_SPLIT = in_split
                    out = layer(x).clone()
                    call = lambda: layer(x)  # noqa: E731
                    wall = 1e3 * statistics.median(_time_stream(call, 3) for _ in range(3))
                    runs[in_split] = (out, wall, gpu_us(call), host_us(call))
            tmarun.REDUCE_IN_SPLIT = False
            (a_out, *a), (b_out, *b) = runs[True], runs[False]
            print(f"{name + ' ' + precision:14} | {a[0]:14.1f} {a[1]:6.1f} {a[2]:6.1f} | {b[0]:22.1f} {b[1]:6.1f} "
                  f"{b[2]:6.1f} | {torch.equal(a_out, b_out)} (split {split})", flush=True)


if __name__ == "__main__":
    main()
