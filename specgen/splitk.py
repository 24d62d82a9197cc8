"""Split K: when to run a GEMM engine's split kernel, and into how many parts.

At small batches a deep layer is a handful of output tiles (ResNet's 512 channels at 7 x 7 are
one M tile by 4 N tiles at batch 1): a few SMs walk all of K while the rest idle. An engine with a
split kernel (TMA, implicit GEMM) also compiles `<kernel>_split`, whose block (tile, part) walks one
of SPLIT_K equal parts of K (a literal divisor of its K loop's trip count) and writes its sums to a
workspace, and `<kernel>_reduce`, which adds the parts in order and runs the epilogue. SPLIT_K is
planned for one sample, the smallest batch (the batch is a run-time value); the launch takes the
split kernel for the batches where `pays` says so.

The cost model counts main-loop iterations of one block (about 0.3 us for a 128 x 128 tf32 tile on
an H200), fitted to kernel times measured there (benchmarks/NOTES.md, v23): waves of blocks over
the GPU's block slots x (iterations per block + a block's pipeline fill), and for a split the
reduction's launch and the partial sums' traffic (written, then read back: about 0.9 MB of it per
iteration's time).
"""

from __future__ import annotations

BLOCK_FILL = 5  # a block's setup and pipeline fill, in iterations
REDUCE = 7  # the reduction kernel's launch and run, beyond its traffic
PARTIAL_BYTES_PER_ITERATION = 900_000
MIN_ITERATIONS = 3  # a split block walks at least this many iterations
REDUCE_THREADS = 256  # threads per block of `<kernel>_reduce` (its __launch_bounds__ in the templates)


def kernel_names(kernel_name: str) -> tuple[str, str]:
    """The split kernel and its reduction, beside the main kernel `kernel_name` in its module."""
    return f"{kernel_name}_split", f"{kernel_name}_reduce"


def cost(tiles: int, k_iters: int, parts: int, slots: int, outputs: int) -> float:
    """A launch's time in iterations: `tiles` output tiles of `k_iters` iterations each, `slots`
    blocks resident at once (SMs x blocks per SM), `parts` parts of K (1: the plain kernel), the
    `outputs` (batch x positions x C_OUT) values whose partial sums a split writes per part."""
    if parts <= 1:
        return -(-tiles // slots) * (k_iters + BLOCK_FILL)
    waves = -(-tiles * parts // slots)
    return waves * (k_iters // parts + BLOCK_FILL) + REDUCE + parts * outputs * 8 / PARTIAL_BYTES_PER_ITERATION


def pays(tiles: int, k_iters: int, parts: int, slots: int, outputs: int) -> bool:
    """Whether the split kernel beats the plain one by a tenth (`cost`; the second launch's host
    time is not in it)."""
    return parts > 1 and cost(tiles, k_iters, parts, slots, outputs) * 10 <= cost(tiles, k_iters, 1, slots, outputs) * 9


def takes(batch: int, positions: int, bm: int, n_tiles: int, k_iters: int, parts: int, cout: int, slots: int) -> bool:
    """Whether a launch of `batch` samples (`positions` each, in tiles of `bm` x `n_tiles` along N)
    runs the split kernel of `parts` parts (1: none planned)."""
    tiles = -(-batch * positions // bm) * n_tiles
    return pays(tiles, k_iters, parts, slots, batch * positions * cout)


def choose(positions: int, cout: int, bm: int, n_tiles: int, k_iters: int, slots: int) -> int:
    """SPLIT_K for one sample of `positions` x `cout` outputs in tiles of `bm` positions x
    (`n_tiles` along N): the divisor of `k_iters` (at least MIN_ITERATIONS each) with the cheapest
    `cost`, or 1 (no split kernel) where none `pays`."""
    tiles = -(-positions // bm) * n_tiles
    outputs = positions * cout
    best, best_cost = 1, cost(tiles, k_iters, 1, slots, outputs)
    for parts in range(2, k_iters // MIN_ITERATIONS + 1):
        if k_iters % parts == 0 and (c := cost(tiles, k_iters, parts, slots, outputs)) < best_cost:
            best, best_cost = parts, c
    return best if pays(tiles, k_iters, best, slots, outputs) else 1
