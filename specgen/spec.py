"""The layer spec: what a user writes (YAML or Python), validated, canonical and hashable.

    name: kb90
    input: {channels: 8, size: [16, 64, 64]}     # the batch is not part of the spec
    conv: {out_channels: 64, kernel: 3}
    epilogue:
      - leaky_relu: {negative_slope: 0.2}
      - add: {param: sum_tensor}
      - clamp: {min: -1.0, max: 1.0}
      - gelu: {approximate: none}

Specs are frozen Pydantic models that forbid unknown fields. Every stage of the epilogue is a
one-key mapping `{op: args}` (or the bare op name when it takes no arguments); the ops and their
arguments come from the tables in `specgen.ops`. Validation also walks the tensor shape through
the conv and every stage, so a spec that validates describes a layer that can be built.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    create_model,
    model_validator,
)

from specgen import ops, upsample
from specgen.expr import RESERVED as EXPR_RESERVED
from specgen.literals import QUOTE_LIMIT, quote

IntOrList = Union[int, list[int], tuple[int, ...]]
# Per-channel parameters become attributes of the layer module: names it already uses are taken.
RESERVED_PARAM_NAMES = frozenset(
    {"conv", "weight", "bias", "spec", "op", "key", "arch", "forward", "training", "specialize", "spec_params",
     "cuda", "to", "half", "float", "double", "parameters", "state_dict", "train", "eval", "apply"}
)
PositiveInt = Annotated[int, Field(gt=0)]
MAX_EXTENT = 1 << 20

# ---- limits on work: each one keeps a spec that validates buildable in reasonable time --------
# Epilogue stages. Fused layers have a handful (the examples at most 6); every stage adds code at
# each place the template evaluates the epilogue, and the plan's work grows with the square of it.
MAX_STAGES = 64
# Conv taps (the product of the kernel's extents). The taps loops are unrolled completely for a
# constant trip count, so nvcc's time grows with taps x the thread's register tile: measured (a
# loaded 2-core machine) 8 s for a 1-D kernel of 127 taps, 48 s for 255, 158 s for 511, 37 s for
# 7 x 7 x 7; kernel 1001 or 101 x 101 took many minutes. 343 = 7 x 7 x 7 is the largest common
# 3-D kernel (2-D up to 18 x 18, 1-D up to 343 fit).
MAX_TAPS = 343
# The input span a thread reads along the conv's last dim for one position, dilation x (kernel -
# 1) + 1: each thread keeps that row segment in a register array whose loads are unrolled (kernel
# 1024 with dilation 1024 needed a 4 MB stack frame per thread; kernel 2 with dilation 512, a span
# of 513, compiled in 30 s). 1024 admits WaveNet-style dilations (kernel 2, dilation 512).
MAX_CONV_SPAN = 1024
# Values of the level below one output of the body reads through the windowed pools after the conv
# (the product of their window volumes): a pool window asks the level below for each of its
# elements, recomputing them, so stacked pools multiply the work per output (50 growing max_pool
# stages asked for 2^50 convs per output). 4096 = a 16 x 16 x 16 window, or 8 x 8 x 8 then 2 x 2 x 2.
MAX_POOL_RECOMPUTE = 4096


class Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False, strict=False)


class InputSpec(Model):
    channels: Annotated[int, Field(gt=0, le=1 << 16)]
    size: Annotated[list[Annotated[int, Field(gt=0, le=MAX_EXTENT)]], Field(min_length=1, max_length=3)]


class ConvSpec(Model):
    out_channels: Annotated[int, Field(gt=0, le=1 << 16)]
    kernel: IntOrList
    stride: IntOrList = 1
    padding: IntOrList = 0
    dilation: IntOrList = 1
    groups: PositiveInt = 1
    bias: bool = True
    # A transposed convolution, as nn.ConvTranspose1d/2d/3d: weights [C_in, C_out / groups, k...],
    # output (in - 1) * stride - 2 * padding + dilation * (kernel - 1) + output_padding + 1.
    transposed: bool = False
    output_padding: IntOrList = 0
    # The conv reads its input upsampled this many times along each dim (nearest, as nn.Upsample):
    # computed as the transposed conv it equals (specgen.upsample), the upsampled input never made.
    upsample: IntOrList = 1

    @model_validator(mode="before")
    @classmethod
    def _padding_words(cls, data):
        """`padding: same` or `valid`, as nn.Conv*d takes them, written as the numbers they pad."""
        if not isinstance(data, dict) or not isinstance(data.get("padding"), str):
            return data
        if data["padding"] not in ("same", "valid"):
            raise ValueError(f"padding: a number, one per spatial dim, 'same' or 'valid' (got {quote(data['padding'])})")
        if data["padding"] == "valid":
            return {**data, "padding": 0}
        kernel, dilation, stride = data.get("kernel"), data.get("dilation", 1), data.get("stride", 1)
        if data.get("transposed"):
            raise ValueError("padding 'same' is a plain conv's (a transposed conv takes numbers)")
        if any(v != 1 for v in (stride if isinstance(stride, (list, tuple)) else [stride])):
            raise ValueError(f"padding 'same' needs stride 1, as in PyTorch (got stride {stride!r})")
        per_dim = [list(v) for v in (kernel, dilation) if isinstance(v, (list, tuple))]
        n = len(per_dim[0]) if per_dim else 1
        ks, ds = (list(v) if isinstance(v, (list, tuple)) else [v] * n for v in (kernel, dilation))
        if len(ks) != len(ds) or not all(isinstance(v, int) and not isinstance(v, bool) for v in ks + ds):
            return data  # (the fields' own checks report it)
        spans = [d * (k - 1) for k, d in zip(ks, ds)]
        if any(t % 2 for t in spans):
            raise ValueError(f"padding 'same' over an even kernel span (dilation x (kernel - 1) = {spans}) pads "
                             "one more after than before, which a spec cannot say: pad the input first and "
                             "give the conv padding 0")
        return {**data, "padding": [t // 2 for t in spans] if per_dim else spans[0] // 2}


class TileSpec(Model):
    """Optional tiling; every field left out is chosen by the planner. See specgen.plan."""

    threads: Optional[Annotated[int, Field(ge=32, le=1024, multiple_of=32)]] = None
    channels_per_thread: Optional[Annotated[int, Field(ge=1, le=16)]] = None
    positions_per_thread: Optional[Annotated[int, Field(ge=1, le=8)]] = None
    box: Optional[list[Annotated[int, Field(gt=0)]]] = None
    min_blocks: Optional[Annotated[int, Field(ge=1, le=32)]] = None  # __launch_bounds__ occupancy hint
    # The conv's arithmetic: true = tensor cores (3xTF32 mma.sync, fp32-accurate), false = fp32
    # FFMA register tiles; left out, the planner uses tensor cores wherever the layer allows.
    tensor_cores: Optional[bool] = None
    # The engine: "tma" (Hopper: implicit GEMM fed by the tensor memory accelerator, on wgmma),
    # "igemm" (implicit GEMM, K-tiled and pipelined: any channel count, any target), "slab" (tensor
    # cores with the block's weights staged once: few input channels) or "ffma"; left out, the
    # planner chooses.
    engine: Optional[Literal["tma", "igemm", "slab", "ffma"]] = None
    # The slab engine's tensor-core instruction: true = wgmma (Hopper, sm_90a: a warpgroup's 64
    # output channels x up to 256 positions per instruction, the input read by descriptor from
    # shared memory), false = mma.sync; left out, mma.sync (the planner does not choose wgmma yet).
    wgmma: Optional[bool] = None

    @model_validator(mode="after")
    def _wgmma_on_the_slab_engine(self):
        if self.wgmma is not None and self.engine not in (None, "slab"):
            raise ValueError(f"tile.wgmma: chooses the slab engine's instruction; tile.engine is {self.engine!r}, "
                             "not 'slab' (leave one of them out)")
        return self


# ---------------------------------------------------------------------------------------------
# Stages: one model per op, generated from the op tables, joined in a tagged union.
# ---------------------------------------------------------------------------------------------


class StageBase(Model):
    """One epilogue stage. Its single field is named after the op and holds the op's arguments."""

    @property
    def op(self) -> str:
        return next(iter(type(self).model_fields))

    @property
    def args(self) -> ops.Args:
        return getattr(self, self.op)

    @property
    def kind(self) -> str:
        """pointwise, pool, reduce or norm (a statistic stage: normalizations and softmax)."""
        return ops.stage_kind(self.op, self.args)


