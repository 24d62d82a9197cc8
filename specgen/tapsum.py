"""The tap-sum fold: a mean (or sum, or global average pool) over whole spatial dims of a conv's
output, taken before the conv.

A convolution is linear, so the mean over a spatial dim r of its output needs no output position
along r: for each tap k_r it only needs the sum of the input over the positions that tap reads,
I_r(k_r), an arithmetic progression of input indices (of step `stride` for a plain conv, contiguous
for a transposed one); taps that read the same positions share one sum. With R the reduced dims
and T = the product of their distinct index sets,

    mean_R(conv(x))[co, kept] = sum over ci, t in T, kept taps of  w'[co, ci, t, kept taps] * S[ci, t, kept],
    S[ci, t, kept] = sum of x[ci] over the product of I_r(t_r), r in R     (the tap sums)

with w' = w / (the output positions reduced). The layer becomes two kernels:

* the tap-sum kernel (`templates/tapsum.cu.j2`) reads x once and writes S, T values per input
  channel and kept position;
* the folded conv, an ordinary layer: the same conv over the kept dims, whose first reduced dim
  now holds the T taps as input and kernel extent (input T, kernel T, no padding: one output) and
  whose other reduced dims are 1. Its epilogue is the user's with the reduction taken out (a sum
  becomes a multiplication by the positions' count; where the reduction drops its dims, the
  output is a view of the folded conv's, or, where a later stage numbers dims, a reduction over
  the now single positions drops them).

What may stand between the conv and the reduction: per-channel affine stages (add, sub, mul, div by
a constant or a per-channel parameter; an eval-mode batch norm), which commute with a mean over
positions. The conv's multiply-adds shrink by the reduced positions over T (KernelBench 42:
514^2 / 1, every tap reading the whole input); the bytes moved are x once and S.

Exact in real arithmetic. The sums are taken in double (up to DOUBLE_TAPS per thread; float
beyond) and rounded to float once: each thread sums its positions in order, then a fixed tree
(no atomics, a run repeats bit for bit); the weights carry one more rounding (times 1 / count).
The folded conv runs in fp32 (3xTF32) also for a tf32 layer: its input, the sums, is no longer
the data TF32 would round, and the conv is now small.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from specgen import __version__, ops
from specgen.kernelplan import KernelStep, SequencePart, SequencePlan, TemplateValues
from specgen.spec import LayerSpec

THREADS = 256  # threads per block (at most)
MAX_TEAM_W = 256  # where W is summed: threads across W per (channel, kept position), at most
ROWS_PER_THREAD = 8  # ... and rows of the other summed dims per thread, at least, where there are that many
MAX_ROW = 1024  # the widest W a team sums across
MIN_GAIN = 4  # fold only where the conv's multiply-adds shrink at least this much (positions / T)
MAX_TAPS = 256  # a thread keeps one sum per tap in registers (and a block one per warp in shared memory)
DOUBLE_TAPS = 64  # up to this many, in double (the sums of many positions then round once)
UNROLL_ALL = 64  # loops over at most this many reduced positions unroll fully (membership at compile time)


@dataclass(frozen=True)
class Taps:
    """The distinct index sets the taps of one reduced dim read over all its output positions:
    set j is first[j], first[j] + step, ..., count[j] of them. `of_tap[k]`: the set tap k reads
    (-1: only padding). Taps that read the same set share one sum (and their weights are added)."""

    first: tuple[int, ...]
    count: tuple[int, ...]
    step: int
    of_tap: tuple[int, ...]

    @property
    def last(self) -> tuple[int, ...]:
        return tuple(f + (c - 1) * self.step for f, c in zip(self.first, self.count))

    @property
    def sets(self) -> int:
        return len(self.first)


@dataclass(frozen=True)
class Fold:
    """Where and how a layer folds: the reduction at `at`, over spatial dims `reduced` (0-based),
    `positions` output positions in all; `taps[r]` per reduced dim; `spec` the folded conv's layer."""

    at: int
    reduced: tuple[int, ...]
    positions: int
    taps: tuple[Taps, ...]
    spec: LayerSpec

    @property
    def tap_count(self) -> int:
        """The sums per input channel and kept position: the product of the reduced dims' sets."""
        return math.prod(t.sets for t in self.taps)


