"""The tail engine: layers whose epilogue holds a statistic stage run as a short sequence of kernels.

A statistic stage (group_norm, instance_norm, layer_norm, batch_norm with batch statistics,
softmax, log_softmax; the rows of `specgen.ops.NORMS`) normalizes every value with statistics of
a group of values (a sample's channel group, a channel of the whole batch, a row, the positions
a softmax runs over) that many thread blocks compute. No block of the conv sees a whole group, so
the layer is split before each statistic stage:

* **Body**: the conv and the stages before the first statistic stage, planned by `plan.build_plan`
  as any layer (implicit GEMM, slab or FFMA), write their result T0 to a workspace.
* **Tail** (this module, `templates/tail.cu.j2`), per statistic stage: kernels that compute the
  statistic of every group in a fixed order and apply the normalization and the pointwise ops
  that follow it. The tensor is contiguous, [batch, E1, ..., Er]; a stage over trailing dims sees
  each sample as GROUPS runs of GROUP_LEN contiguous floats (a batch norm's group is run g of every
  sample), a softmax over leading or middle dims as OUTER x ELEMS x INNER with groups strided by INNER:
  - `one_pass` (a group of at most ONE_PASS_MAX floats, per sample): a team of TEAM threads holds
    the group in registers, sums it (a butterfly in the warp, the team's warps in order), takes the
    mean, then sums the squared deviations (two passes over registers: no cancellation), then
    normalizes and writes: one read, one write. Softmax: the max, then the sum of exp(x - max).
  - `split` (larger groups, and a batch norm's groups, which span the batch): a stats kernel (one
    block per chunk of CHUNK floats: the chunk's mean and squared deviations, two passes over
    registers), a finalize kernel (one block per group joins its chunks' partials: Chan's merge of
    (count, mean, M2), or the logsumexp merge for softmax, each thread over chunks t, t + T, ...,
    then a fixed tree) and an apply kernel (one block per chunk again): two reads, one write.
  - `strided` (softmax over dims that are not trailing): one thread per VEC neighbouring inner
    positions (the widest VEC whose groups fit in registers, ELEMS x VEC <= 64); larger groups are
    read twice (an online max and sum, then the normalization).
  No atomics: every sum has a fixed order, so a run repeats bit for bit; per-sample results do not
  depend on the batch (a batch norm's do, as its statistics span it).
* **Rest**: the stages after a statistic stage up to the next one: the tail kernel applies the
  pointwise ops that follow it directly; from the first pool or reduction on, the stages run as a
  further kernel of the body engine over an identity conv (1x1, depthwise, weights 1, no bias:
  exact), which reads the tail kernel's output. A further statistic stage starts the next tail.

The plan of such a layer is `plan_sequence`'s, a `kernelplan.SequencePlan`: every part's own plan
(the body's and the rests' are ordinary plans, the tails' are this module's `TailPlan`s) and the
steps the runtime launches (`specgen.tailrun`). Its source is one translation unit: each part's
source in a namespace of its own, the includes first (`join`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace

from specgen import __version__, ops
from specgen.kernelplan import KernelPlan, KernelStep, LayerStep, SequencePart, SequencePlan, TemplateValues
from specgen.spec import LayerSpec

THREADS = 256  # threads per block of the split kernels and the strided kernel
FLOATS_PER_THREAD = 32  # the values of a group (or chunk) a thread holds in registers
ONE_PASS_MAX = 16 * FLOATS_PER_THREAD * 32  # 16384: the largest group a team of 512 threads holds at once
CHUNK = THREADS * FLOATS_PER_THREAD  # 8192: the floats a split kernel's block takes of a group
STRIDED_REGISTERS = 64  # a strided softmax keeps its group in registers up to this many values per thread
# A strided group of more than STRIDED_REGISTERS values (a LayerNorm over 96-768 channels), or of
# any length where a sample has few groups (a small map), is a team's: a block holds TEAM_POS
# neighbouring groups (positions) x THREADS / TEAM_POS slices of their values, each thread the
# values slice, slice + SLICES, ... of its group in registers (at most STRIDED_TEAM_ITEMS); the
# statistics join through shared memory in slice order (deterministic). One thread per group read
# hundreds of values twice, and a 7x7 map gave a sample 49 threads: 0.2-0.3 ms for a 0.01-0.1 ms
# layer on an H100 (NOTES v52). TEAM_POS is the widest of 32, 16, 8 positions that leaves a sample
# STRIDED_TEAM_BLOCKS blocks (8 at least: a 32-byte sector), narrower only where a group's values
# would not fit the registers.
STRIDED_TEAMS = True
STRIDED_TEAM_ITEMS = 32
STRIDED_TEAM_BLOCKS = 16
STRIDED_TEAM_FEW_SLOTS = THREADS  # a sample with fewer thread-per-group slots than this (a block's) takes teams
RE_READ_UNROLL = 4  # how far the re-reading strided loops are unrolled


@dataclass(frozen=True)
class Segment:
    """One statistic stage and what follows it up to the next: `apply` the pointwise ops the tail
    kernel applies after it, `rest` the stages from the first pool or reduction on (a further kernel)."""

    index: int
    apply: tuple[int, ...]
    rest: tuple[int, ...]


@dataclass(frozen=True, eq=False)
class TailKernel(TemplateValues):
    """One kernel of a tail: its function, its `role` (one_pass, stats, finalize, apply, strided),
    `threads` per block, `grid_x` blocks per sample (`once`: for the whole batch), its arguments by
    the tail's own names ("in", "out", "partials", "stat", "p_<name>", "i_<name>": `plan_sequence`
    maps them to the sequence's buffers) and the bytes it moves per sample."""

    name: str
    role: str
    threads: int
    grid_x: int
    once: bool
    args: list
    bytes_per_sample: int


