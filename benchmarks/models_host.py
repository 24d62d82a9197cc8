"""Whole models (examples/models.py) at batch 1 and 8 through from_module: host time per forward
(no sync in the loop) and wall time (with sync), eager PyTorch against the fused model, autograd
off and on; with autograd on also through the custom op (what eager calls used before
torchop.eager_autograd), all in one run.

    python benchmarks/models_host.py
"""
import sys, time, io, cProfile, pstats, torch
sys.path.insert(0, "examples")
import models
sys.path.insert(0, "benchmarks")
from host import host  # host time per forward: no sync in the loop
from specgen import torchop
from specgen.importer import from_module

def timed(fn, n=30):  # wall per forward with sync: what a user sees
    for _ in range(10): fn()
    torch.cuda.synchronize()
    best = []
    for _ in range(10):
        t = time.perf_counter()
        for _ in range(n): fn()
        torch.cuda.synchronize()
        best.append((time.perf_counter() - t) / n)
    return min(best) * 1e6

fast = torchop.eager_autograd
def via_op(op, sp, args):
    return op.overload(*torchop.in_op_shapes(op, args))

for cls, batch in [(models.ResNet18, 1), (models.ResNet18, 8), (models.MobileNetV2, 1)]:
    torch.manual_seed(0)
    m = cls().cuda().eval()
    x = torch.randn(batch, 3, 224, 224, device="cuda")
    t = time.perf_counter()
    f = from_module(m, x, keep_slower=True)
    name = f"{cls.__name__} b{batch}"
    print(f"{name}: from_module {time.perf_counter() - t:.1f} s", flush=True)
    with torch.no_grad():
        print(f"  no_grad   host us: eager {host(lambda: m(x), 30):8.1f}  fused {host(lambda: f(x), 30):8.1f}   wall us: eager {timed(lambda: m(x)):8.1f}  fused {timed(lambda: f(x)):8.1f}", flush=True)
    e, n = host(lambda: m(x), 30), host(lambda: f(x), 30)
    torchop.eager_autograd = via_op
    o = host(lambda: f(x), 30)
    torchop.eager_autograd = fast
    print(f"  autograd  host us: eager {e:8.1f}  fused {n:8.1f}  fused through the custom op {o:8.1f}", flush=True)
    if batch == 8:
        with torch.no_grad():
            pr = cProfile.Profile(); pr.enable()
            for _ in range(20): f(x)
            pr.disable(); torch.cuda.synchronize()
            out = io.StringIO(); pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(14); print(out.getvalue()[-3500:])
