"""The eager PyTorch side of benchmarks/2026-12-04-h200-v34-pointwise-bf16.txt: per-kernel GPU times
(torch.profiler, 4 inputs rotated, 5 calls of warm-up, 20 profiled) of a 1x1 256 -> 64 conv + ReLU at
56^2, batch 64, in bf16 and in float32 with PyTorch's default flags. Needs a CUDA GPU."""
import torch, torch.nn.functional as F
from torch.profiler import profile, ProfilerActivity
for dt in (torch.bfloat16, torch.float32):
    xs = [torch.randn(64, 256, 56, 56, device="cuda").to(dt) for _ in range(4)]
    w = (torch.randn(64, 256, 1, 1, device="cuda") * 0.05).to(dt); b = torch.randn(64, device="cuda").to(dt)
    with torch.no_grad():
        for i in range(5): F.relu(F.conv2d(xs[i % 4], w, b))
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for i in range(20): F.relu(F.conv2d(xs[i % 4], w, b))
            torch.cuda.synchronize()
    rows = sorted(((e.key, e.self_device_time_total / 20 / 1000) for e in prof.key_averages() if e.self_device_time_total > 0), key=lambda r: -r[1])
    print(f"== eager conv2d 256->64 1x1 + relu, {dt}, batch 64: GPU {sum(t for _, t in rows):.4f} ms per call")
    for k, t in rows: print(f"   {t:.4f} ms  {k[:70]}")