def _stage_model(op: str) -> type[StageBase]:
    args = ops.args_model(op)
    try:
        default: Any = args()
    except ValidationError:
        default = ...

    def _bare(cls, data):
        if data == op:
            return {op: {}}
        if isinstance(data, dict) and data.get(op, 0) is None:
            return {op: {}}
        return data

    return create_model(
        f"{op}_stage",
        __base__=StageBase,
        __validators__={"_bare": model_validator(mode="before")(_bare)},
        **{op: (args, default)},
    )


STAGE_MODELS: dict[str, type[StageBase]] = {op: _stage_model(op) for op in ops.STAGE_KINDS}


def _stage_tag(value) -> Optional[str]:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and len(value) == 1:
        key = next(iter(value))
        return key if isinstance(key, str) else None
    if isinstance(value, StageBase):
        return value.op
    return None


Stage = Annotated[
    Union[tuple(Annotated[model, Tag(op)] for op, model in STAGE_MODELS.items())],
    Discriminator(
        _stage_tag,
        custom_error_type="stage",
        custom_error_message=(
            "a stage is one op, written {op: {args}} or a bare op name; known ops: "
            + ", ".join(STAGE_MODELS)
        ),
    ),
]


# ---------------------------------------------------------------------------------------------
# Shapes: the tensor walked through conv and stages (used by validation and by the plan)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Axis:
    """One non-batch axis of the tensor between stages."""

    role: str  # "c" or "s0", "s1", "s2" (spatial dims of the conv, in order)
    extent: int
    reduced: bool = False  # reduced with keepdim (extent 1, still present)


@dataclass(frozen=True)
class StageShape:
    """The tensor after a stage: present axes in order (dropped axes are gone)."""

    axes: tuple[Axis, ...]

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(a.extent for a in self.axes)

    def axis(self, role: str) -> Optional[Axis]:
        return next((a for a in self.axes if a.role == role), None)


class SpecShapeError(ValueError):
    pass


def expand(value, nd: int, where: str) -> tuple[int, ...]:
    """`3` -> (3, 3, 3) for nd = 3; a list must already have nd entries."""
    if isinstance(value, bool):
        raise SpecShapeError(f"{where}: expected an int or a list of {nd} ints, got {quote(value)}")
    if isinstance(value, int):
        return (value,) * nd
    values = tuple(value)
    if len(values) != nd:
        raise SpecShapeError(
            f"{where}: expected one value or {nd} (one per spatial dim of input.size), got {len(values)}: {quote(list(values))}"
        )
    return values


def _window_out(size: int, kernel: int, stride: int, padding: int, dilation: int, where: str) -> int:
    effective = dilation * (kernel - 1) + 1
    out = (size + 2 * padding - effective) // stride + 1
    if size + 2 * padding < effective or out < 1:
        raise SpecShapeError(
            f"{where}: the kernel spans {effective} (kernel {kernel}, dilation {dilation}) but the padded input is "
            f"{size + 2 * padding} (size {size} + 2*{padding} padding): the output would be empty"
        )
    return out


