"""The transposed pool fold: an average pool after a strided transposed conv, folded into the plain
conv the two make together.

Along one dim, a transposed conv (stride s, padding p, dilation d, kernel K) followed by an average
pool (window P, stride Q, no padding) computes

    z[u] = 1/P * sum over a < P of y[u*Q + a],   y[o] = sum over i, k with o = i*s - p + k*d of w[k] * x[i],

so z[u] reads x[i] with i*s = u*Q + a + p - k*d. When Q is a multiple of s (Q = m*s) that is
i = u*m + j for the pairs (a, k) with a + p - k*d = s*j: a plain conv of stride m whose tap j
(shifted by its padding) has the weight  W'[j] = 1/P * (sum of w[k] over the pairs that give j).
Every window of the pool lies inside the transposed conv's output, so the plain conv sees exactly
the input the transposed one read, zero beyond its edges; its padding and trailing zero taps are
chosen so that it has the pool's output count. Per-channel affine stages between the conv and the
pool commute with the average and stay where they are.

The plain conv runs on every engine (tensor cores included), without the stride phases, and does
fewer multiply-adds: per dim U*K' instead of O*K/s (KernelBench 72: two pools of 2 after a 3x3x3
transposed conv of stride 2 become one 3x3x3 conv of stride 2 after the avg-pool fold). Exact in
real arithmetic; the weights are combined in double and rounded once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from specgen.spec import LayerSpec


@dataclass(frozen=True)
class DimFold:
    """One dim: the plain conv's kernel, stride and padding, and `taps[j']`, the (count, k) pairs
    that make its tap j' (count: how many pool offsets a pair with transposed tap k has)."""

    kernel: int
    stride: int
    padding: int
    window: int
    taps: tuple[tuple[tuple[int, int], ...], ...]


def dim_fold(size: int, kernel: int, stride: int, padding: int, dilation: int, out: int, window: int,
             pool_stride: int) -> DimFold | None:
    """The plain conv of one dim (`out`: the transposed conv's output extent), or None where the
    pool's stride is not a multiple of the conv's."""
    if pool_stride % stride:
        return None
    m = pool_stride // stride
    pooled = (out - window) // pool_stride + 1
    if pooled < 1:
        return None
    contrib: dict[int, dict[int, int]] = {}
    for a in range(window):
        for k in range(kernel):
            v = a + padding - k * dilation
            if v % stride == 0:
                row = contrib.setdefault(v // stride, {})
                row[k] = row.get(k, 0) + 1
    if not contrib:
        return None
    j_min, j_max = min(contrib), max(contrib)
    pad = max(0, -j_min, (pooled - 1) * m + j_max - size + 1)
    taps_needed = j_max + pad + 1
    k_plain = max(taps_needed, size + 2 * pad - pooled * m + 1)
    assert (size + 2 * pad - k_plain) // m + 1 == pooled, (size, pad, k_plain, m, pooled)
    taps = tuple(tuple(sorted((c, k) for k, c in contrib.get(j - pad, {}).items())) for j in range(k_plain))
    return DimFold(k_plain, m, pad, window, taps)


@dataclass(frozen=True)
class PoolFold:
    at: int  # the pool's stage index
    dims: tuple[DimFold, ...]
    spec: LayerSpec  # the plain conv's layer


def find(spec: LayerSpec, rewrites: bool = True) -> PoolFold | None:
    """The fold of a strided transposed conv into the avg pool after it, or None (`rewrites`: the
    planner's setting, beside the spec's own)."""
    from specgen import tapsum

    if not (spec.rewrites and rewrites) or spec.tile is not None or not spec.conv.transposed or not spec.epilogue:
        return None
    geo = spec.conv_geometry()
    if all(s == 1 for s in geo["stride"]):
        return None  # stride 1: the plain conv it equals, then the avg-pool fold (specgen.plan)
    at = next((i for i, st in enumerate(spec.epilogue) if st.kind != "pointwise"), None)
    if at is None or spec.epilogue[at].op != "avg_pool" or not all(tapsum.commutes_with_mean(spec, i) for i in range(at)):
        return None
    pool = spec.pool_geometry(spec.epilogue[at], f"epilogue[{at}]")
    if any(pool["padding"]):
        return None
    out = spec.shapes()[0].sizes[1:]
    dims = []
    for r in range(spec.ndim):
        f = dim_fold(spec.input.size[r], geo["kernel"][r], geo["stride"][r], geo["padding"][r], geo["dilation"][r],
                     out[r], pool["kernel"][r], pool["stride"][r])
        if f is None:
            return None
        dims.append(f)
    pooled = spec.shapes()[at + 1].sizes[1:]
    plain_work = math.prod(u * f.kernel for u, f in zip(pooled, dims))
    transposed_work = math.prod(o * k / s for o, k, s in zip(out, geo["kernel"], geo["stride"]))
    if plain_work > transposed_work:
        return None
    data = spec.model_dump(mode="json")
    data["conv"].update(transposed=False, kernel=[f.kernel for f in dims], stride=[f.stride for f in dims],
                        padding=[f.padding for f in dims], dilation=1)
    data["conv"].pop("output_padding", None)
    from specgen.tail import _stage_data

    data["epilogue"] = [_stage_data(spec, i) for i in range(len(spec.epilogue)) if i != at]
    plain = LayerSpec.model_validate(data)
    assert plain.shapes()[-1].sizes == spec.shapes()[-1].sizes, (plain.shapes(), spec.shapes())
    return PoolFold(at, tuple(dims), plain)


def transform(spec: LayerSpec, fold: PoolFold) -> dict:
    """The plan's weight transform (specgen.torchop.pool_fold_weight)."""
    return {"kind": "transposed_pool_fold", "groups": spec.conv.groups,
            "dims": [{"kernel": f.kernel, "window": f.window, "taps": [list(map(list, t)) for t in f.taps]} for f in fold.dims]}


def note(spec: LayerSpec, fold: PoolFold) -> str:
    k = "x".join(str(f.kernel) for f in fold.dims)
    s = "x".join(str(f.stride) for f in fold.dims)
    p = "x".join(str(f.padding) for f in fold.dims)
    return (f"transposed pool fold: epilogue[{fold.at}] avg_pool after the strided transposed conv, folded into "
            f"the plain conv they make (kernel {k}, stride {s}, padding {p}; its weights the transposed taps "
            f"each window offset meets, / the window, combined at launch in double)")
