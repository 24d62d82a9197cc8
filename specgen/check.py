"""`specgen check`: specgen against the PyTorch reference on the GPU, with random inputs."""

from __future__ import annotations

import torch

from specgen import reference
from specgen.module import FusedLayer

REL_L2_BAR = 1e-5


def check_one(spec, batch: int, seed: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    layer = FusedLayer(spec, precision=spec.precision).cuda()  # the spec's own (fp32 unless it says)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, device="cuda") * (0.3 if p.dim() > 1 else 1.0))
    x = torch.randn((batch, spec.input.channels, *spec.input.size), generator=gen, device="cuda")
    extras = {name: torch.randn((batch, *shape), generator=gen, device="cuda") for name, shape in spec.inputs().items()}
    out = torch.full(spec.output_shape(batch), float("nan"), device="cuda")
    with torch.no_grad():
        layer(x, *extras.values(), out=out)
    ref64 = reference.forward64(spec, x, layer.conv.weight, layer.conv.bias, {**layer.spec_params(), **extras})
    diff = out.double() - ref64
    rel = (diff.norm() / ref64.norm().clamp_min(1e-30)).item()
    max_abs = diff.abs().max().item() if diff.numel() else 0.0
    ok = bool(torch.isfinite(out).all()) and rel <= REL_L2_BAR
    return {"name": spec.name, "key": layer.key, "max_abs": max_abs, "rel_l2": rel, "ok": ok}


def main(specs, batch: int = 2, seed: int = 0) -> int:
    if not torch.cuda.is_available():
        print("specgen check: needs a CUDA GPU")
        return 2
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    failed = 0
    for spec in specs:
        r = check_one(spec, batch, seed)
        failed += not r["ok"]
        verdict = "PASS" if r["ok"] else "FAIL"
        print(f"{r['name']:24} batch {batch}  max abs err {r['max_abs']:.3e}  rel L2 {r['rel_l2']:.3e}  {verdict}")
    return 1 if failed else 0
