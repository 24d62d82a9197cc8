"""Time every tile `specgen tune` offers for each spec, plus more of the implicit GEMM's wgmma tiles
(two to four warpgroups, 64 to 256 channels, 3 or 4 stages, 1 to 4 blocks per SM) and, for a layer on
the slab engine, its wgmma variants (`tune.SLAB_WGMMA_CANDIDATES`: run tests/test_slab_wgmma.py on the
GPU first), with no cap on their number and nothing stored: the sweep behind a change to the
planner's or the tuner's tiles.

    python benchmarks/tile_sweep.py BATCH FILE.yaml [FILE.yaml ...]

Each table is `specgen tune`'s (interleaved CUDA-event timing over rotated inputs, median of 15,
checked against float64). Needs a CUDA GPU.
"""

from __future__ import annotations

import sys
from dataclasses import replace

import specgen
from specgen import igemm, tune
from specgen.plan import PlanError

# (warpgroups, stages, largest block width in channels, blocks per SM asked of the compiler)
EXTRA_WGMMA = ((2, 3, 256, 2), (2, 4, 256, 2), (2, 4, 256, 1), (2, 3, 128, 2), (2, 3, 64, 2), (2, 4, 64, 2),
               (3, 4, 256, 1), (3, 3, 64, 1), (4, 3, 128, 1), (1, 4, 128, 3), (1, 3, 64, 4))


def main(argv: list[str]) -> int:
    batch, paths = int(argv[0]), argv[1:]
    offered = tune.candidates

    def every(spec):
        out = list(offered(spec))
        if igemm.wgmma_fits(spec.input.channels):
            for warpgroups, stages, bn, blocks in EXTRA_WGMMA:
                cfg = replace(igemm.wgmma_config(spec.conv.out_channels, warpgroups, stages, bn), min_blocks=blocks)
                try:
                    if cfg not in out and tune.plan_with(spec, cfg)["engine"] == "igemm":
                        out.append(cfg)
                except (PlanError, ValueError):
                    continue
        return out

    tune.candidates = every
    tune.MAX_CANDIDATES = 10**6
    tune.SLAB_WGMMA_CANDIDATES = True
    specs = [s for path in paths for s in specgen.load_specs(path)]
    for result in tune.tune(specs, batch, store=False):
        print(result.table(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
