"""A diffusion U-Net's residual block with a time embedding, imported whole: eager PyTorch,
torch.compile and `from_module` (its default never-slower check, and `keep_slower=True`), with
PyTorch's default flags (TF32 convolutions), under no_grad.

    python benchmarks/time_embedding.py [--batch 8 32] [--shape 64,32,32 128,64,64] [--no-compile]

The block: group norm, SiLU, 3x3 conv; the embedding (Linear of SiLU(t)) added per sample and
channel, `h + emb[:, :, None, None]`; group norm, SiLU, 3x3 conv; the block's input added. specgen
fuses conv1 + the embedding's add + group norm + SiLU (the embedding an extra input of shape
[N, C, 1, 1]) and conv2 + the residual add; the first group norm and the Linear stay PyTorch.
Each row: ms per forward (CUDA events, median of 20, two inputs alternating), x eager, rel. L2
against the float64 block. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specgen import bench  # noqa: E402
from specgen.importer import from_module  # noqa: E402

EMBED = 256
REPS = 20


class TimeBlock(nn.Module):
    def __init__(self, c: int, t: int = EMBED, groups: int = 32):
        super().__init__()
        self.norm1, self.conv1 = nn.GroupNorm(groups, c), nn.Conv2d(c, c, 3, padding=1)
        self.emb = nn.Linear(t, c)
        self.norm2, self.conv2 = nn.GroupNorm(groups, c), nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x, t):
        h = self.conv1(F.silu(self.norm1(x)))
        h = h + self.emb(F.silu(t))[:, :, None, None]
        h = self.conv2(F.silu(self.norm2(h)))
        return x + h


def run(c: int, h: int, w: int, batch: int, compile: bool) -> list[dict]:
    torch.manual_seed(0)
    model = TimeBlock(c).cuda().eval()
    with torch.no_grad():  # group norms that are not identities
        for m in model.modules():
            if isinstance(m, nn.GroupNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
    inputs = [(torch.randn(batch, c, h, w, device="cuda"), torch.randn(batch, EMBED, device="cuda")) for _ in range(2)]
    x, t = inputs[0]
    with torch.no_grad():
        ref64 = copy.deepcopy(model).double()(x.double(), t.double())
    contenders = [("eager", model)]
    if compile:
        contenders.append(("torch.compile", torch.compile(model)))
    fused = from_module(copy.deepcopy(model), x, t)
    contenders.append(("specgen", fused))
    contenders.append(("specgen keep_slower", from_module(copy.deepcopy(model), x, t, keep_slower=True)))
    rows = []
    for name, fn in contenders:
        with torch.no_grad():
            out = fn(x, t)
            rel = ((out.double() - ref64).norm() / ref64.norm()).item()
            calls = [0]

            def step():
                calls[0] += 1
                return fn(*inputs[calls[0] % 2])

            rows.append({"name": name, "ms": bench._time(step, REPS), "rel_l2": rel})
    eager = rows[0]["ms"]
    for r in rows:
        r["vs_eager"] = eager / r["ms"]
    print(f"block {c} ch {h}x{w}, batch {batch}")
    for r in rows:
        print(f"  {r['name']:<22} {r['ms']:8.3f} ms  {r['vs_eager']:5.2f}x eager  rel L2 {r['rel_l2']:.1e}")
    for choice in fused.specgen_report.choices:
        verdict = "specgen" if choice.fused else "PyTorch"
        print(f"    chain {choice.layer}: runs as {verdict} (specgen {choice.specgen_ms}, PyTorch {choice.pytorch_ms} ms)")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--shape", nargs="+", default=["64,32,32", "128,64,64"], help="C,H,W")
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    for shape in args.shape:
        c, h, w = map(int, shape.split(","))
        for batch in args.batch:
            run(c, h, w, batch, not args.no_compile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