@dataclass(frozen=True, eq=False)
class TailPlan(TemplateValues):
    """The plan of one statistic stage's tail kernels (tail.cu.j2 sees only this): what every mode
    has; `OnePassTail`, `SplitTail` and `StridedTail` add their own values (`family` and `mode` name
    the kind)."""

    version: str
    name: str
    spec_hash: str
    index: int
    op: str
    op_comment: str
    group_text: str
    statistic: str
    prepare: str  # %-format snippets of the op table, formatted by the template
    normalize: str
    prepare_comment: str
    eps: str
    affine: str
    affine_index: str | None
    pointwise: list
    # what each value goes through after its normalization: the norm's weight and bias, the stages after it
    steps: list
    params: list
    inputs: list
    constants: list
    in_shape: list
    per_sample: int
    c_stride: int
    needs_channel: bool
    lse_helpers: str
    across_batch: bool
    stats_output: bool
    threads: int
    vec: int
    kernels: tuple  # TailKernel, in launch order


@dataclass(frozen=True, eq=False)
class OnePassTail(TailPlan):
    """A group of at most ONE_PASS_MAX floats, per sample: a team of `team` threads holds it."""

    groups: int
    group_len: int
    team: int
    teams: int
    items_: int  # (the key "items") vectors per thread: ITEMS * TEAM * VEC >= GROUP_LEN
    lane_span: int
    team_warps: int
    family: str = field(default="runs", init=False)
    mode: str = field(default="one_pass", init=False)


@dataclass(frozen=True, eq=False)
class SplitTail(TailPlan):
    """Larger groups, and a batch norm's: stats, finalize and apply kernels over chunks of CHUNK floats."""

    groups: int
    group_len: int
    items_: int  # (the key "items") vectors per thread: ITEMS * THREADS * VEC = CHUNK
    chunk: int
    chunks: int
    partials: int
    stat_per_sample: int
    stat_floats: int
    fin_threads: int
    fin_iters: int
    family: str = field(default="runs", init=False)
    mode: str = field(default="split", init=False)


@dataclass(frozen=True, eq=False)
class StridedTail(TailPlan):
    """A softmax over dims that are not trailing: groups strided by INNER."""

    outer: int
    elems: int
    inner: int
    registers: bool
    groups_t: int
    re_read_unroll: int
    team_pos: int = 0  # a team's block: team_pos groups x THREADS / team_pos slices (0: a thread per group)
    lane_items: int = 0  # a team thread's values of its group, in registers
    family: str = field(default="strided", init=False)
    mode: str = field(default="strided", init=False)


