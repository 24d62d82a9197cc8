"""Host time and GPU time of one bf16 1x1 conv (256 -> 64 at 56^2, batch 64), specgen against eager:
host us per call (loops of 200 calls, no sync inside), an idle-start call (CUDA events around one
call after a sync: what `specgen bench` times), back-to-back calls (events around 50), and a
cProfile of 200 calls. Records: benchmarks/2026-12-04-h200-v35-host-pointwise.txt.

    python benchmarks/2026-12-04-host-pointwise.py
"""
import time, cProfile, pstats, io, statistics, torch
import specgen
from specgen.spec import load_specs
spec = [s for s in load_specs("benchmarks/2026-12-04-nchw-in-place.yaml") if s.name == "pw256_64_56_relu_bf16"][0]
layer = specgen.FusedLayer(spec).cuda().eval()
xs = [torch.randn(64, 256, 56, 56, device="cuda").to(torch.bfloat16) for _ in range(4)]
conv = torch.nn.Conv2d(256, 64, 1).cuda().to(torch.bfloat16)
eager = lambda x: torch.relu(conv(x))
def host(fn, n=200):
    with torch.no_grad():
        for i in range(20): fn(xs[i % 4])
        torch.cuda.synchronize()
        best = 1e9
        for _ in range(10):
            t = time.perf_counter()
            for i in range(n): fn(xs[i % 4])
            best = min(best, (time.perf_counter() - t) / n)
            torch.cuda.synchronize()
    return best * 1e6
def idle(fn, reps=20):
    ts = []
    with torch.no_grad():
        for i in range(reps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record(); fn(xs[i % 4]); e.record(); e.synchronize(); ts.append(s.elapsed_time(e))
    return statistics.median(ts) * 1e3
def pipelined(fn, n=50):
    with torch.no_grad():
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for i in range(n): fn(xs[i % 4])
        e.record(); e.synchronize()
    return s.elapsed_time(e) / n * 1e3
for name, fn in (("specgen", layer), ("eager", eager)):
    print(f"{name}: host {host(fn):.1f} us/call, idle-start call {idle(fn):.1f} us, pipelined {pipelined(fn):.1f} us/call")
pr = cProfile.Profile()
with torch.no_grad():
    pr.enable()
    for i in range(200): layer(xs[i % 4])
    pr.disable()
torch.cuda.synchronize()
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25); print(s.getvalue()[:6000])
