"""Per-kernel GPU time inside one forward of from_module(model) (its CUDA graph, where from_module
takes it) and of torch.compile reduce-overhead, at one batch: where a small batch's time goes once
the host's is gone. Kernel durations from torch.profiler (10 forwards), grouped by kernel name.
The wall column is timed after the profiler ran (it can read high): compare the kernel sums.

    python benchmarks/graph_kernels.py MODEL BATCH [DTYPE]    (a class of examples/models.py;
                                                              DTYPE fp32 (default), bf16 or fp16)
"""
import sys, collections, torch
_here = __import__("pathlib").Path(__file__).resolve().parent
sys.path.insert(0, str(_here.parent / "examples")); sys.path.insert(0, str(_here))
import models
from models_latency import latency
from specgen.importer import from_module
from torch.profiler import profile, ProfilerActivity

name, batch = sys.argv[1], int(sys.argv[2])
dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[sys.argv[3] if len(sys.argv) > 3 else "fp32"]
cls = getattr(models, name)
m = cls.make().cuda().to(dtype)
xs = [cls.example_input(batch, device="cuda", seed=s).to(dtype) for s in (1, 2)]

def kernels(fn, label, reps=10):
    for i in range(5): fn(xs[i % 2])
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for i in range(reps): fn(xs[i % 2])
        torch.cuda.synchronize()
    evs = [e for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    agg = collections.defaultdict(lambda: [0, 0.0])
    for e in evs:
        agg[e.name][0] += 1; agg[e.name][1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    total = sum(v[1] for v in agg.values()) / reps
    count = sum(v[0] for v in agg.values()) / reps
    print(f"== {label}: wall {latency(fn, xs):.1f} us/forward; {count:.0f} kernels, summed {total:.1f} us/forward")
    for k, (n, t) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:40]:
        print(f"  {t / reps:8.1f} us {n / reps:5.1f}x  {k[:110]}")

with torch.no_grad():
    f = from_module(m, xs[0])
    kernels(f, "specgen from_module")
    c = torch.compile(m, mode="reduce-overhead")
    kernels(c, "torch.compile reduce-overhead")
