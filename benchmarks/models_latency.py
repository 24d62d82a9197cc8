"""Where a whole model's time goes, eager against from_module's result: per forward under no_grad,
latency (CUDA events around one forward, median of 30, two inputs alternating), throughput (best of
10 loops of 20 forwards, then a sync), host time (the same loops without the sync) and kernel time
(the profiler's summed kernel durations); with --compile also torch.compile of both, with --prof a
cProfile of the fused forwards. Needs a GPU.

    python benchmarks/models_latency.py [MODEL [BATCH,BATCH...]] [--compile] [--prof]
"""
import sys, time, io, cProfile, pstats, statistics, torch
_here = __import__("pathlib").Path(__file__).resolve().parent
sys.path.insert(0, str(_here.parent / "examples")); sys.path.insert(0, str(_here))
import models
from host import kernels
from specgen.importer import from_module

def latency(fn, xs, reps=30):
    for i in range(5): fn(xs[i % 2])
    torch.cuda.synchronize(); ts = []
    for i in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); fn(xs[i % 2]); e.record(); e.synchronize(); ts.append(s.elapsed_time(e) * 1e3)
    return statistics.median(ts)

def throughput(fn, x, n=20, loops=10):
    for _ in range(5): fn(x)
    torch.cuda.synchronize(); best = 1e9
    for _ in range(loops):
        t = time.perf_counter()
        for _ in range(n): fn(x)
        torch.cuda.synchronize(); best = min(best, (time.perf_counter() - t) / n)
    return best * 1e6

def hostonly(fn, x, n=10, loops=10):
    best = 1e9
    for _ in range(loops):
        torch.cuda.synchronize(); t = time.perf_counter()
        for _ in range(n): fn(x)
        best = min(best, (time.perf_counter() - t) / n)
    torch.cuda.synchronize()
    return best * 1e6

def prof(fn, x, n=20, top=30):
    pr = cProfile.Profile(); torch.cuda.synchronize(); pr.enable()
    for _ in range(n): fn(x)
    pr.disable(); torch.cuda.synchronize()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(top); print(s.getvalue()[:6000])

def main():
    torch.backends.cudnn.benchmark = False
    name = sys.argv[1] if len(sys.argv) > 1 else "ResNet18"
    for batch in [int(b) for b in (sys.argv[2] if len(sys.argv) > 2 else "8").split(",")]:
        cls = getattr(models, name)
        model = cls.make().cuda(); x = cls.example_input(batch=batch, device="cuda"); xs = [x, torch.randn_like(x)]
        with torch.no_grad():
            fused = from_module(model, x)
            rows = {"eager": model, "fused": fused}
            from specgen.replay import GraphReplay
            print("graph:", isinstance(fused, GraphReplay), getattr(fused.specgen_report, "graph", None), "whole:", fused.specgen_report.whole_model)
            if isinstance(fused, GraphReplay):
                rows["fused no graph"] = fused.fallback
            if "--compile" in sys.argv:
                rows["compile(fused)"] = torch.compile(fused); rows["compile"] = torch.compile(model)
            print(f"== {name} batch {batch}")
            for k, fn in rows.items():
                fn(x); torch.cuda.synchronize()
                print(f"{k:16s} latency {latency(fn, xs):8.1f} us  throughput {throughput(fn, x):8.1f} us  host {hostonly(fn, x):8.1f} us  kernels {kernels(lambda: fn(x), n=20):8.1f} us", flush=True)
            if "--prof" in sys.argv:
                print("-- cProfile fused"); prof(fused, x)
                if "--compile" in sys.argv:
                    print("-- cProfile compile(fused)"); prof(rows["compile(fused)"], x)


if __name__ == "__main__":
    main()
