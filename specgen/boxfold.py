"""The box fold: an average pool after a stride-1 conv, taken before the conv's taps.

Along one dim, a stride-1 conv (kernel K, padding p) followed by an average pool of window P and
stride P (no padding) computes

    z[o] = 1/P * sum over a < P of y[P*o + a],   y[i] = sum over k < K of w[k] * xp[i + k],

(xp: x with p zeros on each side), so, swapping the sums,

    z[o] = sum over k < K of w[k] * B[k](o),   B[k](o) = 1/P * sum over a < P of xp[P*o + k + a],

the conv's own weights over the input's box means B: for each output position and tap, the mean
of the P inputs that tap meets over the window. Over several dims the means are of boxes.

The avg-pool fold (specgen.plan) computes the same layer as one conv of kernel K + P - 1 and
stride P: (K + P - 1) / K times the multiply-adds per dim (KernelBench 65: 6x6 against 3x3, 4x).
The box fold does the K taps only, in two kernels:

* the box-mean kernel (`templates/boxmean.cu.j2`) reads x once and writes B [C_IN * TAPS, pooled
  sizes] per sample, channel c's tap t at channel c * TAPS + t;
* a 1x1 conv over B with the user's weights read as [C_OUT, C_IN / groups * TAPS] (a reshape:
  channel c's taps in order, as the weight tensor holds them), the user's bias and the epilogue
  without the pool. It runs on the planner's engine like any 1x1 layer (a GEMM), itself a
  sequence where its epilogue needs one.

It pays where the taps saved cost more than B's round trip through memory: B holds K / P of the
input per dim (K <= P, so the windows do not overlap) and is written once and read once. The
planner takes it where the multiply-adds saved per byte of B moved are at least MIN_INTENSITY (a
conv on tensor cores at about a third of the TF32 rate, 3xTF32, against the copy rate), where the
taps shrink by at least MIN_GAIN, and in fp32 tensors only: B is rounded once to float (a tf32
conv of the means would not average its rounding over the window as PyTorch's pool does).

Exact in real arithmetic. Each mean is a sum in a fixed order (along W, then H, then D) divided by
the window's size once: no atomics, a run repeats bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from specgen import __version__
from specgen.kernelplan import KernelStep, SequencePart, SequencePlan, TemplateValues
from specgen.spec import LayerSpec

# Whether the planner takes the box fold where it applies (False: never; the avg-pool fold's one
# kernel as before). On since v45: its GPU tests pass and kb65 at batch 128 ran 0.87 ms folded
# against 1.03 without (H100, `specgen tune`, benchmarks/NOTES.md v45). Either way `specgen tune`
# times a layer both ways (`plan.SlabConfig.box_fold`) and keeps the faster.
ENABLED = True
THREADS = 256  # threads per block: one per (input channel, pooled position)
MIN_GAIN = 3  # fold only where the taps shrink at least this much: prod(K + P - 1) / prod(K)
MIN_INTENSITY = 32  # ... and the multiply-adds saved per byte of B written and read again, at least
MAX_TAPS = 64  # taps a thread writes (its box means, in registers)
MAX_WINDOW = 343  # inputs a thread loads: prod(K + P - 1)


@dataclass(frozen=True)
class BoxFold:
    """Where and how a layer folds: the pool at `at`, per spatial dim its conv kernel, padding
    and window; `spec` the 1x1 conv over the box means."""

    at: int
    kernel: tuple[int, ...]
    padding: tuple[int, ...]
    window: tuple[int, ...]
    spec: LayerSpec

    @property
    def taps(self) -> int:
        return math.prod(self.kernel)

    @property
    def gain(self) -> float:
        """The conv's multiply-adds per output, the avg-pool fold's over this fold's."""
        return math.prod(k + p - 1 for k, p in zip(self.kernel, self.window)) / self.taps


def find(spec: LayerSpec, rewrites: bool = True, enabled: bool | None = None) -> BoxFold | None:
    """The box fold of `spec`, or None where it does not apply or would not pay (`rewrites`: the
    planner's setting, beside the spec's own; `enabled`: a tuner's candidate's, None: `ENABLED`)."""
    from specgen import tapsum

    if not ((ENABLED if enabled is None else enabled) and spec.rewrites and rewrites) or spec.tile is not None or spec.precision != "fp32" or not spec.epilogue:
        return None
    if spec.conv.transposed:
        return None  # (a stride-1 transposed conv reaches here as the plain conv it equals)
    at = next((i for i, st in enumerate(spec.epilogue) if st.kind != "pointwise"), None)
    if at is None or spec.epilogue[at].op != "avg_pool" or not all(tapsum.commutes_with_mean(spec, i) for i in range(at)):
        return None
    geo = spec.conv_geometry()
    if any(s != 1 for s in geo["stride"]) or any(d != 1 for d in geo["dilation"]):
        return None
    pool = spec.pool_geometry(spec.epilogue[at], f"epilogue[{at}]")
    kernel, window = tuple(geo["kernel"]), tuple(pool["kernel"])
    if any(pool["padding"]) or tuple(pool["stride"]) != window or any(k > p for k, p in zip(kernel, window)):
        return None  # overlapping or padded windows, or taps beyond the window: B would repeat inputs
    taps = math.prod(kernel)
    if taps > MAX_TAPS or math.prod(k + p - 1 for k, p in zip(kernel, window)) > MAX_WINDOW:
        return None
    pooled = spec.shapes()[at + 1].sizes[1:]
    if math.prod(pooled) == 0:
        return None
    cin_g = spec.input.channels // spec.conv.groups
    cout = spec.conv.out_channels
    saved = 2 * cout * cin_g * (math.prod(k + p - 1 for k, p in zip(kernel, window)) - taps)  # per pooled position
    moved = 2 * 4 * spec.input.channels * taps  # B written, then read, per pooled position
    fold = BoxFold(at, kernel, tuple(geo["padding"]), window, _conv_spec(spec, at, taps, pooled))
    if fold.gain < MIN_GAIN or saved < MIN_INTENSITY * moved:
        return None
    return fold


