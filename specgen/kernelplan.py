"""The plans, typed: one kernel's (`KernelPlan`: what `plan.plan_whole` builds and a template
renders) and a sequence's (`SequencePlan`: its parts, each with its own plan, and the steps that
launch them; `tail.plan_sequence`, `tail.plan_split`, `tapsum.plan_fold` build it).

Every value a template reads is a field, named as the template names it, so a plan that misses
one or names one that does not exist fails when it is built (a TypeError naming the field), not
when a template renders. A plan is frozen: a change makes a new plan (`with_changes`), and a plan
built from another (a fold's sequence from the folded conv's) shares its parts and makes new steps.
The sequences' own parts are typed likewise: `tail.TailPlan` (a statistic stage's kernels) and
`tapsum.TapsumPlan` (a fold's tap sums).

Each is also a read-only mapping of those names (`plan["box"]`, `plan.get("igemm")`, `**plan` into
Jinja), the form the templates and some of the launch code and the tests read; the field `in_` is
the key "in" (a Python keyword), `items_` the key "items" (a method of the mapping).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from specgen.spec import LayerSpec
    from specgen.tail import Segment

# fields whose template name is a Python keyword ("in") or a method of the mapping ("items": a
# dataclass would take the method for the field's default)
_KEY_OF = {"in_": "in", "items_": "items"}
_FIELD_OF = {v: k for k, v in _KEY_OF.items()}


class TemplateValues(Mapping):
    """A frozen dataclass read as a mapping of its fields' template names (read-only)."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        taken = sorted(n for n in cls.__dict__.get("__annotations__", {}) if callable(getattr(TemplateValues, n, None)))
        if taken:
            raise TypeError(f"{cls.__name__}: the field(s) {', '.join(taken)} would hide the mapping's methods; "
                            f"name them with a trailing underscore (kernelplan._KEY_OF)")

    @classmethod
    def _keys(cls) -> tuple[tuple[str, ...], frozenset]:
        table = cls.__dict__.get("_key_table")
        if table is None:
            keys = tuple(_KEY_OF.get(f.name, f.name) for f in fields(cls))
            table = (keys, frozenset(keys))
            setattr(cls, "_key_table", table)
        return table

    def __getitem__(self, key: str):
        if key not in self._keys()[1]:
            raise KeyError(key)
        return getattr(self, _FIELD_OF.get(key, key))

    def __iter__(self):
        return iter(self._keys()[0])

    def __len__(self) -> int:
        return len(self._keys()[0])

    def __contains__(self, key) -> bool:
        return key in self._keys()[1]

    def with_changes(self, **changes):
        """A copy with these keys changed (template names: "in" for `in_`, "items" for `items_`)."""
        return replace(self, **{_FIELD_OF.get(k, k): v for k, v in changes.items()})


