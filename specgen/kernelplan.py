"""The plan of one kernel, typed: what `plan.plan_whole` builds and a template renders.

Every value a template reads is a field, named as the template names it, so a plan that misses
one or names one that does not exist fails when it is built (a TypeError naming the field), not
when a template renders. The plan is frozen: a change makes a new plan (`with_changes`).

It is also a read-only mapping of those names (`plan["box"]`, `plan.get("igemm")`, `**plan` into
Jinja), the form the launch code, the sequences (`tail`, `tapsum`), whose plans are still plain
dicts, and the tests read; the field `in_` is the key "in" (a Python keyword).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, Optional

_KEY_OF = {"in_": "in"}  # fields whose template name is a Python keyword
_FIELD_OF = {v: k for k, v in _KEY_OF.items()}


class TemplateValues(Mapping):
    """A frozen dataclass read as a mapping of its fields' template names (read-only)."""

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
        """A copy with these keys changed (template names: "in" for `in_`)."""
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
    # tensor-core products per multiply-add: 3 (3xTF32, fp32-accurate) or 1 (TF32 operands, for a
    # tf32 layer whose cuDNN conv runs in TF32 too: `plan.SLAB_TF32_MAX_CHANNELS`)
    products: int = 3


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


def with_changes(plan, **changes):
    """`plan` with these keys changed: a new KernelPlan, or for a sequence's (dict) plan a new dict."""
    if isinstance(plan, TemplateValues):
        return plan.with_changes(**changes)
    return {**plan, **changes}
