"""A model from examples/models.py fused both ways, its activations as given and channels-last
(`from_module(..., memory_format=...)`, no CUDA graph), at batch 64: the two timed against each
other (`measured.compare`), host and wall time per forward, and a host profile of the
channels-last one. Needs a GPU.

    python benchmarks/model_formats.py ResNet18
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import models  # noqa: E402

from specgen import from_module, measured  # noqa: E402


def main(name: str) -> None:
    cls = getattr(models, name)
    model = cls.make().cuda().eval()
    x = cls.example_input(64).cuda()
    x2 = torch.randn_like(x)
    fused = {fmt: from_module(model, x, memory_format=fmt, cuda_graph=False) for fmt in ("as_given", "channels_last")}
    cl_ms, given_ms = measured.compare(lambda a: fused["channels_last"](a), lambda a: fused["as_given"](a), [x, x2])
    print(f"{name}: channels-last {cl_ms:.3f} ms, as given {given_ms:.3f} ms per forward (measured.compare)")
    with torch.no_grad():
        for fmt, f in fused.items():
            for _ in range(3):
                f(x)
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(10):
                f(x)
            host = (time.perf_counter() - t) / 10
            torch.cuda.synchronize()
            t = time.perf_counter()
            for i in range(10):
                f((x, x2)[i % 2])
            torch.cuda.synchronize()
            print(f"{fmt}: host per forward {host * 1e3:.3f} ms, wall per forward {(time.perf_counter() - t) / 10 * 1e3:.3f} ms")
        profile = cProfile.Profile()
        profile.enable()
        for i in range(10):
            fused["channels_last"]((x, x2)[i % 2])
        torch.cuda.synchronize()
        profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "ResNet18")