def dim_taps(size: int, out: int, kernel: int, stride: int, padding: int, dilation: int, transposed: bool) -> Taps:
    """The input indices each tap of one dim reads over the `out` output positions. A plain conv's
    output o reads x[o * stride - padding + k * dilation] with tap k; a transposed conv's output
    o = i * stride - padding + k * dilation receives x[i] through tap k."""
    sets: dict[tuple[int, int], int] = {}
    of_tap = []
    for k in range(kernel):
        off = k * dilation - padding
        if transposed:  # x[i] reaches output i * stride + off: 0 <= it <= out - 1, 0 <= i <= size - 1
            lo, hi = max(0, -(off // stride)), min(size - 1, (out - 1 - off) // stride)
            first = lo
        else:  # output o reads x[o * stride + off]: 0 <= it <= size - 1, 0 <= o <= out - 1
            lo, hi = max(0, -(off // stride)), min(out - 1, (size - 1 - off) // stride)
            first = lo * stride + off
        count = hi - lo + 1
        of_tap.append(sets.setdefault((first, count), len(sets)) if count > 0 else -1)
    return Taps(tuple(f for f, _ in sets), tuple(c for _, c in sets), 1 if transposed else stride, tuple(of_tap))


def _per_channel(spec: LayerSpec, name: str) -> bool:
    shape = spec.params()[name]
    return all(s == 1 for s in shape[1:])


def commutes_with_mean(spec: LayerSpec, i: int) -> bool:
    """Whether stage i is a per-channel affine map (commutes with a mean over positions)."""
    stage = spec.epilogue[i]
    if stage.kind != "pointwise":
        return False
    if stage.op == "batch_norm":  # eval mode: (x - mean) / sqrt(var + eps) * weight + bias, per channel
        return all(_per_channel(spec, n) for n in ops.POINTWISE["batch_norm"].params(stage.args))
    if ops.POINTWISE[stage.op].affine is None:  # the op table's affine rows (add, sub, mul, div)
        return False
    a = stage.args
    if getattr(a, "input", None) is not None:
        return False
    return a.value is not None or (a.param is not None and _per_channel(spec, a.param))


def _reduction(spec: LayerSpec, i: int) -> tuple[int, ...] | None:
    """The spatial dims (0-based) stage i averages or sums over whole, or None."""
    stage = spec.epilogue[i]
    if stage.kind == "pool" and stage.op == "global_avg_pool":
        return tuple(range(spec.ndim))
    if stage.kind == "reduce" and stage.op in ("mean", "sum"):
        dims = spec.reduce_dims(i)
        if all(d >= 2 for d in dims):
            return tuple(sorted(d - 2 for d in dims))
    return None


def find(spec: LayerSpec, rewrites: bool = True) -> Fold | None:
    """The fold of `spec`, or None where it does not apply or would not pay (`rewrites`: the
    planner's setting, beside the spec's own)."""
    if not (spec.rewrites and rewrites) or spec.tile is not None or spec.precision not in ("fp32", "tf32") or not spec.epilogue:
        return None
    at = next((i for i, st in enumerate(spec.epilogue) if st.kind != "pointwise"), None)
    if at is None or not all(commutes_with_mean(spec, i) for i in range(at)):
        return None
    reduced = _reduction(spec, at)
    if not reduced:
        return None
    nd = spec.ndim
    transposed = spec.conv.transposed
    if transposed and len(reduced) != nd:
        return None  # a transposed conv over kept dims would need its taps apart from its input channels
    if transposed and spec.conv.groups > 1:
        return None
    geo = spec.conv_geometry()
    if spec.conv.groups == spec.input.channels == spec.conv.out_channels and all(k == 1 for k in geo["kernel"]):
        return None  # a 1x1 depthwise conv (a split's identity conv, a per-channel scale) costs nothing to fold away
    out = spec.shapes()[0].sizes[1:]  # the conv's output extents
    taps = tuple(
        dim_taps(spec.input.size[r], out[r], geo["kernel"][r], geo["stride"][r], geo["padding"][r], geo["dilation"][r], transposed)
        for r in reduced
    )
    positions = math.prod(out[r] for r in reduced)
    tap_count = math.prod(t.sets for t in taps)
    if positions < MIN_GAIN * tap_count or tap_count > MAX_TAPS or tap_count == 0:
        return None
    if nd - 1 in reduced:  # W summed: a thread holds at most MAX_ROW / MAX_TEAM_W positions of a row,
        w_slots = -(-spec.input.size[-1] // MAX_TEAM_W)  # and a sum per W slot and tap of the other dims
        if spec.input.size[-1] > MAX_ROW or w_slots * tap_count // taps[-1].sets > MAX_TAPS // 4:
            return None
    folded = folded_spec(spec, at, reduced, tap_count, positions)
    assert math.prod(folded.shapes()[-1].sizes) == math.prod(spec.shapes()[-1].sizes), (folded.shapes(), spec.shapes())
    return Fold(at, reduced, positions, taps, folded)


def folded_spec(spec: LayerSpec, at: int, reduced: tuple[int, ...], tap_count: int, positions: int) -> LayerSpec:
    """The folded conv as a layer: its input the tap sums, [C_in, sizes'] with the first reduced dim
    T long and the other reduced dims 1; the kernel the same over the kept dims, T along the first
    reduced dim; the user's epilogue without the reduction."""
    from specgen.tail import _stage_data

    geo = spec.conv_geometry()
    r0 = reduced[0]
    size, kernel = list(spec.input.size), list(geo["kernel"])
    stride, padding, dilation = list(geo["stride"]), list(geo["padding"]), list(geo["dilation"])
    for r in reduced:
        size[r], kernel[r], stride[r], padding[r], dilation[r] = 1, 1, 1, 0, 1
    size[r0] = kernel[r0] = tap_count
    data = spec.model_dump(mode="json")
    data["input"]["size"] = size
    data["conv"].update(kernel=kernel, stride=stride, padding=padding, dilation=dilation, transposed=False)
    data["conv"].pop("output_padding", None)
    data["precision"] = "fp32"
    stages = [_stage_data(spec, i) for i in range(len(spec.epilogue))]
    stage = spec.epilogue[at]
    keep = stage.op == "global_avg_pool" or stage.args.keepdim
    # The folded conv's output keeps the reduced dims as 1s. Where the reduction dropped them and
    # only pointwise stages follow, that is the same tensor (the output is a view of it); else a
    # reduction over the single positions drops them (and numbers the later dims as the user's).
    reshape_only = keep or all(st.kind == "pointwise" for st in spec.epilogue[at + 1:])
    replace = [] if reshape_only else [{"mean": {"dims": [r + 2 for r in reduced], "keepdim": False}}]
    if stage.op == "sum":
        replace.insert(0, {"mul": {"value": float(positions)}})
    data["epilogue"] = stages[:at] + replace + stages[at + 1:]
    data.pop("tile", None)
    return LayerSpec.model_validate(data)


def plan_fold(spec: LayerSpec, fold: Fold, target=None, settings=None) -> SequencePlan:
    """The plan of a folded layer: the tap-sum kernel into S, then the folded conv's plan (itself a
    sequence where its epilogue needs one) reading S. The launch hands the folded conv the folded
    weights (`weight_transforms`, specgen.torchop.tap_fold_weight)."""
    from specgen.plan import DEFAULT_SETTINGS, build_plan
    from specgen.tail import prefixed_sequence

    inner = build_plan(fold.spec, None, target, settings=settings or DEFAULT_SETTINGS)
    tp = tapsum_plan(spec, fold, f"specgen_{spec.name}_tapsum")
    tap_part = SequencePart(role="tapsum", namespace="tapsum", plan=tp, folded_spec=fold.spec)  # (the layer the later parts are of)
    tap_step = KernelStep(part=0, name=tp.kernel_name, threads=tp.threads, grid_x=tp.grid_x, once=False, args=["x", "s"])
    op = spec.epilogue[fold.at].op
    why = [f"epilogue[{fold.at}] {op} {'sums' if op == 'sum' else 'averages'} whole spatial dims of a linear conv: "
           f"the conv reads the input's sums per tap ({fold.tap_count} per input channel) instead of its "
           f"{fold.positions} output positions (the stages after it are numbered as the folded layer's)"]
    rewrite = (f"tap-sum fold: epilogue[{fold.at}] {op} over whole spatial dims, taken before "
               f"the conv (the input summed per tap: {fold.tap_count} sums per input channel; the conv over them "
               f"in fp32, its weights / {fold.positions})")
    return prefixed_sequence(spec, inner, tap_part, tap_step, tp.s_per_sample, why, rewrite, tp.adds_per_sample, {
        "kind": "tap_fold", "transposed": spec.conv.transposed, "groups": spec.conv.groups,
        "reduced": list(fold.reduced), "positions": fold.positions, "sets": [list(t.of_tap) for t in fold.taps],
    })


@dataclass(frozen=True, eq=False)
class TapsumPlan(TemplateValues):
    """What templates/tapsum.cu.j2 renders (`tapsum_plan`): the input as [C_in, D, H, W], which of
    D, H, W are summed, each summed dim's tap progressions, the tap sums' layout, the thread mapping."""

    version: str
    name: str
    spec_hash: str
    kernel_name: str
    dims: list  # per dim of (D, H, W): its extent, whether it is summed, its strides and divisors; a summed one's taps
    cin: int
    plane: int
    per_sample_in: int
    s_per_sample: int
    s_tap_stride: int
    tap_count: int
    reduced_names: list
    kept_positions: int
    reduced_positions: int
    rows_mode: bool  # W summed: a team of whole warps per (channel, kept position), else a thread per one
    rows: int
    rows_par: int
    row_iters: int
    threads: int
    grid_x: int
    unroll_all: bool
    taps_w: int
    rest_taps: int
    tap_conds: list
    rest_conds: list
    w_conds: list
    rows_exact: bool
    team_w: int
    w_slots: int
    w_exact: bool
    team: int
    team_warps: int
    items_: int  # (the key "items") teams per block
    tap_iters: int
    acc_type: str
    positions: int
    op: str
    at: int
    adds_per_sample: int
    bytes_per_sample: int


def tapsum_plan(spec: LayerSpec, fold: Fold, kernel_name: str) -> TapsumPlan:
    """What templates/tapsum.cu.j2 needs: the input as [C_in, D, H, W], which of D, H, W are summed,
    each summed dim's tap progressions, the tap sums' layout, and the thread mapping."""
    from specgen.plan import _spatial3

    nd = spec.ndim
    size3 = _spatial3(tuple(spec.input.size), 1)
    lead = 3 - nd
    red3 = tuple(r + lead for r in fold.reduced)  # reduced dims among (D, H, W)
    x_stride3 = [size3[1] * size3[2], size3[2], 1]
    dims = []
    for axis, name in enumerate("dhw"):
        entry = {"name": name, "size": size3[axis], "reduced": axis in red3, "x_stride": x_stride3[axis]}
        if entry["reduced"]:
            t = fold.taps[red3.index(axis)]
            entry.update(taps=t.sets, first=list(t.first), last=list(t.last), count=list(t.count), step=t.step,
                         of_tap=list(t.of_tap),
                         reads=[reads_expr(name, f, l, t.step, c, size3[axis]) for f, l, c in zip(t.first, t.last, t.count)])
        dims.append(entry)
    # how a flat index splits into coordinates: the kept dims (a kept position), the summed dims (a
    # summed position) and, where W is summed, the other summed dims (a row): (index / div) % size
    for group, pick in (("kept_div", lambda d: not d["reduced"]), ("red_div", lambda d: d["reduced"]),
                        ("row_div", lambda d: d["reduced"] and d["name"] != "w")):
        div = 1
        for d in reversed(dims):
            if pick(d):
                d[group] = div
                div *= d["size"]
    cin = spec.input.channels
    plane = math.prod(size3)
    # S, one sample: [C_in][sizes'] where the first reduced dim holds the tap index t and the other
    # reduced dims are 1: strides over (D, H, W) of S for the kept dims, and of t.
    s_size3 = [d["size"] if not d["reduced"] else 1 for d in dims]
    r0 = red3[0]
    s_size3[r0] = fold.tap_count
    s_stride3 = [s_size3[1] * s_size3[2], s_size3[2], 1]
    for d, stride in zip(dims, s_stride3):
        d["s_stride"] = stride
    # the tap index t runs over the summed dims' taps in row-major order: t = sum of k_r * tap_div_r
    div = 1
    for d in reversed(dims):
        if d["reduced"]:
            d["tap_div"] = div
            div *= d["taps"]
    tap_digits = [[(t // d["tap_div"]) % d["taps"] for d in dims if d["reduced"]] for t in range(fold.tap_count)]
    kept_positions = math.prod(d["size"] for d in dims if not d["reduced"])
    tap_count = fold.tap_count
    rows_mode = dims[2]["reduced"]  # W summed: a block per (channel, kept position), a thread per W position
    reduced_positions = math.prod(d["size"] for d in dims if d["reduced"])
    if rows_mode:
        # A team of whole warps per (channel, kept position): TEAM_W threads across W (each taking
        # W_SLOTS positions TEAM_W apart) times ROWS_PAR rows at once; ITEMS teams per block.
        width = dims[2]["size"]
        rows = reduced_positions // width  # the summed (D, H) positions of one item
        team_w = min(width, MAX_TEAM_W)
        w_slots = -(-width // team_w)
        rows_par = max(1, min(rows // ROWS_PER_THREAD, THREADS // team_w))
        team = -(-team_w * rows_par // 32) * 32
        items = max(1, THREADS // team)
        threads = items * team
        grid_x = -(-cin * kept_positions // items)
        row_iters = -(-rows // rows_par)
    else:
        threads = THREADS
        grid_x = -(-cin * kept_positions // threads)
        width = rows = rows_par = row_iters = team_w = w_slots = team = items = 0
    loop = reduced_positions if not rows_mode else row_iters
    taps_w = dims[2]["taps"] if rows_mode else 1
    rest_taps = tap_count // taps_w  # where W is summed: the taps of the other summed dims (t = t_rest * TAPS_W + k_w)
    summed = [d for d in dims if d["reduced"]]

    def cond(digits, dims_of):  # C: the position is one tap t reads, along each of `dims_of`
        terms = [f"({d['reads'][k]})" for d, k in zip(dims_of, digits) if d["reads"][k] != "true"]
        return " && ".join(terms) or "true"

    tap_conds = [cond(digits, summed) for digits in tap_digits]
    rest_conds = [cond(digits[:-1], summed[:-1]) for digits in tap_digits[::taps_w]] if rows_mode else tap_conds
    w_conds = dims[2]["reads"] if rows_mode else []
    return TapsumPlan(
        version=__version__, name=spec.name, spec_hash=spec.shape_hash, kernel_name=kernel_name,
        dims=dims, cin=cin, plane=plane, per_sample_in=cin * plane,
        s_per_sample=cin * tap_count * kept_positions, s_tap_stride=s_stride3[r0],
        tap_count=tap_count, reduced_names=[d["name"] for d in dims if d["reduced"]],
        kept_positions=kept_positions, reduced_positions=reduced_positions,
        rows_mode=rows_mode, rows=rows, rows_par=rows_par, row_iters=row_iters,
        threads=threads, grid_x=grid_x, unroll_all=loop <= UNROLL_ALL,
        taps_w=taps_w, rest_taps=rest_taps, tap_conds=tap_conds, rest_conds=rest_conds, w_conds=w_conds,
        rows_exact=rows_mode and rows % rows_par == 0,
        team_w=team_w, w_slots=w_slots, w_exact=rows_mode and width % team_w == 0, team=team,
        team_warps=team // 32, items_=items,
        tap_iters=-(-tap_count // (team if rows_mode else threads)),
        acc_type="double" if max(tap_count, w_slots * rest_taps) <= DOUBLE_TAPS else "float",
        positions=fold.positions, op=spec.epilogue[fold.at].op, at=fold.at,
        adds_per_sample=cin * plane * tap_count,
        bytes_per_sample=4 * (cin * plane + cin * tap_count * kept_positions),
    )


def reads_expr(var: str, first: int, last: int, step: int, count: int, size: int) -> str:
    """C for 'index `var` (0 <= var < size) is one a tap reads': first <= var <= last, on its step."""
    if count == 0:
        return "false"
    terms = []
    if first > 0:
        terms.append(f"{var} >= {first}")
    if last < size - 1:
        terms.append(f"{var} <= {last}")
    if step > 1 and count > 1:
        terms.append(f"({var} - {first}) % {step} == 0")
    elif step > 1:
        terms = [f"{var} == {first}"]
    return " && ".join(terms) if terms else "true"


def describe(tp: TapsumPlan) -> str:
    """One line for `specgen show --plan`: what the tap-sum kernel does."""
    summed = "x".join(d["name"].upper() for d in tp.dims if d["reduced"])
    how = (f"a team of {tp.team} threads per (channel, kept position): {tp.team_w} across W "
           f"({tp.w_slots} position(s) each) x {tp.rows_par} row(s) at once, {tp.items_} team(s) per block"
           if tp.rows_mode else "a thread per (channel, kept position)")
    return (f"tap sums: the input summed over {summed} for each of the {tp.tap_count} taps' index ranges, "
            f"{how}; {tp.threads} threads/block, {tp.grid_x} block(s) per sample")
