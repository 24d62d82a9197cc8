"""The plan: plain values derived from a spec, the only thing templates see.

How a generated kernel works (the names below are the plan's and the .cu's):

* Every extent is normalized to 3 spatial dims (D, H, W); a 2D conv has D = 1, a 1D conv D = H = 1.
* The epilogue splits into a **body** and a **tail**. The body is the conv followed by pointwise
  ops and pools; it produces the tensor T1 (channels x D x H x W per sample). The tail is every
  stage from the first reduction on: reductions with pointwise ops between them.
* Body levels: level 0 is the conv plus the pointwise ops that follow it; level k > 0 is the k-th
  pool plus the pointwise ops after it. A T1 value is computed by pulling through the levels: a
  pool window asks the level below for each of its elements, level 0 runs the conv.
* A block owns a tile of the **kept** axes F (the axes no reduction touches). It computes T1 in
  boxes: F axes cover the block's tile, the axes of the first reduction R1 are walked chunk by
  chunk, the axes of later reductions R2.. are walked one coordinate at a time (outer loops).
  Each thread computes a register tile of CT channels x PT consecutive W positions of a box.
* Without a tail the box is written straight to the output. With a tail it goes to shared memory
  and "owner" threads fold it, in a fixed order, into accumulators for their F elements; several
  lanes share an F element when F is small, and combine through a fixed-shape tree. No atomics:
  the result is the same on every run.
* Every loop has a trip count known at compile time; the batch only sizes the grid.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Optional

import yaml

from specgen import __version__, igemm as igemm_engine, ops, target as targets, tma as tma_engine
from specgen.kernelplan import KernelPlan, SlabTiling, with_changes
from specgen.literals import FLOAT32_MAX, c_float
from specgen.spec import LayerSpec, SpecError
from specgen.target import BLOCK_RESERVED_SMEM, Target, TargetError

AXES = ("c", "d", "h", "w")
AXIS_NAMES = {"c": "channels", "d": "depth", "h": "height", "w": "width"}
INT32_MAX = (1 << 31) - 1
# Shared memory per block and per SM, registers and cluster sizes are the target's (specgen/target.py).


# The engines whose epilogue reads an extra input (`add: {input: ...}`) at each output element.
INPUT_ENGINES = ("tma", "igemm")
# Left to the planner, an fp32 layer of fewer input channels stays off the GEMM engines (TMA,
# implicit GEMM): their K chunks would pad the channels, and 3xTF32 triples what the padding wastes.
FP32_GEMM_MIN_CHANNELS = 16
# The FFMA engine reads and writes a 16-bit layer's tensors in their own type (its arithmetic is
# fp32 either way): a memory-bound depthwise conv then moves half the bytes, and no widening pass
# or rounding copy runs around it. The slab and implicit-GEMM engines stage fp32 operands and run
# on widened tensors.
BOX_IO_CTYPE = {"bf16": "__nv_bfloat16", "fp16": "__half"}


class PlanError(SpecError):
    """A spec that validates but cannot be planned (e.g. a tile that does not fit)."""


class NotOneKernel(PlanError):
    """A layer that runs as one kernel only on an engine the planner did not take (a softmax over
    the channels off the TMA engine): `build_plan` plans it as a sequence instead."""


@dataclass(frozen=True)
class Constant:
    name: str
    value: str  # a C literal
    comment: str
    ctype: str = "int"


def _round_up(a: int, b: int) -> int:
    return -(-a // b) * b


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _balanced(extent: int, limit: int, multiple: int = 1) -> int:
    """A chunk size <= limit (rounded to `multiple`) that splits `extent` into near-equal chunks."""
    limit = max(multiple, min(limit, _round_up(extent, multiple)))
    chunks = _ceil_div(extent, limit)
    return min(limit, _round_up(_ceil_div(extent, chunks), multiple))


def _spatial3(values: tuple[int, ...], fill: int) -> tuple[int, int, int]:
    return (fill,) * (3 - len(values)) + tuple(values)


def spec_yaml(spec: LayerSpec) -> str:
    """The spec as the user would write it (canonical values), for the banner and `show`."""
    data = spec.display()  # canonical, without the fields left unset
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=None, width=100).rstrip()


def input_entries(spec: LayerSpec, names) -> list[dict]:
    """The kernel parameters of extra inputs (and saved values the tail binds alike): name, values
    per sample, and what the generated code says of its shape."""
    out = tuple(spec.shapes()[-1].sizes)
    declared = spec.inputs()
    entries = []
    for name in names:
        shape = declared.get(name, out)
        what = "of the output's shape" if shape == out else f"one value per sample and channel [batch, {', '.join(map(str, shape))}]"
        entries.append({"name": name, "per_sample": math.prod(shape), "what": what})
    return entries


def _pointwise_code(spec: LayerSpec, index: int, constants: list[Constant], channel: str,
                    sample: Optional[str] = "sample") -> dict:
    """One pointwise stage: named constants, and the C statement `v = <expr>;`. `channel` and
    `sample` name the element's channel and sample where the code runs (sample None: none is in
    scope; an input of one value per sample and channel divides e_out by the sample's size)."""
    stage = spec.epilogue[index]
    row = ops.POINTWISE[stage.op]
    names: dict[str, str] = {}
    for field, value in row.constants(stage.args).items():
        cname = f"S{index}_{field.upper()}"
        names[field] = cname
        constants.append(Constant(cname, c_float(value), f"epilogue[{index}] {stage.op} {field} = {value!r}", "float"))
    preloaded = dict(names)  # the same stage where the channel's parameters are read into pc_<name> beforehand
    for param in row.params(stage.args):
        names[param] = f"__ldg(p_{param} + {channel})"
        preloaded[param] = f"pc_{param}"
    # An extra input, read at the element's offset in the output (the engine's e_out); a saved
    # value likewise, from the tensor that holds it (the sequence binds i_<name> to it).
    inputs = list(row.inputs(stage.args)) + list(row.saved(stage.args))
    for name in inputs:
        names[name] = preloaded[name] = f"input_value(i_{name}, e_out)"
    # An input of one value per sample and channel (`shape: [C, 1, ...]`), read at the element's
    # sample and channel (where no sample variable is in scope, e_out's: a sample lies whole in
    # either memory format).
    channel_inputs = []
    if row.inputs(stage.args):
        out, declared = tuple(spec.shapes()[-1].sizes), spec.inputs()
        channel_inputs = [n for n in row.inputs(stage.args) if declared[n] != out]
    for name in channel_inputs:
        at = sample or f"e_out / {math.prod(out)}"
        if out and out[0] > 1:
            at = f"{at} * {out[0]} + {channel}"
        names[name] = preloaded[name] = f"input_value(i_{name}, {at})"
    channel_values = []  # computed once per channel where the parameters are preloaded
    if row.channel_values is not None:
        for key, code in row.channel_values(stage.args, preloaded).items():
            channel_values.append({"name": f"pc{index}_{key}", "code": code,
                                   "comment": f"epilogue[{index}] {stage.op}: the channel's {key}"})
            preloaded[key] = f"pc{index}_{key}"
    detail = ", ".join(f"{k}={v!r}" for k, v in stage.args.model_dump().items() if v is not None)
    before = spec.epilogue[index - 1] if index > 0 else None
    bound = ops.gelu_polynomial_bound(stage, before)
    if bound is None:
        code, code_preloaded = row.cuda(stage.args, "v", names), row.cuda(stage.args, "v", preloaded)
    else:  # the stage before bounds x: the exact GELU as a polynomial over that range (ops.GELU_BOUNDED_R)
        coefficients = [f"S{index}_R{degree}" for degree in range(len(ops.GELU_BOUNDED_R))]
        for degree, (cname, value) in enumerate(zip(coefficients, ops.GELU_BOUNDED_R)):
            constants.append(Constant(cname, c_float(value),
                                      f"epilogue[{index}] gelu on |x| <= {bound!r} (bounded by epilogue[{index - 1}] "
                                      f"{before.op}): x/2 + x^2 R(x^2), R's x^{2 * degree} coefficient", "float"))
        code = code_preloaded = ops.gelu_bounded_code("v", coefficients)
        detail += f"{', ' if detail else ''}on |x| <= {bound!r}: a polynomial"
    return {
        "index": index,
        "op": stage.op,
        "comment": f"epilogue[{index}] {stage.op}" + (f" ({detail})" if detail else ""),
        "code": code,
        "code_preloaded": code_preloaded,
        "channel_values": channel_values,
        "params": list(row.params(stage.args)),
        "inputs": inputs,
        "channel_inputs": channel_inputs,  # (they read the channel variable)
    }


def norm_constants(spec: LayerSpec, index: int, consts: list) -> str:
    """Appends statistic stage `index`'s float constants to `consts` (S<index>_<NAME>); returns the
    name of its eps ("0.0f" for a stage without one, whose formulas do not read it)."""
    stage = spec.epilogue[index]
    eps = "0.0f"
    for name, value in ops.NORMS[stage.op].constants(stage.args).items():
        cname = f"S{index}_{name.upper()}"
        consts.append(Constant(cname, c_float(value), f"epilogue[{index}] {stage.op} {name} = {value!r}", "float"))
        eps = cname if name == "eps" else eps
    return eps


def _channel_norm_code(spec: LayerSpec, index: int, consts: list) -> dict:
    """A softmax, log-softmax or LayerNorm over the channels, as the TMA epilogue takes it: the row's
    statistics (max mx and sum of exp(x - mx); or mean mx and the squared deviations from it), then
    `prepare` (the second's factor nb) and `normalize` (each value) from the op table, the norm's
    per-channel weight and bias, and the pointwise stages after it (filled in by the caller);
    appends eps to `consts`."""
    from specgen.tail import _affine_code

    stage = spec.epilogue[index]
    row = ops.NORMS[stage.op]
    moments = row.statistic == "moments"
    eps = norm_constants(spec, index, consts)
    return {
        "index": index,
        "op": stage.op,
        "axis": "channels",
        "moments": moments,
        "comment": f"epilogue[{index}] {stage.op} over the channels",
        "prepare": row.prepare % {"a": "mx", "b": "sum * (1.0f / C_OUT)" if moments else "sum", "eps": eps},
        "prepare_comment": row.prepare_comment,
        "normalize": row.normalize % {"x": "v", "a": "mx", "b": "nb"},
        "affine": _affine_code(row, stage.args, "cj") if row.params(stage.args) else "",
        "pointwise": [],
    }


def _row_norm_code(spec: LayerSpec, index: int, consts: list) -> dict:
    """A statistic stage over trailing spatial dims, as the TMA epilogue takes it (`tma.row_norm`):
    each group's first statistic sa (the mean, or the max) and second (the variance about it, or
    the sum of exp(x - max)), `prepare` (sb from the second) and `normalize` (each value) from the
    op table, the norm's weight and bias at the value's place in its group (e_el), and the
    pointwise stages after it (filled in by the caller); appends eps to `consts`."""
    from specgen.tail import _affine_code, _group_text

    stage = spec.epilogue[index]
    row = ops.NORMS[stage.op]
    eps = norm_constants(spec, index, consts)
    fmt = {"a": "sa", "b": "sb", "eps": eps}
    return {
        "index": index,
        "op": stage.op,
        "axis": "rows",
        "moments": row.statistic == "moments",
        "comment": f"epilogue[{index}] {stage.op} over {_group_text(spec, index)}",
        "prepare": row.prepare % fmt,
        "prepare_comment": row.prepare_comment,
        "normalize": row.normalize % {"x": "v", **fmt},
        # (a LayerNorm's weight and bias are of the normalized shape; an instance norm's, per channel)
        "affine": _affine_code(row, stage.args, "e_el" if row.affine == "element" else "cj") if row.params(stage.args) else "",
        "pointwise": [],
    }


def _can_fold_avg_pool(spec: LayerSpec, levels: list[dict]) -> bool:
    """avg_pool(conv(x)) == conv'(x) with kernel K + k - 1 and the pool's stride, when the pool
    follows the conv (or per-channel affine stages after it, which commute with the average and
    move after the pool) and has the fold's geometry (`avg_pool_fold_geometry`).
    conv' has weights W'(t) = sum over window offsets e of W(t - e) / window: exact in real
    arithmetic; in float32 it reorders the sums (a few ulps of the largest partial sum)."""
    from specgen.tapsum import commutes_with_mean

    conv, pool = levels[0], levels[1]
    return (
        all(commutes_with_mean(spec, st["index"]) for st in conv["pointwise"])
        and pool["kind"] == "pool"
        and pool["op"] == "avg_pool"
        and avg_pool_fold_geometry(spec, pool["index"])
    )


def avg_pool_fold_geometry(spec: LayerSpec, index: int) -> bool:
    """Whether the avg pool at epilogue[index] has the avg-pool fold's geometry: a conv of stride
    and dilation 1 under it, no padding (`tail.pool_split` leaves such a pool right after the conv to
    the fold, and splits any other)."""
    geo = spec.conv_geometry()
    pool = spec.pool_geometry(spec.epilogue[index], f"epilogue[{index}]")
    return all(v == 1 for v in (*geo["stride"], *geo["dilation"], *pool["dilation"])) and not any(pool["padding"])


# ---- tensor-core tiling ----------------------------------------------------------------------
# The conv as an implicit GEMM: M = output positions of a slab of the box (16 per m-tile), N =
# output channels (8 per n-tile), K = taps x input channels (8 per k-step; the channels padded to
# a multiple of 4 so that a lane's K index splits into a compile-time tap and its own channel).
MMA_WARPS = 8  # warps per block
MMA_MAX_WM = 4  # m-tiles per warp
MMA_MAX_WN = 4  # n-tiles per warp
MMA_WARPS_ONE_BLOCK = 16  # warps per block when only one block fits an SM
MMA_STAGE_BATCH = 8  # 16-byte input loads in flight per thread while staging through registers
MMA_MAX_TILES = 8  # m-tiles x n-tiles per warp: 32 accumulators, so two blocks of 8 warps fit an SM's registers
MMA_MIN_K = 64  # taps x input channels, for the planner to pick tensor cores by itself
MMA_MIN_CHANNELS = 32  # output channels, likewise
# The FFMA box of a reduction over depth that keeps the rows spans depths before rows (`_box_tiling`).
DEPTH_REDUCTION_DEPTHS_FIRST = True


