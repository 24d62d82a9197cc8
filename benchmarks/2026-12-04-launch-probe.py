"""Host cost of the pieces of one small layer's launch (tiny conv + ReLU, batch 1, FFMA engine), two
passes in one run: the layer, its full path (torchop.launch), the output allocation, the driver
call through ctypes (cuLaunchKernel against cuLaunchKernelEx on a packed configuration), torch's
own launch of a tiny kernel, and the recorded launch (FastLaunch) alone. Rows are the min and
median of 25 loops of 200 calls. Records: benchmarks/2026-12-04-h200-v39-launch-probe.txt.

    python benchmarks/2026-12-04-launch-probe.py
"""
import sys
from pathlib import Path

import torch
from specgen.module import FusedLayer
from specgen.spec import LayerSpec
from specgen import torchop, runtime

sys.path.insert(0, str(Path(__file__).resolve().parent))
from host import host_times  # noqa: E402

def host(fn):
    """(min, median) host time per call over 25 loops of 200 calls."""
    times = host_times(fn, 200, 25)
    return times[0], times[len(times) // 2]

def row(name, us):
    print(f"  {name:58} min {us[0]:7.2f} med {us[1]:7.2f} us", flush=True)

tiny = LayerSpec.model_validate({"name": "tiny", "input": {"channels": 3, "size": [32, 32]},
        "conv": {"out_channels": 16, "kernel": 3, "padding": 1}, "epilogue": ["relu"], "precision": "tf32"})
layer = FusedLayer(tiny).cuda().eval()
x = torch.randn(1, 3, 32, 32, device="cuda")
with torch.no_grad():
    out = layer(x)
    sp = layer.specialize()
    print("engine", sp.plan["engine"])
    lp = torchop._launch_plan(sp)
    kernel = runtime.lookup(sp.key, 0)
    w, b = layer.conv.weight, layer.conv.bias
    ptrs = [x.data_ptr(), w.data_ptr(), b.data_ptr(), out.data_ptr()]
    st = torchop._current_stream(0)
    lib = runtime._libcuda
    values, batch_arg, argv = runtime._prepare(kernel, len(ptrs))
    values[:len(ptrs)] = ptrs; batch_arg.value = 1
    grid = lp.blocks_per_sample
    for rep in range(2):
        row("layer(x) no_grad", host(lambda: layer(x)))
        row("layer.forward(x)", host(lambda: layer.forward(x)))
        row("torchop.launch(sp, x, w, b, {}, None)", host(lambda: torchop.launch(sp, x, w, b, {}, None)))
        row("torch.empty((1,16,32,32), device=, dtype=)", host(lambda: torch.empty((1, 16, 32, 32), device=x.device, dtype=torch.float32)))
        row("x.new_empty((1,16,32,32))", host(lambda: x.new_empty((1, 16, 32, 32))))
        sz = torch.Size((1, 16, 32, 32))
        row("torch.empty(Size, device=, dtype=)", host(lambda: torch.empty(sz, device=x.device, dtype=torch.float32)))
        row("runtime.launch", host(lambda: runtime.launch(kernel, grid, ptrs, lp.strides, 1, st)))
        row("_launch_kernel (Ex, CDLL)", host(lambda: runtime._launch_kernel(lib, kernel.function, grid, 1, kernel.threads, kernel.smem_bytes, st, argv)))
        fn = kernel.function
        row("cuLaunchKernel CDLL", host(lambda: lib.cuLaunchKernel(fn, grid, 1, 1, kernel.threads, 1, 1, kernel.smem_bytes, st, argv, None)))
        key = (fn.value, grid, 1, kernel.threads, kernel.smem_bytes)
        runtime._launch_kernel(lib, fn, grid, 1, kernel.threads, kernel.smem_bytes, st, argv)
        cfg, ref = runtime._plain.by_key[key]
        f4 = lib.cuLaunchKernelEx
        row("cuLaunchKernelEx CDLL bare", host(lambda: f4(ref, fn, argv, None)))
        t = torch.randn(16, device="cuda")
        row("torch.relu_(tiny) (torch's launch)", host(lambda: torch.relu_(t)))
        fast = layer._fast
        print("fast", fast)
        if fast is not None:
            row("layer._fast.run(x, ())", host(lambda: fast.run(x, ())))
            row("layer._fast.prepared.launch(st)", host(lambda: fast.prepared.launch(st)))
