"""Per-kernel GPU time of each spec in YAML files, from torch.profiler: where a layer's time goes
between its kernels (a layout pass, the body, a pool's second kernel).

    python benchmarks/kernel_times.py [--channels-last] BATCH FILE.yaml [FILE.yaml ...]

Each spec runs as a FusedLayer under no_grad, on four random inputs in turn (together larger than
the L2 cache, so the input is read from memory as in a model), 5 calls of warm-up, then 20 calls
profiled; the table gives each kernel's mean time per call (--channels-last: the inputs in that
memory format). Needs a CUDA GPU.
"""

from __future__ import annotations

import sys

import torch
from torch.profiler import ProfilerActivity, profile

import specgen


def main(argv: list[str]) -> int:
    channels_last = argv[:1] == ["--channels-last"]
    argv = argv[1:] if channels_last else argv
    batch, paths = int(argv[0]), argv[1:]
    for path in paths:
        for spec in specgen.load_specs(path):
            layer = specgen.FusedLayer(spec).cuda().eval()
            dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(spec.precision, torch.float32)
            xs = [torch.randn(batch, spec.input.channels, *spec.input.size, device="cuda").to(dtype) for _ in range(4)]
            if channels_last:
                fmt = {4: torch.channels_last, 5: torch.channels_last_3d}.get(xs[0].dim(), torch.contiguous_format)
                xs = [x.contiguous(memory_format=fmt) for x in xs]
            with torch.no_grad():
                for i in range(5):
                    layer(xs[i % 4])
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for i in range(20):
                        layer(xs[i % 4])
                    torch.cuda.synchronize()
            rows = [(e.key, e.self_device_time_total / 20 / 1000) for e in prof.key_averages()]
            rows = sorted(((k, t) for k, t in rows if t > 0), key=lambda r: -r[1])
            print(f"== {spec.name} batch {batch}{' channels-last' if channels_last else ''}: GPU {sum(t for _, t in rows):.4f} ms per call")
            for key, t in rows:
                print(f"   {t:.4f} ms  {key[:70]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
