"""Host time per call of the standalone layers at batch 1 (bf16), where a call costs its host
work: `MaxPoolLayer` (32 channels at 128^2, 2x2) against `F.max_pool2d`, `ConcatLayer` (64
channels at 64^2 upsampled by 2 beside 32 at 128^2) against `F.interpolate` + `torch.cat`, with
the recorded launch (`specgen.standalone.RECORD`) on and off, a few of torch's own costs beside
them, then cProfile of 3000 calls of each layer. Wall time per call of 3000 calls after 200.

    python benchmarks/standalone_host.py

Needs a CUDA GPU.
"""

import cProfile
import pstats
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specgen import standalone  # noqa: E402
from specgen.bench import host_us  # noqa: E402
from specgen.concat import ConcatLayer, ConcatPlan, Source, reference  # noqa: E402
from specgen.maxpool import MaxPoolLayer, MaxPoolPlan  # noqa: E402


def per_call(fn, n=3000):
    """Wall microseconds per call of `fn` over `n` calls after 200."""
    return host_us(fn, n, warmup=200)


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    x = torch.randn(1, 32, 128, 128, device="cuda").bfloat16()
    pool = MaxPoolLayer(MaxPoolPlan(32, (128, 128), (2, 2), (2, 2), "bfloat16"))
    a = torch.randn(1, 64, 64, 64, device="cuda").bfloat16()
    b = torch.randn(1, 32, 128, 128, device="cuda").bfloat16()
    join = ConcatLayer(ConcatPlan((Source(64, (64, 64), (2, 2)), Source(32, (128, 128), (1, 1))), (128, 128), "bfloat16", False))
    with torch.no_grad():
        assert torch.equal(pool(x), F.max_pool2d(x, 2, 2)) and torch.equal(join(a, b), reference([a, b], [(2, 2), (1, 1)]))
        for _ in range(2):
            for rec in (True, False):
                standalone.RECORD = rec
                print("RECORD", rec, "pool us/call", per_call(lambda: pool(x)), "join", per_call(lambda: join(a, b)))
            standalone.RECORD = True
            print("pool us/call", per_call(lambda: pool(x)), "F.max_pool2d", per_call(lambda: F.max_pool2d(x, 2, 2)),
                  "join", per_call(lambda: join(a, b)), "torch up+cat", per_call(lambda: reference([a, b], [(2, 2), (1, 1)])),
                  "empty", per_call(lambda: torch.empty((1, 32, 64, 64), dtype=torch.bfloat16, device="cuda")),
                  "Stream obj", per_call(lambda: torch.cuda.current_stream(x.device).cuda_stream),
                  "raw stream", per_call(lambda: torch._C._cuda_getCurrentRawStream(0)))
        for name, fn in (("pool", lambda: pool(x)), ("join", lambda: join(a, b))):
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(3000):
                fn()
            profile.disable()
            torch.cuda.synchronize()
            print("==", name)
            pstats.Stats(profile).sort_stats("tottime").print_stats(22)
    return 0


if __name__ == "__main__":
    sys.exit(main())