@dataclass(frozen=True, eq=False)
class SlabTiling(TemplateValues):
    """The slab engine's tensor-core tiling (`plan._mma_tiling`): the block stages its weights once
    and walks its box in slabs of input, each warp a (16 WM) x (8 WN) tile with mma.sync."""

    box: list
    threads: int
    warps: int
    wm: int
    wn: int
    units: int  # warp tiles per slab
    unit_iters: int
    n_groups: int
    slab: tuple  # slab extents (d, h)
    slabs: tuple  # slabs per box (d, h)
    m_slab: int
    mt: int
    cip: int
    k_pad: int
    ksteps: int
    ws: int  # the staged weights' row stride
    swizzle: bool
    xs: tuple
    xs_wp: int
    ci_stride: int
    stage: str
    stage_batch: int
    x_floats: int
    w_floats: int
    direct_fold: bool
    # 4-byte staging ("cp4") of slabs whose staged rows are whole input rows of one depth (no W
    # padding, the box as wide as the output): each channel's slab is one contiguous run of
    # XS_H x IN_W floats in x and in shared memory, copied without per-row index arithmetic
    runs: bool = False
    # tensor-core products per multiply-add: 3 (3xTF32, fp32-accurate) or 1 (TF32 operands, for a
    # tf32 layer whose cuDNN conv runs in TF32 too: `plan.SLAB_TF32_MAX_CHANNELS`)
    products: int = 3
    # wgmma (sm_90a, `plan._wgmma_tiling`): a warpgroup multiplies 64 output channels (the weights,
    # A, from registers) by NB positions of the slab (B, read by descriptor from the staged planes).
    # The slab's positions are those of its staged input rows (XS_W per row; the last XS_W - BOX_W
    # of each are computed and dropped), so a tap is one row offset for every position.
    wgmma: bool = False
    nb: int = 0  # positions per wgmma (the N of m64nNBk8)
    n_tiles: int = 0  # N tiles per slab
    c_tiles: int = 0  # 64-channel tiles per box (the M tiles)
    chunks: int = 0  # planes of 8 input channels (CIP / 8)
    xs_rows: int = 0  # staged rows of a plane that hold input: XS_D * XS_H * XS_W
    plane_rows: int = 0  # rows of a plane: the staged ones and those the last N tile's last tap reads
    # the epilogue stores two neighbouring positions of a row as one float2: every row length (XS_W,
    # BOX_W, T1's W) is even, so a kept position at an even p has its neighbour p + 1 kept too
    pair_stores: bool = False
    # Strided along H or W (`plan.wgmma_phases`): the input staged by phase. periods: (H, W) tap
    # periods of the phases; phase_rows: rows XS_H[j] of each H phase j; phase_base: the first
    # plane row of H phase j's group; w_phases: W phases per staged input row. Stride 1: one phase.
    phased: bool = False
    periods: tuple = (1, 1)
    phase_rows: tuple = ()
    phase_base: tuple = ()
    w_phases: int = 1
    # the next slab's input loaded into registers (STAGE_ITERS x 8 a thread) while the current slab
    # multiplies, written to the planes after it: staging hidden at one block per SM
    prefetch: bool = False
    # the K_W taps along W packed with the input channels into one K run per (kd, kh) of CIP values
    # ((kw, ci) at kw C_IN_G + ci, `plan.wgmma_k`): a staged row per output column, holding its
    # input at every W tap; the GEMM's taps are then (kd, kh)
    packed_w: bool = False
    # a block walks boxes (item = sample x tiles + tile: blockIdx.x, + gridDim.x, ...) with its
    # weights staged once, as many blocks as the SMs hold (`runtime.LoadedKernel.walk_blocks`): a
    # wgmma slab layer whose boxes all hold the same channels and keep no reduction (`plan.SLAB_WALK`)
    walk: bool = False

    @property
    def row_iters(self) -> int:
        """wgmma: the staged rows of one plane per thread and slab."""
        return -(-self.plane_rows // self.threads)

    @property
    def stage_iters(self) -> int:
        """wgmma: the staged rows (of all planes) per thread and slab."""
        return self.chunks * self.row_iters

    @property
    def m_groups(self) -> int:
        """Warp tiles along a slab's positions."""
        return self.units // self.n_groups

    @property
    def last_wm(self) -> int:
        """The m-tiles of the last warp tile along a slab's positions that lie in the slab (WM
        where WM divides the slab's m-tiles)."""
        return self.mt - (self.m_groups - 1) * self.wm

    @property
    def unrolled_last_tile(self) -> bool:
        """Whether that last warp tile, reaching past the slab, gets a K loop of its own with its
        m-tile count known at compile time (no test per m-tile): in TF32 only, as a second copy of
        the 3xTF32 loop spilled registers (benchmarks/NOTES.md v33)."""
        return self.last_wm < self.wm and self.products == 1


@dataclass(frozen=True, eq=False)
class KernelPlan(TemplateValues):
    # ---- identity: the banner and the kernel's name --------------------------------------------
    version: str
    name: str
    kernel_name: str
    spec_hash: str
    spec_yaml: str
    target: str  # the target's one-line summary (the banner names it: it is part of the cache key)
    precision: str
    engine: str  # tma, igemm, slab or ffma
    # The C type the box kernel reads x as and writes out as: float, or the 16-bit type of a bf16 /
    # fp16 layer on the FFMA engine (loads widen exactly, stores round once). Other engines: float
    # (the TMA engine has its own operand types; slab and implicit GEMM run on widened tensors).
    io_ctype: str
    # ---- the conv (3-dim geometry: d, h, w; 1 / 0 for dims the conv lacks) -----------------------
    ndim: int
    cin: int
    cout: int
    groups: int
    cin_g: int
    cout_g: int
    in_: tuple  # input extents (d, h, w)
    kernel: tuple
    stride: tuple
    padding: tuple
    dilation: tuple
    conv_out: tuple
    taps: int
    has_bias: bool
    transposed: bool
    output_padding: tuple
    # ---- the body levels (conv + pointwise, then each pool) and the tail's reductions -------------
    levels: list
    pointwise: list  # level 0's pointwise stages (before a channel_norm)
    channel_norm: Optional[dict]  # a softmax over the channels in the TMA epilogue, with its pointwise stages after it
    t1: tuple  # the body's result, (c, d, h, w) per sample
    reductions: list
    role: dict  # axis -> F (kept), R1, R2 (reduced at that level)
    f_axes: list
    f1_axes: list
    r1_axes: list
    batched: bool  # two reductions leaving one value per sample: the outer one a box at a time
    # ---- tiling, grid and threads --------------------------------------------------------------
    box: list
    tiles: dict
    chunks: dict
    ct: int
    pt: int
    threads: int
    thread_tiles: int
    tile_iters: int
    tree_top: int
    blocks_per_sample: int
    cluster: int
    r1_chunks: int
    cluster_at_launch: bool
    chunk_iters: int
    f_tiles: int
    nf: int
    nr: int
    lanes: int
    owner_iters: int
    channels_fastest: bool
    split_channels: bool
    min_blocks: int
    unroll_cin: bool
    conv_span: int
    in_vec: int
    in_lead: int  # (the FFMA engine's level 0: its row loads start this far before the first tap)
    in_vectors: int  # (... in this many vectors of in_vec; 0: from the first tap)
    out_vec: int
    # ---- shared memory ---------------------------------------------------------------------------
    weights_in_smem: bool
    weight_channels: int
    weight_floats: int
    w_stride: int
    w_smem_floats: int
    box_floats: int
    red_floats: int
    x_floats: int
    smem_bytes: int
    w_raw: Optional[dict]
    # ---- sizes, operands, constants --------------------------------------------------------------
    in_per_sample: int
    out_per_sample: int
    out_shape: list
    params: list
    inputs: list
    constants: list
    flops_per_sample: int
    # ---- rewrites and engines ----------------------------------------------------------------------
    rewrites: list
    fold: Optional[dict]
    affine: Optional[dict]
    direct_fold: bool
    mma: Optional[SlabTiling]  # the slab engine's tensor-core tiling
    igemm: Any  # an igemm.IgemmPlan, or None
    tma: Any  # a tma.TmaPlan, or None
    settings: Any  # the plan.Settings it was built with
    # how the launch hands the kernel the user's weights, in order (a rewrite to another layer)
    weight_transforms: list = field(default_factory=list)


# ---- a layer that runs as a sequence of kernels ----------------------------------------------------

PART_ROLES = {  # a part's role -> what it needs beside its plan
    "body": ("spec",),  # the conv and the stages before the first split: `spec` the layer it plans
    "rest": ("spec", "segment"),  # the stages after a split, over an identity conv
    "tail": ("segment",),  # a statistic stage's kernels (`tail.TailPlan`)
    "tapsum": ("folded_spec",),  # a fold's tap sums (`tapsum.TapsumPlan`)
    "boxmean": ("folded_spec",),  # a box fold's means (`boxfold.BoxmeanPlan`)
}


@dataclass(frozen=True, eq=False)
class SequencePart(TemplateValues):
    """One part of a sequence: its `role` (PART_ROLES), the namespace its source goes in, and its
    own plan: a KernelPlan for a body or a rest, a `tail.TailPlan`, a `tapsum.TapsumPlan`. (A fold
    over a layer that is itself a sequence takes that sequence's parts as its own: `tapsum.plan_fold`.)"""

    role: str
    namespace: str
    plan: Any
    spec: Optional[LayerSpec] = None  # the layer a body or rest plans
    segment: Optional[Segment] = None  # the statistic stage (or split) a tail or rest follows
    folded_spec: Optional[LayerSpec] = None  # a tap-sum part's folded layer: the later parts' stages are numbered as its

    def __post_init__(self):
        if self.role not in PART_ROLES:
            raise TypeError(f"SequencePart: role {self.role!r} is none of {', '.join(PART_ROLES)}")
        missing = [name for name in PART_ROLES[self.role] if getattr(self, name) is None]
        if missing:
            raise TypeError(f"SequencePart: a {self.role} part needs its {' and '.join(missing)}")


@dataclass(frozen=True, eq=False)
class LayerStep(TemplateValues):
    """A body or rest part's launch: part `part` reads buffer `in_` ("in") and writes `out`,
    `out_shape` per sample; a rest's identity conv has `ones` channels (its weights: ones)."""

    part: int
    in_: str
    out: str
    out_shape: list
    ones: int = 0  # 0 for a body
    kind: str = field(default="layer", init=False)


@dataclass(frozen=True, eq=False)
class KernelStep(TemplateValues):
    """A tail or tap-sum kernel's launch: function `name`, `threads` per block, `grid_x` blocks per
    sample (`once`: for the whole batch), and its pointer arguments in order: a buffer's name
    ("x", "out" or one of the plan's buffers), "p_<name>" a parameter, "i_<name>" an extra input."""

    part: int
    name: str
    threads: int
    grid_x: int
    once: bool
    args: list
    kind: str = field(default="kernel", init=False)


@dataclass(frozen=True, eq=False)
class SequencePlan(TemplateValues):
    """The plan of a layer that runs as a sequence of kernels: its parts in order (each part's
    source in its own namespace of one translation unit: `tail.join`) and the steps the runtime
    launches (`specgen.tailrun`), then what the pipeline, the CLI and bench read of any plan."""

    # ---- identity: the banner ----------------------------------------------------------------------
    version: str
    name: str
    kernel_name: str  # the first part's kernel
    spec_hash: str
    spec_yaml: str
    target: str
    # ---- the sequence ------------------------------------------------------------------------------
    parts: tuple  # SequencePart
    steps: tuple  # LayerStep and KernelStep, in launch order
    # the workspaces by name: floats per sample, ("stats", offset into the layer's batch statistics)
    # or ("once", floats for the whole batch)
    buffers: dict
    stats_floats: int  # the batch statistics the layer returns (its training-mode batch norms')
    why: list  # why the layer runs as a sequence, in sentences (`specgen show --plan` and the banner)
    # ---- what the pipeline, the CLI and bench read of any plan -------------------------------------
    smem_bytes: int
    cluster: int  # the largest cluster any part launches
    cluster_at_launch: bool
    min_blocks: int
    igemm: Any  # the body's
    tma: Any  # the body's (the pipeline builds a body on Hopper's TMA engine for sm_90a)
    mma: Optional[SlabTiling]  # the body's
    rewrites: list
    flops_per_sample: int
    in_per_sample: int
    out_per_sample: int
    out_shape: list
    params: list
    precision: str
    # how the launch hands the parts the user's weights, in order (a rewrite to another layer)
    weight_transforms: list = field(default_factory=list)
    # x and out channels-last (`specgen.dwcl`: a layer's plan for channels-last inputs); else NC(D)HW
    channels_last_io: bool = False
    engine: str = field(default="sequence", init=False)

    def __post_init__(self):
        for n, step in enumerate(self.steps):  # a body or rest launches as a layer, a tail's or fold's kernels one by one
            if not 0 <= step.part < len(self.parts):
                raise TypeError(f"SequencePlan: step {n} names part {step.part} of {len(self.parts)}")
            if (self.parts[step.part].role in ("body", "rest")) != isinstance(step, LayerStep):
                raise TypeError(f"SequencePlan: step {n} is a {step.kind} step of a {self.parts[step.part].role} part")


def with_changes(plan: TemplateValues, **changes):
    """`plan` (a KernelPlan or a SequencePlan) with these keys changed: a new plan."""
    return plan.with_changes(**changes)
