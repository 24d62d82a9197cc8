"""Where an idle-start call's time goes for the bf16 3x3 conv 512 -> 512 at 14^2 (batch 64), specgen
against eager, from a contiguous and a channels-last input: GPU kernel time per call from the
profiler (back-to-back calls), and the median of CUDA events around one call after a sync (what
`specgen bench` times: host time and launch gaps included). Records:
benchmarks/2026-12-04-h200-v35-idle-start.txt.

    python benchmarks/2026-12-04-idle-start.py
"""
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

import specgen

spec = specgen.load_specs("examples/layers.yaml")
spec = next(s for s in spec if s.name == "conv3x3_512_14_relu").model_copy(update={"precision": "bf16"})
layer = specgen.FusedLayer(spec).cuda().eval()
conv = torch.nn.Conv2d(512, 512, 3, padding=1).cuda().to(torch.bfloat16)
xs = [torch.randn(64, 512, 14, 14, device="cuda").to(torch.bfloat16) for _ in range(4)]
cls = [x.contiguous(memory_format=torch.channels_last) for x in xs]
conv_cl = torch.nn.Conv2d(512, 512, 3, padding=1).cuda().to(torch.bfloat16).to(memory_format=torch.channels_last)


def gpu_ms(fn, inputs, n=20):
    with torch.no_grad():
        for i in range(5):
            fn(inputs[i % 4])
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for i in range(n):
                fn(inputs[i % 4])
            torch.cuda.synchronize()
    rows = [(e.key, e.self_device_time_total / n / 1000) for e in prof.key_averages() if e.self_device_time_total > 0]
    return sum(t for _, t in rows), rows


def idle_ms(fn, inputs, reps=30):
    ts = []
    with torch.no_grad():
        for i in range(reps):
            torch.cuda.synchronize()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn(inputs[i % 4])
            e.record()
            e.synchronize()
            ts.append(s.elapsed_time(e))
    return statistics.median(ts)


for name, fn, inputs in (("eager", lambda x: torch.relu(conv(x)), xs), ("eager channels_last", lambda x: torch.relu(conv_cl(x)), cls),
                         ("specgen", layer, xs), ("specgen channels_last in", layer, cls)):
    total, rows = gpu_ms(fn, inputs)
    print(f"{name:26} idle-start {idle_ms(fn, inputs):.4f} ms; GPU {total:.4f} ms per call: "
          + ", ".join(f"{k[:40]} {t:.4f}" for k, t in sorted(rows, key=lambda r: -r[1])))
