"""Host time per forward of small layers, broken into its parts, on the GPU.

    python benchmarks/host.py [--models]

Each row is the best of 15 loops of 200 calls without a sync inside the loop (short enough that
the launch queue never fills, so the GPU never holds the host back); GPU time per call from a CUDA
graph replay and from the profiler's kernel durations. `--models` adds ResNet-18 and MobileNetV2
through from_module. Host times move by up to 2x between runs of the same code on a shared host:
compare rows of one run, not runs."""
import os, sys, time, torch
from torch import nn
from specgen.module import FusedLayer
from specgen.spec import LayerSpec, load_specs
from specgen import torchop, runtime

def host_times(fn, n=200, loops=15):
    """Host time per call of each loop, sorted, in us: loops short enough (n calls, a few launches
    each) that the launch queue never fills, so the GPU never holds the host back."""
    for _ in range(50): fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(loops):
        t = time.perf_counter()
        for _ in range(n): fn()
        times.append((time.perf_counter() - t) / n * 1e6)
        torch.cuda.synchronize()
    return sorted(times)

def host(fn, n=200, loops=15):
    """Host time per call: the best loop's (`host_times`)."""
    return host_times(fn, n, loops)[0]

def kernels(fn, n=50):
    """GPU time per call: the kernels' own durations (no gaps), from the profiler."""
    from torch.profiler import profile, ProfilerActivity
    fn(); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n): fn()
        torch.cuda.synchronize()
    total = sum(e.self_device_time_total for e in prof.key_averages())
    return total / n

def gpu_graph(fn):
  try:
    return _gpu_graph(fn)
  except Exception as e:
    print("   graph capture failed:", str(e).splitlines()[0]); return float("nan")

def _gpu_graph(fn):
    st = torch.cuda.Stream(); st.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(st):
        for _ in range(3): fn()
    torch.cuda.current_stream().wait_stream(st)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(20): fn()
    g.replay(); torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20): g.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / 400 * 1e6

def row(name, us):
    print(f"  {name:58} {us:8.2f} us", flush=True)

