"""A depthwise conv and a LayerNorm over the channels on channels-last tensors, in one kernel
(templates/dwcl.cu.j2): ConvNeXt's block, whose activations PyTorch keeps channels-last.

The contiguous plan of such a layer is a sequence (specgen/tail.py): the conv on the FFMA engine
writes T0 in NCHW, then the strided tail kernel normalizes each position's channels. Given a
channels-last input it also pays a layout pass into NCHW, and its NCHW output is what the model
then permutes back to channels-last for its Linear layers (a copy). Channels-last, a position's
channels are contiguous: one warp takes a run of PT neighbouring positions of an output row, each
lane the channels 4 lane, 4 lane + 128, ... (float4s), accumulates the taps over the rows of the
window it reads once per row (the weights arrive tap-major, [taps][C]: the plan's weight transform), then normalizes each position over its channels by butterflies
across the warp and stores it, channels-last: one read of the input (the window's rows from the
cache), one write of the output, no workspace.

This is the layer's channels-last kernel (`pipeline.channels_last_variant`): the planner builds it
for `Settings.channels_last` where `why_not` finds nothing against it; the contiguous plan is
unchanged. fp32 arithmetic (the FFMA conv is exact fp32 in every float32 mode).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from specgen.kernelplan import KernelStep, SequencePart, SequencePlan
from specgen.spec import LayerSpec
from specgen.tail import StridedTail, TailKernel, TailPlan, split, tail_plan

ENABLED = True  # (off: such layers take their contiguous sequence's layout pass, as before v52)
WARPS = 4  # warps per block: each its own run of positions (no block barriers)
MAX_LANE_VECS = 8  # float4s of a position's channels per lane: channels up to 32 x 4 x 8 = 1024
ACC_FLOATS = 48  # a lane's accumulators, PT x LANE_VECS x 4, at most (and 8 positions)
WEIGHT_REGISTERS = 28  # a row's weights (K_W x LANE_VECS x 4 floats) stay in registers up to this many (192 channels: 224 registers a thread with them, 108 without)


@dataclass(frozen=True, eq=False)
class DwclTail(TailPlan):
    """The one kernel's plan: the conv's geometry, the warp's tiling, and the statistic stage's
    code as the strided tail kernel has it (TailPlan's fields)."""

    c: int  # channels (in = out)
    cv: int  # float4s per position: C / 4
    in_hw: tuple  # (IN_H, IN_W)
    out_hw: tuple  # (OUT_H, OUT_W)
    k: tuple  # (K_H, K_W)
    s: tuple  # stride (S_H, S_W)
    p: tuple  # padding (P_H, P_W)
    d: tuple  # dilation (D_H, D_W)
    has_bias: bool
    lane_vecs: int  # float4s per lane: lane + 32 j
    pt: int  # neighbouring output positions of a row per warp
    span: int  # input columns a warp's run reads per window row: (PT - 1) S_W + (K_W - 1) D_W + 1
    segs_w: int  # runs per output row
    warps: int
    weights_in_registers: bool  # a window row's weights loaded once per row (else per use, from the cache)
    family: str = field(default="dwcl", init=False)
    mode: str = field(default="dwcl", init=False)


def why_not(spec: LayerSpec) -> str | None:
    """Why this layer has no channels-last depthwise-LayerNorm kernel, or None where it has one."""
    conv = spec.conv
    if not ENABLED:
        return "switched off (dwcl.ENABLED)"
    if len(spec.input.size) != 2:
        return "not a 2-D conv"
    if conv.transposed or conv.groups != spec.input.channels or conv.out_channels != spec.input.channels:
        return "not a depthwise conv of one output channel per input channel"
    if spec.precision not in ("fp32", "tf32"):
        return f"precision {spec.precision} (the kernel computes and stores float32)"
    if spec.input.channels % 4 or spec.input.channels > 4 * 32 * MAX_LANE_VECS:
        return f"{spec.input.channels} channels (a multiple of 4 up to {4 * 32 * MAX_LANE_VECS} is read as float4s)"
    if spec.inputs():
        return "an extra input"
    if len(spec.epilogue) == 0 or spec.epilogue[0].op != "layer_norm_channels":
        return "the conv is not followed by layer_norm_channels"
    _, segments = split(spec)
    if len(segments) != 1 or segments[0].rest:
        return "more than the LayerNorm and pointwise stages after it"
    return None


def plan(spec: LayerSpec, contiguous: SequencePlan) -> SequencePlan | None:
    """The channels-last plan of `spec` (one kernel), built on its contiguous sequence plan, or None
    where `why_not` finds a reason."""
    if why_not(spec) is not None:
        return None
    geometry = spec.conv_geometry()
    c = spec.input.channels
    cv = c // 4
    lane_vecs = -(-cv // 32)
    kh, kw = geometry["kernel"]
    sh, sw = geometry["stride"]
    ph, pw = geometry["padding"]
    dh, dw = geometry["dilation"]
    ih, iw = spec.input.size
    oh, ow = spec.shapes()[0].sizes[1:]
    pt = max(1, min(8, ACC_FLOATS // (4 * lane_vecs), ow))
    segment = split(spec)[1][0]
    prefix = f"specgen_{spec.name}"
    strided = tail_plan(spec, segment, f"{prefix}_e{segment.index}")
    if not isinstance(strided, StridedTail) or strided.statistic != "moments":
        return None
    base = {f.name: getattr(strided, f.name) for f in fields(TailPlan) if f.init and f.name != "kernels"}
    base["threads"] = 32 * WARPS
    base["vec"] = 4
    tensors = [a for a in strided.kernels[0].args if a not in ("in", "out")]
    segs_w = -(-ow // pt)
    name = f"{prefix}_dwcl"
    kernel = TailKernel(name=name, role="dwcl", threads=32 * WARPS, grid_x=-(-oh * segs_w // WARPS), once=False,
                        args=["x", "weight", *(["bias"] if spec.conv.bias else []), *tensors, "out"],
                        bytes_per_sample=4 * (ih * iw * c + oh * ow * c))
    tp = DwclTail(**base, kernels=(kernel,), c=c, cv=cv, in_hw=(ih, iw), out_hw=(oh, ow), k=(kh, kw), s=(sh, sw),
                  p=(ph, pw), d=(dh, dw), has_bias=spec.conv.bias, lane_vecs=lane_vecs, pt=pt,
                  span=(pt - 1) * sw + (kw - 1) * dw + 1, segs_w=segs_w, warps=WARPS,
                  weights_in_registers=kw * lane_vecs * 4 <= WEIGHT_REGISTERS)
    part = SequencePart(role="tail", namespace="dwcl", plan=tp, segment=segment)
    step = KernelStep(part=0, name=name, threads=kernel.threads, grid_x=kernel.grid_x, once=False,
                      args=[{"in": "x"}.get(a, a) for a in kernel.args])
    why = [f"a channels-last input: the depthwise conv and epilogue[{segment.index}] layer_norm_channels run as one "
           f"kernel that reads it where it lies and writes a channels-last output (specgen/dwcl.py)"]
    return replace(contiguous, kernel_name=name, parts=(part,), steps=(step,), buffers={}, why=why, smem_bytes=0,
                   cluster=1, cluster_at_launch=False, min_blocks=1, igemm=None, tma=None, mma=None, rewrites=[],
                   weight_transforms=[{"kind": "taps_major", "channels": c, "taps": kh * kw}], channels_last_io=True,
                   flops_per_sample=2 * oh * ow * c * kh * kw + 8 * oh * ow * c)


def describe(tp: DwclTail) -> str:
    return (f"depthwise {tp.k[0]}x{tp.k[1]} conv and {tp.op_comment} over {tp.c} channels on channels-last tensors: "
            f"a warp per {tp.pt} neighbouring position(s) of a row, {tp.lane_vecs} float4(s) of channels a lane, "
            f"the statistics by butterflies; weights {'in registers per window row' if tp.weights_in_registers else 'from the cache'}")