def _warp_tiles(mt: int, nt: int, warps: int = MMA_WARPS) -> tuple[int, int, int] | None:
    """(wm, wn, units): the warp tile (m-tiles x n-tiles) for a slab of mt x nt tiles; units = warp
    tiles per slab, at most two per warp. Preferred: no idle warps, then the fewest idle tiles, then
    the largest warp tile (fewer shared-memory loads per mma)."""
    best = None
    for wn in (4, 2, 1):
        if wn > max(nt, 1) or wn > MMA_MAX_WN:
            continue
        for wm in range(1, min(MMA_MAX_WM, MMA_MAX_TILES // wn) + 1):
            units = _ceil_div(mt, wm) * _ceil_div(nt, wn)
            if units > 2 * warps:
                continue
            idle_warps = _ceil_div(units, warps) * warps - units
            waste = _ceil_div(mt, wm) * wm * _ceil_div(nt, wn) * wn - mt * nt  # idle (m, n) tiles
            key = (-idle_warps, -waste, wm * wn, wn)
            if best is None or key > best[0]:
                best = (key, (wm, wn, units))
    return best[1] if best else None


def _weight_stride(weight_channels: int) -> tuple[int, bool]:
    """(row stride, swizzled) of the slab engine's staged weights [K][channels]. Fragment loads
    read 4 K rows x 8 channels: on 32 distinct banks when the rows are XOR-swizzled (channel block
    ^= K row % 4; rows a multiple of 32 channels) or padded to 8 or 24 channels past a multiple of 32."""
    ws = _round_up(weight_channels, 8)
    swizzle = ws % 32 == 0
    while not swizzle and ws % 32 not in (8, 24):
        ws += 8
    return ws, swizzle


def _forced_warp_tile(mt: int, nt: int, wm: int, wn: int, warps: int = MMA_WARPS) -> tuple[int, int, int] | None:
    """(wm, wn, units) for a warp tile a tuner's candidate names, or None where it takes more than
    two warp tiles per warp or reaches past the box's channels by a whole n-tile group."""
    units = _ceil_div(mt, wm) * _ceil_div(nt, wn)
    return (wm, wn, units) if units <= 2 * warps and wn <= max(nt, 1) else None


def _bank_conflicts(cs: int, s_w: int) -> int:
    """Worst bank multiplicity of an A-fragment load: 8 positions s_w apart x 4 planes cs apart."""
    banks = [(g * s_w + t * cs) % 32 for g in range(8) for t in range(4)]
    return max(banks.count(b) for b in set(banks))


# The slab engine stages whole-row slabs as one run per channel (`SlabTiling.runs`); False: row by
# row, as before (kept for an A/B on a GPU).
SLAB_RUNS = True


def _bank_spread_stride(plane: int, s_w: int, multiple: int) -> int:
    """The stride between input-channel planes of the staged input: at least `plane`, a multiple of
    `multiple`, with the fewest A-fragment bank conflicts."""
    return min(range(_round_up(plane, multiple), plane + 32 * multiple, multiple), key=lambda cs: (_bank_conflicts(cs, s_w), cs))


def _mma_tiling(tile, t1, role, has_tail: bool, cout: int, cin_g: int, in3, k3, s3, p3, d3, c_kept: bool,
                target: Target = targets.DEFAULT, warp_tile: tuple[int, int] | None = None) -> SlabTiling | None:
    """Box, slab and warp tiling of the tensor-core engine, or None if nothing fits in shared memory.
    `role` sizes the box (axes "F" and "R1" are in it); c_kept: the channels are kept (a block
    stages only its box's weights); warp_tile: (wm, wn), a tuner's candidate for the planner's."""
    in_box = {a: role[a] in ("F", "R1") for a in AXES}
    box_c = cout if cout <= 128 else _balanced(t1[0], 64, 8)
    weight_channels = box_c if c_kept else cout
    ws, swizzle = _weight_stride(weight_channels)
    cip = _round_up(cin_g, 4)
    taps = k3[0] * k3[1] * k3[2]
    k_pad = _round_up(taps * cip, 8)
    user_box = tile.box if tile is not None and tile.box is not None else None
    if user_box is not None:
        want = [user_box[0], *_spatial3(tuple(user_box[1:]), 1)]
        for a, b in zip(AXES, want):
            if not in_box[a] and b != 1:
                raise PlanError([f"tile.box: the {AXIS_NAMES[a]} extent must be 1 (that axis is reduced one at a time)"])
        if want[0] % 8 or want[0] > 128:
            raise PlanError([f"tile.box: with tensor cores the channel extent must be a multiple of 8 up to 128, got {want[0]}"])
        sizes = [None]
    else:
        sizes = [2 * MMA_WARPS * MMA_MAX_TILES * 16 // _ceil_div(box_c, 8) >> k for k in range(7)]
    for size in sizes:
        if size is None:
            box = [min(b, e) for b, e in zip(want, t1)]
            sd, sh = box[1], box[2]
        else:
            bw = _balanced(t1[3], size) if in_box["w"] else 1
            sh = _balanced(t1[2], max(1, size // bw)) if in_box["h"] else 1  # near-equal slabs: little waste
            sd = _balanced(t1[1], max(1, size // (sh * bw))) if in_box["d"] and (sh == t1[2] or not in_box["h"]) else 1
            bd, bh = sd, sh
            if not has_tail:  # a block walks up to 4 slabs, staging its weights once
                if in_box["h"] and sh < t1[2]:
                    bh = sh * min(4, _ceil_div(t1[2], sh))
                elif in_box["d"]:
                    bd = sd * min(4, _ceil_div(t1[1], sd))
            box = [box_c, bd, bh, bw]
        m_slab = sd * sh * box[3]
        if m_slab < 16 and size is not None:  # under one m-tile of positions: tensor cores would idle
            break
        mt = _ceil_div(m_slab, 16)
        tiles = _warp_tiles(mt, _ceil_div(box[0], 8)) if warp_tile is None else _forced_warp_tile(mt, _ceil_div(box[0], 8), *warp_tile)
        if tiles is None:
            if size is None:
                raise PlanError([f"tile.box: {m_slab} positions x {box[0]} channels per box are more than {MMA_WARPS} warps take "
                                 f"at once with tensor cores ({2 * MMA_WARPS * MMA_MAX_TILES} tiles of 16 positions x 8 channels); choose a smaller box"])
            continue
        wm, wn, units = tiles
        # One kept element per box (a full reduction, say): threads fold their fragments
        # straight into their accumulators, so no box is parked in shared memory.
        nf = math.prod(b for a, b in zip(AXES, box) if role[a] == "F")
        nr = math.prod(b for a, b in zip(AXES, box) if role[a] == "R1")
        direct = has_tail and nf == 1 and nr >= 32 * MMA_WARPS_ONE_BLOCK
        xs = tuple((o - 1) * st + (k - 1) * dl + 1 for o, st, k, dl in zip((sd, sh, box[3]), s3, k3, d3))
        # Staging the input: 16-byte chunks when every chunk is inside the input or outside it
        # (rows, padding and slab origins on multiples of 4), as cp.async straight into shared
        # memory when the staged rows can be 16-byte aligned without bank conflicts, else as
        # 16-byte loads and 4-byte stores; otherwise 4-byte cp.async.
        w_tiles = _ceil_div(t1[3], box[3]) if in_box["w"] else t1[3]
        chunked = in3[2] % 4 == 0 and p3[2] % 4 == 0 and (w_tiles == 1 or box[3] * s3[2] % 4 == 0)
        plane4 = xs[0] * xs[1] * _round_up(xs[2], 4)
        cs_aligned, cs_any = _bank_spread_stride(plane4, s3[2], 4), _bank_spread_stride(plane4, s3[2], 1)
        aligned_ok = _bank_conflicts(cs_aligned, s3[2]) == _bank_conflicts(cs_any, s3[2])
        stage = "cp16" if chunked and aligned_ok else ("ldg16" if chunked else "cp4")
        xs_wp = _round_up(xs[2], 4) if stage != "cp4" else xs[2]  # row stride of the staged input
        ci_stride = {"cp16": cs_aligned, "ldg16": cs_any}.get(stage) or _bank_spread_stride(xs[0] * xs[1] * xs_wp, s3[2], 1)
        floats = {"w": k_pad * ws, "x": cip * ci_stride,
                  "box": math.prod(box) if has_tail and not direct else 0,
                  "red": 2 * max(32 * MMA_WARPS_ONE_BLOCK, nf) if has_tail else 0}
        if 4 * sum(floats.values()) > target.smem_per_block:
            if size is None:
                raise PlanError([f"tile.box: {box} needs {4 * sum(floats.values())} bytes of shared memory, more than the "
                                 f"{target.smem_per_block} a block can have on {target.arch}"])
            continue
        warps = MMA_WARPS
        if 2 * (4 * sum(floats.values()) + BLOCK_RESERVED_SMEM) > target.smem_per_sm:
            # One block per SM: twice the warps hide its latencies (staging, barriers); measured
            # 1.5x on a full reduction. The slab stays; the warp tiles are dealt out again.
            warps = MMA_WARPS_ONE_BLOCK
            if warp_tile is None:
                wm, wn, units = _warp_tiles(mt, _ceil_div(box[0], 8), warps) or (wm, wn, units)
        # whole input rows of one depth, the box as wide as T1: a channel's slab is one run (`SlabTiling.runs`)
        runs = SLAB_RUNS and stage == "cp4" and xs[0] == 1 and xs[2] == in3[2] and p3[2] == 0 and in_box["w"] and w_tiles == 1
        return SlabTiling(
            box=box, threads=32 * warps, warps=warps, wm=wm, wn=wn, units=units,
            unit_iters=_ceil_div(units, warps), n_groups=_ceil_div(_ceil_div(box[0], 8), wn),
            slab=(sd, sh), slabs=(_ceil_div(box[1], sd), _ceil_div(box[2], sh)), m_slab=m_slab, mt=mt,
            cip=cip, k_pad=k_pad, ksteps=k_pad // 8, ws=ws, swizzle=swizzle, xs=xs, xs_wp=xs_wp,
            ci_stride=ci_stride, stage=stage, stage_batch=min(MMA_STAGE_BATCH, _ceil_div(cip * xs[0] * xs[1] * xs_wp // 4, 32 * warps)),
            x_floats=floats["x"], w_floats=floats["w"], direct_fold=direct, runs=runs,
        )
    return None


# ---- the slab engine on wgmma (sm_90a) -------------------------------------------------------
WGMMA_THREADS = 256  # two warpgroups
WGMMA_MAX_K = 512  # fp32 mode sums all of K in the accumulators, which add with truncation (NOTES v15a)
WGMMA_MAX_ROW = 256  # staged positions per row (XS_W)
WGMMA_MAX_SLAB_H = 8
WGMMA_TWO_BLOCKS_NB = 128  # positions per wgmma whose accumulators (NB / 2 a thread) fit two blocks' 128 registers
# Slabs a wgmma slab block walks along H (then D, where a box holds whole planes), staging its
# weights once: WGMMA_BOX_SLABS, or WGMMA_TALL_BOX_SLABS where a sample still has at least
# WGMMA_TALL_BOX_MIN_BOXES boxes of that height (blocks enough at a batch of a few samples).
# Measured on an H100 (NOTES v47): kb90 at batch 128 2.54-2.62 ms with boxes of 4 slabs, 2.38-2.41
# with 8 (56 boxes a sample), 2.41 with 16; at batch 8 0.198 -> 0.208. The 3-channel stem at
# batch 8 (7 boxes a sample) lost with 8 (0.157 -> 0.168): it keeps 4.
WGMMA_BOX_SLABS = 4
WGMMA_TALL_BOX_SLABS = 8
WGMMA_TALL_BOX_MIN_BOXES = 48
WGMMA_MAX_BOX_SLABS = 32  # (a tuner's candidate: `SlabConfig.box_slabs`)
# A wgmma slab block walks boxes (`SlabTiling.walk`) where every box holds the same channels and no
# reduction is kept: the launch starts as many blocks as the SMs hold, each staging its weights once
# for all its boxes. Off: measured on an H100 (NOTES v47) kb90 ran 2.62 -> 2.74 ms walking (its two
# blocks per SM start together and stay in step, staging at the same time), its tf32 form 3.29 ->
# 3.15. True: walk wherever it applies (the GPU tests run it so).
SLAB_WALK = False
WGMMA_ALIGN_FLOATS = 256  # the planes start 1024-byte aligned (the swizzle is by shared-memory address)
# Left to the planner, the slab engine runs on wgmma on sm_90a where that was measured faster on an
# H200 (benchmarks/NOTES.md, v43): layers whose output is stored as computed (kb90 3.41 -> 2.46 ms,
# the ResNet stem's conv in fp32 0.50 -> 0.44 and in tf32 0.34 -> 0.26), each that the wgmma slab
# can run (`wgmma_why_not`), unless its spec says `tile: {wgmma: false}` or a tuned choice pins
# mma.sync. Not where a reduction follows the conv in the same kernel (kb65 ran 1.09 -> 1.21), except
# after an unstrided 1x1 conv, where the next slab is prefetched too (the box fold's 1x1 conv over
# kb65's box means on an H100, v46: 0.50 ms on mma.sync, 0.36 on wgmma, 0.31 prefetching). With
# exact sums too (a tf32 layer computed as fp32, v47 on an H100: kb90 4.08 -> 3.13 ms, the folded
# kb65 0.84 -> 0.73), which never prefetch, but for layers of at most WGMMA_EXACT_MIN_CHANNELS output
# channels (KernelBench 21's 32, half of wgmma's 64-channel M tile padding: 2.54 ms on mma.sync,
# 2.72 and 2.85 on wgmma in two runs). False: mma.sync wherever not asked.
SLAB_WGMMA_DEFAULT = True
WGMMA_EXACT_MIN_CHANNELS = 32
# the most registers (`wgmma_registers`, an estimate) a wgmma slab thread may have: with the next
# slab's rows beside its accumulators, or exact sums' two further sets; ptxas's limit is 255, and
# the estimate was off by -35 to +20 on the test layers and the seeds; a build that still spills is
# rebuilt without the prefetch (`pipeline._without_spills`)
WGMMA_MAX_REGS = 232


def wgmma_registers(nb: int, stage_iters: int, prefetch: bool, packed: bool = False, exact: bool = False) -> int:
    """A wgmma slab thread's registers, estimated: NB / 2 accumulators, the next slab's rows when
    prefetched, and about 64 for fragments, addresses and the epilogue; 32 more where the W taps
    are packed into K (a staged value's own column bounds); NB more with exact sums (two k-steps'
    sums in flight beside the total). Checked against ptxas on the test layers
    (benchmarks/2026-12-05-cpu2-v42-wgmma-slab-build.txt): packed layers took 12-36 registers more
    than the estimate without that term."""
    return nb // 2 + 64 + (32 if packed else 0) + (8 * stage_iters if prefetch else 0) + (nb if exact else 0)


def wgmma_k(cin_g: int, k3) -> tuple[int, bool]:
    """The K of one GEMM tap of the wgmma slab, padded to a k-step (8), and whether the W taps are
    packed into it. A k-step reads 8 K values of one position; with fewer than 8 input channels a
    tap's channels alone would leave most of them zero (the stem's 3 of 8), so the K_W taps along W
    and the channels are packed together, (kw, ci) at kw C_IN_G + ci of one K run per (kd, kh), where
    that takes fewer k-steps. (Not with 8 or more channels: what packing saves there is small, and a
    row per output column stages each input value once per W tap.)"""
    plain, packed = _round_up(cin_g, 8), _round_up(k3[2] * cin_g, 8)
    return (packed, True) if cin_g < 8 and packed < k3[2] * plain else (plain, False)


def wgmma_why_not(cin_g: int, k3, role, products: int, target: Target, exact: bool = False) -> list[str]:
    """Why the slab engine cannot run this layer on wgmma (empty: it can). `exact`: each k-step's
    products are summed apart (`Settings.exact_sums`), so no running sum limits K."""
    cip, packed = wgmma_k(cin_g, k3)
    k_pad = k3[0] * k3[1] * cip * (1 if packed else k3[2])
    return [
        why
        for why, bad in (
            (f"wgmma needs sm_90a (Hopper), the target is {target.arch}", not igemm_engine.has_wgmma(target)),
            ("the width is reduced one position at a time", role["w"] not in ("F", "R1")),
            (f"taps x input channels padded to 8 is {k_pad}, more than the {WGMMA_MAX_K} one running "
             "3xTF32 sum keeps to fp32 accuracy", products == 3 and not exact and k_pad > WGMMA_MAX_K),
        )
        if bad
    ]


def wgmma_phases(k: int, s: int, dil: int) -> tuple[int, list[int]]:
    """A strided axis of the wgmma slab, staged by phase: tap t reads input S (o + q) + r of output
    o, with q = t DIL // S and r = t DIL % S, so the input positions of residue r, staged apart and
    in order, put every tap one offset q from its output. r depends on t % PERIOD only (PERIOD =
    S / gcd(DIL, S)), and phase j < min(K, PERIOD) holds residue j DIL % S. Returns PERIOD and, per
    phase, the largest q of its taps (the positions it stages past the slab's own)."""
    period = s // math.gcd(dil, s)
    return period, [max(t * dil // s for t in range(j, k, period)) for j in range(min(k, period))]


def _wgmma_tiling(tile, t1, role, has_tail: bool, cout: int, cin_g: int, in3, k3, s3, p3, d3, c_kept: bool,
                  products: int, target: Target, slab_h: int = 0, prefetch: int = 0, exact: bool = False,
                  box_slabs: int = 0) -> SlabTiling | None:
    """The slab engine's tiling on wgmma, or None if nothing fits in shared memory.

    A slab is one output depth and SH output rows of the box. Its input is staged as CIP / 8
    planes (fp32 mode: a hi and a lo plane each, the 3xTF32 split done once while staging) of rows
    of 8 input channels (32 bytes, the K of one k-step), one row per staged input position
    (zd, zh, zw), XS_W = BOX_W + (K_W - 1) DIL_W per input row. Output position (h, w) of the
    slab is taken as row p = h * XS_W + w: its tap (kd, kh, kw) then reads row p + offset(tap),
    the same offset for every position, so a k-step's B operand (NB positions x 8 channels) is NB
    consecutive rows, read by one descriptor. The XS_W - BOX_W positions past each row's last are
    computed and dropped. A warpgroup multiplies 64 channels (A: the weights, from registers) by
    NB positions; 64 x NB accumulators per unit, NB / 2 registers a thread.

    Strided along H or W, the input is staged by phase (`wgmma_phases`): H phase j is a group of
    rows holding, for each staged depth zd and W phase i, XS_H[j] = SH + (its largest q) rows of
    XS_W = BOX_W + (the largest q along W) positions; row (a, b) of the group's (zd, i) block holds
    input row S_H (h0 + a) + j DIL_H % S_H, column S_W (w0 + b) + i DIL_W % S_W. Tap (kd, kh, kw)
    of phases (j, i) and offsets (qh, qw) then reads row p + base(j) + ((kd W_PHASES + i) XS_H[j]
    + qh) XS_W + qw for every position p = h XS_W + w: again one offset. The staged input is no
    larger than the strided slab's own (no position is staged twice).

    Staging is hidden behind the products by a second block on the SM where two fit. A block alone
    on its SM with several slabs per box can prefetch: each thread loads the next slab's rows into
    registers while the current slab multiplies (`prefetch`: 1 on; 0, the planner's, and 2 off).
    Measured on an H200 (benchmarks/NOTES.md, v43), the prefetch lost on every layer timed (kb65
    1.29 against 1.21 ms, the fp32 stem 0.477 against 0.441): the tuner tries it, and the planner
    only after an unstrided 1x1 conv followed by a reduction (v46, on an H100: 0.31 against 0.36 ms).

    `exact`: each k-step's products are summed apart (`Settings.exact_sums`), two k-steps' sums in
    registers beside the total: NB / 2 registers more a set, so 32 positions a wgmma are tried too
    (two blocks per SM at 112 estimated registers); no prefetch. `box_slabs`: the slabs a box
    holds (a tuner's candidate), 0: WGMMA_BOX_SLABS or WGMMA_TALL_BOX_SLABS."""
    if wgmma_why_not(cin_g, k3, role, products, target, exact):
        return None
    in_box = {a: role[a] in ("F", "R1") for a in AXES}
    box_c = min(_round_up(cout, 8), 256) if cout <= 256 else _balanced(t1[0], 256, 64)
    weight_channels = box_c if c_kept else cout
    ws, swizzle = _weight_stride(weight_channels)  # (wgmma's A fragments read w_s as mma.sync's B fragments do)
    cip, packed = wgmma_k(cin_g, k3)
    k_pad = k3[0] * k3[1] * cip * (1 if packed else k3[2])
    c_tiles = _ceil_div(box_c, 64)
    period_h, q_h = wgmma_phases(k3[1], s3[1], d3[1])
    # packed: a staged row per output column, holding every W tap's input (no W phases, no halo)
    period_w, q_w = (1, [0]) if packed else wgmma_phases(k3[2], s3[2], d3[2])
    halo_w = max(q_w)  # (stride 1: (K_W - 1) DIL_W)
    bw = _balanced(t1[3], WGMMA_MAX_ROW - halo_w)
    xs_w = bw + halo_w
    user_box = tile.box if tile is not None and tile.box is not None else None
    best = None
    for sh in range(min(WGMMA_MAX_SLAB_H, t1[2]) if in_box["h"] else 1, 0, -1):
        if slab_h and sh != min(slab_h, t1[2] if in_box["h"] else 1):  # (a tuner's candidate: its rows only)
            continue
        phase_rows = tuple(sh + q for q in q_h)  # rows of each H phase (stride 1: one, SH + (K_H - 1) DIL_H)
        group_rows = [k3[0] * len(q_w) * rows * xs_w for rows in phase_rows]
        phase_base = tuple(sum(group_rows[:j]) for j in range(len(phase_rows)))
        xs_h = max(phase_rows)
        nv = sh * xs_w  # the slab's positions, dropped ones included
        tap_rows = [phase_base[kh % period_h] + ((kd * len(q_w) + kw % period_w) * phase_rows[kh % period_h]
                    + kh * d3[1] // s3[1]) * xs_w + kw * d3[2] // s3[2]
                    for kd in range(k3[0]) for kh in range(k3[1]) for kw in range(1 if packed else k3[2])]
        off_max = max(tap_rows)  # the last tap's row offset
        xs_rows = sum(group_rows)
        # A block walks up to WGMMA_BOX_SLABS slabs a box, staging its weights once (and, prefetching,
        # hiding all but the first slab's staging); a box that a reduction keeps in shared memory stays one slab.
        for tall in (True, False):
            per_box = box_slabs or WGMMA_BOX_SLABS
            tall_h = sh * min(WGMMA_TALL_BOX_SLABS, _ceil_div(t1[2], sh))
            if not box_slabs and tall and in_box["h"] and tall_h < t1[2] \
                    and (t1[1] if in_box["d"] else 1) * _ceil_div(t1[2], tall_h) * _ceil_div(t1[3], bw) >= WGMMA_TALL_BOX_MIN_BOXES:
                per_box = WGMMA_TALL_BOX_SLABS  # (boxes enough a sample: taller ones, fewer weight stagings)
            bh = sh * min(per_box, _ceil_div(t1[2], sh)) if tall and in_box["h"] else sh
            bd = min(per_box, t1[1]) if tall and not has_tail and in_box["d"] and bh >= t1[2] else 1
            box = [box_c, bd, min(bh, t1[2]), bw]
            nf = math.prod(b for a, b in zip(AXES, box) if role[a] == "F")
            nr = math.prod(b for a, b in zip(AXES, box) if role[a] == "R1")
            direct = has_tail and nf == 1 and nr >= 32 * MMA_WARPS_ONE_BLOCK  # (folded as computed: no box kept)
            if not has_tail or direct:
                break
        floats = {"w": k_pad * ws, "box": math.prod(box) if has_tail and not direct else 0,
                  "red": 2 * max(32 * MMA_WARPS_ONE_BLOCK, nf) if has_tail else 0}
        for nb_max in ((32,) if exact else ()) + (64, 128, 256):
            n_tiles = _ceil_div(nv, nb_max)
            nb = _round_up(_ceil_div(nv, n_tiles), 8)
            units = c_tiles * n_tiles
            plane_rows = _round_up(max(xs_rows, n_tiles * nb + off_max), 8)
            x_floats = (2 if products == 3 else 1) * (cip // 8) * plane_rows * 8 + WGMMA_ALIGN_FLOATS
            smem = 4 * (sum(floats.values()) + x_floats)
            if smem > target.smem_per_block:
                continue
            # (two blocks: at most 128 registers a thread, which hold 64 accumulators beside the rest)
            two_blocks = 2 * (smem + BLOCK_RESERVED_SMEM) <= target.smem_per_sm and nb <= WGMMA_TWO_BLOCKS_NB
            stage_iters = (cip // 8) * _ceil_div(plane_rows, WGMMA_THREADS)  # (plane by plane: SlabTiling.stage_iters)
            slabs = (bd, _ceil_div(box[2], sh))
            # (not with exact sums: in the K loop a prefetching kernel does not unroll, ptxas serialized
            # the products of their three register sets, C7511/C7515)
            can_prefetch = slabs[0] * slabs[1] > 1 and not exact and wgmma_registers(nb, stage_iters, True, packed) <= WGMMA_MAX_REGS
            if prefetch == 1 and not can_prefetch:
                continue
            pf = can_prefetch and prefetch == 1
            if wgmma_registers(nb, stage_iters, pf, packed, exact) > WGMMA_MAX_REGS:
                continue  # (exact sums at a large NB: three sets of NB / 2 accumulators would spill)
            two_blocks = two_blocks and wgmma_registers(nb, stage_iters, pf, packed, exact) <= 128
            waste = (n_tiles * nb * c_tiles * 64) / (sh * bw * box_c)
            # staging hidden (two blocks per SM, one staging while the other multiplies, or the next
            # slab prefetched, when asked), no idle warpgroup, the least waste, then the most
            # positions per wgmma and the tallest slab
            key = (two_blocks or pf, two_blocks, units % (WGMMA_THREADS // 128) == 0, -round(waste, 2), nb, sh)
            if best is None or key > best[0]:
                best = (key, SlabTiling(
                    box=box, threads=WGMMA_THREADS, warps=WGMMA_THREADS // 32, wm=nb // 16, wn=8, units=units,
                    unit_iters=_ceil_div(units, WGMMA_THREADS // 128), n_groups=c_tiles, slab=(1, sh),
                    slabs=slabs, m_slab=nv, mt=_ceil_div(nv, 16), cip=cip, k_pad=k_pad,
                    ksteps=k_pad // 8, ws=ws, swizzle=swizzle, xs=(k3[0], xs_h, xs_w), xs_wp=xs_w, ci_stride=0,
                    stage="planes", stage_batch=0, x_floats=x_floats, w_floats=floats["w"], direct_fold=direct,
                    products=products, wgmma=True, nb=nb, n_tiles=n_tiles, c_tiles=c_tiles, chunks=cip // 8,
                    xs_rows=xs_rows, plane_rows=plane_rows,
                    pair_stores=not has_tail and xs_w % 2 == 0 and bw % 2 == 0 and t1[3] % 2 == 0,
                    phased=s3[1] != 1 or s3[2] != 1, periods=(period_h, period_w), phase_rows=phase_rows,
                    phase_base=phase_base, w_phases=len(q_w), prefetch=pf, packed_w=packed,
                ))
    if best is not None and user_box is not None:
        raise PlanError(["tile.box: the slab engine on wgmma chooses its own box (leave tile.box out)"])
    return best[1] if best else None


NESTED_POOL_TILE = 16  # most register-tile values (CT x PT) per level when two or more pools nest
# The FFMA engine parallelizes over the outputs alone. A layer of few outputs and a deep K (many
# input channels and taps into a few channels, often before a pool) would leave a sample a block of
# 32 threads with millions of multiply-adds each (384 -> 16 channels of a 7x7 conv, 2x2 max pool:
# 2.4 million). Left to the planner, the register tile shrinks (CT, then PT, halved) until a sample
# has FFMA_SPREAD_TILES thread tiles or a tile FFMA_HEAVY_TILE_MACS multiply-adds or fewer, and
# such heavy tiles are not stacked four to a thread where a sample has fewer than four times that
# many; kept only where a sample gets more threads (`_box_tiling`). Chosen from that arithmetic;
# timed on three layers (an H100, NOTES v48: 1.2-3.8x, and 1.00x where the threads stay the same).
FFMA_SPREAD_TILES = 1024
FFMA_HEAVY_TILE_MACS = 1 << 16


def tile_pt_default(t1, w_in_box: bool) -> int:
    """The FFMA register tile's positions along W, left to the planner."""
    return min(4, t1[3]) if w_in_box else 1


AFFINE_SCALE_RANGE = (2.0**-64, 2.0**64)  # |scale| outside: no fold (weights could under/overflow)


def _affine_fold(spec: LayerSpec, level0: dict, consts: list[Constant]) -> dict | None:
    """Pass 4, a rewrite: fold the scalar affine ops (the op table's rows with `affine`:
    mul/div/add/sub by a constant) that directly follow the conv into its weights and bias: v -> scale * v + shift becomes
    W' = scale * W, b' = scale * b + shift.

    Exact in real arithmetic. In float32 it moves roundings: scale and shift are computed in double
    and rounded once, and each weight and the bias are rounded once more after scaling, so the
    result differs from the unrewritten kernel by at most about 2 * 2^-24 * (sum |scale W x| + |b'|),
    the size of two more rounding steps of the conv's own accumulation."""
    scale, shift, taken = 1.0, 0.0, []
    for st in level0["pointwise"]:
        stage = spec.epilogue[st["index"]]
        compose = ops.POINTWISE[stage.op].affine
        folded = compose(stage.args, scale, shift) if compose is not None else None
        if folded is None:
            break
        scale, shift = folded
        taken.append(st)
    if not taken or not AFFINE_SCALE_RANGE[0] <= abs(scale) <= AFFINE_SCALE_RANGE[1] or not abs(shift) <= FLOAT32_MAX:
        return None
    level0["pointwise"] = level0["pointwise"][len(taken):]
    dropped = {f"S{st['index']}_" for st in taken}
    consts[:] = [c for c in consts if not any(c.name.startswith(d) for d in dropped)]
    first, last = taken[0]["index"], taken[-1]["index"]
    where = f"epilogue[{first}]" if first == last else f"epilogue[{first}..{last}]"
    consts.append(Constant("AFFINE_SCALE", c_float(scale), f"affine fold of {where}: W' = AFFINE_SCALE * W", "float"))
    consts.append(Constant("AFFINE_SHIFT", c_float(shift), f"affine fold of {where}: b' = AFFINE_SCALE * b + AFFINE_SHIFT", "float"))
    ops_text = ", ".join(st["op"] for st in taken)
    return {
        "scale": scale,
        "shift": shift,
        "summary": f"affine fold: {where} ({ops_text}) folded into the conv's weights and bias "
        f"(v -> {scale!r} * v + {shift!r}; one more float32 rounding per weight)",
    }


@dataclass(frozen=True)
class SlabConfig:
    """A tuner's candidate for the slab engine (a planner setting, like the GEMM engines' tile
    configs): wgmma = 1 runs it on wgmma (sm_90a), 0 on mma.sync; on mma.sync, a warp tile of wm
    m-tiles (16 positions) x wn n-tiles (8 channels); on wgmma, slab_h output rows per slab. 0: the
    planner's choice."""

    wgmma: int = 0
    wm: int = 0
    wn: int = 0
    slab_h: int = 0
    prefetch: int = 0  # wgmma: the next slab's rows loaded during the current one's products (1), not (2; the planner's)
    # the box fold (specgen.boxfold) where it applies and pays (1), never (2: the avg-pool fold's one
    # kernel), 0: the planner's (`boxfold.ENABLED`); so the tuner times a layer both ways
    box_fold: int = 0
    # wgmma: blocks that walk the batch's boxes (1), a block per box (2), 0: the planner's (`SLAB_WALK`)
    walk: int = 0
    # wgmma: the slabs a box holds (1..WGMMA_MAX_BOX_SLABS), 0: the planner's (`WGMMA_BOX_SLABS`,
    # `WGMMA_TALL_BOX_SLABS`)
    box_slabs: int = 0

    def __post_init__(self):
        if self.wgmma not in (0, 1):
            raise ValueError(f"wgmma must be 0 or 1, got {self.wgmma}")
        if not (0 <= self.wm <= MMA_MAX_WM and 0 <= self.wn <= MMA_MAX_WN and (self.wm == 0) == (self.wn == 0)):
            raise ValueError(f"a warp tile is 1..{MMA_MAX_WM} m-tiles x 1..{MMA_MAX_WN} n-tiles (or 0 x 0), got {self.wm} x {self.wn}")
        if self.wgmma and self.wm:
            raise ValueError("a warp tile is mma.sync's; wgmma tiles are a warpgroup's 64 channels")
        if not 0 <= self.slab_h <= WGMMA_MAX_SLAB_H or (self.slab_h and not self.wgmma):
            raise ValueError(f"slab_h (1..{WGMMA_MAX_SLAB_H}) is a wgmma slab's rows, got {self.slab_h}")
        if self.prefetch not in (0, 1, 2) or (self.prefetch and not self.wgmma):
            raise ValueError(f"prefetch (1 on, 2 off, 0 the planner's) is a wgmma slab's, got {self.prefetch}")
        if self.box_fold not in (0, 1, 2):
            raise ValueError(f"box_fold (1 on, 2 off, 0 the planner's) must be 0, 1 or 2, got {self.box_fold}")
        if self.walk not in (0, 1, 2) or (self.walk and not self.wgmma):
            raise ValueError(f"walk (1 on, 2 off, 0 the planner's) is a wgmma slab's, got {self.walk}")
        if not 0 <= self.box_slabs <= WGMMA_MAX_BOX_SLABS or (self.box_slabs and not self.wgmma):
            raise ValueError(f"box_slabs (1..{WGMMA_MAX_BOX_SLABS}) is a wgmma slab's, got {self.box_slabs}")

    def label(self) -> str:
        unfolded = {0: "", 1: " box fold", 2: " no box fold"}[self.box_fold]
        if self.wgmma:
            return "slab wgmma" + (f" {self.slab_h} rows" if self.slab_h else "") + {0: "", 1: " prefetch", 2: " no prefetch"}[self.prefetch] \
                + (f" {self.box_slabs} slabs a box" if self.box_slabs else "") + {0: "", 1: " walking", 2: " not walking"}[self.walk] + unfolded
        return "slab mma.sync" + (f" w{16 * self.wm}x{8 * self.wn}" if self.wm else "") + unfolded


@dataclass(frozen=True)
class Settings:
    """Planner settings: inputs of a plan beside the spec, never written into it (the spec, its
    banner and its cache key stay the user's)."""

    min_blocks: int | None = None  # blocks per SM asked of the compiler (None: the planner's; a tile's wins)
    rewrites: bool = True  # False: no rewrite applies (the re-plan when a fold finds no room)
    # 3xTF32 on mma.sync: each k-step's products summed apart, then added rounded to nearest (the
    # tensor cores add with truncation). Measured on kb90: rel. L2 7.9e-7 -> 8.3e-8, 18% slower; taken
    # for a tf32 layer computed exactly (`exact_tf32`), held to PyTorch's fp32-level error.
    # None: the planner's choice (exact sums for such a layer); False: the running sum (the spill retry).
    exact_sums: bool | None = None
    # The plan for inputs that arrive channels-last (channels innermost). The TMA engine reads such
    # an input where it lies, with no layout pass, so the intensity it needs to pay for that pass
    # (`tma.worth_it`) does not apply, and writes its output channels-last too; a layer keeps this
    # plan beside its contiguous one, chosen per call by the input's memory format
    # (`pipeline.channels_last_variant`).
    channels_last: bool = False
    slab: SlabConfig | None = None  # the slab engine's instruction and tile (a tuner's candidate)
    # The FFMA engine's channels per thread, at most this (None: the planner's, up to 8): the spill
    # retry's smaller register tile (`pipeline._without_spills`). A tile's channels_per_thread wins.
    ffma_ct: int | None = None
    # False: an FFMA box without a reduction keeps one register tile a thread instead of stacking
    # four (which amortizes a block's weight staging), so a sample gets about four times the
    # blocks: the kernel for a batch too small to fill the SMs with the stacked box
    # (`pipeline.small_batch_settings`, depthwise convs).
    stacked_tiles: bool = True

    def summary(self) -> str:
        parts = ([f"min_blocks {self.min_blocks}"] if self.min_blocks else []) + ([] if self.rewrites else ["no rewrites"])
        parts += [self.slab.label()] if self.slab is not None else []
        parts += [f"FFMA tiles of at most {self.ffma_ct} channels"] if self.ffma_ct else []
        parts += [] if self.stacked_tiles else ["one FFMA tile a thread"]
        parts += ["exact sums"] if self.exact_sums else []
        parts += ["channels-last input and output"] if self.channels_last else []
        return ", ".join(parts)


DEFAULT_SETTINGS = Settings()


def build_plan(spec: LayerSpec, igemm_config: "igemm_engine.IgemmConfig | None" = None, target: Target | None = None,
               tma_config: "tma_engine.TmaConfig | None" = None, settings: Settings = DEFAULT_SETTINGS) -> dict:
    """Everything the template needs, as plain Python values. `igemm_config` / `tma_config`: a
    planner setting (a tuner's candidate) for the implicit-GEMM or the TMA engine's tile shape; it
    makes that engine run. `settings`: the other planner settings (`Settings`).
    `target`: the GPU planned for (default: the built-in sm_90); the plan fits its shared memory,
    uses clusters only where it has them, or refuses with a `TargetError`."""
    target = target or targets.DEFAULT
    if not target.has_cp_async:
        raise TargetError(f"{spec.name}: {target.arch} has no cp.async, which every specgen engine stages with")
    if spec.upsampled():
        # ---- a conv over an upsampled input is the transposed conv it equals (how it runs) ------
        from specgen import upsample

        return _presented_as(build_plan(upsample.equivalent(spec), igemm_config, target, tma_config, settings), spec,
                             upsample.note(spec), upsample.transform(spec))
    if exact_tf32(spec):
        # ---- a tf32 layer of few input channels computes in 3xTF32, as cuDNN computes it in fp32 -
        try:
            exact = build_plan(spec.model_copy(update={"precision": "fp32"}), igemm_config, target, tma_config,
                               replace(settings, exact_sums=settings.exact_sums is not False))
            return _presented_as(exact, spec, EXACT_TF32_NOTE, None)
        except PlanError:
            pass  # the engines fp32 takes cannot run it (an extra input on FFMA): TF32 as before
    may_rewrite = spec.rewrites and settings.rewrites
    if may_rewrite and (plain := forward_equivalent(spec)) is not None:
        # ---- rewrite: a transposed conv of stride 1 is a plain conv (every engine runs it) ---
        return _as_transposed(build_plan(plain, igemm_config, target, tma_config, settings), spec, plain)
    from specgen import boxfold, poolfold, tail, tapsum

    if igemm_config is None and tma_config is None and (pf := poolfold.find(spec, may_rewrite)) is not None:
        # ---- rewrite: an avg pool after a strided transposed conv makes a plain conv with it --
        return _presented_as(build_plan(pf.spec, None, target, settings=settings), spec, poolfold.note(spec, pf),
                             poolfold.transform(spec, pf))
    if igemm_config is None and tma_config is None and (fold := tapsum.find(spec, may_rewrite)) is not None:
        # ---- rewrite: a mean over whole spatial dims of the conv, taken before it -----------
        return tapsum.plan_fold(spec, fold, target, settings)
    box_on = {0: None, 1: True, 2: False}[settings.slab.box_fold if settings.slab is not None else 0]
    if igemm_config is None and tma_config is None and (box := boxfold.find(spec, may_rewrite, box_on)) is not None:
        # ---- rewrite: an avg pool after a stride-1 conv, taken before the conv's taps --------
        return boxfold.plan_fold(spec, box, target, settings)
    if tail.is_sequence(spec):  # statistic stages: a sequence of kernels, each part planned on its own
        if igemm_config is None and (fused := tail.plan_channel_norm(spec, target, tma_config, settings)) is not None:
            return fused  # a softmax over the channels in the TMA epilogue (with what it can take after it)
        seq = tail.plan_sequence(spec, igemm_config, target, tma_config, settings)
        if settings.channels_last and igemm_config is None and tma_config is None:
            from specgen import dwcl

            # a depthwise conv and LayerNorm over the channels on channels-last tensors: one kernel
            seq = dwcl.plan(spec, seq) or seq
        return seq
    if igemm_config is None and tma_config is None and (at := tail.pool_split(spec, target, may_rewrite)) is not None:
        return tail.plan_pool_split(spec, at, target, settings)  # the conv on tensor cores, its pool in a second kernel
    return plan_whole(spec, igemm_config, target, tma_config, settings)


def _body_levels(spec: LayerSpec, shapes, o3: tuple, consts: list[Constant]) -> tuple[list[dict], int, dict | None]:
    """Pass 1, the body: level 0 the conv (+ its pointwise ops), then one level per pool (+ its
    pointwise ops), up to the first reduction (or global pool with no windowed pool after it).
    Returns (levels, the epilogue index where the tail starts, the TMA epilogue's softmax over
    the channels or None); appends the pointwise ops' constants to `consts`."""
    levels = [{"kind": "conv", "level": 0, "pointwise": [], "out": o3}]
    tail_start = len(spec.epilogue)
    later_windowed = [
        any(s.kind == "pool" and ops.POOLS[s.op].windowed for s in spec.epilogue[i + 1 :]) for i in range(len(spec.epilogue))
    ]
    # A softmax over the channels alone, after nothing but pointwise ops: the TMA engine's epilogue
    # normalizes its accumulators (`tma.channel_norm`); the pointwise ops after it are its own.
    channel_norm = None
    norm_at = tma_engine.channel_norm(spec)
    rows_at = tma_engine.row_norm(spec) if norm_at is None else None
    for i, stage in enumerate(spec.epilogue):
        # A global pool with no windowed pool after it is a reduction over the spatial dims
        # (keepdim): the tail computes it with a whole block instead of one thread per window.
        as_reduction = stage.kind == "pool" and not ops.POOLS[stage.op].windowed and not later_windowed[i]
        if stage.kind == "reduce" or as_reduction:
            tail_start = i
            break
        if stage.kind == "pointwise":
            (channel_norm["pointwise"] if channel_norm else levels[-1]["pointwise"]).append(_pointwise_code(spec, i, consts, "cj"))
            continue
        if i == norm_at:
            channel_norm = _channel_norm_code(spec, i, consts)
            continue
        if i == rows_at:
            channel_norm = _row_norm_code(spec, i, consts)
            continue
        if stage.kind == "norm" or channel_norm is not None:
            raise PlanError([f"epilogue[{i}] {stage.op}: a statistic stage, or a pool after a softmax over the channels, "
                             f"runs in a sequence of kernels (specgen.tail), not in one"])
        pool = ops.POOLS[stage.op]
        prev = levels[-1]["out"]
        if pool.windowed:
            g = spec.pool_geometry(stage, f"epilogue[{i}]")
            pk, ps = _spatial3(g["kernel"], 1), _spatial3(g["stride"], 1)
            pp, pdl = _spatial3(g["padding"], 0), _spatial3(g["dilation"], 1)
        else:  # global pool: one window covering the whole extent
            pk, ps, pp, pdl = prev, prev, (0, 0, 0), (1, 1, 1)
        out = _spatial3(shapes[i + 1].sizes[1:], 1)
        include_pad = getattr(stage.args, "count_include_pad", True)
        levels.append(
            {
                "kind": "pool",
                "level": len(levels),
                "index": i,
                "op": stage.op,
                "reduce": pool.reduce,
                "kernel": pk,
                "stride": ps,
                "padding": pp,
                "dilation": pdl,
                "in": prev,
                "out": out,
                "window": pk[0] * pk[1] * pk[2],
                "count_valid": pool.reduce == "avg" and not include_pad and any(pp),
                **pool.cuda(),
                "pointwise": [],
            }
        )
    return levels, tail_start, channel_norm


def _widest(candidates, *strides) -> int:
    """The widest vector width that divides every stride (so every access is aligned)."""
    return next(v for v in candidates if all(st % v == 0 for st in strides))


def _row_span(levels: list[dict], in3, k3, s3, p3, cin_g: int, transposed: bool, on_mma: bool, pt: int,
              box_w: int) -> dict | None:
    """How the FFMA engine's pool level reads a per-channel 1x1 conv under it (a pool split's
    second kernel is a pool over an identity conv): each window row of the input loaded once, as
    one span of LEAD + SPAN values from an aligned start, in vectors of VEC floats, instead of
    level 0 called once per window column (each call loading what the next loads again). None
    where level 0 is a real conv, the pool's windows along W leave gaps (stride > kernel) or are
    dilated: the general path then.

    The span of a register tile's PT outputs: positions w0 * S - P + q, q < (PT - 1) * S + K. Its
    vector loads start LEAD before it, at a multiple of VEC for every tile (its first output w0 is a
    multiple of PT, and of the box's width past the first box), so LEAD is a constant and each
    vector lies wholly inside the row or wholly in its padding (the row's length is a multiple of
    VEC too)."""
    pool = levels[1]  # (level 0 is the conv, every later level a pool)
    if on_mma or transposed or cin_g != 1:
        return None
    if tuple(k3) != (1, 1, 1) or tuple(s3) != (1, 1, 1) or tuple(p3) != (0, 0, 0) or pool["step"] != 1:
        return None
    k, s, p, dil = pool["kernel"][2], pool["stride"][2], pool["padding"][2], pool["dilation"][2]
    if dil != 1 or s > k:
        return None
    vec = _widest((4, 2, 1), in3[2], pt * s, box_w * s)
    span = (pt - 1) * s + k
    lead = (-p) % vec
    return {"span": span, "lead": lead, "vec": vec, "vectors": -(-(lead + span) // vec)}


def _fold_avg_pool(levels: list[dict], k3: tuple, nd: int) -> tuple[dict, str, tuple, tuple, tuple]:
    """Pass 2, a rewrite: the avg-pool at level 1 (`_can_fold_avg_pool` said it may) folded into
    the conv: its kernel grows by the window less one, its stride is the pool's. Removes the pool's
    level (its pointwise ops join the conv's). Returns (the fold as the launch's weight transform
    needs it, the rewrite's line for `show --plan`, the new kernel, stride and output extents)."""
    pool = levels.pop(1)
    fold = {"orig_kernel": k3, "window": pool["kernel"], "window_size": pool["window"]}
    new_k = tuple(k + w - 1 for k, w in zip(k3, pool["kernel"]))
    dims = lambda t: "x".join(map(str, t[3 - nd:]))  # noqa: E731
    saving = pool["window"] * math.prod(k3) / math.prod(new_k)
    note = (
        f"avg-pool fold: epilogue[{pool['index']}] {pool['op']} {dims(pool['kernel'])} folded into the conv "
        f"(kernel {dims(k3)} -> {dims(new_k)}, stride {dims(pool['stride'])}): {saving:.2f}x fewer multiply-adds"
    )
    levels[0]["out"] = pool["out"]
    levels[0]["pointwise"] = levels[0]["pointwise"] + pool["pointwise"]  # (the affine stages, now after the pool)
    for k, lvl in enumerate(levels):
        lvl["level"] = k
    return fold, note, new_k, pool["stride"], pool["out"]


def _tail_reductions(spec: LayerSpec, shapes, t1: tuple, tail_start: int, consts: list[Constant]) -> tuple[list[dict], dict, bool, dict]:
    """Pass 3, the tail: the reductions over T1's axes (c, d, h, w), in order, from epilogue index
    `tail_start` on (each with the pointwise ops after it). Returns (reductions, each axis's role:
    "F" kept or "R<j>" reduced by reduction j, whether two reductions are batched, the roles that
    size the box); appends the named counts a finalize uses to `consts`."""
    nd = spec.ndim
    offset = 3 - nd
    role_to_axis = {"c": "c", **{f"s{j}": AXES[1 + offset + j] for j in range(nd)}}
    reductions: list[dict] = []
    reduced: set[str] = set()
    for i in range(tail_start, len(spec.epilogue)):
        stage = spec.epilogue[i]
        if stage.kind == "pointwise":
            channel = "c_tail"
            if reductions:
                reductions[-1]["pointwise"].append(_pointwise_code(spec, i, consts, channel, sample=None))
            continue
        before = shapes[i]
        if stage.kind == "pool":  # a global pool: mean / amax over the spatial dims, keepdim
            op = ops.POOLS[stage.op].global_reduction().name
            axes = [role_to_axis[a.role] for a in before.axes if a.role != "c"]
        else:
            op = stage.op
            axes = [role_to_axis[before.axes[d - 1].role] for d in spec.reduce_dims(i)]
        axes = [a for a in AXES if a in axes and a not in reduced]
        reduced.update(axes)
        if not axes:  # reducing axes already reduced with keepdim: the identity
            continue
        red = ops.REDUCTIONS[op]
        count = math.prod(t1[AXES.index(a)] for a in axes)
        reductions.append(
            {
                "index": i,
                "op": op,
                "axes": axes,
                "count": count,
                **red.cuda(),
                "helpers": red.helpers,
                "note": red.note,
                "pointwise": [],
                "comment": f"epilogue[{i}] {stage.op} over {', '.join(AXIS_NAMES[a] for a in axes)} ({count} values)"
                + (f", computed as {op}" if op != stage.op else ""),
            }
        )
    # the channel coordinate the tail's per-channel parameters see: 0 once channels are reduced
    reduced_so_far: set[str] = set()
    for r in reductions:
        reduced_so_far.update(r["axes"])
        r["channel_reduced"] = "c" in reduced_so_far

    role = {a: "F" for a in AXES}
    for j, r in enumerate(reductions):
        for a in r["axes"]:
            role[a] = f"R{j + 1}"
    # Two reductions leaving one value per sample (e.g. a sum over channels, then a max over
    # positions): the outer reduction's positions are taken a box at a time, not one by one. Each
    # owner folds its inner results into one accumulator per thread; a fixed tree joins them.
    batched = len(reductions) == 2 and math.prod(t1[AXES.index(a)] for a in AXES if role[a] == "F") == 1
    # the roles that size the box: batched, the outer reduction's axes are in the box like kept ones
    srole = {a: "F" if batched and r == "R2" else r for a, r in role.items()}
    for j, r in enumerate(reductions):
        r["level"] = j + 1
        r["count_const"] = f"R{j + 1}_COUNT"  # the named number of values reduced, for a finalize that uses it
        # the channel coordinate the level's pointwise ops see
        r["channel"] = "0" if r["channel_reduced"] else ("f_c" if srole["c"] == "F" else "o_c")
        if ops.REDUCTIONS[r["op"]].uses_count:
            consts.append(Constant(r["count_const"], c_float(r["count"]), f"values per {r['op']} of {r['comment']}", "float"))

    return reductions, role, batched, srole


@dataclass(frozen=True)
class BoxTiling:
    """The box engines' tiling (`_box_tiling`; names as in the plan and the templates)."""

    mma: Any  # the slab engine's SlabTiling, or None (FFMA)
    box: list  # T1 extents (c, d, h, w) a block owns
    ct: int  # register tile: channels ...
    pt: int  # ... and W positions
    threads: int
    thread_tiles: int
    tile_iters: int
    split_channels: bool  # a cluster splits a reduction's channels, one chunk per block
    f_axes: list
    r1_axes: list
    f1_axes: list
    tiles: dict  # kept tiles along each axis
    chunks: dict  # reduced chunks along each axis
    f_tiles: int
    r1_chunks: int
    cluster: int
    blocks_per_sample: int
    nf: int  # the tail's owners: kept elements of a box
    nr: int
    lanes: int  # ... lanes each
    owner_iters: int


@dataclass(frozen=True)
class BoxMemory:
    """The box engines' shared memory (`_box_memory`)."""

    weight_channels: int
    weight_floats: int
    direct_fold: bool
    box_floats: int
    red_floats: int
    w_stride: int
    w_smem_floats: int
    x_floats: int
    weights_in_smem: bool
    w_raw: dict | None
    smem_bytes: int
    cluster: int
    cluster_at_launch: bool
    blocks_per_sample: int


def _box_tiling(spec: LayerSpec, levels: list, t1: tuple, role: dict, srole: dict, reductions: list,
                in3: tuple, k3: tuple, s3: tuple, p3: tuple, d3: tuple, taps: int, target: Target,
                slab: SlabConfig | None = None, exact_sums: bool = False, ffma_ct: int | None = None,
                spread: bool = True, stacked: bool = True) -> BoxTiling:
    """Pass 5, the box engines' tiling (slab on tensor cores, else FFMA): the box of T1 a block
    owns, the register tile, the threads, the blocks per sample and their clusters, and the tail's
    owners (the kept elements of a box and the lanes each). A tile's fields in the spec decide where
    given; `slab`, a tuner's candidate, makes the slab engine run with its instruction and tile.
    `exact_sums`: the layer sums each k-step's products apart (`Settings.exact_sums`: a tf32 layer
    computed exactly), on either instruction. `ffma_ct`: the FFMA register tile's channels, at most
    this (`Settings.ffma_ct`). `stacked`: whether a box without a reduction stacks four register
    tiles on each thread (`Settings.stacked_tiles`).
    (The TMA and implicit-GEMM engines tile for themselves: `tma.plan_tma`, `igemm.plan_igemm`.)"""
    nd = spec.ndim
    cin, cout, groups = spec.input.channels, spec.conv.out_channels, spec.conv.groups
    tile = spec.tile
    cout_g = cout // groups
    c_in_box = srole["c"] in ("F", "R1")
    w_in_box = srole["w"] in ("F", "R1")

    def pick(value, default, field):
        return default if (tile is None or getattr(tile, field) is None) else value(getattr(tile, field))

    # The engine: tensor cores (3xTF32 mma.sync) when the conv is a plain GEMM over its taps (no
    # groups), nothing but pointwise ops sits between the conv and T1, and the box holds several
    # channels; a tile that pins FFMA register-tile fields keeps FFMA unless it asks otherwise.
    ffma_pinned = tile is not None and (tile.channels_per_thread is not None or tile.positions_per_thread is not None)
    # Left to the planner, tensor cores only where the GEMM is deep and wide enough to pay for
    # staging the input (measured: K = 24..36 or 16 output channels ran faster on FFMA).
    worth_it = (cin // groups) * taps >= MMA_MIN_K and cout >= MMA_MIN_CHANNELS
    # the slab engine is the box kernel on tensor cores (a tuner's slab candidate asks for it too)
    asks_slab = (tile is not None and tile.engine == "slab") or slab is not None
    if asks_slab and tile is not None and tile.tensor_cores is False:
        raise PlanError(["tile.engine: slab runs on tensor cores, but tile.tensor_cores is false"])
    asks_wgmma = (tile is not None and tile.wgmma is True) or (slab is not None and slab.wgmma == 1)  # on wgmma
    if asks_wgmma and tile is not None and tile.tensor_cores is False:
        raise PlanError(["tile.wgmma: wgmma runs on tensor cores, but tile.tensor_cores is false"])
    want_mma = True if (asks_slab or asks_wgmma) else tile.tensor_cores if (tile is not None and tile.tensor_cores is not None) \
        else (worth_it and not ffma_pinned)
    mma_why_not = [
        why
        for why, bad in (
            ("the conv has groups", groups > 1),
            ("a pool sits between the conv and the output", len(levels) > 1),
            ("channels are reduced one at a time", not c_in_box),
            ("the conv is transposed (a gather over taps, on fp32 FFMA only)", spec.conv.transposed),
        )
        if bad
    ]
    if asks_slab and mma_why_not:
        raise PlanError([f"tile.engine: the slab engine cannot run this layer: {'; '.join(mma_why_not)} (it runs on tensor cores)"])
    if tile is not None and tile.tensor_cores and mma_why_not:
        raise PlanError([f"tile.tensor_cores: cannot use tensor cores here: {'; '.join(mma_why_not)}"])
    mma = None
    products = 1 if slab_in_tf32(spec) else 3  # (the slab engine's, on either instruction)

    def wgmma_tiling(slab_h: int = 0, prefetch: int = 0, box_slabs: int = 0) -> SlabTiling | None:
        return _wgmma_tiling(tile, t1, srole, bool(reductions), cout, cin // groups, in3, k3, s3, p3, d3, role["c"] == "F",
                             products, target, slab_h, prefetch, exact_sums, box_slabs)

    if asks_wgmma:  # (want_mma is then true)
        if mma_why_not:
            raise PlanError([f"tile.wgmma: the slab engine cannot run this layer: {'; '.join(mma_why_not)}"])
        why = wgmma_why_not(cin // groups, k3, srole, products, target, exact_sums)
        if why:
            raise PlanError([f"tile.wgmma: the slab engine cannot run this layer on wgmma: {'; '.join(why)}"])
        mma = wgmma_tiling(slab.slab_h, slab.prefetch, slab.box_slabs) if slab is not None else wgmma_tiling()
        if mma is None and slab is not None and slab.prefetch == 1 and wgmma_tiling(slab.slab_h) is not None:
            raise PlanError(["tile.wgmma: no slab of this layer can prefetch the next one (a box of one slab, exact sums, or no "
                             f"registers left for the next slab's rows beside its accumulators: at most {WGMMA_MAX_REGS} estimated)"])
        if mma is None:
            raise PlanError(["tile.wgmma: the slab engine's staged planes and weights do not fit in shared memory"])
    elif want_mma and not mma_why_not:
        # a 1x1 conv, unstrided, with a reduction after it, in 3xTF32 (the box fold's second kernel):
        # measured faster on wgmma, with the next slab prefetched (v46); in TF32 (one product, no
        # split) not timed
        one_tap_reduction = bool(reductions) and math.prod(k3) == 1 and all(st == 1 for st in s3) and products == 3
        # (exact sums with at most WGMMA_EXACT_MIN_CHANNELS output channels stay on mma.sync: wgmma's
        # 64-channel M tile would be half padding)
        if SLAB_WGMMA_DEFAULT and slab is None and (tile is None or (tile.wgmma is None and tile.box is None)) \
                and (not reductions or one_tap_reduction) and not (exact_sums and cout <= WGMMA_EXACT_MIN_CHANNELS):
            # (the planner's default on sm_90a where measured faster: None where wgmma_why_not refuses the layer)
            mma = (one_tap_reduction and wgmma_tiling(prefetch=1)) or wgmma_tiling()
        if mma is None:
            mma = _mma_tiling(tile, t1, srole, bool(reductions), cout, cin // groups, in3, k3, s3, p3, d3, role["c"] == "F", target,
                              (slab.wm, slab.wn) if slab is not None and slab.wm else None)
            if mma is not None and slab_in_tf32(spec):
                mma = replace(mma, products=1)
        if mma is None and asks_slab:
            raise PlanError(["tile.engine: the slab engine's staged input and weights do not fit in shared memory"])
        if mma is None and tile is not None and tile.tensor_cores:
            raise PlanError(["tile.tensor_cores: the staged input and weights do not fit in shared memory"])
    split_channels = spread_out = False
    if mma is not None:
        box = mma.box
        ct, pt = 8, 16
        threads = mma.threads
        thread_tiles = tile_iters = 0
    else:
        def widest(choices):
            return next(c for c in choices if cout_g % c == 0 and c <= cout and c <= (ffma_ct or 8)) if c_in_box else 1

        ct_default = widest((8, 4, 2, 1))
        if len(levels) >= 3 and tile_pt_default(t1, w_in_box) * ct_default > NESTED_POOL_TILE:
            # Two or more pools: every level holds its own CT x PT accumulators and its level
            # below's results at once; measured, 8 x 3 spills with two pools and 4 x 3 does not.
            ct_default = widest((4, 2, 1))
        ct = pick(lambda v: v, ct_default, "channels_per_thread")
        if c_in_box and cout_g % ct:
            raise PlanError([f"tile.channels_per_thread: {ct} must divide the channels per group ({cout_g})"])
        if not c_in_box and ct != 1:
            raise PlanError(["tile.channels_per_thread: must be 1 when channels are reduced one at a time"])
        pt = pick(lambda v: v, tile_pt_default(t1, w_in_box), "positions_per_thread")
        if not w_in_box and pt != 1:
            raise PlanError(["tile.positions_per_thread: must be 1 when width is reduced one position at a time"])
        heavy = False
        if not reductions and spread:
            # (the conv outputs behind one T1 value: a pool's window, at the pools' strides)
            macs_per_value = (cin // groups) * taps * math.prod(levels[0]["out"]) / math.prod(t1[1:])
            planned = (ct, pt)
            ct, pt, heavy = _spread_heavy_tiles(ct, pt, t1, macs_per_value, tile is None or tile.channels_per_thread is None,
                                                tile is None or tile.positions_per_thread is None)
            spread_out = (ct, pt) != planned

        target_threads = 256
        # A reduction over channels whose kept part is small: the channels are split across a
        # cluster of blocks, one channel chunk per block, so each block stages only its weights.
        kept = math.prod(t1[AXES.index(a)] for a in AXES if srole[a] == "F")
        split_channels = bool(reductions) and srole["c"] == "R1" and kept <= 64 and cout // ct >= 2
        box = [1, 1, 1, 1]
        if split_channels:
            box[0] = _round_up(_ceil_div(cout, min(8, cout // ct)), ct)
        elif c_in_box:
            box[0] = _balanced(t1[0], 64, ct)
        if w_in_box:
            box[3] = _balanced(t1[3], 16 * pt, pt)
        per_row = (box[0] // ct) * _ceil_div(box[3], pt)
        rows = max(1, target_threads // per_row)
        if not reductions and not heavy and stacked:
            rows *= 4  # four register tiles per thread amortize the block's weight staging
        # Rows along H, then D; but a reduction over depth that keeps the rows (a min over depth)
        # takes its depths first: a box of few kept elements, each folding several depths, where
        # rows first gave every thread about CT x PT kept elements' accumulators (and their
        # indices) to hold in registers across the boxes (DEPTH_REDUCTION_DEPTHS_FIRST).
        depths_first = DEPTH_REDUCTION_DEPTHS_FIRST and bool(reductions) and srole["d"] == "R1" and srole["h"] == "F"
        for a in ("d", "h") if depths_first else ("h", "d"):
            i = AXES.index(a)
            if srole[a] in ("F", "R1"):
                box[i] = _balanced(t1[i], rows)
                rows = max(1, rows // box[i])
        if w_in_box and rows > 1:  # thin tensors (1D, or H and D small): widen the box along W
            box[3] = _balanced(t1[3], box[3] * rows, pt)
        if tile is not None and tile.box is not None:
            want = tuple(tile.box)
            if len(want) != 1 + nd:
                raise PlanError([f"tile.box: expected {1 + nd} extents (channels and {nd} spatial), got {list(want)}"])
            box = [want[0], *_spatial3(want[1:], 1)]
            for a, b in zip(AXES, box):
                if srole[a] not in ("F", "R1") and b != 1:
                    raise PlanError([f"tile.box: the {AXIS_NAMES[a]} extent must be 1 (that axis is reduced one at a time)"])
            if box[0] % ct:
                raise PlanError([f"tile.box: the channel extent {box[0]} must be a multiple of channels_per_thread {ct}"])
        box = [min(b, e) if srole[a] in ("F", "R1") else 1 for a, b, e in zip(AXES, box, t1)]
        box[0] = _round_up(box[0], ct)
        thread_tiles = (box[0] // ct) * box[1] * box[2] * _ceil_div(box[3], pt)
        cap = target.max_threads if reductions else target_threads
        threads = pick(lambda v: v, min(cap, _round_up(thread_tiles, 32)), "threads")
        tile_iters = _ceil_div(thread_tiles, threads)

    f_axes = [a for a in AXES if role[a] == "F"]
    r1_axes = [a for a in AXES if role[a] == "R1"]
    f1_axes = [a for a in AXES if srole[a] == "F"]  # what reduction level 1 keeps (batched: + the outer axes)
    tiles = {a: _ceil_div(t1[AXES.index(a)], box[AXES.index(a)]) if a in f_axes else 1 for a in AXES}
    chunks = {a: _ceil_div(t1[AXES.index(a)], box[AXES.index(a)]) if a in r1_axes else 1 for a in AXES}
    f_tiles = math.prod(tiles.values())
    r1_chunks = math.prod(chunks.values())
    # Few kept tiles per sample (e.g. a full reduction): a cluster of blocks shares each tile's
    # chunks and joins its partials through distributed shared memory, in rank order. A target
    # without clusters gets a cluster of 1: one block walks all of a tile's chunks.
    cluster = min(target.cluster_limit, r1_chunks) if reductions and f_tiles <= 16 and r1_chunks >= 2 else 1
    split_channels = split_channels and chunks["c"] == cluster  # then a block's chunks share one channel range
    blocks_per_sample = f_tiles * cluster

    # ---- the tail's owners: F elements of the box, several lanes each when F is small ---------
    nf = math.prod(box[AXES.index(a)] for a in f1_axes)
    nr = math.prod(box[AXES.index(a)] for a in r1_axes)
    lanes = 1
    if reductions:
        while lanes * 2 * nf <= threads and lanes * 2 <= nr:
            lanes *= 2
    owner_iters = _ceil_div(nf * lanes, threads)

    tiling = BoxTiling(
        mma=mma, box=box, ct=ct, pt=pt, threads=threads, thread_tiles=thread_tiles, tile_iters=tile_iters,
        split_channels=split_channels, f_axes=f_axes, r1_axes=r1_axes, f1_axes=f1_axes, tiles=tiles, chunks=chunks,
        f_tiles=f_tiles, r1_chunks=r1_chunks, cluster=cluster, blocks_per_sample=blocks_per_sample, nf=nf, nr=nr,
        lanes=lanes, owner_iters=owner_iters,
    )
    if spread_out:
        # The spread tiles only where a sample gets more threads: smaller tiles on as many threads
        # only lose register reuse (256 -> 8 channels 3x3 at 64^2, avg pool, fp32: 0.38 ms with 8 x 4
        # tiles, 0.56 with 4 x 4 on the same 256 threads; H100, NOTES v48)
        plain = _box_tiling(spec, levels, t1, role, srole, reductions, in3, k3, s3, p3, d3, taps, target, slab,
                            exact_sums, ffma_ct, spread=False, stacked=stacked)
        if threads * blocks_per_sample <= plain.threads * plain.blocks_per_sample:
            return plain
    return tiling


def _spread_heavy_tiles(ct: int, pt: int, t1: tuple, macs_per_value: float, can_ct: bool, can_pt: bool) -> tuple[int, int, bool]:
    """The FFMA register tile (CT, PT) for a layer of few outputs and a deep K, and whether its
    tiles are still heavy (FFMA_SPREAD_TILES, FFMA_HEAVY_TILE_MACS). `can_ct` / `can_pt`: the planner
    chose that extent (a tile's field pins it)."""
    def tiles(c, p):
        return _ceil_div(t1[0], c) * t1[1] * t1[2] * _ceil_div(t1[3], p)

    def heavy(c, p):
        return c * p * macs_per_value > FFMA_HEAVY_TILE_MACS

    while tiles(ct, pt) < FFMA_SPREAD_TILES and heavy(ct, pt):
        if can_ct and ct > 1 and (ct >= pt or not can_pt):
            ct //= 2  # (a power of two dividing the channels per group: its half divides them too)
        elif can_pt and pt > 1:
            pt = max(1, pt // 2)
        else:
            break
    # (stacked four to a thread, a sample of 4 x FFMA_SPREAD_TILES tiles still has enough threads)
    return ct, pt, heavy(ct, pt) and tiles(ct, pt) < 4 * FFMA_SPREAD_TILES


def _box_memory(spec: LayerSpec, bt: BoxTiling, role: dict, reductions: list, batched: bool, fold, taps: int,
                target: Target) -> BoxMemory | None:
    """Pass 6, the box engines' shared memory: the staged weights (all channels, or the box's), the
    box and reduction buffers, the tensor cores' raw weight staging, and a cluster sized at launch
    where its blocks fill an SM each. None where an avg-pool fold's weights do not fit (the caller
    plans again without rewrites); TargetError where the block's shared memory exceeds the target's."""
    cin, cout, groups = spec.input.channels, spec.conv.out_channels, spec.conv.groups
    mma, box, ct, threads, nf, lanes = bt.mma, bt.box, bt.ct, bt.threads, bt.nf, bt.lanes
    split_channels, cluster, blocks_per_sample = bt.split_channels, bt.cluster, bt.blocks_per_sample
    f_tiles, r1_chunks = bt.f_tiles, bt.r1_chunks
    weight_channels = box[0] if (role["c"] == "F" or split_channels) else cout
    weight_floats = weight_channels * (cin // groups) * taps
    direct_fold = bool(mma is not None and mma.direct_fold and nf == 1 and lanes == threads)
    box_floats = math.prod(box) if reductions and not direct_fold else 0
    red_floats = 2 * max(nf * lanes, threads if batched else 0) if reductions else 0
    if mma is not None:  # [K_PAD][WS] weights, then the staged input slab
        w_stride, w_smem_floats, x_floats, weights_in_smem = mma.ws, mma.w_floats, mma.x_floats, True
    else:
        # Row stride of the staged weights: padded off multiples of 32 so that the transposing
        # stores spread over banks, and kept a multiple of 4 for 16-byte loads.
        w_stride = weight_channels + (4 if weight_channels % 32 == 0 else 0)
        w_smem_floats = w_stride * (cin // groups) * taps
        x_floats = 0
        weights_in_smem = 4 * (w_smem_floats + box_floats + red_floats) <= target.smem_per_block and weight_channels % ct == 0
    if fold is not None and not weights_in_smem:  # the fold builds W' while staging: no room, no fold
        return None
    smem_floats = (w_smem_floats if weights_in_smem else 0) + x_floats + box_floats + red_floats
    # Tensor cores stage their weights through x_s (free until the first slab): channels' weights
    # copied as they lie in memory, then written out as B a (c, ci) pair per thread. RAW_STRIDE is
    # odd so that lanes 1 channel apart read distinct banks; passes of a multiple of 32 channels
    # keep a warp's stores in one K row. Folds with more than 64 taps (not unrolled) stay direct.
    w_raw = None
    if mma is not None:
        raw_per_c = (cin // groups) * (math.prod(fold["orig_kernel"]) if fold is not None else taps)
        raw_stride = raw_per_c | 1
        raw_floats = x_floats - (WGMMA_ALIGN_FLOATS if mma.wgmma else 0)  # (the planes start 1024-byte aligned)
        raw_c = min(weight_channels, raw_floats // raw_stride)
        raw_c = raw_c - raw_c % 32 if raw_c >= 32 and raw_c < weight_channels else raw_c
        if raw_c >= 8 and (fold is None or taps <= 64):
            iters = _ceil_div(raw_c * raw_per_c, threads)  # copied floats per thread, in near-equal batches of <= 8
            w_raw = {"c": raw_c, "stride": raw_stride, "batch": _ceil_div(iters, _ceil_div(iters, 8)),
                     "taps0": raw_per_c // (cin // groups)}
    smem_bytes = 4 * smem_floats
    if smem_bytes > target.smem_per_block:
        raise TargetError(
            f"{spec.name}: tile: needs {smem_bytes} bytes of shared memory (box {box}, {nf * lanes} reduction slots), "
            f"more than the {target.smem_per_block} a block can have on {target.arch}; choose a smaller tile.box"
        )

    # A cluster of blocks that fill an SM each is sized at launch (1 .. cluster blocks): a GPU's
    # processor clusters hold fewer large clusters of them than their SMs would suggest, and a
    # small batch wants more. One that splits the weights' channels by rank cannot be resized.
    cluster_at_launch = cluster > 1 and not split_channels and 2 * (smem_bytes + BLOCK_RESERVED_SMEM) > target.smem_per_sm
    if cluster_at_launch:
        cluster = min(target.cluster_limit_at_launch, r1_chunks)
        blocks_per_sample = f_tiles * cluster

    return BoxMemory(
        weight_channels=weight_channels, weight_floats=weight_floats, direct_fold=direct_fold, box_floats=box_floats,
        red_floats=red_floats, w_stride=w_stride, w_smem_floats=w_smem_floats, x_floats=x_floats,
        weights_in_smem=weights_in_smem, w_raw=w_raw, smem_bytes=smem_bytes, cluster=cluster,
        cluster_at_launch=cluster_at_launch, blocks_per_sample=blocks_per_sample,
    )


@dataclass(frozen=True)
class BoxAccess:
    """How the box engines' threads walk rows (`_box_access`)."""

    conv_span: int  # the input positions along W one register tile's conv reads
    in_vec: int  # floats per input load (1, 2 or 4)
    out_vec: int  # floats per output store
    unroll_cin: bool  # the input channels unrolled in the conv (else a loop)
    # Level 0's row loads from an aligned start IN_LEAD positions before a tile's first tap, in
    # `in_vectors` vectors of `in_vec` (0: the loads start at the first tap; see `_box_access`).
    in_lead: int = 0
    in_vectors: int = 0


def _box_access(levels: list, bt: BoxTiling, t1: tuple, in3: tuple, k3: tuple, s3: tuple, p3: tuple, d3: tuple,
                cin_g: int, taps: int, transposed: bool, reductions: list) -> BoxAccess:
    """Pass 6b, the box engines' row accesses: each level's step along W (the level's "step"), the
    span of input a register tile reads, the widest aligned input loads and output stores, whether
    the channels unroll, and a pool level's row span (`_row_span`, its "row_span")."""
    box, pt, ct, tiles, chunks = bt.box, bt.pt, bt.ct, bt.tiles, bt.chunks
    # Body step along W: level k's register tile covers positions w0 + i * step[k].
    step = 1
    for lvl in reversed(levels):
        lvl["step"] = step
        if lvl["kind"] == "pool":
            step *= lvl["stride"][2]
    conv_span = (pt - 1) * levels[0]["step"] * s3[2] + (k3[2] - 1) * d3[2] + 1

    # Input rows are read in vectors when every thread's first input position is aligned: rows
    # start at multiples of IN_W, a tile starts pt * step * stride after its neighbour, a box
    # box_w * step * stride after its neighbour (only when there are several boxes along W).
    level0_w_stride = levels[0]["step"] * s3[2]
    # (the widest vector every tile's first output and every row start align to)
    row_vec = _widest((4, 2, 1), in3[2], pt * level0_w_stride,
                      box[3] * level0_w_stride if (tiles["w"] > 1 or chunks["w"] > 1) else 0)
    in_vec = _widest((4, 2, 1), row_vec, p3[2])  # ... and the padding: the first tap itself
    # (pool windows shift level 0's start by odd offsets: no vectors under a pool)
    # (and no wider than the span a tile reads: a power of two, since a load is a float4 or a float2 --
    # a span of 3 once made IN_VEC 3, whose float2 loads left every third float unset)
    in_vec = next(v for v in (4, 2, 1) if v <= min(in_vec, conv_span)) if conv_span >= 2 and len(levels) == 1 else 1
    # Padding that leaves the first tap unaligned (a 3x3 conv's padding 1) would make those loads
    # single elements: one load instruction per value, and a warp's loads of one row then cost the
    # L1 cache as many wavefronts each as a vector's would (depthwise convs ran L1-bound, 97% of its
    # throughput, on them). Instead the tile loads from the aligned start IN_LEAD = (-P) mod VEC
    # before its first tap, whole vectors only: each lies wholly inside the row or wholly in its
    # padding, since the start and the row's length are multiples of VEC.
    in_lead = in_vectors = 0
    if len(levels) == 1 and conv_span >= 2 and not transposed and row_vec > in_vec:
        in_vec, in_lead = row_vec, (-p3[2]) % row_vec
        in_vectors = -(-(in_lead + conv_span) // row_vec)
    if transposed:
        # A transposed conv gathers: output w reads input (w + P_W - kw * DIL_W) / S_W where that
        # divides evenly. Level 0 loads the span of numerators w + P_W - kw * DIL_W the tile needs
        # (CONV_SPAN of them, the stride's multiples valid), one element at a time.
        conv_span = (pt - 1) * levels[0]["step"] + (k3[2] - 1) * d3[2] + 1
        in_vec = 1
    if len(levels) == 2:
        levels[1]["row_span"] = _row_span(levels, in3, k3, s3, p3, cin_g, transposed, bt.mma is not None, pt,
                                          box[3] if (tiles["w"] > 1 or chunks["w"] > 1) else 0)
    # Without a tail, a thread stores PT consecutive outputs of a row: vectorized when aligned.
    out_vec = 1 if reductions else _widest((4, 2, 1), t1[3], pt, box[3] if tiles["w"] > 1 else 0)
    fmas_per_conv_row = cin_g * taps * ct * pt
    unroll_cin = fmas_per_conv_row <= 2048  # larger bodies: ci stays a loop (compile time, registers)
    return BoxAccess(conv_span=conv_span, in_vec=in_vec, out_vec=out_vec, unroll_cin=unroll_cin, in_lead=in_lead,
                     in_vectors=in_vectors)


def _box_occupancy(bt: BoxTiling, smem_bytes: int, reductions: list, levels: list, tile, settings: Settings,
                   target: Target) -> int:
    """Pass 6c, the blocks per SM the box engines ask the compiler for (registers per thread follow
    from it): a tile's or the planner settings' when given."""
    # Occupancy: without a tail, ask the compiler for registers that let up to 3 blocks share
    # an SM (when shared memory allows): measured faster than fewer blocks with more registers.
    mma, threads = bt.mma, bt.threads
    min_blocks = 1
    if mma is not None:  # two blocks per SM when shared memory and registers allow: one stages while the other computes
        # accumulators + fragments, addresses and the epilogue (wgmma: NB / 2 accumulators)
        regs = wgmma_registers(mma.nb, mma.stage_iters, mma.prefetch, mma.packed_w, bool(settings.exact_sums)) if mma.wgmma \
            else 4 * mma.wm * mma.wn + 64
        min_blocks = 2 if 2 * (smem_bytes + BLOCK_RESERVED_SMEM) <= target.smem_per_sm and 2 * threads * max(regs, 128) <= target.regs_per_sm else 1
    elif not reductions and len(levels) == 1:
        fit = min(target.smem_per_block // max(1, smem_bytes), 2048 // threads)
        # never below 96 registers: below that the fully unrolled conv spills
        min_blocks = next((mb for mb in (3, 2) if mb <= fit and target.regs_per_sm // (mb * threads) // 8 * 8 >= 96), 1)
    if tile is not None and tile.min_blocks:
        min_blocks = tile.min_blocks
    elif settings.min_blocks:
        min_blocks = settings.min_blocks
    return min_blocks


def plan_whole(spec: LayerSpec, igemm_config: "igemm_engine.IgemmConfig | None" = None, target: Target | None = None,
               tma_config: "tma_engine.TmaConfig | None" = None, settings: Settings = DEFAULT_SETTINGS) -> dict:
    """The plan of `spec` as one kernel, split nowhere: what `build_plan` returns for a layer it
    does not rewrite, sequence or split (`tail.pool_split` asks it where the whole layer would run)."""
    target = target or targets.DEFAULT
    may_rewrite = spec.rewrites and settings.rewrites
    nd = spec.ndim
    geo = spec.conv_geometry()
    consts: list[Constant] = []
    shapes = spec.shapes()

    cin, cout, groups = spec.input.channels, spec.conv.out_channels, spec.conv.groups
    in3 = _spatial3(tuple(spec.input.size), 1)
    k3, s3 = _spatial3(geo["kernel"], 1), _spatial3(geo["stride"], 1)
    p3, d3 = _spatial3(geo["padding"], 0), _spatial3(geo["dilation"], 1)
    conv_out = shapes[0].sizes[1:]
    o3 = _spatial3(conv_out, 1)
    taps = k3[0] * k3[1] * k3[2]

    # ---- passes: the body's levels, then the rewrites, then the tail's reductions -----------------
    levels, tail_start, channel_norm = _body_levels(spec, shapes, o3, consts)
    # ---- rewrite: an avg-pool right after the conv folds into the conv ----------------------
    rewrites: list[str] = []
    fold = None
    transposed = spec.conv.transposed
    if may_rewrite and len(levels) > 1 and not transposed and _can_fold_avg_pool(spec, levels):
        fold, note, k3, s3, o3 = _fold_avg_pool(levels, k3, nd)
        rewrites.append(note)
        taps = k3[0] * k3[1] * k3[2]
    # ---- rewrite: scalar affine ops right after the conv fold into its weights and bias ------
    affine = _affine_fold(spec, levels[0], consts) if may_rewrite else None
    if affine is not None:
        rewrites.append(affine["summary"])
    t1 = (cout, *levels[-1]["out"])  # T1 extents (c, d, h, w)

    reductions, role, batched, srole = _tail_reductions(spec, shapes, t1, tail_start, consts)

    # ---- passes 5 and 6: the box engines' tiling, shared memory, row accesses and occupancy -------
    tile = spec.tile
    cout_g = cout // groups
    bt = _box_tiling(spec, levels, t1, role, srole, reductions, in3, k3, s3, p3, d3, taps, target, settings.slab,
                     bool(settings.exact_sums), settings.ffma_ct, stacked=settings.stacked_tiles)
    mma, box, ct, pt, threads = bt.mma, bt.box, bt.ct, bt.pt, bt.threads
    thread_tiles, tile_iters, split_channels = bt.thread_tiles, bt.tile_iters, bt.split_channels
    f_axes, r1_axes, f1_axes, tiles, chunks = bt.f_axes, bt.r1_axes, bt.f1_axes, bt.tiles, bt.chunks
    f_tiles, r1_chunks, nf, nr, lanes, owner_iters = bt.f_tiles, bt.r1_chunks, bt.nf, bt.nr, bt.lanes, bt.owner_iters
    mem = _box_memory(spec, bt, role, reductions, batched, fold, taps, target)
    if mem is None:  # an avg-pool fold whose weights do not fit: plan again without rewrites
        return build_plan(spec, igemm_config, target, tma_config, replace(settings, rewrites=False))
    weight_channels, weight_floats, direct_fold = mem.weight_channels, mem.weight_floats, mem.direct_fold
    box_floats, red_floats, w_stride, w_smem_floats = mem.box_floats, mem.red_floats, mem.w_stride, mem.w_smem_floats
    x_floats, weights_in_smem, w_raw, smem_bytes = mem.x_floats, mem.weights_in_smem, mem.w_raw, mem.smem_bytes
    cluster, cluster_at_launch, blocks_per_sample = mem.cluster, mem.cluster_at_launch, mem.blocks_per_sample

    in_per_sample = cin * math.prod(in3)
    out_shape = shapes[-1].sizes
    out_per_sample = math.prod(out_shape) if out_shape else 1
    for what, n in (("input", in_per_sample), ("output", out_per_sample), ("T1", math.prod(t1))):
        if n > INT32_MAX:
            raise PlanError([f"input.size: one sample's {what} has {n} elements, more than 2^31 - 1"])
    if blocks_per_sample > INT32_MAX:
        raise PlanError([f"tile: {blocks_per_sample} blocks per sample exceed gridDim.x's limit"])

    access = _box_access(levels, bt, t1, in3, k3, s3, p3, d3, cin // groups, taps, transposed, reductions)
    conv_span, in_vec, out_vec, unroll_cin = access.conv_span, access.in_vec, access.out_vec, access.unroll_cin
    min_blocks = _box_occupancy(bt, smem_bytes, reductions, levels, tile, settings, target)
    params = list(spec.params().items())

    # ---- pass 7: the engine (a GEMM engine's plan replaces the box's launch values) -----------
    engine, tp, ig = _choose_engine(spec, levels, reductions, fold, o3, taps, mma, channel_norm, igemm_config,
                                    tma_config, target, settings)
    if tp is not None:
        threads, smem_bytes, min_blocks = tp.threads, tp.smem_bytes, tp.blocks_per_sm
        cluster, cluster_at_launch = 1, False
    if ig is not None:
        threads, smem_bytes, min_blocks = ig.threads, ig.smem_bytes, ig.min_blocks
        if tile is not None and tile.min_blocks:
            min_blocks = tile.min_blocks
        elif settings.min_blocks:
            min_blocks = settings.min_blocks
        cluster, cluster_at_launch = 1, False
    asked_walk = settings.slab.walk if settings.slab is not None else 0
    # (no reduction: no cluster, no channels split between blocks)
    if (asked_walk == 1 or (SLAB_WALK and asked_walk == 0)) and engine == "slab" and mma is not None and mma.wgmma \
            and not mma.prefetch and not reductions and tiles["c"] == 1 and weights_in_smem:
        # (every box the same channels: the weights staged once a block; not beside a prefetch, whose
        # registers are at their limit already: the stem's spilled 560 bytes walking)
        mma = replace(mma, walk=True)
    return KernelPlan(
        version=__version__,
        name=spec.name,
        kernel_name=f"specgen_{spec.name}",
        spec_hash=spec.shape_hash,
        spec_yaml=spec_yaml(spec),
        ndim=nd,
        cin=cin,
        cout=cout,
        groups=groups,
        cin_g=cin // groups,
        cout_g=cout_g,
        in_=in3,
        kernel=k3,
        stride=s3,
        padding=p3,
        dilation=d3,
        conv_out=o3,
        taps=taps,
        has_bias=spec.conv.bias,
        levels=levels,
        t1=t1,
        reductions=reductions,
        role=role,
        f_axes=f_axes,
        f1_axes=f1_axes,
        batched=batched,
        tree_top=1 << max(0, (threads - 1).bit_length() - 1),  # the largest power of two below threads
        r1_axes=r1_axes,
        box=box,
        tiles=tiles,
        chunks=chunks,
        ct=ct,
        pt=pt,
        threads=threads,
        thread_tiles=thread_tiles,
        tile_iters=tile_iters,
        blocks_per_sample=blocks_per_sample,
        cluster=cluster,
        r1_chunks=r1_chunks,
        cluster_at_launch=cluster_at_launch,
        chunk_iters=_ceil_div(r1_chunks, cluster),
        f_tiles=f_tiles,
        nf=nf,
        nr=nr,
        lanes=lanes,
        owner_iters=owner_iters,
        weights_in_smem=weights_in_smem,
        weight_channels=weight_channels,
        weight_floats=weight_floats,
        w_stride=w_stride,
        w_smem_floats=w_smem_floats if weights_in_smem else 0,
        box_floats=box_floats,
        red_floats=red_floats,
        smem_bytes=smem_bytes,
        conv_span=conv_span,
        in_vec=in_vec,
        in_lead=access.in_lead,
        in_vectors=access.in_vectors,
        out_vec=out_vec,
        channels_fastest=bool(reductions),
        split_channels=split_channels,
        min_blocks=min_blocks,
        unroll_cin=unroll_cin,
        in_per_sample=in_per_sample,
        out_per_sample=out_per_sample,
        out_shape=list(out_shape),
        params=[{"name": n, "shape": list(s), "channels": s[0]} for n, s in params],
        inputs=input_entries(spec, spec.inputs()),
        constants=consts,
        # (a transposed conv: each output meets about taps / stride-volume of its taps)
        flops_per_sample=2 * math.prod(t1) * (cin // groups) * taps * math.prod(l.get("window", 1) for l in levels)
        // (math.prod(s3) if transposed else 1),
        transposed=transposed,
        output_padding=_spatial3(geo["output_padding"], 0) if transposed else (0, 0, 0),
        rewrites=rewrites,
        fold=fold,
        mma=mma,
        affine=affine,
        direct_fold=direct_fold,
        x_floats=x_floats,
        w_raw=w_raw,
        engine=engine,
        io_ctype=BOX_IO_CTYPE.get(spec.precision, "float") if engine == "ffma" else "float",
        igemm=ig,
        tma=tp,
        pointwise=levels[0]["pointwise"],
        channel_norm=channel_norm,
        precision=spec.precision,
        target=target.summary(),
        settings=settings,
    )


def _choose_engine(spec: LayerSpec, levels: list, reductions: list, fold, o3: tuple, taps: int, mma, channel_norm,
                   igemm_config, tma_config, target: Target, settings: Settings) -> tuple[str, object, object]:
    """Pass 7, the engine: Hopper's TMA engine where it runs the layer and pays (`_choose_tma`),
    else the implicit GEMM (`_choose_igemm`), else the box engines' choice (slab where pass 5 put the
    conv on tensor cores, else FFMA). Returns (engine, its TmaPlan or None, its IgemmPlan or None);
    NotOneKernel where a softmax over the channels would need the TMA epilogue, PlanError where an
    extra input meets an engine that cannot read it."""
    # A tf32 conv of few input channels (the stem, `slab_in_tf32`) left to the planner takes the
    # slab engine: it stages each input once and forms the taps in shared memory, where the TMA
    # engine loads every tap of 8 padded channels. Not where only the TMA engine can run the layer
    # (a softmax over the channels, an extra input).
    slab_first = mma is not None and mma.products == 1 and igemm_config is None and tma_config is None \
        and (spec.tile is None or spec.tile.engine is None) and channel_norm is None and not spec.inputs()
    tp = None if igemm_config is not None or slab_first else _choose_tma(spec, levels, reductions, fold, tma_config, target, settings)
    ig = None if tp is not None or slab_first else _choose_igemm(spec, levels, reductions, fold, o3, taps, igemm_config, target)
    engine = "tma" if tp is not None else "igemm" if ig is not None else ("slab" if mma is not None else "ffma")
    if channel_norm is not None and engine != "tma":
        norm_at = channel_norm["index"]
        what = "a statistic stage over positions" if channel_norm["axis"] == "rows" else f"a {channel_norm['op']} over the channels"
        raise NotOneKernel([f"epilogue[{norm_at}] {spec.epilogue[norm_at].op}: {what} runs in the TMA "
                            f"engine's epilogue only, and this layer plans for the {engine} engine"])
    inputs = list(spec.inputs())
    if inputs and engine not in INPUT_ENGINES:
        raise PlanError([f"epilogue: an extra input ({', '.join(inputs)}) is read by the {' and '.join(INPUT_ENGINES)} "
                         f"engines (and the tail engine after a statistic stage); this layer plans for the {engine} engine"])
    return engine, tp, ig


def forward_equivalent(spec: LayerSpec) -> LayerSpec | None:
    """The plain conv a stride-1 transposed conv equals, or None. With stride 1, output o of
    nn.ConvTranspose sums x[o + padding - dilation * k] * w[ci, co, k] over taps k: read with the
    taps reversed (k' = kernel - 1 - k) that is x[o - pad' + dilation * k'], a plain conv padded
    pad' = dilation * (kernel - 1) - padding, whose weight is w with its two channel axes swapped
    (per group) and its taps reversed (`specgen.torchop.forward_weight`). Output padding (only
    allowed with a dilation) would pad one side only, and padding beyond dilation * (kernel - 1)
    would crop: those stay transposed."""
    if not spec.conv.transposed:
        return None
    geo = spec.conv_geometry()
    if any(s != 1 for s in geo["stride"]) or any(geo["output_padding"]):
        return None
    pad = [d * (k - 1) - p for k, p, d in zip(geo["kernel"], geo["padding"], geo["dilation"])]
    if min(pad) < 0:
        return None
    data = spec.model_dump(mode="json")
    data["conv"].update(transposed=False, output_padding=0, padding=pad)
    return LayerSpec.model_validate(data)


# In TF32 mode cuDNN computes the convs of a few input channels in fp32: measured on an H200
# (benchmarks/NOTES.md v26), contiguous inputs of 1-8 channels give rel. L2 3e-8..3e-7 against
# float64 where TF32 operands give 3e-4, except larger kernels with more output channels (a 7x7
# stem of 64 channels: TF32). "PyTorch's own TF32 error" there is fp32's, so specgen computes
# such layers in 3xTF32 (or FFMA), on the engines the fp32 mode takes. They are memory-bound: the
# same measurement found them 0.6-1.7x the time of the TF32 kernels (8 channels slower, 3 faster:
# a TF32 kernel pads 3 channels to 8). Transposed and grouped convs keep TF32, as cuDNN does.
EXACT_TF32_MAX_CHANNELS = 8
EXACT_TF32_MAX_TAPS = 27  # up to 3x3x3 / 5x5 always; larger kernels only with few output channels
EXACT_TF32_MAX_OUT_CHANNELS = 32
EXACT_TF32_NOTE = (f"tf32 layer of at most {EXACT_TF32_MAX_CHANNELS} input channels computed to fp32 accuracy "
                   f"(3xTF32 or FFMA, as cuDNN computes such convs in TF32 mode)")


# A tf32 conv of at most this many input channels that `exact_tf32` leaves in TF32 (large kernels,
# many output channels: the ResNet stem) runs its slab products in TF32 (one mma per k-step, not
# three), as cuDNN runs such a conv, and takes the slab engine: measured on an H200 on the 3-channel
# stem (benchmarks/NOTES.md, v32), where the TMA engine pads the channels to 8 (the slab to 4).
# Layers of 5-8 channels, which the TMA engine pads less, were not timed: they keep it.
SLAB_TF32_MAX_CHANNELS = 4


def slab_in_tf32(spec: LayerSpec) -> bool:
    """Whether the slab engine multiplies in TF32 (one product per k-step): a tf32 layer of at most
    SLAB_TF32_MAX_CHANNELS input channels that is not computed exactly. Any other layer it runs
    (fp32, 16-bit on widened tensors, tf32 with more channels, whose cuDNN conv may run in fp32)
    stays in 3xTF32."""
    return spec.precision == "tf32" and spec.input.channels // spec.conv.groups <= SLAB_TF32_MAX_CHANNELS \
        and not exact_tf32(spec) and not spec.conv.transposed


def exact_tf32(spec: LayerSpec) -> bool:
    """Whether a `tf32` layer computes as an `fp32` one: a plain, ungrouped conv of at most
    EXACT_TF32_MAX_CHANNELS input channels, whose kernel has at most EXACT_TF32_MAX_TAPS taps or
    whose output has at most EXACT_TF32_MAX_OUT_CHANNELS channels."""
    if spec.precision != "tf32" or spec.conv.groups != 1 or spec.conv.transposed:
        return False
    taps = math.prod(spec.conv_geometry()["kernel"])
    small_kernel = taps <= EXACT_TF32_MAX_TAPS or spec.conv.out_channels <= EXACT_TF32_MAX_OUT_CHANNELS
    return spec.input.channels <= EXACT_TF32_MAX_CHANNELS and small_kernel


def _as_transposed(plan: dict, spec: LayerSpec, plain: LayerSpec) -> dict:
    """`plain`'s plan, presented as the user's transposed `spec`'s (`_presented_as`)."""
    pad = "x".join(map(str, plain.conv_geometry()["padding"]))
    note = (f"stride-1 transposed conv run as a plain conv (padding {pad}, the weights' channel axes swapped and "
            f"their taps reversed at launch, once per weight version)")
    return _presented_as(plan, spec, note, {"kind": "transposed_to_plain", "groups": spec.conv.groups})


def _presented_as(plan: dict, spec: LayerSpec, note: str, transform: dict) -> dict:
    """The plan of the layer `spec` was rewritten to, presented as `spec`'s: its banner shows the
    user's spec and the rewrite (`note`), and the launch hands the kernels the user's weights
    through `transform` first, then through whatever the rewritten layer's plan does to them."""
    return with_changes(
        plan,
        spec_hash=spec.shape_hash,
        spec_yaml=spec_yaml(spec),
        rewrites=[note, *plan["rewrites"]],
        weight_transforms=[*([transform] if transform else []), *plan.get("weight_transforms", [])],
    )


def _tile_pins_other_engine(tile) -> bool:
    """A tile that sets fields only the slab and FFMA engines have (left to the planner, they keep it there)."""
    return tile is not None and (
        tile.tensor_cores is False or tile.channels_per_thread is not None or tile.positions_per_thread is not None
        or tile.box is not None or tile.threads is not None or tile.wgmma is not None
    )


def _choose_tma(spec: LayerSpec, levels: list, reductions: list, fold, config, target: Target,
                settings: Settings = DEFAULT_SETTINGS):
    """The TMA engine's plan (Hopper), or None for the other engines. A tile that names an engine
    decides; left to the planner, the TMA engine takes every layer it can run, except fp32 layers
    with few input channels (the seeds' 8 channels run on the slab engine) and layers with too few
    multiply-adds per input byte to pay for its layout pass (`tma.worth_it`); a strided transposed
    conv runs its stride phases here, from as many input channels as the implicit GEMM's."""
    tile = spec.tile
    asked = "tma" if config is not None else (tile.engine if tile is not None else None)
    reasons = tma_engine.why_not(spec, levels, reductions, target)
    if fold is not None:
        reasons.append("an avg-pool is folded into the conv")
    if asked == "tma":
        if reasons:
            raise PlanError([f"tile.engine: the TMA engine cannot run this layer: {'; '.join(reasons)}"])
        if tile is not None and tile.tensor_cores is False:
            raise PlanError(["tile.engine: tma runs on tensor cores, but tile.tensor_cores is false"])
    elif asked is not None or reasons:
        return None
    elif _tile_pins_other_engine(tile) or (spec.input.channels < FP32_GEMM_MIN_CHANNELS and spec.precision == "fp32"):
        return None
    elif spec.conv.transposed and spec.input.channels < igemm_engine.TRANSPOSED_MIN_CHANNELS:
        return None  # a transposed conv of few channels: its phases' K is a handful of taps x channels (FFMA's)
    elif spec.conv.transposed and spec.inputs():
        # An extra input read in the epilogue, one value at a time: on the TMA engine (one block of
        # 8 consumer warps per SM, no registers left to hoist the loads) it waits on memory.
        # Measured on KernelBench 26: 2.18 ms on the implicit GEMM, 2.75 on the TMA engine's W pairs
        # (4.54 on its single phases); the TMA engine runs it only when a tile asks for it.
        return None
    elif not tma_engine.worth_it(spec) and not (settings.channels_last and tma_engine.reads_in_place(spec)) \
            and not tma_engine.row_norm_fits(spec):
        # (a channels-last input read in place pays no layout pass; a statistic stage over positions
        # the epilogue takes saves the conv's output's round trip: the family's 25, a stride-2 Conv3d
        # of 54 multiply-adds per input byte before a LayerNorm over W, ran 1.72x faster on it than as
        # the implicit GEMM and a tail kernel, layout pass included: benchmarks/row_norm.py, NOTES v51)
        return None
    try:
        # (the spill retry's one block per SM: the planner's tile without two blocks sharing an SM)
        return tma_engine.plan_tma(spec, target, config, two_blocks=settings.min_blocks != 1,
                                   channels_last=settings.channels_last)
    except ValueError as err:
        if asked is None:
            return None
        raise PlanError([f"tile: the TMA tile does not fit this layer: {err}"]) from None


def _choose_igemm(spec: LayerSpec, levels: list, reductions: list, fold, conv_out, taps: int, config=None,
                  target: Target = targets.DEFAULT):
    """The implicit-GEMM plan, or None for the other engines. A tile that names an engine decides;
    left to the planner, the implicit GEMM takes every layer it can run whose input channels are
    not too few for its K chunks (the seeds' 8 channels run faster on the slab engine)."""
    tile = spec.tile
    asked = "igemm" if config is not None else (tile.engine if tile is not None else None)
    reasons = igemm_engine.why_not(spec, levels, reductions)
    if fold is not None:
        reasons.append("an avg-pool is folded into the conv")
    if asked == "igemm" and reasons:
        raise PlanError([f"tile.engine: the implicit-GEMM engine cannot run this layer: {'; '.join(reasons)}"])
    if asked == "igemm" and tile is not None and tile.tensor_cores is False:
        raise PlanError(["tile.engine: igemm runs on tensor cores, but tile.tensor_cores is false"])
    if asked in ("slab", "ffma", "tma") or reasons:
        return None
    if asked is None and (_tile_pins_other_engine(tile) or (spec.input.channels < FP32_GEMM_MIN_CHANNELS and spec.precision == "fp32")):
        return None
    if asked is None and spec.conv.transposed and spec.input.channels < igemm_engine.TRANSPOSED_MIN_CHANNELS:
        return None  # a transposed conv of few channels: its phases' K is a handful of taps x channels (FFMA's)
    try:
        return igemm_engine.plan_igemm(spec, conv_out, taps, config, target=target)
    except ValueError as err:
        if asked is None and target != targets.DEFAULT and _fits_default(spec, conv_out, taps, config):
            # Left to the planner, a tile too large for this target's shared memory: fewer pipeline
            # stages (the same tile), else the other engines.
            base = igemm_engine.planner_config(spec, taps, target)
            for stages in range(base.stages - 1, 1, -1):
                try:
                    return igemm_engine.plan_igemm(spec, conv_out, taps, replace(base, stages=stages), target=target)
                except ValueError:
                    continue
            return None
        raise PlanError([f"tile: the implicit-GEMM tile does not fit this layer: {err}"]) from None


def _fits_default(spec: LayerSpec, conv_out, taps: int, config) -> bool:
    """Whether the implicit-GEMM tile fits the default target (so only the target's limits refused it)."""
    try:
        igemm_engine.plan_igemm(spec, conv_out, taps, config, target=targets.DEFAULT)
    except ValueError:
        return False
    return True


def _engine_summary(plan: dict) -> str:
    if plan["engine"] == "tma":
        return tma_engine.describe(plan["tma"])
    if plan["engine"] == "igemm":
        return igemm_engine.describe(plan["igemm"])
    mma = plan["mma"]
    if mma is None:
        text = f"fp32 FFMA, register tile {plan['ct']} channels x {plan['pt']} positions"
        if plan["in_vectors"]:
            text += (f"; conv rows in {plan['in_vec']}-wide loads from {plan['in_lead']} position(s) before the first tap "
                     "(an aligned start)")
        elif plan["in_vec"] > 1:
            text += f"; conv rows in {plan['in_vec']}-wide loads"
        if plan["io_ctype"] != "float":
            text += f"; x and out read and written as {plan['precision']} (widened on load, rounded once on store)"
        return text
    sd, sh = mma.slab
    if mma.wgmma:
        return (
            f"tensor cores ({'3xTF32' if mma.products == 3 else 'TF32'} wgmma m64n{mma.nb}k8, sm_90a): slabs of {sh} rows x "
            f"{mma.xs_wp} staged positions ({plan['box'][3]} kept per row), {mma.c_tiles * mma.n_tiles} warpgroup tiles of "
            f"64 channels x {mma.nb} positions per slab"
            + (f"; input staged by phase ({len(mma.phase_rows)} H x {mma.w_phases} W phases)" if mma.phased else "")
            + ("; the next slab's input prefetched into registers" if mma.prefetch else "")
            + (f"; the W taps packed into K ({mma.cip} per (kd, kh))" if mma.packed_w else "")
        )
    return (
        f"tensor cores ({'3xTF32' if mma.products == 3 else 'TF32'} mma.sync m16n8k8): slabs of {sd}x{sh}x{plan['box'][3]} positions, warp tile "
        f"{16 * mma.wm} positions x {8 * mma.wn} channels, {mma.units} warp tiles per slab"
    )


def describe(plan: dict) -> str:
    """A short human summary of the plan (used by `specgen show`), with the planner settings where
    they are not the defaults."""
    settings = plan.get("settings")
    extra = settings.summary() if settings is not None else ""
    return _describe(plan) + (f"\nplanner settings: {extra}" if extra else "")


def _describe(plan: dict) -> str:
    if plan["engine"] == "sequence":
        from specgen import tail

        return tail.describe(plan)
    if plan["engine"] == "tma":
        tp = plan["tma"]
        return "\n".join([
            f"kernel {plan['kernel_name']}: {tp.threads} threads/block, "
            f"{'tiles' if tp.persistent else 'one block per'} {tp.bm} positions x {tp.bn} channels "
            f"({tp.n_tiles} {'tile(s)' if tp.persistent else 'block(s)'} along channels"
            f"{'; each block walks tiles, as many blocks as the SMs hold' if tp.persistent else ''}), "
            f"{tp.smem_bytes} bytes shared memory; "
            + ("no layout pass (A read in place)" if tp.a_in_place else f"layout pass {plan['kernel_name']}_prep"),
            _engine_summary(plan),
            "rewrites: " + ("; ".join(plan["rewrites"]) or "none"),
        ])
    if plan["engine"] == "igemm":
        ig = plan["igemm"]
        return "\n".join([
            f"kernel {plan['kernel_name']}: {ig.threads} threads/block, one block per {ig.bm} positions x {ig.bn} channels "
            f"({ig.n_tiles} block(s) along channels), {ig.smem_bytes} bytes shared memory",
            _engine_summary(plan),
            "rewrites: " + ("; ".join(plan["rewrites"]) or "none"),
        ])
    b = plan["box"]
    if plan["cluster_at_launch"]:
        blocks = f"{plan['f_tiles']} to {plan['blocks_per_sample']} blocks per sample"
        cluster = f"a cluster of 1 to {plan['cluster']} blocks per kept tile, sized at launch"
    elif plan["mma"] is not None and plan["mma"].walk:
        blocks = f"{plan['blocks_per_sample']} boxes per sample, walked by as many blocks as the SMs hold (weights staged once a block)"
        cluster = "no cluster"
    else:
        blocks = f"{plan['blocks_per_sample']} blocks per sample"
        cluster = f"cluster of {plan['cluster']} block(s) per kept tile"
    lines = [
        f"kernel {plan['kernel_name']}: {plan['threads']} threads/block, {blocks}, {plan['smem_bytes']} bytes shared memory",
        f"box (c, d, h, w) = {tuple(b)}; " + _engine_summary(plan) + "; " + cluster,
        "axes: " + ", ".join(f"{AXIS_NAMES[a]}={plan['role'][a]}" for a in AXES),
        "rewrites: " + ("; ".join(plan["rewrites"]) or "none"),
    ]
    return "\n".join(lines)


__all__ = ["build_plan", "describe", "PlanError", "spec_yaml"]