def main():
    tiny = LayerSpec.model_validate({"name": "tiny", "input": {"channels": 3, "size": [32, 32]},
            "conv": {"out_channels": 16, "kernel": 3, "padding": 1}, "epilogue": ["relu"]})
    specs = {s.name: s for s in load_specs("examples/folds.yaml")}
    layers = {s.name: s for s in load_specs("examples/layers.yaml")}
    # (a 3x3 512 -> 512 conv + ReLU at batch 1: planned for the TMA engine, whose batch-1 calls run
    # the implicit GEMM's small-batch tile (one launch); with the rule off (SPECGEN_SMALL_BATCH=0)
    # the TMA engine: one launch in tf32, the layout pass and the GEMM in fp32 mode; the sequence
    # rows: a conv with a reduction after it, its kernels). The fourth field: the small-batch rule on.
    c512 = layers["conv3x3_512_14_relu"]
    cases = [(tiny, 1, "fp32", True), (tiny, 1, "tf32", True), (tiny, 8, "tf32", True),
             (c512, 1, "tf32", True), (c512, 1, "fp32", True), (c512, 1, "tf32", False), (c512, 1, "fp32", False),
             (specs["conv1d_5_128_256_1024_mean"], 32, "tf32", True), (specs["head_3x3_256_512_14_bn_gap"], 64, "tf32", True)]
    x0 = torch.randn(1, 3, 32, 32, device="cuda")
    row("torch.empty((1,16,32,32), device=x.device)", host(lambda: torch.empty((1, 16, 32, 32), device=x0.device)))
    row("torch.empty((1,16,32,32), device=x.device, dtype=f32)", host(lambda: torch.empty((1, 16, 32, 32), device=x0.device, dtype=torch.float32)))
    row("x.new_empty((1,16,32,32))", host(lambda: x0.new_empty((1, 16, 32, 32))))
    row("torch._C._cuda_getCurrentRawStream(0)", host(lambda: torchop._current_stream(0)))
    row("x.data_ptr()", host(lambda: x0.data_ptr()))
    row("x.is_contiguous()", host(lambda: x0.is_contiguous()))
    row("x.get_device()", host(lambda: x0.get_device()))
    row("torch.is_grad_enabled()", host(lambda: torch.is_grad_enabled()))
    row("torch.compiler.is_compiling()", host(lambda: torch.compiler.is_compiling()))
    row("x.shape[1:] == (3,32,32)", host(lambda: x0.shape[1:] == (3, 32, 32)))
    for spec, batch, prec, small_batch in cases:
        os.environ["SPECGEN_SMALL_BATCH"] = "1" if small_batch else "0"
        s = spec.model_copy(update={"precision": prec})
        torch.backends.cudnn.allow_tf32 = prec == "tf32"
        layer = FusedLayer(s).cuda().eval()
        x = torch.randn(batch, s.input.channels, *s.input.size, device="cuda")
        sp = layer.specialize()
        ran = torchop.kernel_for(sp, x).plan["engine"]
        planned = "" if ran == sp.plan["engine"] else f" (the layer's plan: {sp.plan['engine']}; a small batch)"
        rule = "" if small_batch else ", small-batch rule off"
        print(f"{s.name} batch {batch} {prec}{rule}: engine {ran}{planned}", flush=True)
        with torch.no_grad():
            layer(x)
            if s.epilogue == tiny.epilogue and s.ndim == 2:  # a 2-D conv + ReLU: PyTorch's layer beside it
                k, pad = s.conv.kernel, s.conv.padding
                eager = nn.Sequential(nn.Conv2d(s.input.channels, s.conv.out_channels, k, padding=pad), nn.ReLU()).cuda()
                row("eager nn.Sequential(conv, relu)", host(lambda: eager(x)))
                row("eager gpu kernel time per call", kernels(lambda: eager(x)))
                row("eager F.conv2d alone", host(lambda: torch.nn.functional.conv2d(x, eager[0].weight, eager[0].bias, padding=pad)))
            row("layer(x) no_grad", host(lambda: layer(x)))
            fast = layer._fast
            if fast is not None:  # the FFMA, implicit-GEMM and TMA engines keep their last plain launch
                row("layer._fast.run(x, ()) (the recorded launch alone)", host(lambda: fast.run(x, ())))
            row("layer.forward(x) no_grad", host(lambda: layer.forward(x)))
            w, b = layer.conv.weight, layer.conv.bias
            params = layer._launch_params() if layer._param_names else {}
            row("torchop.launch(sp, x, w, b, params, None)", host(lambda: torchop.launch(sp, x, w, b, params, None)))
            out = layer(x)
            row("torchop.launch(..., out)", host(lambda: torchop.launch(sp, x, w, b, params, out)))
            row("gpu time per call (graph replay)", gpu_graph(lambda: layer(x)))
            row("gpu kernel time per call (profiler)", kernels(lambda: layer(x)))
        row("layer(x) grad enabled (custom op)", host(lambda: layer(x)))
        with torch.inference_mode():
            row("layer(x) inference_mode", host(lambda: layer(x)))
        if sp.plan["engine"] not in ("sequence", "tma"):
            lp = torchop._launch_plan(sp)
            kernel = runtime.lookup(sp.key, 0)
            ptrs = [x.data_ptr(), w.data_ptr()] + ([b.data_ptr()] if lp.has_bias else []) + [params[n].data_ptr() for n in lp.param_names] + [out.data_ptr()]
            st = torchop._current_stream(0)
            if lp.igemm is None:
                row("runtime.launch alone", host(lambda: runtime.launch(kernel, lp.blocks_per_sample, ptrs, lp.strides, batch, st)))
            else:
                pos, bm, nt, _, gm = lp.igemm
                row("runtime.launch_flat alone", host(lambda: runtime.launch_flat(kernel, pos, bm, nt * gm, ptrs, lp.strides, batch, st)))
            lib = runtime._libcuda
            values, batch_arg, argv = runtime._prepare(kernel, len(ptrs))
            values[:len(ptrs)] = ptrs; batch_arg.value = batch
            row("cuLaunchKernel via ctypes alone", host(lambda: lib.cuLaunchKernel(kernel.function, 1, 1, 1, kernel.threads, 1, 1, kernel.smem_bytes, st, argv, None)))
            row("cuCtxGetCurrent via ctypes", host(lambda: lib.cuCtxGetCurrent(runtime._args.context_ref)))

    if "--models" in sys.argv:
        sys.path.insert(0, "examples")
        import models
        from specgen.importer import from_module
        for cls, shape in [(models.ResNet18, (1, 3, 224, 224)), (models.ResNet18, (8, 3, 224, 224)), (models.MobileNetV2, (1, 3, 224, 224))]:
            torch.manual_seed(0)
            m = cls().cuda().eval()
            x = torch.randn(*shape, device="cuda")
            t = time.perf_counter()
            with torch.no_grad():
                f = from_module(m, x, keep_slower=True)
                print(f"{cls.__name__} from_module {time.perf_counter() - t:.1f} s", flush=True)
                row(f"{cls.__name__} eager host", host(lambda: m(x), 30))
                row(f"{cls.__name__} fused host", host(lambda: f(x), 30))
                row(f"{cls.__name__} eager gpu (graph)", gpu_graph(lambda: m(x)) )
                row(f"{cls.__name__} fused gpu (graph)", gpu_graph(lambda: f(x)))
                row(f"{cls.__name__} eager gpu kernels", kernels(lambda: m(x), 10))
                row(f"{cls.__name__} fused gpu kernels", kernels(lambda: f(x), 10))
            row(f"{cls.__name__} eager host, autograd on", host(lambda: m(x), 30))
            row(f"{cls.__name__} fused host, autograd on", host(lambda: f(x), 30))


if __name__ == "__main__":
    main()
