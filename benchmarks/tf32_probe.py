"""PyTorch's own error in TF32 mode (cudnn.allow_tf32=True) against float64, over input channels
per group, kernel sizes, dims, transposed convs, memory format and batch: where does cuDNN compute a
conv in fp32 although TF32 is allowed? (`plan.exact_tf32` follows what this found; NOTES.md v26.)
"emulated-tf32" is the error of TF32 operands (rounded to nearest) in float64 arithmetic. Needs a GPU.

    python benchmarks/tf32_probe.py
"""
import torch, torch.nn.functional as F
torch.backends.cudnn.allow_tf32 = True
torch.backends.cuda.matmul.allow_tf32 = True
def rnd(t):
    b = t.float().contiguous().view(torch.int32); return ((b + 0x1000) & -8192).view(torch.float32)
def rel(a, b): b = b.double(); return ((a.double() - b).norm() / b.norm()).item()
def case(dims, cin, cout, k, stride=1, pad=0, groups=1, transposed=False, batch=8, size=32, cl=False):
    g = torch.Generator(device="cuda").manual_seed(0)
    shape = (batch, cin) + (size,) * dims
    x = torch.randn(shape, generator=g, device="cuda")
    if transposed:
        w = torch.randn((cin, cout // groups) + (k,) * dims, generator=g, device="cuda")
    else:
        w = torch.randn((cout, cin // groups) + (k,) * dims, generator=g, device="cuda")
    if cl and dims in (2, 3):
        fmt = torch.channels_last if dims == 2 else torch.channels_last_3d
        x = x.contiguous(memory_format=fmt)
    fn = {1: (F.conv1d, F.conv_transpose1d), 2: (F.conv2d, F.conv_transpose2d), 3: (F.conv3d, F.conv_transpose3d)}[dims][transposed]
    kw = dict(stride=stride, padding=pad, groups=groups)
    y = fn(x, w, **kw)
    y64 = fn(x.double(), w.double(), **kw)
    ye = fn(rnd(x).double(), rnd(w).double(), **kw)
    return rel(y, y64), rel(ye, y64)
rows = []
def run(label, **kw):
    try:
        t, e = case(**kw)
        kind = "FP32" if t < 20 * 1e-7 else "tf32"
        print(f"{label:58s} torch {t:.2e}  emulated-tf32 {e:.2e}  -> {kind}", flush=True)
    except Exception as ex:
        print(f"{label:58s} error {ex}", flush=True)
for cin in [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64]:
    for cout in [16, 64]:
        for k in [1, 3, 7]:
            run(f"2d k{k} {cin}->{cout} b8 32^2", dims=2, cin=cin, cout=cout, k=k, pad=k // 2)
for cin in [3, 4, 8, 16, 32]:
    run(f"2d k3 {cin}->64 b32 128^2", dims=2, cin=cin, cout=64, k=3, pad=1, batch=32, size=128)
    run(f"2d k3 {cin}->64 b8 32^2 channels_last", dims=2, cin=cin, cout=64, k=3, pad=1, cl=True)
    run(f"2d k7 s2 {cin}->64 b64 224^2 (stem)", dims=2, cin=cin, cout=64, k=7, stride=2, pad=3, batch=64, size=224)
for cin in [3, 4, 8, 16, 32]:
    run(f"3d k3 {cin}->16 b4 16^3", dims=3, cin=cin, cout=16, k=3, pad=1, batch=4, size=16)
    run(f"1d k3 {cin}->64 b8 256", dims=1, cin=cin, cout=64, k=3, pad=1, size=256)
    run(f"2d T k4 s2 {cin}->64 b8 32^2", dims=2, cin=cin, cout=64, k=4, stride=2, pad=1, transposed=True)
    run(f"3d T k3 s2 {cin}->16 b4 16^3", dims=3, cin=cin, cout=16, k=3, stride=2, pad=1, transposed=True, batch=4, size=16)
for cin, groups in [(32, 32), (64, 8), (64, 16), (64, 4), (128, 32), (128, 2)]:
    run(f"2d k3 {cin}->{cin} groups {groups} b8 32^2", dims=2, cin=cin, cout=cin, k=3, pad=1, groups=groups)