def _team_positions(groups: int, elems: int) -> int:
    """Groups per block of a strided team kernel (see STRIDED_TEAMS), or 0 where no width holds a
    group's values in its threads' registers (the thread-per-group kernel reads them twice)."""
    widths = [p for p in (32, 16, 8, 4, 2, 1) if -(-elems // (THREADS // p)) <= STRIDED_TEAM_ITEMS]
    if not widths:
        return 0
    wide = [p for p in widths if p >= 8 and -(-groups // p) >= STRIDED_TEAM_BLOCKS]
    return wide[0] if wide else min(widths[0], 8)


def is_sequence(spec: LayerSpec) -> bool:
    """Whether the layer holds a statistic stage (and so runs as a sequence of kernels)."""
    return any(stage.kind == "norm" for stage in spec.epilogue)


def split(spec: LayerSpec) -> tuple[tuple[int, ...], list[Segment]]:
    """(the body's stages, one Segment per statistic stage)."""
    marks = [i for i, stage in enumerate(spec.epilogue) if stage.kind == "norm"]
    body = tuple(range(marks[0])) if marks else tuple(range(len(spec.epilogue)))
    segments = []
    for k, i in enumerate(marks):
        end = marks[k + 1] if k + 1 < len(marks) else len(spec.epilogue)
        after = list(range(i + 1, end))
        cut = next((j for j in after if spec.epilogue[j].kind != "pointwise"), end)
        segments.append(Segment(i, tuple(j for j in after if j < cut), tuple(j for j in after if j >= cut)))
    return body, segments


def _stage_data(spec: LayerSpec, i: int) -> dict:
    """Stage i as a spec mapping, its dims normalized (the numbering survives the split)."""
    stage = spec.epilogue[i]
    args = stage.args.model_dump(mode="json")
    if stage.kind == "reduce":
        args["dims"] = list(spec.reduce_dims(i))
    return {stage.op: args}


def body_spec(spec: LayerSpec) -> LayerSpec:
    """The conv and the stages before the first statistic stage, as a layer of its own."""
    body, _ = split(spec)
    data = spec.model_dump(mode="json")
    data["epilogue"] = [_stage_data(spec, i) for i in body]
    return LayerSpec.model_validate(data)


def rest_spec(spec: LayerSpec, segment: Segment) -> tuple[LayerSpec, tuple[int, ...]]:
    """The stages of segment.rest as a layer over an identity conv of the tensor they start from,
    and the per-sample shape of its output as that layer computes it. The tensor's first dim is the
    layer's channels (the channels when they are still there; without them no stage refers to
    them), the others its spatial dims; a tensor of one dim gets a trailing spatial dim of 1, which
    the output keeps (a view drops it). Dims keep their numbers: the new dims come after them."""
    sizes = list(spec.shapes()[segment.rest[0]].sizes)
    channels, size = sizes[0], sizes[1:] or [1]
    data = {
        "name": spec.name,
        "input": {"channels": channels, "size": size},
        "conv": {"out_channels": channels, "kernel": 1, "groups": channels, "bias": False},
        "epilogue": [_stage_data(spec, i) for i in segment.rest],
        "precision": "fp32",  # an identity conv in tf32 would round its input
        "rewrites": spec.rewrites,
    }
    rest = LayerSpec.model_validate(data)
    return rest, rest.shapes()[-1].sizes


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _vec(n: int) -> int:
    """The widest vector (4, 2 or 1 floats) that divides n."""
    return next(v for v in (4, 2, 1) if n % v == 0)


def _group_text(spec: LayerSpec, i: int) -> str:
    """What one statistic group of stage i holds, in words: '8 x 258 x 258 values'."""
    shape, span = spec.shapes()[i], spec.norm_span(i)
    sizes = list(shape.sizes)
    dims = sizes[span.first - 1:span.last]
    if span.split > 1:
        dims = [dims[0] // span.split, *dims[1:]]
    return " x ".join(map(str, dims)) + " values" + (" of every sample" if span.across_batch else "")


def _affine_code(row: ops.Norm, args, index: str) -> str:
    """The norm's own weight and bias applied to v (their element `index`), or ''."""
    weight = f"__ldg(p_{args.weight} + {index})" if args.weight else None
    bias = f"__ldg(p_{args.bias} + {index})" if args.bias else None
    if weight and bias:
        return f"fmaf(v, {weight}, {bias})"
    if weight:
        return f"v * {weight}"
    if bias:
        return f"v + {bias}"
    return ""


def tail_plan(spec: LayerSpec, segment: Segment, kernel_prefix: str) -> TailPlan:
    """The plan of one statistic stage's tail kernels (tail.cu.j2 sees only this)."""
    from specgen.plan import Constant, _pointwise_code, input_entries, norm_constants

    i = segment.index
    stage = spec.epilogue[i]
    row = ops.NORMS[stage.op]
    args = stage.args
    shape = spec.shapes()[i]
    span = spec.norm_span(i)
    sizes = list(shape.sizes)
    per_sample = math.prod(sizes)
    consts: list[Constant] = []
    eps_name = norm_constants(spec, i, consts)
    pointwise = [_pointwise_code(spec, j, consts, "c_el", sample="n") for j in segment.apply]
    has_channels = bool(shape.axes) and shape.axes[0].role == "c"
    c_stride = math.prod(sizes[1:]) if has_channels else 1
    affine = _affine_code(row, args, "e_el" if row.affine == "element" else "c_el") if row.params(args) else ""
    needs_channel = bool(any(st["params"] or st["channel_inputs"] for st in pointwise) or (affine and row.affine == "channel"))
    params = list(dict.fromkeys([*row.params(args), *(p for st in pointwise for p in st["params"])]))
    inputs = list(dict.fromkeys(n for st in pointwise for n in st["inputs"]))
    tensors = [*(f"p_{n}" for n in params), *(f"i_{n}" for n in inputs)]  # what an applying kernel reads besides its input
    trailing = span.last == len(sizes)
    base = dict(
        version=__version__,
        name=spec.name,
        spec_hash=spec.shape_hash,
        index=i,
        op=stage.op,
        op_comment=f"epilogue[{i}] {stage.op}",
        group_text=_group_text(spec, i),
        statistic=row.statistic,
        prepare=row.prepare,  # %-format snippets of the op table, formatted by the template
        normalize=row.normalize,
        prepare_comment=row.prepare_comment,
        eps=eps_name,
        affine=affine,
        affine_index=row.affine if affine else None,
        pointwise=pointwise,
        # what each value goes through after its normalization: the norm's weight and bias, the stages after it
        steps=([{"code": affine, "comment": "its weight and bias"}] if affine else []) + pointwise,
        params=[{"name": n} for n in params],
        inputs=input_entries(spec, inputs),  # (extra inputs and saved values: the sequence binds each)
        constants=consts,
        in_shape=sizes,
        per_sample=per_sample,
        c_stride=c_stride,
        needs_channel=needs_channel,
        lse_helpers=ops.REDUCTIONS["logsumexp"].helpers if row.statistic == "lse" else "",
        across_batch=span.across_batch,
        stats_output=i in spec.running_stat_stages(),
    )
    if not trailing:  # a softmax over leading or middle dims: groups strided by INNER
        outer = math.prod(sizes[:span.first - 1])
        elems = math.prod(sizes[span.first - 1:span.last])
        inner = math.prod(sizes[span.last:])
        # the widest vector whose groups still fit in registers; groups too large for that are read twice
        fitting = [v for v in (4, 2, 1) if inner % v == 0 and elems * v <= STRIDED_REGISTERS]
        registers = bool(fitting)
        vec = fitting[0] if fitting else _vec(inner)
        team_pos = _team_positions(outer * inner, elems) if STRIDED_TEAMS and (
            not registers or outer * inner // vec < STRIDED_TEAM_FEW_SLOTS) else 0
        if team_pos:
            kernel = TailKernel(name=f"{kernel_prefix}_{'softmax' if row.statistic == 'lse' else 'norm'}", role="strided",
                                threads=THREADS, grid_x=-(-outer * inner // team_pos), once=False,
                                args=["in", *tensors, "out"], bytes_per_sample=8 * per_sample)
            return StridedTail(**base, outer=outer, elems=elems, inner=inner, vec=1, registers=True,
                               groups_t=outer * inner, threads=THREADS, re_read_unroll=RE_READ_UNROLL,
                               team_pos=team_pos, lane_items=-(-elems // (THREADS // team_pos)), kernels=(kernel,))
        threads_per_sample = outer * inner // vec
        kernel = TailKernel(name=f"{kernel_prefix}_{'softmax' if row.statistic == 'lse' else 'norm'}", role="strided", threads=THREADS,
                            grid_x=-(-threads_per_sample // THREADS), once=False, args=["in", *tensors, "out"],
                            bytes_per_sample=4 * per_sample * (1 if registers else 2) + 4 * per_sample)
        return StridedTail(**base, outer=outer, elems=elems, inner=inner, vec=vec, registers=registers,
                           groups_t=threads_per_sample, threads=THREADS, re_read_unroll=RE_READ_UNROLL, kernels=(kernel,))
    groups = math.prod(sizes[:span.first - 1]) * span.split
    group_len = per_sample // groups
    vec = _vec(group_len)
    items = FLOATS_PER_THREAD // vec
    if not span.across_batch and group_len <= ONE_PASS_MAX:
        team = _pow2_at_least(-(-group_len // FLOATS_PER_THREAD))
        threads = max(team, THREADS)
        teams = threads // team
        items = -(-group_len // (team * vec))
        kernel = TailKernel(name=f"{kernel_prefix}_norm", role="one_pass", threads=threads, grid_x=-(-groups // teams),
                            once=False, args=["in", *tensors, "out"], bytes_per_sample=8 * per_sample)
        return OnePassTail(**base, groups=groups, group_len=group_len, vec=vec, team=team, threads=threads, teams=teams,
                           items_=items, lane_span=min(team, 32), team_warps=max(1, team // 32), kernels=(kernel,))
    chunks = -(-group_len // CHUNK)
    partials = 2 * groups * chunks  # per sample: [means or maxima][M2s or sums], group-major
    stat_per_sample = 0 if span.across_batch else 2 * groups
    fin_threads = THREADS if span.across_batch else min(THREADS, max(32, _pow2_at_least(chunks)))
    kernels = (
        TailKernel(name=f"{kernel_prefix}_stats", role="stats", threads=THREADS, grid_x=groups * chunks, once=False,
                   args=["in", "partials"], bytes_per_sample=4 * per_sample + 4 * partials),
        TailKernel(name=f"{kernel_prefix}_finalize", role="finalize", threads=fin_threads, grid_x=groups,
                   once=span.across_batch, args=["partials", "stat"],
                   bytes_per_sample=4 * partials + 4 * stat_per_sample),
        TailKernel(name=f"{kernel_prefix}_apply", role="apply", threads=THREADS, grid_x=groups * chunks, once=False,
                   args=["in", "stat", *tensors, "out"], bytes_per_sample=8 * per_sample + 4 * stat_per_sample),
    )
    return SplitTail(**base, groups=groups, group_len=group_len, vec=vec, threads=THREADS, items_=items, chunk=CHUNK,
                     chunks=chunks, partials=partials, stat_per_sample=stat_per_sample, stat_floats=2 * groups,
                     fin_threads=fin_threads, fin_iters=-(-chunks // fin_threads), kernels=kernels)


# A plain conv splits before a windowed pool where the planner would put the conv alone on tensor
# cores (plan.MMA_MIN_K and MMA_MIN_CHANNELS): K (input channels x taps) of at least this and at
# least that many output channels. Measured whole (FFMA) against split (benchmarks/pool_split.py,
# NOTES v24): 8 -> 64 channels 3x3 (K 72) before a 4x4 max pool 10.8 -> 2.7 ms, before a 2x2 one
# 1.28 -> 0.67 ms, 3 -> 64 3x3x3 (81) 1.31 -> 0.85 ms; but 3 -> 16 3x3x3 (16 output channels)
# 0.32 -> 0.54 ms: there T0 is as large as the conv's work, and FFMA ran at about half its floor.
POOL_SPLIT_MIN_K = 64
# Fewer output channels split too where K is this deep: the FFMA engine parallelizes over the
# outputs alone, so a few channels before a pool leave a sample a block of 32 to 256 threads with
# hundreds of thousands of multiply-adds each (384 -> 16 channels of a 7x7 conv before a 2x2 max
# pool: one block of 32 threads, 2.4 million each), while T0's extra write and read is the same
# per output at any K. Chosen from that arithmetic, above the 81 of the measured 3 -> 16 loss; not
# timed.
POOL_SPLIT_FEW_CHANNELS_MIN_K = 512


def pool_split(spec: LayerSpec, target, rewrites: bool = True) -> int | None:
    """Where a layer without statistic stages is better split in two (the index of its first
    windowed pool), or None. A pool between the conv and the output keeps the whole layer off the
    tensor cores (the FFMA engine pulls each window's values through the conv); when the conv alone
    would run on Hopper's TMA engine and on tensor cores by the planner's own bar (POOL_SPLIT_MIN_K),
    the conv and the pointwise ops before the pool run there and write T0, and the pool and what
    follows run as a further kernel over an identity conv that reads it (one more write and read
    of T0); with fewer than 32 output channels only from a K of POOL_SPLIT_FEW_CHANNELS_MIN_K. A
    strided transposed conv of 16 input channels or more splits the same way before any
    pool or reduction: its stride phases run on a GEMM engine, where the FFMA gather that a
    fused pool or reduction would keep it on ran 2-14x slower (benchmarks/NOTES.md, v19); a deep
    plain conv of 32+ input channels before a reduction, where the whole layer would run on FFMA. Left
    to the planner only: a tile that names an engine keeps the layer whole."""
    from specgen import igemm, tma
    from specgen.plan import MMA_MIN_CHANNELS, avg_pool_fold_geometry

    if spec.tile is not None or is_sequence(spec):
        return None
    first = next((i for i, st in enumerate(spec.epilogue) if st.kind != "pointwise"), None)
    if first is None:
        return None
    if spec.conv.transposed:
        if spec.input.channels < igemm.TRANSPOSED_MIN_CHANNELS or not (spec.rewrites and rewrites) or spec.inputs():
            return None
        if (at := _channel_reduction_split(spec, first, target)) is not None:
            return at or None
        return first if split_engine(spec, first, target) in ("tma", "igemm") else None
    windowed = spec.epilogue[first].kind == "pool" and ops.POOLS[spec.epilogue[first].op].windowed
    if not windowed and spec.input.channels < 32:  # a reduction (or global pool) after a conv of few channels
        return None
    if first == 0 and spec.epilogue[0].op == "avg_pool" and spec.rewrites and rewrites \
            and avg_pool_fold_geometry(spec, 0):
        return None  # an avg-pool right after the conv folds into it instead
    conv = spec.conv
    k = spec.input.channels * math.prod(spec.conv_geometry()["kernel"])
    # (before a reduction the bar stays twice as high: only windowed pools were measured at 64-127)
    few_channels = conv.out_channels < MMA_MIN_CHANNELS
    if conv.groups > 1 or conv.transposed or (few_channels and not windowed) \
            or k < (POOL_SPLIT_FEW_CHANNELS_MIN_K if few_channels else POOL_SPLIT_MIN_K if windowed else 2 * POOL_SPLIT_MIN_K):
        return None
    body = _cut(spec, first)
    if tma.why_not(body, [None], [], target):
        return None
    if not tma.worth_it(body) and not (few_channels and windowed):
        # (few channels over a deep K split anyway: the body then runs where the planner puts the
        # conv alone, the implicit GEMM where the TMA engine's layout pass does not pay; whole, the
        # FFMA engine gives each thread hundreds of thousands of multiply-adds)
        return None
    if not windowed:
        # A reduction after a plain conv of 32 input channels or more: split only where the whole
        # layer would run on FFMA (the slab engine fuses reductions on tensor cores when the block's
        # weights fit); T0's extra write and read cost far less than the FFMA conv (KernelBench 42, 77: v19).
        from specgen.plan import Settings, plan_whole

        if plan_whole(spec, None, target, settings=Settings(rewrites=rewrites))["engine"] != "ffma":
            return None
    return first


def _channel_reduction_split(spec: LayerSpec, first: int, target) -> int | None:
    """For a strided transposed conv whose first stage past the pointwise ones, `first`, reduces
    over the channels alone, which the TMA engine's epilogue takes on its accumulators
    (`tma.channel_reduction`): 0 where nothing but pointwise ops follows it (the whole layer is one
    kernel: no split), else, where it keeps the dim, the index of the pool or reduction after it (the
    split goes there, and T0 holds one channel instead of all of them); None otherwise."""
    from specgen import tma

    stage = spec.epilogue[first]
    if stage.kind != "reduce" or tuple(spec.reduce_dims(first)) != (1,) or spec.conv.out_channels > tma.MAX_REDUCED_CHANNELS:
        return None
    after = next((i for i in range(first + 1, len(spec.epilogue)) if spec.epilogue[i].kind != "pointwise"), None)
    if after is None:
        return 0 if split_engine(spec, len(spec.epilogue), target) == "tma" else None
    if getattr(stage.args, "keepdim", False) and split_engine(spec, after, target) == "tma":
        return after
    return None


def split_engine(spec: LayerSpec, at: int, target) -> str | None:
    """The engine a split layer's body (the conv and stages [0, at)) runs on: the TMA engine for a
    plain conv (None, the planner's choice, where that is the slab engine: at most 4 input
    channels in tf32 or fp32); for a transposed one its stride phases on the TMA engine where it runs them and they
    pay for its layout pass (`tma.worth_it`), else on the implicit GEMM; None where it cannot."""
    from specgen import igemm, tma
    from specgen.plan import SLAB_TF32_MAX_CHANNELS, slab_in_tf32

    body = _cut(spec, at)
    if body.conv.transposed:
        if not tma.why_not(body, [None], [], target) and tma.worth_it(body):
            return "tma"
        return None if igemm.why_not(body, [None], []) else "igemm"
    if slab_in_tf32(body):
        return None  # the planner's: the slab engine in TF32 (`plan.slab_in_tf32`)
    if body.precision == "fp32" and body.input.channels // body.conv.groups <= SLAB_TF32_MAX_CHANNELS:
        # The planner's too: an fp32 conv of at most 4 input channels on the slab engine (3xTF32),
        # which forms the taps from each staged input, where the TMA engine would pad the channels
        # to its 8-wide K chunk and load every tap (measured on the ResNet stem: 3 channels, 49
        # taps, NOTES v34-3; 5 to 15 channels, which the TMA engine pads less, keep it, untimed).
        return None
    return None if tma.why_not(body, [None], [], target) else "tma"


def _cut(spec: LayerSpec, end: int, engine: str | None = None) -> LayerSpec:
    """The conv and stages [0, end) as a layer of its own (on `engine` when given)."""
    data = spec.model_dump(mode="json")
    data["epilogue"] = [_stage_data(spec, i) for i in range(end)]
    if engine is not None:
        data["tile"] = {"engine": engine}
    return LayerSpec.model_validate(data)


def channel_norm_end(spec: LayerSpec) -> int | None:
    """Where the part of a layer that Hopper's TMA engine runs as one kernel ends when the layer's
    first statistic stage is a softmax over the channels alone after nothing but pointwise ops
    (`tma.channel_norm`): after the softmax, the pointwise ops after it and a reduction over the
    channels that ends the layer (with its pointwise ops); or a statistic stage over trailing
    spatial dims (`tma.row_norm`): after it and the pointwise ops after it. None when there is no
    such stage or a further statistic stage follows (the whole layer then runs as a sequence)."""
    from specgen import tma

    at, rows = tma.channel_norm(spec), False
    if at is None:  # a statistic stage over positions (`tma.row_norm`): the same, less the reduction
        at, rows = tma.row_norm(spec), True
        if at is not None and not tma.row_norm_fits(spec):
            return None  # (groups no tile holds whole, or an extra input: the tail engine's)
    if at is None:
        return None
    n = len(spec.epilogue)
    end = at + 1
    while end < n and spec.epilogue[end].kind == "pointwise":
        end += 1
    if not rows and end < n and spec.epilogue[end].kind == "reduce" and tuple(spec.reduce_dims(end)) == (1,):
        last = end + 1
        while last < n and spec.epilogue[last].kind == "pointwise":
            last += 1
        if last == n:
            return n
    if any(st.kind == "norm" for st in spec.epilogue[end:]):
        return None
    return end


def plan_channel_norm(spec: LayerSpec, target=None, tma_config=None, settings=None) -> KernelPlan | SequencePlan | None:
    """The plan of a layer whose softmax over the channels the TMA engine's epilogue takes
    (`channel_norm_end`): one kernel, or that kernel writing T0 and the stages after it over an
    identity conv (`plan_split`, the body left to the planner, which must take the TMA engine);
    None where it does not (the planner's bar, the target, a tile that names another engine): the
    layer then runs as a sequence."""
    from specgen import tma
    from specgen.plan import DEFAULT_SETTINGS, NotOneKernel, plan_whole

    end = channel_norm_end(spec)
    if end is None:
        return None
    if end == len(spec.epilogue):
        try:
            return plan_whole(spec, None, target, tma_config, settings or DEFAULT_SETTINGS)
        except NotOneKernel:
            return None
    norm, first = tma.channel_norm(spec), spec.epilogue[end]
    if norm is None:
        norm = tma.row_norm(spec)
        taken = f"over {_group_text(spec, norm)} is taken in the TMA engine's epilogue (a tile holds whole groups)"
    else:
        taken = "over the channels is taken in the TMA engine's epilogue (a block holds every channel)"
    why = (f"epilogue[{norm}] {spec.epilogue[norm].op} {taken}; epilogue[{end}] {first.op} and what follows read its output T0 "
           f"in a further kernel over an identity conv (1x1 depthwise, weights 1: exact)")
    try:
        plan = plan_split(spec, end, None, lambda body_plan: why, target, settings, tma_config)
    except NotOneKernel:
        return None
    # The body is left to the planner: where it does not take the TMA engine (fp32 with few input
    # channels, say) the body would be a sequence of its own, its softmax a tail kernel, and the
    # reason above untrue; the whole layer runs as one flat sequence instead.
    return plan if plan.parts[0].plan["engine"] == "tma" else None


def plan_pool_split(spec: LayerSpec, at: int, target=None, settings=None) -> SequencePlan:
    """The plan of a layer split before its first windowed pool (`pool_split`): the body (the conv
    and the pointwise ops before it, on `split_engine`'s engine) into T0, then the rest."""
    from specgen import tma

    first = spec.epilogue[at]
    what = "a pool between the conv and the output" if first.kind == "pool" and ops.POOLS[first.op].windowed else "a fused reduction"

    def why(body_plan) -> str:
        ran = ("the conv and the stages before it run on the {} engine and write T0"
               if any(st.kind != "pointwise" for st in spec.epilogue[:at]) else "the conv runs on the {} engine and writes T0")
        return (f"epilogue[{at}] {first.op} would keep the whole layer on FFMA ({what}): {ran.format(body_plan.engine)}, "
                f"the pool and what follows read it in a further kernel over an identity conv (1x1 depthwise, weights 1: exact)")

    engine = split_engine(spec, at, target)
    if engine == "tma" and not spec.conv.transposed and not tma.worth_it(_cut(spec, at)):
        engine = None  # the conv alone where the planner puts it (few channels over a deep K: `pool_split`)
    plan = plan_split(spec, at, engine, why, target, settings)
    if engine is None and plan.parts[0].plan.engine == "ffma":
        # Left to the planner (few input channels: the slab engine), a body whose staged weights do
        # not fit falls to the FFMA engine, which is what the split avoids: the TMA engine then.
        plan = plan_split(spec, at, "tma", why, target, settings)
    return plan


def _rest_settings(settings):
    """The planner settings of a sequence's later kernels: the layer's, less the slab engine's tile
    (`Settings.slab`, a tuner's candidate for the body's conv, not for an identity conv)."""
    return replace(settings, slab=None) if settings is not None else None


def plan_split(spec: LayerSpec, at: int, body_engine: str | None, why, target=None, settings=None,
               tma_config=None) -> SequencePlan:
    """A layer as two kernels: the body (the conv and stages [0, at), on `body_engine`, or the
    planner's choice when None) writes T0; the rest reads it over an identity conv. `why(body_plan)`
    says why the layer is split."""
    from specgen.kernelplan import with_changes
    from specgen.plan import DEFAULT_SETTINGS, build_plan

    prefix = f"specgen_{spec.name}"
    body = _cut(spec, at, body_engine)
    settings = settings or DEFAULT_SETTINGS
    body_plan = with_changes(build_plan(body, None, target, tma_config, settings=settings), kernel_name=f"{prefix}_body")
    seg = Segment(at - 1, (), tuple(range(at, len(spec.epilogue))))
    rest, rest_out = rest_spec(spec, seg)
    if spec.precision in ("bf16", "fp16"):  # T0 is in the layer's dtype: the rest widens it (exactly) and rounds once
        rest = rest.model_copy(update={"precision": spec.precision})
    rest_plan = with_changes(build_plan(rest, None, target, settings=_rest_settings(settings)), kernel_name=f"{prefix}_rest")
    parts = (SequencePart(role="body", namespace="body", spec=body, plan=body_plan),
             SequencePart(role="rest", namespace="rest", spec=rest, plan=rest_plan, segment=seg))
    t0 = list(body.shapes()[-1].sizes)
    steps = (LayerStep(part=0, in_="x", out="t0", out_shape=t0),
             LayerStep(part=1, in_="t0", out="out", out_shape=list(rest_out), ones=rest.input.channels))
    return sequence_plan(spec, parts, steps, {"t0": math.prod(t0)}, 0, [why(body_plan)])


def plan_sequence(spec: LayerSpec, igemm_config=None, target=None, tma_config=None, settings=None) -> SequencePlan:
    """The plan of a layer with statistic stages: its parts in order and the steps that launch them.
    The planner settings (`igemm_config`, `tma_config`) are the body's; `settings` (`plan.Settings`)
    every part's."""
    from specgen.kernelplan import with_changes
    from specgen.plan import DEFAULT_SETTINGS, PlanError, build_plan

    if spec.precision not in ("fp32", "tf32"):
        raise PlanError([f"precision: the tail engine's kernels compute in float32; a layer with statistic stages "
                         f"takes precision fp32 or tf32, got {spec.precision}"])
    _, segments = split(spec)
    prefix = f"specgen_{spec.name}"
    body = body_spec(spec)
    settings = settings or DEFAULT_SETTINGS
    body_plan = with_changes(build_plan(body, igemm_config, target, tma_config, settings), kernel_name=f"{prefix}_body")
    parts = [SequencePart(role="body", namespace="body", spec=body, plan=body_plan)]
    steps: list = [LayerStep(part=0, in_="x", out="t0", out_shape=list(body.shapes()[-1].sizes))]
    buffers = {"t0": math.prod(body.shapes()[-1].sizes)}
    why = []
    current = "t0"
    stats_offset = 0
    for k, seg in enumerate(segments):
        tp = tail_plan(spec, seg, f"{prefix}_e{seg.index}")
        last = k + 1 == len(segments)
        u = "out" if last and not seg.rest else f"u{seg.index}"
        if u != "out":
            buffers[u] = tp.per_sample
        names = {"in": current, "out": u}
        # a saved value is this statistic stage's input (LayerSpec._check_saved): read back from it
        saved = list(dict.fromkeys(n for j in seg.apply for n in ops.POINTWISE[spec.epilogue[j].op].saved(spec.epilogue[j].args)))
        names.update({f"i_{n}": current for n in saved})
        if isinstance(tp, SplitTail):
            names["partials"] = f"partials{seg.index}"
            buffers[names["partials"]] = tp.partials
            names["stat"] = f"stat{seg.index}"
            if tp.stats_output:  # a batch norm's statistics are part of the layer's output: the running update reads them
                buffers[names["stat"]] = ("stats", stats_offset)
                stats_offset += tp.stat_floats
            elif tp.across_batch:
                buffers[names["stat"]] = ("once", tp.stat_floats)
            else:
                buffers[names["stat"]] = tp.stat_per_sample
        for kernel in tp.kernels:
            steps.append(KernelStep(part=len(parts), name=kernel.name, threads=kernel.threads, grid_x=kernel.grid_x,
                                    once=kernel.once, args=[names.get(a, a) for a in kernel.args]))
        parts.append(SequencePart(role="tail", namespace=f"e{seg.index}", plan=tp, segment=seg))
        why.append(f"epilogue[{seg.index}] {tp.op} normalizes each value with a statistic of its group "
                   f"({_group_text(spec, seg.index)}), which no block of the kernel before it computes whole: "
                   f"the layer is split there")
        if saved:
            why.append(f"the saved value{'s' if len(saved) > 1 else ''} {', '.join(saved)} (epilogue[{seg.index}]'s input) "
                       f"{'are' if len(saved) > 1 else 'is'} read back from {current} by its tail kernel")
        current = u
        if seg.rest:
            rest, rest_out = rest_spec(spec, seg)
            rest_plan = with_changes(build_plan(rest, None, target, settings=_rest_settings(settings)),
                                     kernel_name=f"{prefix}_e{seg.index}_rest")
            out = "out" if last else f"t{seg.rest[-1] + 1}"
            if out != "out":
                buffers[out] = math.prod(rest_out)
            steps.append(LayerStep(part=len(parts), in_=current, out=out, out_shape=list(rest_out), ones=rest.input.channels))
            first = spec.epilogue[seg.rest[0]]
            parts.append(SequencePart(role="rest", namespace=f"e{seg.index}_rest", spec=rest, plan=rest_plan, segment=seg))
            why.append(f"epilogue[{seg.rest[0]}] {first.op} after a statistic stage runs in a further kernel of the body engine "
                       f"over an identity conv (1x1 depthwise, weights 1: exact) that reads the tail kernel's output")
            current = out
    return sequence_plan(spec, tuple(parts), tuple(steps), buffers, stats_offset, why)


def sequence_plan(spec: LayerSpec, parts: tuple, steps: tuple, buffers: dict, stats_floats: int, why: list,
                  **values) -> SequencePlan:
    """The plan of `spec` run as `parts` launched by `steps`. What the pipeline, the CLI and bench
    read of any plan comes from its body's and rests' plans (a sequence has one body); `values`
    gives others (a fold's: specgen.tapsum.plan_fold)."""
    from specgen.plan import spec_yaml

    body_plan = next(p.plan for p in parts if p.role == "body")
    layer_plans = [p.plan for p in parts if p.role in ("body", "rest")]  # (the tails' and tap sums' need no more)
    out_shape = list(spec.shapes()[-1].sizes)
    return SequencePlan(**{
        "version": __version__,
        "name": spec.name,
        "kernel_name": body_plan.kernel_name,
        "spec_hash": spec.shape_hash,
        "spec_yaml": spec_yaml(spec),
        "target": body_plan.target,
        "parts": parts,
        "steps": steps,
        "buffers": buffers,
        "stats_floats": stats_floats,
        "why": why,
        "smem_bytes": max(p.smem_bytes for p in layer_plans),  # (the tails' and tap sums' shared memory is static)
        "cluster": max(p.cluster for p in layer_plans),
        "cluster_at_launch": any(p.cluster_at_launch for p in layer_plans),
        "min_blocks": body_plan.min_blocks,
        "igemm": body_plan.igemm,
        "tma": body_plan.tma,
        "mma": body_plan.mma,
        "rewrites": [rw for p in layer_plans for rw in p.rewrites],
        "flops_per_sample": sum(p.flops_per_sample for p in layer_plans),
        "in_per_sample": body_plan.in_per_sample,
        "out_per_sample": math.prod(out_shape) if out_shape else 1,
        "out_shape": out_shape,
        "params": [{"name": n, "shape": list(s), "channels": s[0] if s else 1} for n, s in spec.params().items()],
        "precision": spec.precision,
        **values,
    })


def prefixed_sequence(spec: LayerSpec, inner, part: SequencePart, step: KernelStep, s_size: int, why: list, rewrite: str,
                      adds_per_sample: int, weight_transform: dict) -> SequencePlan:
    """The plan of a fold: `part`'s kernel (`step`) reads x and writes buffer "s" (`s_size` values per
    sample), then `inner`, the plan of the layer `part.folded_spec` that reads s in x's place (its
    steps one part later where it is a sequence itself). The launch hands the inner layer the
    user's weights through `weight_transform` (specgen.torchop.transformed_weight)."""
    if isinstance(inner, SequencePlan):  # the inner layer's epilogue has statistic stages or a split of its own
        parts = (part, *inner.parts)
        steps = [step]
        for st in inner.steps:  # the inner sequence's steps, one part later, reading s where they read x
            if isinstance(st, LayerStep):
                st = replace(st, part=st.part + 1, in_="s" if st.in_ == "x" else st.in_)
            else:
                st = replace(st, part=st.part + 1, args=["s" if a == "x" else a for a in st.args])
            steps.append(st)
        buffers = {"s": s_size, **inner.buffers}
        why = [*why, *inner.why]
        stats_floats = inner.stats_floats
    else:
        folded = part.folded_spec
        parts = (part, SequencePart(role="body", namespace="body", spec=folded, plan=inner))
        steps = [step, LayerStep(part=1, in_="s", out="out", out_shape=list(folded.shapes()[-1].sizes))]
        buffers = {"s": s_size}
        stats_floats = 0
    return sequence_plan(
        spec, parts, tuple(steps), buffers, stats_floats, why,
        kernel_name=step.name,
        rewrites=[rewrite, *inner.rewrites],
        flops_per_sample=inner.flops_per_sample + adds_per_sample,
        in_per_sample=spec.input.channels * math.prod(spec.input.size),
        weight_transforms=[weight_transform],
    )


def _layer_bytes(plan) -> int:
    """Bytes per sample a body-engine kernel moves: its input and its output (weights once per launch)."""
    return 4 * (plan.in_per_sample + plan.out_per_sample)


def describe(plan: SequencePlan) -> str:
    """`specgen show --plan` of a sequence: every kernel in order, the bytes it moves per sample, why
    the layer is split."""
    from specgen.plan import describe as describe_plan

    if plan.channels_last_io:
        lines = [f"layer {plan.name}: one kernel on channels-last tensors (specgen/dwcl.py)"]
    else:
        lines = [f"layer {plan.name}: a sequence of {len(plan.steps)} kernels (the tail engine: specgen/tail.py)"]
    lines += [f"  why: {w}" for w in plan.why]
    total = 0
    for n, step in enumerate(plan.steps, 1):
        part = plan.parts[step.part]
        if isinstance(step, LayerStep):
            p = part.plan
            moved = _layer_bytes(p)
            what = "body (the conv and the stages before the split)" if part.role == "body" else \
                "rest (from the pool or reduction after the split on)"
            lines.append(f"  {n}. {p.kernel_name}: {what}; reads {step.in_}, writes {step.out} "
                         f"{step.out_shape or '(one value per sample)'}; {moved} bytes per sample")
            lines += [f"       {line}" for line in describe_plan(p).splitlines()]
        elif part.role in ("tapsum", "boxmean"):
            from specgen import boxfold, tapsum

            describe_fold = tapsum.describe if part.role == "tapsum" else boxfold.describe
            moved = part.plan.bytes_per_sample
            lines.append(f"  {n}. {step.name}: {describe_fold(part.plan)}; reads {step.args[0]}, "
                         f"writes {step.args[-1]}; {moved} bytes per sample")
        else:
            tp = part.plan
            kernel = next(k for k in tp.kernels if k.name == step.name)
            moved = kernel.bytes_per_sample
            grid = f"{kernel.grid_x} block(s)" + ("" if kernel.once else " per sample")
            lines.append(f"  {n}. {kernel.name}: {_role_text(tp, kernel.role)}; {kernel.threads} threads/block, {grid}; "
                         f"reads {', '.join(a for a in step.args[:-1])}, writes {step.args[-1]}; {moved} bytes per sample")
        total += moved
    lines.append(f"  in all about {total} bytes per sample (the fewest: {4 * (plan.in_per_sample + plan.out_per_sample)})")
    return "\n".join(lines)


def _role_text(tp: TailPlan, role: str) -> str:
    what = f"{tp.op_comment} over groups of {tp.group_text}"
    if role == "one_pass":
        return f"{what}: a team of {tp.team} thread(s) per group holds it in registers (statistic and normalization in one kernel)"
    if role == "stats":
        return f"{what}: partial statistics of chunks of {tp.chunk} floats ({tp.chunks} per group)"
    if role == "finalize":
        per = f"{tp.chunks} per sample" if tp.across_batch else f"{tp.chunks}"
        return f"{what}: joins each group's partials ({per}) in a fixed tree"
    if role == "apply":
        return f"{what}: normalizes chunk by chunk{' and applies ' + ', '.join(st['op'] for st in tp.pointwise) if tp.pointwise else ''}"
    if role == "dwcl":
        from specgen import dwcl

        return dwcl.describe(tp)
    if getattr(tp, "team_pos", 0):
        return (f"{what}: a block per {tp.team_pos} group(s), {THREADS // tp.team_pos} threads a group, "
                f"{tp.lane_items} value(s) a thread in registers")
    return f"{what}: one thread per {tp.vec} group(s), {'in registers' if tp.registers else 'read twice'}"


_INCLUDE = re.compile(r"^#include .*$\n?", re.MULTILINE)


def join(plan: SequencePlan, sources: list[str]) -> str:
    """The sequence's translation unit: a banner, every part's includes once, then each part's
    source in its own namespace (their constants share names; the kernels are extern "C")."""
    includes = list(dict.fromkeys(m.group(0).strip() for src in sources for m in _INCLUDE.finditer(src)))
    lines = [
        "// " + "=" * 101,
        f"// Generated by specgen {plan.version} -- do not edit; change the spec and rebuild.",
        f"// spec hash: {plan.spec_hash} (the first 16 hex digits of the canonical spec's sha256). The cache key",
        "//   (`specgen build` and `specgen cache ls` print its first 16) also covers this source, nvcc, arch and flags.",
        f"// target: {plan.target}",
        "// spec:",
        *[f"//   {line}" for line in plan.spec_yaml.splitlines()],
        "//",
        (f"// This layer runs as a sequence of {len(plan.steps)} kernels, launched in this order on one stream:"
         if len(plan.steps) > 1 else "// This layer runs as one kernel:"),
    ]
    for n, step in enumerate(plan.steps, 1):
        if isinstance(step, KernelStep):
            name, args = step.name, step.args
        else:
            name, args = plan.parts[step.part].plan.kernel_name, [step.in_, step.out]
        lines.append(f"//   {n}. {name} ({', '.join(args[:-1])} -> {args[-1]})")
    lines += [f"// Why: {w}." for w in plan.why]
    lines += ["// Each part below is the source of its kernels, in a namespace of its own.", "// " + "=" * 101, *includes, ""]
    for part, source in zip(plan.parts, sources):
        body = _INCLUDE.sub("", source).strip("\n")
        lines += [f"namespace {part.namespace} {{", "", body, "", f"}}  // namespace {part.namespace}", ""]
    return "\n".join(lines)