def _conv_spec(spec: LayerSpec, at: int, taps: int, pooled) -> LayerSpec:
    """The 1x1 conv over the box means: [C_IN * TAPS, pooled sizes], the user's conv channels,
    groups and bias; the epilogue without the pool (the per-channel affine stages before it
    commute with the mean and stay in place)."""
    from specgen.tail import _stage_data

    data = spec.model_dump(mode="json")
    data["input"] = {**data["input"], "channels": spec.input.channels * taps, "size": list(pooled)}
    data["conv"].update(kernel=1, stride=1, padding=0, dilation=1)
    data["epilogue"] = [_stage_data(spec, i) for i in range(len(spec.epilogue)) if i != at]
    data.pop("tile", None)
    out = LayerSpec.model_validate(data)
    assert out.shapes()[-1].sizes == spec.shapes()[-1].sizes, (out.shapes(), spec.shapes())
    return out


@dataclass(frozen=True, eq=False)
class BoxmeanPlan(TemplateValues):
    """What templates/boxmean.cu.j2 renders (`boxmean_plan`): per dim of (D, H, W) the input's
    extent, the conv's kernel and padding, the window and the pooled extent; the thread mapping."""

    version: str
    name: str
    spec_hash: str
    kernel_name: str
    dims: list
    cin: int
    plane: int
    per_sample_in: int
    out_positions: int
    taps: int
    count: int
    s_per_sample: int
    threads: int
    grid_x: int
    at: int
    bytes_per_sample: int
    adds_per_sample: int


def boxmean_plan(spec: LayerSpec, fold: BoxFold, kernel_name: str) -> BoxmeanPlan:
    from specgen.plan import _spatial3

    size3 = _spatial3(tuple(spec.input.size), 1)
    k3, p3, w3 = _spatial3(fold.kernel, 1), _spatial3(fold.padding, 0), _spatial3(fold.window, 1)
    out3 = _spatial3(tuple(fold.spec.input.size), 1)
    dims = [{"name": name, "size": size3[a], "kernel": k3[a], "pad": p3[a], "window": w3[a], "out": out3[a],
             "extent": k3[a] + w3[a] - 1} for a, name in enumerate("dhw")]
    cin = spec.input.channels
    out_positions = math.prod(out3)
    taps = fold.taps
    plane = math.prod(size3)
    window_loads = math.prod(d["extent"] for d in dims)
    return BoxmeanPlan(
        version=__version__, name=spec.name, spec_hash=spec.shape_hash, kernel_name=kernel_name,
        dims=dims, cin=cin, plane=plane, per_sample_in=cin * plane, out_positions=out_positions, taps=taps,
        count=math.prod(w3), s_per_sample=cin * taps * out_positions, threads=THREADS,
        grid_x=-(-cin * out_positions // THREADS), at=fold.at,
        bytes_per_sample=4 * (cin * plane + cin * taps * out_positions),
        adds_per_sample=cin * out_positions * window_loads,
    )


def plan_fold(spec: LayerSpec, fold: BoxFold, target=None, settings=None) -> SequencePlan:
    """The plan of a box-folded layer: the box-mean kernel into B, then the 1x1 conv's plan (itself
    a sequence where its epilogue needs one) reading B, with the user's weights reshaped at launch
    (`weight_transforms`, specgen.torchop.box_fold_weight)."""
    from specgen.plan import DEFAULT_SETTINGS, build_plan
    from specgen.tail import prefixed_sequence

    inner = build_plan(fold.spec, None, target, settings=settings or DEFAULT_SETTINGS)
    bp = boxmean_plan(spec, fold, f"specgen_{spec.name}_boxmean")
    part = SequencePart(role="boxmean", namespace="boxmean", plan=bp, folded_spec=fold.spec)
    step = KernelStep(part=0, name=bp.kernel_name, threads=bp.threads, grid_x=bp.grid_x, once=False, args=["x", "s"])
    k = "x".join(map(str, fold.kernel))
    p = "x".join(map(str, fold.window))
    why = [f"epilogue[{fold.at}] avg_pool averages windows of {p} of a stride-1 {k} conv: the conv's {fold.taps} taps "
           f"over the input's box means instead of the avg-pool fold's {fold.gain:g}x as many"]
    rewrite = (f"box fold: epilogue[{fold.at}] avg_pool {p} taken before the conv's taps (the input's {p} box means, "
               f"{fold.taps} per input channel and pooled position; then a 1x1 conv over them with the user's weights)")
    return prefixed_sequence(spec, inner, part, step, bp.s_per_sample, why, rewrite, bp.adds_per_sample,
                             {"kind": "box_fold", "taps": fold.taps})


def describe(bp: BoxmeanPlan) -> str:
    """One line for `specgen show --plan`: what the box-mean kernel does."""
    k = "x".join(str(d["kernel"]) for d in bp.dims if d["kernel"] > 1 or d["window"] > 1) or "1"
    p = "x".join(str(d["window"]) for d in bp.dims if d["kernel"] > 1 or d["window"] > 1) or "1"
    return (f"box means: for each of the {bp.taps} taps of the {k} conv, the input's mean over each {p} window, "
            f"a thread per (input channel, pooled position); {bp.threads} threads/block, {bp.grid_x} block(s) per sample")