def _transposed_out(size: int, kernel: int, stride: int, padding: int, dilation: int, output_padding: int, where: str) -> int:
    out = (size - 1) * stride - 2 * padding + dilation * (kernel - 1) + output_padding + 1
    if out < 1:
        raise SpecShapeError(
            f"{where}: a transposed conv of input size {size} (kernel {kernel}, stride {stride}, dilation {dilation}, "
            f"output_padding {output_padding}) with padding {padding} has output size {out}; it must be at least 1"
        )
    return out


# ---------------------------------------------------------------------------------------------
# The spec
# ---------------------------------------------------------------------------------------------


class LayerSpec(Model):
    name: Annotated[str, Field(pattern=ops.IDENTIFIER_PATTERN)]
    input: InputSpec
    conv: ConvSpec
    epilogue: list[Stage] = Field(default_factory=list, max_length=MAX_STAGES)
    # fp32: fp32-accurate (3xTF32 on tensor cores); tf32: the conv's operands rounded to TF32, as
    # PyTorch's default cuDNN convolutions do (the implicit-GEMM engines round; the others stay
    # fp32-accurate); bf16 / fp16: the layer's tensors in that dtype (input, parameters, output),
    # fp32 accumulation and epilogue (engines without a 16-bit path compute in fp32 and round the
    # output once).
    precision: Literal["fp32", "tf32", "bf16", "fp16"] = "fp32"
    tile: Optional[TileSpec] = None
    rewrites: bool = True  # plan-level rewrites (e.g. folding an avg-pool into the conv)

    # -- derived, canonical views --------------------------------------------------------------

    @property
    def ndim(self) -> int:
        return len(self.input.size)

    def conv_geometry(self) -> dict[str, tuple[int, ...]]:
        """kernel, stride, padding, dilation per spatial dim (and output_padding for a transposed conv)."""
        nd = self.ndim
        fields = ("kernel", "stride", "padding", "dilation") + (("output_padding",) if self.conv.transposed else ("upsample",))
        return {f: expand(getattr(self.conv, f), nd, f"conv.{f}") for f in fields}

    def upsampled(self) -> bool:
        """Whether the conv reads its input upsampled (`conv.upsample`)."""
        return not self.conv.transposed and any(u != 1 for u in self.conv_geometry()["upsample"])

    def weight_shape(self) -> tuple[int, ...]:
        """The conv's weight as PyTorch holds it: [C_out, C_in / groups, k...], or for a transposed
        conv [C_in, C_out / groups, k...]."""
        kernel = self.conv_geometry()["kernel"]
        cin, cout, groups = self.input.channels, self.conv.out_channels, self.conv.groups
        if self.conv.transposed:
            return (cin, cout // groups, *kernel)
        return (cout, cin // groups, *kernel)

    def pool_geometry(self, stage: StageBase, where: str) -> dict[str, tuple[int, ...]]:
        nd, a = self.ndim, stage.args
        if not ops.POOLS[stage.op].windowed:
            return {}
        geometry = {
            "kernel": expand(a.kernel, nd, f"{where}.kernel"),
            "padding": expand(a.padding, nd, f"{where}.padding"),
            "dilation": expand(getattr(a, "dilation", 1), nd, f"{where}.dilation"),
        }
        geometry["stride"] = geometry["kernel"] if a.stride is None else expand(a.stride, nd, f"{where}.stride")
        return geometry

    def canonical(self) -> dict:
        """Defaults filled in, scalars expanded per dim, constants as floats: equal specs, equal dicts."""
        data = self.model_dump(mode="json")
        data["conv"].update({k: list(v) for k, v in self.conv_geometry().items()})
        if not self.conv.transposed:  # a plain conv spells (and hashes) as it did before transposed convs
            data["conv"].pop("transposed")
            data["conv"].pop("output_padding")
        if not self.upsampled():  # ... and before upsampling
            data["conv"].pop("upsample", None)
        shapes, reduce_dims, _ = self._walk()  # one walk for every stage: linear in the epilogue's length
        out_sizes = list(shapes[-1].sizes)
        for i, stage in enumerate(self.epilogue):
            if stage.kind == "pool" and ops.POOLS[stage.op].windowed:
                geometry = self.pool_geometry(stage, f"epilogue[{i}]")
                data["epilogue"][i][stage.op].update(
                    {k: list(v) for k, v in geometry.items() if k in type(stage.args).model_fields}
                )
            if stage.kind == "pointwise" and data["epilogue"][i][stage.op].get("input", 0) is None:
                del data["epilogue"][i][stage.op]["input"]  # an operand without an extra input hashes as before them
            if stage.kind == "pointwise" and "shape" in data["epilogue"][i][stage.op]:
                # an input of the output's shape, written out or not, hashes as before input shapes
                if data["epilogue"][i][stage.op]["shape"] in (None, out_sizes):
                    del data["epilogue"][i][stage.op]["shape"]
            if stage.kind == "reduce":
                data["epilogue"][i][stage.op]["dims"] = list(reduce_dims[i])
            if stage.kind == "norm" and "dim" in type(stage.args).model_fields:  # softmax: dims from 1, in order
                span = self.norm_span(i)
                data["epilogue"][i][stage.op]["dim"] = list(range(span.first, span.last + 1))
        return data

    def display(self) -> dict:
        """canonical() without the fields left unset (None): what a banner or `show` prints."""

        def strip(value):
            if isinstance(value, dict):  # (batch norm's momentum: null is a cumulative average, not unset)
                return {k: strip(v) for k, v in value.items() if v is not None or k == "momentum"}
            if isinstance(value, list):
                return [strip(v) for v in value]
            return value

        return strip(self.canonical())

    def canonical_json(self) -> str:
        return json.dumps(self.canonical(), sort_keys=True, separators=(",", ":"))

    @property
    def shape_hash(self) -> str:
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()[:16]

    def reduce_dims(self, index: int) -> tuple[int, ...]:
        """The stage's dims, normalized against the tensor it sees (batch is dim 0)."""
        return self._walk()[1][index]

    def norm_span(self, index: int) -> ops.Span:
        """The values one statistic group of statistic stage `index` spans (see ops.Span)."""
        return self._walk()[2][index]

    # -- shape walk ----------------------------------------------------------------------------

    def conv_output(self) -> StageShape:
        g = self.conv_geometry()
        if self.conv.transposed:
            sizes = [
                _transposed_out(s, k, st, p, d, op, f"conv (spatial dim {i})")
                for i, (s, k, st, p, d, op) in enumerate(
                    zip(self.input.size, g["kernel"], g["stride"], g["padding"], g["dilation"], g["output_padding"])
                )
            ]
            return StageShape((Axis("c", self.conv.out_channels), *(Axis(f"s{i}", n) for i, n in enumerate(sizes))))
        sizes = [
            _window_out(s * u, k, st, p, d, f"conv (spatial dim {i})")
            for i, (s, k, st, p, d, u) in enumerate(
                zip(self.input.size, g["kernel"], g["stride"], g["padding"], g["dilation"], g["upsample"])
            )
        ]
        return StageShape((Axis("c", self.conv.out_channels), *(Axis(f"s{i}", n) for i, n in enumerate(sizes))))

    def shapes(self) -> list[StageShape]:
        """shapes()[i] is the tensor entering stage i; shapes()[-1] the layer's output (no batch)."""
        return self._walk()[0]

    def _walk(self) -> tuple[list[StageShape], dict[int, tuple[int, ...]], dict[int, ops.Span]]:
        """The shape walk: the tensor before every stage and after the last, each reduction's dims
        normalized (batch is dim 0, sorted) and each statistic stage's span. One pass over the epilogue."""
        current = self.conv_output()
        out = [current]
        reduce_dims: dict[int, tuple[int, ...]] = {}
        spans: dict[int, ops.Span] = {}
        reduced_before = False
        recompute = 1  # values of the level below one body output reads (windowed pools multiply it)
        for i, stage in enumerate(self.epilogue):
            where = f"epilogue[{i}] ({stage.op})"
            if stage.kind == "pool":
                if reduced_before:
                    raise SpecShapeError(f"{where}: pooling after a reduction is not supported; pool first")
                if stage.op.startswith("global"):
                    current = StageShape((current.axes[0], *(Axis(a.role, 1) for a in current.axes[1:])))
                else:
                    g = self.pool_geometry(stage, f"epilogue[{i}].{stage.op}")
                    axes = [current.axes[0]]
                    for j, ax in enumerate(current.axes[1:]):
                        k, s, p, d = g["kernel"][j], g["stride"][j], g["padding"][j], g["dilation"][j]
                        if min(k, s, d) < 1 or p < 0:
                            raise SpecShapeError(
                                f"{where}: kernel, stride and dilation must be >= 1 and padding >= 0, "
                                f"got kernel {k}, stride {s}, dilation {d}, padding {p}"
                            )
                        if d * (k - 1) + 1 > ax.extent:
                            raise SpecShapeError(
                                f"{where}: the window spans {d * (k - 1) + 1} but spatial dim {j} is only {ax.extent} "
                                f"(PyTorch refuses a pool window larger than its input)"
                            )
                        if 2 * p > d * (k - 1) + 1:
                            raise SpecShapeError(
                                f"{where}: padding {p} must be at most half the kernel span {d * (k - 1) + 1} (as in PyTorch)"
                            )
                        axes.append(Axis(ax.role, _window_out(ax.extent, k, s, p, d, f"{where} (spatial dim {j})")))
                    current = StageShape(tuple(axes))
                    recompute *= math.prod(g["kernel"])
                    if recompute > MAX_POOL_RECOMPUTE:
                        raise SpecShapeError(
                            f"{where}: the pools up to here read {recompute} values below each output (the product "
                            f"of their windows, each recomputed), more than specgen's limit of {MAX_POOL_RECOMPUTE}; "
                            f"use fewer or smaller pool windows"
                        )
            elif stage.kind == "reduce":
                reduced_before = True
                rank = 1 + len(current.axes)
                dims = []
                for d in stage.args.dims:
                    n = d + rank if d < 0 else d
                    if not 0 <= n < rank:
                        raise SpecShapeError(f"{where}: dim {d} is out of range for a tensor of rank {rank} (batch included)")
                    if n == 0:
                        raise SpecShapeError(f"{where}: dim 0 is the batch, which specgen never reduces")
                    if n in dims:
                        raise SpecShapeError(f"{where}: dim {d} is listed twice")
                    dims.append(n)
                reduce_dims[i] = tuple(sorted(dims))
                axes = []
                for j, ax in enumerate(current.axes):
                    if j + 1 not in dims:
                        axes.append(ax)
                    elif stage.args.keepdim:
                        axes.append(Axis(ax.role, 1, reduced=True))
                current = StageShape(tuple(axes))
            elif stage.kind == "norm":
                try:
                    spans[i] = ops.NORMS[stage.op].span(stage.args, current)
                except ops.SpanError as err:
                    field = f".{err.field}" if err.field else ""
                    raise SpecShapeError(f"epilogue[{i}].{stage.op}{field}: {err}") from None
                recompute = 1  # the stages after it run in later kernels: pools there start afresh
            else:  # pointwise
                for name in ops.POINTWISE[stage.op].params(stage.args):
                    if current.axis("c") is None:
                        raise SpecShapeError(
                            f"{where}: per-channel parameter {name!r} needs the channel dim, which an earlier reduction removed"
                        )
            out.append(current)
        return out, reduce_dims, spans

    def _stage_tensors(self, i: int, stage, shapes) -> list[tuple[str, tuple[int, ...], ops.ParamInit]]:
        """The tensors stage i reads: (name, shape, init). Per-channel tensors are shaped (C, 1, ...);
        a layer norm's weight and bias have its normalized shape."""
        if stage.kind == "pointwise":
            row, make = ops.POINTWISE[stage.op], lambda: (shapes[i].axis("c").extent,) + (1,) * self.ndim
        elif stage.kind == "norm":
            row = ops.NORMS[stage.op]
            if row.affine == "element":
                make = lambda: tuple(stage.args.normalized_shape)  # noqa: E731
            else:
                make = lambda: (shapes[i].axis("c").extent,) + (1,) * self.ndim  # noqa: E731
        else:
            return []
        inits = row.param_init(stage.args)
        return [(name, make(), inits.get(name, ops.ParamInit())) for name in row.params(stage.args)]

    def params(self) -> dict[str, tuple[int, ...]]:
        """The tensors the kernels read besides the conv's (per-channel parameters, batch norm's
        running statistics in eval mode, norms' weights and biases), name -> shape, in order of first use."""
        found: dict[str, tuple[int, ...]] = {}
        shapes = self.shapes()
        for i, stage in enumerate(self.epilogue):
            for name, shape, _ in self._stage_tensors(i, stage, shapes):
                if found.setdefault(name, shape) != shape:
                    if len(shape) == len(found[name]) == 1 + self.ndim and shape[1:] == found[name][1:]:
                        was, now = f"{found[name][0]} channels", f"{shape[0]} channels"
                    else:
                        was, now = f"shape {list(found[name])}", f"shape {list(shape)}"
                    raise SpecShapeError(f"epilogue[{i}] ({stage.op}): parameter {name!r} is used with {now} here but {was} earlier")
        return found

    def param_inits(self) -> dict[str, ops.ParamInit]:
        """How a layer creates each tensor of params(): a buffer (batch norm's running statistics) or
        a parameter, and its initial value."""
        found: dict[str, ops.ParamInit] = {}
        shapes = self.shapes()
        for i, stage in enumerate(self.epilogue):
            for name, _, init in self._stage_tensors(i, stage, shapes):
                if found.setdefault(name, init).buffer != init.buffer:
                    raise SpecShapeError(
                        f"epilogue[{i}] ({stage.op}): {name!r} is a running statistic (a buffer) in one stage "
                        f"and a learnable parameter in another; give them different names"
                    )
        return found

    def buffers(self) -> dict[str, tuple[tuple[int, ...], float, str]]:
        """The state a training-mode batch norm updates and no kernel reads: name -> (shape, initial
        value, dtype): running_mean (C, 1, ...) 0, running_var 1, num_batches_tracked () 0 (int64), as
        nn.BatchNormNd creates them."""
        found: dict[str, tuple[tuple[int, ...], float, str]] = {}
        shapes = self.shapes()
        for i, stage in enumerate(self.epilogue):
            if stage.op != "batch_norm" or not stage.args.buffer_names():
                continue
            a = stage.args
            per_channel = (shapes[i].axis("c").extent,) + (1,) * self.ndim
            for name, value in ((a.running_mean, (per_channel, 0.0, "float32")), (a.running_var, (per_channel, 1.0, "float32")),
                                (a.num_batches_tracked, ((), 0.0, "int64"))):
                if name in found:
                    raise SpecShapeError(
                        f"epilogue[{i}].batch_norm: {name!r} is updated by an earlier training-mode batch norm too; "
                        f"give each its own running statistics (name: ...)"
                    )
                found[name] = value
        return found

    def inputs(self) -> dict[str, tuple[int, ...]]:
        """The extra tensors the caller passes at run time (`add: {input: shortcut}`), name -> shape
        per sample, in order of first use: the layer's output's (only stages that keep the shape
        follow an input's stage), or [C, 1, ...] for one value per sample and channel (`shape:`)."""
        uses = [(n, getattr(st.args, "shape", None)) for st in self.epilogue if st.kind == "pointwise"
                for n in ops.POINTWISE[st.op].inputs(st.args)]
        if not uses:
            return {}
        out = tuple(self.shapes()[-1].sizes)
        found: dict[str, tuple[int, ...]] = {}
        for name, shape in uses:
            found.setdefault(name, out if shape is None else tuple(shape))
        return found

    def _check_upsample(self, g: dict) -> None:
        ups = expand(self.conv.upsample, self.ndim, "conv.upsample")
        if self.conv.transposed:
            if ups != (1,) * self.ndim:
                raise SpecShapeError(f"conv.upsample: only a plain conv reads its input upsampled (a transposed conv "
                                     f"reads it as it is), got {quote(self.conv.upsample)}")
            return
        if not all(1 <= u <= upsample.MAX_SCALE for u in ups):
            raise SpecShapeError(f"conv.upsample: every factor must be in [1, {upsample.MAX_SCALE}], got {quote(list(ups))}")
        if ups == (1,) * self.ndim:
            return
        if any(v != 1 for v in (*g["stride"], *g["dilation"])):
            raise SpecShapeError(f"conv.upsample: an upsampled input is read by a conv of stride 1 and dilation 1, "
                                 f"got stride {list(g['stride'])}, dilation {list(g['dilation'])}")
        for i, (k, p, u) in enumerate(zip(g["kernel"], g["padding"], ups)):
            if upsample.derive(k, p, u) is None:
                raise SpecShapeError(
                    f"conv.upsample: the conv over the upsampled input runs as the transposed conv it equals, and "
                    f"along spatial dim {i} (kernel {k}, padding {p}, upsample {u}) there is none: a padding above "
                    f"kernel - 1 makes outputs that no tap reaches"
                )

    def _check_inputs(self) -> None:
        first = None
        out = tuple(self.shapes()[-1].sizes)
        per_channel = out[:1] + (1,) * (len(out) - 1)  # (an output reduced to a value per sample: ())
        declared: dict[str, tuple[tuple[int, ...], int]] = {}
        for i, stage in enumerate(self.epilogue):
            names = ops.POINTWISE[stage.op].inputs(stage.args) if stage.kind == "pointwise" else ()
            if names:
                first = i if first is None else first
                shape = out if stage.args.shape is None else tuple(stage.args.shape)
                if shape not in (out, per_channel):
                    raise SpecShapeError(
                        f"epilogue[{i}].{stage.op}.shape: an extra input's shape per sample is the layer's output's "
                        f"{list(out)} or one value per channel {list(per_channel)}, got {list(shape)}"
                    )
                for name in names:
                    before = declared.setdefault(name, (shape, i))
                    if before[0] != shape:
                        raise SpecShapeError(
                            f"epilogue[{i}].{stage.op}: extra input {name!r} has shape {list(shape)} here and "
                            f"{list(before[0])} at epilogue[{before[1]}]; give one shape (or two names)"
                        )
            elif first is not None and stage.kind not in ("pointwise", "norm"):
                # (a statistic stage keeps the shape: the body kernel reads the input where it is written)
                raise SpecShapeError(
                    f"epilogue[{first}] ({self.epilogue[first].op}): an extra input is read at the layer's output shape, "
                    f"so only pointwise and statistic stages (which keep the shape) may follow it; "
                    f"epilogue[{i}] is {stage.op} ({stage.kind})"
                )

    def _check_saved(self) -> list[str]:
        """The saved values' names. Where a `save` stage's value may be read: by the pointwise stages
        right after the statistic stage that comes right after the save (the statistic stage's input
        is what its kernels read back: `x + f(group_norm(x))`)."""
        saves: dict[str, int] = {}
        running = self.running_stat_stages()
        for i, stage in enumerate(self.epilogue):
            if stage.op == "save":
                name = stage.args.name
                if name in saves:
                    raise SpecShapeError(f"epilogue[{i}].save: {name!r} is saved twice (epilogue[{saves[name]}] and here); "
                                         f"give each saved value its own name")
                saves[name] = i
                continue
            if stage.kind != "pointwise":
                continue
            for name in ops.POINTWISE[stage.op].saved(stage.args):
                where = f"epilogue[{i}].{stage.op}.saved"
                if name not in saves:
                    raise SpecShapeError(f"{where}: no earlier `save: {name}` stage")
                k = saves[name]
                nxt = self.epilogue[k + 1]
                if k + 1 in running:
                    raise SpecShapeError(
                        f"{where}: epilogue[{k + 1}] is a training-mode batch norm with running statistics, which "
                        f"normalizes per channel with them in eval mode: pointwise, where a saved value is not read")
                between = [j for j in range(k + 2, i) if self.epilogue[j].kind != "pointwise"]
                if nxt.kind != "norm" or between:
                    raise SpecShapeError(
                        f"{where}: a saved value is read by the pointwise stages right after the statistic stage "
                        f"that follows its save (the statistic stage's input); epilogue[{k + 1}] is {nxt.op} ({nxt.kind})"
                        + (f" and epilogue[{between[0]}] ({self.epilogue[between[0]].op}) comes between" if nxt.kind == "norm" else "")
                    )
        return list(saves)

    def running_stat_stages(self) -> list[int]:
        """The training-mode batch norms that update running statistics (indices into the epilogue)."""
        return [i for i, s in enumerate(self.epilogue) if s.op == "batch_norm" and s.args.buffer_names()]

    def eval_twin(self) -> Optional["LayerSpec"]:
        """This layer in eval mode: its training-mode batch norms normalize with their running
        statistics (a pointwise stage each), as nn.BatchNormNd does after .eval(); None when the
        layer has no running statistics (it computes the same in both modes)."""
        stages = self.running_stat_stages()
        if not stages:
            return None
        data = self.model_dump(mode="json")
        for i in stages:
            data["epilogue"][i] = {"batch_norm": self.epilogue[i].args.eval_mode().model_dump(mode="json")}
        return LayerSpec.model_validate(data)

    def output_shape(self, batch: int) -> tuple[int, ...]:
        return (batch, *self.shapes()[-1].sizes)

    @model_validator(mode="after")
    def _consistent(self):
        nd = self.ndim
        g = self.conv_geometry()
        for f, lo in (("kernel", 1), ("stride", 1), ("dilation", 1), ("padding", 0)):
            for v in g[f]:
                if not lo <= v <= MAX_EXTENT:
                    raise SpecShapeError(f"conv.{f}: every value must be in [{lo}, {MAX_EXTENT}], got {quote(list(g[f]))}")
        if self.conv.transposed:
            for i, (op, st, d) in enumerate(zip(g["output_padding"], g["stride"], g["dilation"])):
                if not 0 <= op < max(st, d):
                    raise SpecShapeError(
                        f"conv.output_padding: must be >= 0 and smaller than the stride or the dilation (as in "
                        f"PyTorch); spatial dim {i} has output_padding {op}, stride {st}, dilation {d}"
                    )
        elif expand(self.conv.output_padding, nd, "conv.output_padding") != (0,) * nd:
            raise SpecShapeError(
                f"conv.output_padding: only a transposed conv (conv.transposed: true) has an output padding, "
                f"got {quote(self.conv.output_padding)}"
            )
        self._check_upsample(g)
        taps = math.prod(g["kernel"])
        if taps > MAX_TAPS:
            raise SpecShapeError(
                f"conv.kernel: {list(g['kernel'])} has {taps} taps, more than specgen's limit of {MAX_TAPS} "
                f"(every tap is unrolled into the kernel: compile time grows with it)"
            )
        span = g["dilation"][-1] * (g["kernel"][-1] - 1) + 1
        if span > MAX_CONV_SPAN:
            raise SpecShapeError(
                f"conv.dilation: along the last spatial dim the kernel spans {span} input values (dilation "
                f"{g['dilation'][-1]} x (kernel {g['kernel'][-1]} - 1) + 1), more than specgen's limit of "
                f"{MAX_CONV_SPAN} (each thread keeps that span in registers)"
            )
        cin, cout, groups = self.input.channels, self.conv.out_channels, self.conv.groups
        if cin % groups or cout % groups:
            raise SpecShapeError(
                f"conv.groups: input.channels ({cin}) and conv.out_channels ({cout}) must both be divisible by groups ({groups})"
            )
        self.shapes()
        names = self.params()
        self.param_inits()
        buffers = self.buffers()
        self._check_inputs()
        inputs = self.inputs()
        for name in [*names, *buffers, *inputs]:
            if name in EXPR_RESERVED or name in RESERVED_PARAM_NAMES:
                raise SpecShapeError(f"parameter name {name!r} is reserved; choose another")
        for name in inputs:
            if name in names or name in buffers:
                raise SpecShapeError(f"{name!r} names an extra input and a tensor of the layer; give them different names")
        for name in self._check_saved():
            if name in names or name in buffers or name in inputs or name in EXPR_RESERVED or name in RESERVED_PARAM_NAMES:
                raise SpecShapeError(f"{name!r} names a saved value and a tensor of the layer (or a reserved name); "
                                     f"give them different names")
        for name in buffers:
            if name in names:
                raise SpecShapeError(
                    f"{name!r} is a training-mode batch norm's running statistic and a tensor another stage reads; "
                    f"give them different names"
                )
        if nd not in (1, 2, 3):  # guarded by InputSpec too
            raise SpecShapeError(f"input.size: 1, 2 or 3 spatial dims, got {nd}")
        return self


# ---------------------------------------------------------------------------------------------
# Errors and loading
# ---------------------------------------------------------------------------------------------


MAX_PROBLEMS = 20  # problems an error lists (the rest are counted)
MAX_PROBLEM_CHARS = 400  # characters of one problem's line


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


class SpecError(ValueError):
    """Bad input: one line per problem, each naming the field, what was expected and what came.

    The message stays short whatever came in: at most MAX_PROBLEMS problems of at most
    MAX_PROBLEM_CHARS characters each (quoted input is cut to QUOTE_LIMIT before that)."""

    def __init__(self, problems: list[str], source: str = ""):
        self.problems = problems
        self.source = source
        head = f"{_clip(source, MAX_PROBLEM_CHARS)}: " if source else ""
        lines = [f"  - {_clip(p, MAX_PROBLEM_CHARS)}" for p in problems[:MAX_PROBLEMS]]
        if len(problems) > MAX_PROBLEMS:
            lines.append(f"  ... and {len(problems) - MAX_PROBLEMS} more")
        super().__init__(head + "invalid spec\n" + "\n".join(lines))


def _loc(loc: tuple) -> str:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif parts and parts[-1].lstrip(".") == item:  # the stage union repeats the op's name
            continue
        elif item.endswith("_stage") or item in ("function-after[_consistent(), LayerSpec]",):
            continue
        else:
            parts.append(("." if parts else "") + item)
    return "".join(parts)


# Ops known by another name elsewhere, and how a spec writes them.
OP_ALIASES = {"swish": "silu", "relu6": "hardtanh: {min_val: 0.0, max_val: 6.0}", "bias_add": "add: {param: bias}"}


def _did_you_mean(word: str, choices) -> str:
    """' (did you mean x?)' for the closest of `choices` to a misspelt `word`, else ''."""
    close = difflib.get_close_matches(word.lower(), list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def _unknown_op_hint(word: str) -> str:
    alias = OP_ALIASES.get(word.lower())
    return f" (write {alias})" if alias else _did_you_mean(word, STAGE_MODELS)


def _model_at(loc: tuple):
    """The spec model that holds the field at the end of `loc` (a validation error's location),
    or None where the walk leaves the models."""
    model = LayerSpec
    for item in loc[:-1]:
        if isinstance(item, int):
            continue
        if model is LayerSpec and item == "epilogue":
            model = None  # the stage: the next item names its op
            continue
        if model is None:
            model = STAGE_MODELS.get(item)
            continue
        field = model.model_fields.get(item)
        if field is None:
            return None
        inner = [a for a in (typing.get_args(field.annotation) or (field.annotation,))
                 if isinstance(a, type) and issubclass(a, BaseModel)]
        if not inner:
            return None
        model = inner[0]
    return model


def format_validation_error(err: ValidationError) -> list[str]:
    problems = []
    for e in err.errors(include_url=False, include_input=True, include_context=False):
        where = _clip(_loc(tuple(e["loc"])), QUOTE_LIMIT)
        msg = _clip(e["msg"].removeprefix("Value error, "), MAX_PROBLEM_CHARS)
        got, quoted = e.get("input"), False
        if e["type"] == "stage":
            got = _stage_tag(got) or got
            if isinstance(got, str) and got not in STAGE_MODELS:
                msg = _clip(f"unknown op {quote(got)}{_unknown_op_hint(got)}; {msg}", MAX_PROBLEM_CHARS)
                quoted = True  # (above: the list of ops may clip the message's end)
        elif e["type"] == "extra_forbidden" and e["loc"] and isinstance(e["loc"][-1], str):
            model = _model_at(tuple(e["loc"]))
            if model is not None and not model.model_fields:
                msg = "unknown field: this op takes no arguments"
            elif model is not None:
                msg = f"unknown field{_did_you_mean(e['loc'][-1], model.model_fields)}; expected one of {', '.join(model.model_fields)}"
        shown = "" if e["type"] == "value_error" or quoted or isinstance(got, (dict, BaseModel)) else f" (got {quote(got)})"
        problems.append(f"{where}: {msg}{shown}" if where else f"{msg}{shown}")
    return problems


def validate(data: Any, source: str = "") -> LayerSpec:
    """A LayerSpec from a mapping, or a SpecError that lists every problem."""
    if isinstance(data, LayerSpec):
        return data
    if not isinstance(data, dict):
        raise SpecError([f"a spec is a mapping with keys name, input, conv, epilogue; got {type(data).__name__}"], source)
    try:
        return LayerSpec.model_validate(data)
    except ValidationError as err:
        label = data.get("name") if isinstance(data.get("name"), str) else ""
        raise SpecError(format_validation_error(err), f"{source} spec {quote(label)}" if label else source) from None


# The YAML a spec file may hold. A file of specs is a few KB (the zoo: 3 KB, 14 specs); these caps
# are far above that and keep a hostile file (an alias bomb: 428 bytes that expand to millions of
# nodes, or nesting thousands deep) from costing more than a moment.
MAX_YAML_BYTES = 1 << 20
MAX_YAML_NODES = 50_000  # scalars, lists and mappings, each alias counted as a copy of what it names
MAX_YAML_DEPTH = 32  # lists and mappings inside each other (a spec needs 5)


def _yaml_loader():
    import yaml

    # libyaml's parser where PyYAML has it: parsing a large file in pure Python takes seconds.
    class Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
        pass

    def construct_mapping(loader, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = loader.construct_object(key_node, deep=deep)
            try:
                repeated = key in seen
                seen.add(key)
            except TypeError:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping", node.start_mark, "found a key that is a list or mapping", key_node.start_mark
                ) from None
            if repeated:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping", node.start_mark, f"found duplicate key {quote(key)}", key_node.start_mark
                )
        return loader.construct_mapping(node, deep=deep)

    Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, construct_mapping)
    return Loader


def _check_yaml_size(root) -> None:
    """Refuse a composed YAML graph that is recursive, too deep, or too large once its aliases are
    expanded. Aliases make the graph a DAG whose expanded size can be exponential in the text, so
    sizes are added up per node (memoized), never by expanding; no recursion on the input's depth."""
    import yaml

    def children(node):
        if isinstance(node, yaml.SequenceNode):
            return node.value
        if isinstance(node, yaml.MappingNode):
            return [n for pair in node.value for n in pair]
        return ()

    size: dict[int, int] = {}
    on_path: set[int] = set()
    stack = [(root, 1, False)]
    while stack:
        node, depth, done = stack.pop()
        key = id(node)
        if done:
            on_path.discard(key)
            size[key] = 1 + sum(size[id(c)] for c in children(node))
            if size[key] > MAX_YAML_NODES:
                raise SpecError(
                    [f"the YAML expands to more than {MAX_YAML_NODES} values (aliases counted as copies of what they "
                     f"name), more than a file of specs needs; specgen's limit is {MAX_YAML_NODES}"]
                )
            continue
        if key in size:
            continue
        if key in on_path:
            mark = node.start_mark
            raise SpecError([f"line {mark.line + 1}, column {mark.column + 1}: an alias refers to a value that contains it"])
        if depth > MAX_YAML_DEPTH:
            mark = node.start_mark
            raise SpecError(
                [f"line {mark.line + 1}, column {mark.column + 1}: lists and mappings nested more than {MAX_YAML_DEPTH} "
                 f"deep; a spec needs far fewer (specgen's limit is {MAX_YAML_DEPTH})"]
            )
        on_path.add(key)
        stack.append((node, depth, True))
        stack.extend((child, depth + 1, False) for child in children(node))


def _load_yaml(text: str):
    if len(text) > MAX_YAML_BYTES:
        raise SpecError([f"the YAML is {len(text)} characters long; specgen's limit for a file of specs is {MAX_YAML_BYTES}"])
    loader = _yaml_loader()(text)
    try:
        root = loader.get_single_node()
        if root is None:
            return None
        _check_yaml_size(root)
        return loader.construct_document(root)
    finally:
        loader.dispose()


def parse_yaml(text: str, source: str = "<string>") -> list[LayerSpec]:
    import yaml

    try:
        data = _load_yaml(text)
    except SpecError as err:
        raise SpecError(err.problems, source) from None
    except RecursionError:  # the composer recurses once per level: nesting far past MAX_YAML_DEPTH
        raise SpecError([f"lists and mappings nested more than {MAX_YAML_DEPTH} deep (specgen's limit)"], source) from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(err, "problem", None) or str(err)
        raise SpecError([f"{where}malformed YAML: {_clip(problem, MAX_PROBLEM_CHARS)}"], source) from None
    if data is None or data == []:
        raise SpecError(["the file holds no spec"], source)
    items = data if isinstance(data, list) else [data]
    specs, problems = [], []
    for i, item in enumerate(items):
        try:
            specs.append(validate(item, f"{source}[{i}]" if isinstance(data, list) else source))
        except SpecError as err:
            problems.extend(f"{err.source}: {p}" if err.source else p for p in err.problems)
    names = [s.name for s in specs]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        problems.append(f"spec names must be unique in a file; repeated: {quote(', '.join(dupes))}")
    if problems:
        raise SpecError(problems, "")
    return specs


def load_specs(path: str | Path) -> list[LayerSpec]:
    """Every spec in a YAML file (one spec or a list of them)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_YAML_BYTES + 1)  # never more than the limit (the "file" may be /dev/zero)
    except OSError as err:
        raise SpecError([f"cannot read {path}: {err.strerror or err}"], str(path)) from None
    if len(raw) > MAX_YAML_BYTES:
        raise SpecError([f"the file is larger than {MAX_YAML_BYTES} bytes, specgen's limit for a file of specs"], str(path))
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise SpecError(
            [f"not UTF-8 text: byte {err.start} is {raw[err.start:err.start + 1]!r} ({err.reason}); save the file as UTF-8"],
            str(path),
        ) from None
    return parse_yaml(text, str(path))


def load(spec_or_path: Any) -> LayerSpec:
    """One spec from a LayerSpec, a mapping, or a YAML path holding exactly one spec."""
    if isinstance(spec_or_path, (str, Path)):
        specs = load_specs(spec_or_path)
        if len(specs) != 1:
            raise SpecError([f"expected one spec, found {len(specs)}: {[s.name for s in specs]}"], str(spec_or_path))
        return specs[0]
    return validate(spec_or_path)
