"""The op vocabulary: one table per stage kind.

Every pointwise op is one row of `POINTWISE`: its parameters (a Pydantic model), its CUDA
expression, its PyTorch reference, whether it is affine (for the plan's affine fold) and the
expr function that means the same. Every pool is a row of `POOLS` and every reduction a row of
`REDUCTIONS`, with the CUDA of their accumulators (init, combine or fold and merge, finalize).
Adding an op means adding a row here, nothing else: the spec, the plan, the template and the
reference all read this table, and the templates know no op by name (a row missing a snippet is
an `OpTableError` when a kernel that uses it is rendered). The model importer reads it too: each
row's `spellings` say how PyTorch code writes the op (see `Spelling`), and `EXPR_ONLY` lists the
PyTorch pointwise functions that no op names, which the importer writes as `expr` stages.

CUDA expressions are built by `cuda(args, x, names)`: `x` is the C expression of the value,
`names[field]` the C spelling of a folded constant (a named constexpr) and `names[param]` the
C spelling of a per-channel parameter's value for the current channel. Torch references are
`torch_ref(x, args, params)` with `params[name]` already broadcastable to `x`; they import
torch lazily, so this module (and the whole build path) works without it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Annotated, Any, Callable, ClassVar, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator

from specgen import expr as expr_mod
from specgen.literals import FLOAT32_MAX

IDENTIFIER_PATTERN = r"^[A-Za-z][A-Za-z0-9_]{0,62}$"


class Args(BaseModel):
    """Base of every op's parameter model: frozen, unknown fields forbidden, finite numbers."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    @model_validator(mode="after")
    def _float32_range(self):
        for name, value in self.model_dump().items():
            if isinstance(value, float) and abs(value) > FLOAT32_MAX:
                raise ValueError(f"{name} = {value!r} is outside float32's range (|x| <= {FLOAT32_MAX:.7g})")
        return self

    @classmethod
    def from_operands(cls, operands: tuple, fields: dict) -> Optional[dict]:
        """The op's arguments for a call the importer found: the op applied to x and `operands`
        (each a number, a `Param` or None), with the constants `fields`. None when this op's
        arguments cannot say that call (the importer writes it as an expr instead). Here: an op
        of x alone, its fields as they are."""
        return None if operands else dict(fields)


def _F():
    import torch.nn.functional as F

    return F


def _torch():
    import torch

    return torch


# ---------------------------------------------------------------------------------------------
# How PyTorch code writes an op, for the model importer
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Param:
    """A per-channel parameter, by its spec name: an operand as `Args.from_operands` sees it."""

    name: str


@dataclass(frozen=True)
class Input:
    """An extra tensor operand the caller passes at run time, by its spec name (see OperandArgs.input);
    `shape`: its shape per sample where it is one value per sample and channel (OperandArgs.shape)."""

    name: str
    shape: Optional[tuple[int, ...]] = None


@dataclass(frozen=True)
class Saved:
    """The layer's value where a `save` stage named it: an operand as `Args.from_operands` sees it."""

    name: str


@dataclass(frozen=True)
class Spelling:
    """One way PyTorch code writes an op, for the model importer (specgen.importer).

    Names only, resolved by the importer, so this module needs no torch. `functions` are
    'torch.relu', 'F.relu' (torch.nn.functional), 'torch.special.erf' or 'operator.add';
    `methods` are Tensor methods; `modules` nn class names. A function or method name ending in
    '_' is the in-place form. '{nd}' in a name stands for each spatial rank of `nd`
    ('F.avg_pool{nd}d': the pool over nd spatial dims).

    Calls are bound to `sig`, a signature as text with literal defaults ('input,
    negative_slope=0.01, inplace=False'; None: only the first argument, the tensor, matters);
    the tensor is `input`, and a module's arguments are its attributes of the same names.
    `operands` are the arguments that are values (the chain value, a per-channel tensor, a
    number); the other arguments that name a field of the op's args model (after `rename`,
    PyTorch's name -> the field's) are the op's constants. `fixed` sets arguments this spelling
    does not take (F.relu6 is hardtanh with min_val 0 and max_val 6). `refuse` maps an argument
    to why the call is not fused when it is given (not None, False or 0), as a format string over
    {value!r}; `require` maps an argument to why it is not fused when it is None or False (softmax
    without a dim, instance norm with use_input_stats=False). `scale` = (operand, argument): the
    operand times the argument (torch.add's alpha). `elementwise` (a reduction's spelling): the
    pointwise op this call is when a tensor stands where the dim goes (torch.max(x, y)); with a
    dim it returns (values, indices). `form` names a mapping the importer writes out itself, where
    an argument changes what the call computes: 'power' (x ** c or c ** x), 'prelu' (its slope
    along dim 1 where it has one per channel, as nn.PReLU applies it), 'batch_norm' (eval
    mode over the running statistics, a pointwise op; training mode or no running statistics, a
    statistic stage).

    A statistic stage's spelling (a row of NORMS) has the tensor itself and its weight and bias as
    `operands` (None where the op has none); its other arguments that name fields are its
    constants, and a `dim` names the dims it normalizes over, numbered as the model's code sees
    the tensor."""

    sig: Optional[str] = "input"
    functions: tuple[str, ...] = ()
    methods: tuple[str, ...] = ()
    modules: tuple[str, ...] = ()
    nd: tuple[int, ...] = ()
    operands: tuple[str, ...] = ("input",)
    rename: dict = field(default_factory=dict)
    fixed: dict = field(default_factory=dict)
    refuse: dict = field(default_factory=dict)
    require: dict = field(default_factory=dict)
    scale: Optional[tuple[str, str]] = None
    elementwise: Optional[str] = None
    form: Optional[str] = None


def expr_number(value) -> str:
    """A constant as an expr's text; a ValueError for one that is not finite."""
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"constant {value!r} is not finite")
    return repr(value)


# ---------------------------------------------------------------------------------------------
# Pointwise ops
# ---------------------------------------------------------------------------------------------


class NoArgs(Args):
    pass


class LeakyReluArgs(Args):
    negative_slope: float = 0.01


class GeluArgs(Args):
    approximate: Literal["none", "tanh"] = "none"


class HardtanhArgs(Args):
    min_val: float = -1.0
    max_val: float = 1.0

    @model_validator(mode="after")
    def _ordered(self):
        if self.min_val > self.max_val:
            raise ValueError(f"min_val ({self.min_val}) must not exceed max_val ({self.max_val})")
        return self


class ClampArgs(Args):
    min: Optional[float] = None
    max: Optional[float] = None

    @model_validator(mode="after")
    def _bounds(self):
        if self.min is None and self.max is None:
            raise ValueError("clamp needs min, max or both")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"min ({self.min}) must not exceed max ({self.max})")
        return self

    @classmethod
    def from_operands(cls, operands, fields):
        lo, hi = operands
        if not all(t is None or isinstance(t, float) for t in (lo, hi)) or (lo is None and hi is None):
            return None
        return {k: v for k, v in (("min", lo), ("max", hi)) if v is not None}


class SoftplusArgs(Args):
    beta: float = 1.0
    threshold: float = 20.0

    @field_validator("beta")
    @classmethod
    def _nonzero(cls, v):
        if v == 0:
            raise ValueError("beta must be non-zero")
        return v


class ScalarArgs(Args):
    """A scalar operand, for min/max: `min: 0.5` or `min: {value: 0.5}`."""

    value: float

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data):
        if isinstance(data, dict) and "dims" in data:
            raise ValueError("min/max with dims is a reduction: write amin/amax: {dims: [...]}")
        return {"value": data} if isinstance(data, (int, float)) and not isinstance(data, bool) else data

    @classmethod
    def from_operands(cls, operands, fields):
        (value,) = operands
        return {"value": value} if isinstance(value, float) else None


class OperandArgs(Args):
    """The other operand of add/sub/mul/div: a scalar `value`, a per-channel parameter `param`, or
    an extra tensor `input` that the caller passes at run time, of the layer's output shape
    (`layer(x, shortcut)`: a residual's shortcut); only stages that keep the shape (pointwise and
    statistic stages) may follow an input's stage.
    An input's `shape` (its shape per sample, without the batch) may instead be [C, 1, ...]: one
    value per sample and channel, broadcast over the positions as PyTorch broadcasts a tensor of
    shape [N, C, 1, 1] (a diffusion block's time embedding); left out, the output's shape.

    Shorthands: `add: 2.0` means {value: 2.0}; `add: bias2` means {param: bias2}.
    """

    value: Optional[float] = None
    param: Optional[str] = Field(default=None, pattern=IDENTIFIER_PATTERN)
    input: Optional[str] = Field(default=None, pattern=IDENTIFIER_PATTERN)
    # the layer's own value where a `save` stage named it (see SaveArgs)
    saved: Optional[str] = Field(default=None, pattern=IDENTIFIER_PATTERN)
    # the extra input's shape per sample (checked against the layer's output by LayerSpec)
    shape: Optional[list[Annotated[int, Field(gt=0)]]] = Field(default=None, min_length=2, max_length=4)

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data):
        if isinstance(data, bool):
            return data
        if isinstance(data, (int, float)):
            return {"value": data}
        if isinstance(data, str):
            return {"param": data}
        return data

    @model_validator(mode="after")
    def _exactly_one(self):
        if sum(v is not None for v in (self.value, self.param, self.input, self.saved)) != 1:
            raise ValueError("give exactly one of value (a number), param (a per-channel parameter name), "
                             "input (the name of an extra tensor passed at run time) or saved (the name of a save stage)")
        if self.shape is not None and self.input is None:
            raise ValueError("shape is an extra input's shape per sample: give it with input, not with "
                             f"{'value' if self.value is not None else 'param' if self.param is not None else 'saved'}")
        return self

    @classmethod
    def from_operands(cls, operands, fields):
        (other,) = operands
        if isinstance(other, float) and math.isfinite(other):
            return {"value": other}
        if isinstance(other, Param):
            return {"param": other.name}
        if isinstance(other, Input):
            return {"input": other.name} if other.shape is None else {"input": other.name, "shape": list(other.shape)}
        if isinstance(other, Saved):
            return {"saved": other.name}
        return None


class SaveArgs(Args):
    """`save: conv_out` names the value at this point of the epilogue (the stage itself passes it
    on unchanged), for a later add/sub/mul/div to read as `{saved: conv_out}`: a residual such as
    `x + f(group_norm(x))`. A saved value is the input of the statistic stage right after the save
    and is read by the pointwise stages right after that statistic stage (the tail kernel reads it
    back from the body's output, which it is)."""

    name: str = Field(pattern=IDENTIFIER_PATTERN)

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data):
        return {"name": data} if isinstance(data, str) else data


class ExprArgs(Args):
    """`expr: "x * clamp((x + 3) / 6, 0, 1)"`: a pointwise DAG in the grammar of specgen.expr."""

    code: str

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data):
        return {"code": data} if isinstance(data, str) else data

    @field_validator("code")
    @classmethod
    def _parse(cls, v):
        return expr_mod.parse(v).text  # canonical spelling; raises ExprError (a ValueError)

    @property
    def parsed(self) -> expr_mod.Expr:
        return expr_mod.parse_cached(self.code)


class BatchNormArgs(Args):
    """Batch norm over the channels, as nn.BatchNormNd.

    In eval mode (the default) it normalizes with the running statistics:
    y = (x - running_mean) / sqrt(running_var + eps) * weight + bias, per channel, a pointwise op.
    With `training: true` (nn.BatchNormNd in training mode) or `track_running_stats: false` it
    normalizes with the batch's own statistics (mean and biased variance over the batch and the
    spatial dims of each channel): a statistic stage (see NORMS). In training mode with running
    statistics the layer also updates them as PyTorch does: num_batches_tracked += 1, then
    running = (1 - f) * running + f * batch (the unbiased variance for running_var), where f is
    `momentum`, or 1 / num_batches_tracked when momentum is null (a cumulative average).

    The tensors are named after PyTorch's: `batch_norm: bn` (or the bare op, which means `bn`)
    names them bn_weight, bn_bias, bn_running_mean, bn_running_var (and in training mode
    bn_num_batches_tracked); `name` sets that prefix and each tensor can also be named on its own.
    `affine: false` has no weight and bias; `track_running_stats: false` no running statistics."""

    eps: Annotated[float, Field(gt=0)] = 1e-5
    affine: bool = True
    weight: Optional[str] = Field(default=None, pattern=IDENTIFIER_PATTERN)
    bias: Optional[str] = Field(default=None, pattern=IDENTIFIER_PATTERN)
    running_mean: Optional[str] = Field(default=None, pattern=IDENTIFIER_PATTERN)
    running_var: Optional[str] = Field(default=None, pattern=IDENTIFIER_PATTERN)
    training: bool = False
    momentum: Optional[Annotated[float, Field(ge=0, le=1)]] = 0.1
    track_running_stats: bool = True
    num_batches_tracked: Optional[str] = Field(default=None, pattern=IDENTIFIER_PATTERN)

    @model_validator(mode="before")
    @classmethod
    def _prefix(cls, data):
        if isinstance(data, str):
            data = {"name": data}
        if not isinstance(data, dict):
            return data
        data = dict(data)
        name = data.pop("name", "bn")
        if not isinstance(name, str) or not re.fullmatch(IDENTIFIER_PATTERN, name):
            raise ValueError(f"name must be an identifier (the prefix of the tensors' names), got {name!r}")
        present = {
            "weight": data.get("affine", True) is not False,
            "bias": data.get("affine", True) is not False,
            "running_mean": data.get("track_running_stats", True) is not False,
            "running_var": data.get("track_running_stats", True) is not False,
            "num_batches_tracked": data.get("track_running_stats", True) is not False and data.get("training") is True,
        }
        for field, has in present.items():
            if not has and data.get(field) is not None:
                why = {"weight": "affine: false has no weight", "bias": "affine: false has no bias",
                       "running_mean": "track_running_stats: false has no running_mean",
                       "running_var": "track_running_stats: false has no running_var",
                       "num_batches_tracked": "num_batches_tracked is counted only in training mode (training: true) "
                                              "with running statistics"}[field]
                raise ValueError(f"{why}, got {field}: {data[field]!r}")
            if has and data.get(field) is None:
                data[field] = f"{name}_{field}"
        return data

    @model_validator(mode="after")
    def _not_eps(self):
        if "eps" in self.names() or "eps" in self.buffer_names():
            raise ValueError("'eps' is the op's constant; name the tensors otherwise")
        return self

    @model_serializer(mode="wrap")
    def _eval_mode_spelling(self, handler):
        """In eval mode with running statistics the training-mode fields mean nothing: left out, so
        such a stage spells, hashes and renders as before they existed."""
        data = handler(self)
        if not self.training and self.track_running_stats:
            for field in ("training", "momentum", "track_running_stats", "num_batches_tracked"):
                data.pop(field, None)
        return data

    @property
    def uses_batch_stats(self) -> bool:
        """Normalizes with the batch's statistics (a statistic stage), not the running ones."""
        return self.training or not self.track_running_stats

    def names(self) -> tuple[str, ...]:
        """The tensors the kernel reads: in eval mode the running statistics, weight and bias; with
        batch statistics weight and bias only."""
        stats = () if self.uses_batch_stats else (self.running_mean, self.running_var)
        return tuple(n for n in (*stats, self.weight, self.bias) if n is not None)

    def buffer_names(self) -> tuple[str, ...]:
        """The running statistics a training-mode layer updates (not read by its kernels)."""
        if not (self.training and self.track_running_stats):
            return ()
        return (self.running_mean, self.running_var, self.num_batches_tracked)

    def eval_mode(self) -> "BatchNormArgs":
        """The same stage in eval mode (running statistics): what a training-mode layer runs once
        it is switched to eval()."""
        return BatchNormArgs(eps=self.eps, affine=self.affine, weight=self.weight, bias=self.bias,
                             running_mean=self.running_mean, running_var=self.running_var)

    @classmethod
    def from_operands(cls, operands, fields):
        """Batch norm whose statistics (and weight, bias) are per-channel tensors: one stage naming them.

        In eval mode the operands are (running_mean, running_var, weight, bias). With batch
        statistics (`fields` hold training: true and momentum, or track_running_stats: false) a
        fifth, num_batches_tracked, follows; the running statistics and the counter are None
        without running statistics."""
        mean, var, weight, bias, *counter = operands
        if not all(t is None or isinstance(t, Param) for t in operands) or (weight is None) != (bias is None):
            return None
        batch_stats = fields.get("training", False) or fields.get("track_running_stats", True) is False
        tracked = fields.get("track_running_stats", True) is not False
        if tracked and (mean is None or var is None):
            return None
        if batch_stats and tracked and (not counter or counter[0] is None):
            return None
        args = dict(fields)
        if tracked:
            args.update(running_mean=mean.name, running_var=var.name)
            if batch_stats:
                args["num_batches_tracked"] = counter[0].name
        elif mean is not None or var is not None:
            return None
        if weight is None:
            args["affine"] = False
        else:
            args.update(weight=weight.name, bias=bias.name)
        return args


def _batch_norm_text(t, a):
    x, mean, var, weight, bias = t
    text = f"({x} - {mean}) / sqrt({var} + {expr_number(a['eps'])})"
    if weight is not None:
        text = f"{text} * {weight}"
    if bias is not None:
        text = f"{text} + {bias}"
    return f"({text})"


def _batch_norm_channel(a, k) -> dict:
    """The channel's 1 / sqrt(running_var + eps), once per channel where the engine reads a
    channel's parameters before its values (`Pointwise.channel_values`)."""
    return {"invstd": f"__frsqrt_rn({k[a.running_var]} + {k['eps']})"}


def _batch_norm_c(a, x, k):
    invstd = k.get("invstd") or _batch_norm_channel(a, k)["invstd"]
    text = f"(({x}) - {k[a.running_mean]}) * {invstd}"
    if a.weight is not None:
        text = f"{text} * {k[a.weight]}"
    if a.bias is not None:
        text = f"{text} + {k[a.bias]}"
    return f"({text})"


def _batch_norm_ref(x, a, p):
    y = (x - p[a.running_mean]) / _torch().sqrt(p[a.running_var] + a.eps)
    if a.weight is not None:
        y = y * p[a.weight]
    if a.bias is not None:
        y = y + p[a.bias]
    return y


def _batch_norm_init(a) -> dict:
    """nn.BatchNormNd's initial values; the running statistics are buffers (not trained). With batch
    statistics the kernel reads weight and bias only (the running statistics are `buffer_inits`)."""
    inits = {} if a.uses_batch_stats else {a.running_mean: ParamInit(True, 0.0), a.running_var: ParamInit(True, 1.0)}
    if a.weight is not None:
        inits[a.weight] = ParamInit(False, 1.0)
    if a.bias is not None:
        inits[a.bias] = ParamInit(False, 0.0)
    return inits


@dataclass(frozen=True)
class ParamInit:
    """How a layer creates a per-channel tensor: a buffer or a parameter, filled with `fill`
    (None: standard normal, the default of a per-channel parameter)."""

    buffer: bool = False
    fill: Optional[float] = None


def _operand(args: OperandArgs, names: dict[str, str]) -> str:
    for name in (args.input, args.saved):
        if name is not None:
            return names[name]
    return names["value"] if args.param is None else names[args.param]


def _operand_ref(args: OperandArgs, x, params: dict):
    for name in (args.input, args.saved):
        if name is not None:
            return params[name]
    return args.value if args.param is None else params[args.param]


def _operand_params(a: OperandArgs) -> tuple[str, ...]:
    return () if a.param is None else (a.param,)


def _operand_inputs(a: OperandArgs) -> tuple[str, ...]:
    return () if a.input is None else (a.input,)


def _operand_saved(a: OperandArgs) -> tuple[str, ...]:
    return () if a.saved is None else (a.saved,)


@dataclass(frozen=True)
class Pointwise:
    name: str
    args: type[Args]
    cuda: Callable[[Any, str, dict], str]
    torch_ref: Callable[[Any, Any, dict], Any]
    doc: str = ""
    # Names of the per-channel parameters an instance uses.
    params: Callable[[Any], tuple[str, ...]] = field(default=lambda a: ())
    # Names of the extra tensors an instance reads, which the caller passes at run time.
    inputs: Callable[[Any], tuple[str, ...]] = field(default=lambda a: ())
    # Names of the saved values (`save` stages) an instance reads.
    saved: Callable[[Any], tuple[str, ...]] = field(default=lambda a: ())
    # How a layer creates them, by name (left out: a parameter drawn from a standard normal).
    param_init: Callable[[Any], dict] = field(default=lambda a: {})
    # For the affine fold: `affine(args, scale, shift)` composes this op, as v -> a * v + b, onto
    # the map v -> scale * v + shift and returns the new (scale, shift), or None where this
    # instance is no constant affine map (a per-channel operand, a division by zero). None: the
    # op is not affine and the fold stops at it.
    affine: Optional[Callable[[Any, float, float], Optional[tuple[float, float]]]] = None
    # The function of specgen.expr that means the same op, called as name(x, *operands) with the
    # float fields `expr_operands` as its further arguments; expr_function_mismatches() checks
    # that both spell the same CUDA and the same PyTorch result.
    expr_function: Optional[str] = None
    expr_operands: tuple[str, ...] = ()
    # How PyTorch code writes the op, for the importer (see Spelling).
    spellings: tuple[Spelling, ...] = ()
    # The op in the grammar of specgen.expr, for the importer to write it inside a larger expr:
    # expr_text(operand texts, x first; the op's constants) -> text, or None where the grammar
    # cannot say it. Left out: `expr_function` called on the operands.
    expr_text: Optional[Callable[[list, dict], Optional[str]]] = None
    # Whether x may be either operand of the op's own stage (2 + x is add: 2.0, 2 - x an expr).
    commutative: bool = False
    # Values that depend on the channel alone, `channel_values(args, k)` -> {name: CUDA over k's
    # parameters and constants}: an engine that reads a channel's parameters before its values
    # computes them once there and hands `cuda` their names in k (the same arithmetic: same bits).
    channel_values: Optional[Callable[[Any, dict], dict]] = None

    def constants(self, args: Args) -> dict[str, float]:
        """The float fields of `args` that become named constexprs (None means 'not used')."""
        return {k: v for k, v in args.model_dump().items() if isinstance(v, float)}

    def expr_form(self, operands: list, fields: dict) -> Optional[str]:
        """The op over `operands` (texts, x first) as expr text, or None (see `expr_text`)."""
        if self.expr_text is not None:
            return self.expr_text(operands, fields)
        if self.expr_function is not None:
            return f"{self.expr_function}({', '.join(operands)})"
        return None


def _affine(step: Callable[[float, float, float], Optional[tuple[float, float]]]):
    """An add/sub/mul/div row's affine composition: by a constant `value` only."""

    def compose(a: OperandArgs, scale: float, shift: float):
        return None if a.value is None else step(scale, shift, float(a.value))

    return compose


def _softplus_c(a, x, k):
    return f"(({x}) * {k['beta']} > {k['threshold']} ? ({x}) : log1pf(expf(({x}) * {k['beta']})) / {k['beta']})"


def _softplus_text(t, a):
    if a["threshold"] != 20.0:
        return None
    if a["beta"] == 1.0:
        return f"softplus({t[0]})"
    beta = expr_number(a["beta"])
    return f"(softplus({beta} * {t[0]}) / {beta})"


def _mish_c(a, x, k):
    # x * tanh(softplus(x)) with tanh(log1p(e)) = n / (n + 2), e = exp(x), n = e (e + 2): one expf
    # (the compiler computes the repeated call once) and a division instead of expf, log1pf and
    # tanhf, about a third of the instructions. As accurate: nothing cancels (n / (n + 2) tends to e
    # as x -> -inf and rounds to 1 well before x = 20, past which mish(x) is x in float32, as in PyTorch).
    e = f"expf({x})"
    return f"(({x}) > 20.0f ? ({x}) : ({x}) * ({e} * ({e} + 2.0f)) / fmaf({e}, {e} + 2.0f, 2.0f))"


def _clamp_c(a, x, k):
    out = x
    if a.min is not None:
        out = f"fmaxf({out}, {k['min']})"
    if a.max is not None:
        out = f"fminf({out}, {k['max']})"
    return out


def _clamp_text(t, a):
    x, lo, hi = t
    if lo is not None and hi is not None:
        return f"clamp({x}, {lo}, {hi})"
    if lo is not None:
        return f"max({x}, {lo})"
    if hi is not None:
        return f"min({x}, {hi})"
    return x


# The exact GELU of a value the stage before it bounds to |x| <= GELU_BOUNDED_MAX (`output_bound`:
# a clamp or hardtanh within that, a tanh, a sigmoid) is computed as x (1/2 + x R(x^2)), R a degree-5
# polynomial fitted to GELU over that range (weighted least squares toward the smallest relative
# error, in float64; coefficients rounded to float32). Evaluated in float32 (Horner, fmaf) over the
# range it is within 6.5e-7 relative (at x near -sqrt 2, where GELU is -0.11) and 1.5e-7 absolute
# (1.25 units in the last place at x = 1.4) of the float64 GELU, rel. L2 4.4e-8; the erff form,
# with a correctly rounded erff, 3.3e-7 and 1.3e-7 (tests/test_ops.py compiles both with nvcc and
# checks). It takes 8 instructions where the erff form takes about 28 (erff's selects between its
# two polynomials and the exp2 of its |z| >= 1 branch).
GELU_BOUNDED_MAX = math.sqrt(2.0)
GELU_BOUNDED_R = (0.39894208312034607, -0.0664883404970169, 0.009966489858925343, -0.0011762629728764296,
                  0.00010662533895811066, -5.861103545612423e-06)


def output_bound(stage) -> Optional[float]:
    """The largest |v| an epilogue stage can output whatever it is given (NaN aside), where its op
    and constants bound it: a clamp with both bounds, a hardtanh, a tanh, a sigmoid. None otherwise."""
    if stage.op == "clamp" and stage.args.min is not None and stage.args.max is not None:
        return max(abs(stage.args.min), abs(stage.args.max))
    if stage.op == "hardtanh":
        return max(abs(stage.args.min_val), abs(stage.args.max_val))
    if stage.op in ("tanh", "sigmoid"):
        return 1.0
    return None


def gelu_polynomial_bound(stage, before) -> Optional[float]:
    """The bound on |x| that epilogue stage `before` puts on the exact GELU `stage` that follows it,
    where it lets the GELU be the polynomial (at most GELU_BOUNDED_MAX); None otherwise."""
    if stage.op != "gelu" or stage.args.approximate != "none" or before is None:
        return None
    bound = output_bound(before)
    return bound if bound is not None and bound <= GELU_BOUNDED_MAX else None


def gelu_bounded_code(x: str, coefficients: list[str]) -> str:
    """x (1/2 + x R(x^2)) in fmaf's, R's coefficients named lowest degree first (see GELU_BOUNDED_R):
    the fmaf forms 1/2 + x R exactly before rounding, where the two nearly cancel (x near -sqrt 2)."""
    square = f"({x}) * ({x})"
    poly = coefficients[-1]
    for name in reversed(coefficients[:-1]):
        poly = f"fmaf({poly}, {square}, {name})"
    return f"({x}) * fmaf({x}, {poly}, 0.5f)"


_GELU_TEXT = {
    "none": lambda x: f"(0.5 * {x} * (1 + erf({x} * 0.7071067811865476)))",
    "tanh": lambda x: f"(0.5 * {x} * (1 + tanh(0.7978845608028654 * ({x} + 0.044715 * {x} ** 3))))",
}
_INPLACE = "input, inplace=False"
_BATCH_NORM = "input, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1, eps=1e-05"
_BATCH_NORM_OPERANDS = ("input", "running_mean", "running_var", "weight", "bias")
_ADD_SUB = "input, other, alpha=1"
_BINARY = ("input", "other")


_POINTWISE_ROWS = [
    Pointwise(
        "save",
        SaveArgs,
        lambda a, x, k: x,
        lambda x, a, p: x,
        "x (and names it, for a later {saved: name} operand)",
    ),
    Pointwise(
        "relu",
        NoArgs,
        lambda a, x, k: f"fmaxf({x}, 0.0f)",
        lambda x, a, p: _F().relu(x),
        "max(x, 0)",
        expr_function="relu",
        spellings=(
            Spelling(_INPLACE, ("torch.relu", "F.relu", "torch.relu_", "F.relu_"), ("relu", "relu_"), ("ReLU",)),
        ),
    ),
    Pointwise(
        "leaky_relu",
        LeakyReluArgs,
        lambda a, x, k: f"(({x}) > 0.0f ? ({x}) : ({x}) * {k['negative_slope']})",
        lambda x, a, p: _F().leaky_relu(x, a.negative_slope),
        "x if x > 0 else x * negative_slope",
        spellings=(
            Spelling("input, negative_slope=0.01, inplace=False", ("F.leaky_relu", "F.leaky_relu_"), (), ("LeakyReLU",)),
        ),
        expr_text=lambda t, a: f"(max({t[0]}, 0) + {expr_number(a['negative_slope'])} * min({t[0]}, 0))",
    ),
    Pointwise(
        "gelu",
        GeluArgs,
        lambda a, x, k: (
            f"(0.5f * ({x}) * (1.0f + erff(({x}) * 0.707106781186547524f)))"
            if a.approximate == "none"
            else f"(0.5f * ({x}) * (1.0f + tanhf(0.797884560802865356f * (({x}) + 0.044715f * ({x}) * ({x}) * ({x})))))"
        ),
        lambda x, a, p: _F().gelu(x, approximate=a.approximate),
        "exact (erf) or tanh-approximated GELU",
        spellings=(Spelling("input, approximate='none'", ("F.gelu",), (), ("GELU",)),),
        expr_text=lambda t, a: _GELU_TEXT[a["approximate"]](t[0]),
    ),
    Pointwise(
        "sigmoid",
        NoArgs,
        # expf is the accurate one (2 ulp); the division is __fdividef (2 ulp for a divisor below
        # 2^126, past which the exact quotient is a denormal and this gives 0), which has no IEEE
        # division's slow-path branch: a third of the instructions in an epilogue of sigmoids.
        lambda a, x, k: f"__fdividef(1.0f, 1.0f + expf(-({x})))",
        lambda x, a, p: _torch().sigmoid(x),
        expr_function="sigmoid",
        spellings=(
            Spelling("input", ("torch.sigmoid", "F.sigmoid", "torch.sigmoid_", "torch.special.expit"), ("sigmoid", "sigmoid_"),
                     ("Sigmoid",)),
        ),
    ),
    Pointwise(
        "tanh",
        NoArgs,
        lambda a, x, k: f"tanhf({x})",
        lambda x, a, p: _torch().tanh(x),
        expr_function="tanh",
        spellings=(Spelling("input", ("torch.tanh", "F.tanh", "torch.tanh_"), ("tanh", "tanh_"), ("Tanh",)),),
    ),
    Pointwise(
        "mish",
        NoArgs,
        _mish_c,
        lambda x, a, p: _F().mish(x),
        "x * tanh(softplus(x))",
        spellings=(Spelling(_INPLACE, ("F.mish",), (), ("Mish",)),),
        expr_text=lambda t, a: f"({t[0]} * tanh(log(1 + exp({t[0]}))))",
    ),
    Pointwise(
        "hardswish",
        NoArgs,
        lambda a, x, k: f"(({x}) * fminf(fmaxf(({x}) + 3.0f, 0.0f), 6.0f) / 6.0f)",
        lambda x, a, p: _F().hardswish(x),
        "x * relu6(x + 3) / 6",
        spellings=(Spelling(_INPLACE, ("F.hardswish",), (), ("Hardswish",)),),
        expr_text=lambda t, a: f"({t[0]} * clamp({t[0]} + 3, 0, 6) / 6)",
    ),
    Pointwise(
        "hardtanh",
        HardtanhArgs,
        lambda a, x, k: f"fminf(fmaxf({x}, {k['min_val']}), {k['max_val']})",
        lambda x, a, p: _F().hardtanh(x, a.min_val, a.max_val),
        spellings=(
            # nn.ReLU6 is a Hardtanh(0, 6)
            Spelling("input, min_val=-1.0, max_val=1.0, inplace=False", ("F.hardtanh", "F.hardtanh_"), (), ("Hardtanh",)),
            Spelling(_INPLACE, ("F.relu6",), fixed={"min_val": 0.0, "max_val": 6.0}),
        ),
        expr_text=lambda t, a: f"clamp({t[0]}, {expr_number(a['min_val'])}, {expr_number(a['max_val'])})",
    ),
    Pointwise(
        "clamp",
        ClampArgs,
        _clamp_c,
        lambda x, a, p: _torch().clamp(x, min=a.min, max=a.max),
        expr_function="clamp",
        expr_operands=("min", "max"),
        spellings=tuple(
            Spelling(sig, tuple(f"torch.{n}" for n in names), names, operands=("input", "min", "max"), fixed=fixed)
            for sig, names, fixed in (
                ("input, min=None, max=None", ("clamp", "clip", "clamp_", "clip_"), {}),
                ("input, min", ("clamp_min", "clamp_min_"), {"max": None}),
                ("input, max", ("clamp_max", "clamp_max_"), {"min": None}),
            )
        ),
        expr_text=_clamp_text,
    ),
    Pointwise(
        "silu",
        NoArgs,
        lambda a, x, k: f"__fdividef({x}, 1.0f + expf(-({x})))",  # (as sigmoid's division)
        lambda x, a, p: _F().silu(x),
        spellings=(Spelling(_INPLACE, ("F.silu",), (), ("SiLU",)),),
        expr_text=lambda t, a: f"({t[0]} * sigmoid({t[0]}))",
    ),
    Pointwise(
        "softplus",
        SoftplusArgs,
        _softplus_c,
        lambda x, a, p: _F().softplus(x, beta=a.beta, threshold=a.threshold),
        "log(1 + exp(beta x)) / beta, linear above threshold",
        spellings=(Spelling("input, beta=1.0, threshold=20.0", ("F.softplus",), (), ("Softplus",)),),
        # expr's softplus is PyTorch's at beta 1, threshold 20; another beta scales its argument
        # (x * beta > 20 is the same test), another threshold has no expr form
        expr_text=_softplus_text,
    ),
    Pointwise(
        "add",
        OperandArgs,
        lambda a, x, k: f"({x} + {_operand(a, k)})",
        lambda x, a, p: x + _operand_ref(a, x, p),
        params=_operand_params,
        inputs=_operand_inputs,
        saved=_operand_saved,
        affine=_affine(lambda s, t, v: (s, t + v)),
        spellings=(
            Spelling(
                _ADD_SUB, ("operator.add", "operator.iadd", "torch.add"), ("add", "add_"), operands=_BINARY,
                scale=("other", "alpha"),
            ),
        ),
        expr_text=lambda t, a: f"({t[0]} + {t[1]})",
        commutative=True,
    ),
    Pointwise(
        "sub",
        OperandArgs,
        lambda a, x, k: f"({x} - {_operand(a, k)})",
        lambda x, a, p: x - _operand_ref(a, x, p),
        params=_operand_params,
        inputs=_operand_inputs,
        saved=_operand_saved,
        affine=_affine(lambda s, t, v: (s, t - v)),
        spellings=(
            Spelling(
                _ADD_SUB,
                ("operator.sub", "operator.isub", "torch.sub", "torch.subtract"),
                ("sub", "sub_", "subtract", "subtract_"),
                operands=_BINARY,
                scale=("other", "alpha"),
            ),
        ),
        expr_text=lambda t, a: f"({t[0]} - {t[1]})",
    ),
    Pointwise(
        "mul",
        OperandArgs,
        lambda a, x, k: f"({x} * {_operand(a, k)})",
        lambda x, a, p: x * _operand_ref(a, x, p),
        params=_operand_params,
        inputs=_operand_inputs,
        saved=_operand_saved,
        affine=_affine(lambda s, t, v: (s * v, t * v)),
        spellings=(
            Spelling(
                "input, other",
                ("operator.mul", "operator.imul", "torch.mul", "torch.multiply"),
                ("mul", "mul_", "multiply", "multiply_"),
                operands=_BINARY,
            ),
        ),
        expr_text=lambda t, a: f"({t[0]} * {t[1]})",
        commutative=True,
    ),
    Pointwise(
        "div",
        OperandArgs,
        lambda a, x, k: f"({x} / {_operand(a, k)})",
        lambda x, a, p: x / _operand_ref(a, x, p),
        params=_operand_params,
        inputs=_operand_inputs,
        saved=_operand_saved,
        affine=_affine(lambda s, t, v: None if v == 0.0 else (s / v, t / v)),
        spellings=(
            Spelling(
                "input, other, rounding_mode=None",
                ("operator.truediv", "operator.itruediv", "torch.div", "torch.divide", "torch.true_divide"),
                ("div", "div_", "divide", "divide_", "true_divide", "true_divide_"),
                operands=_BINARY,
                refuse={"rounding_mode": "rounding_mode={value!r} (only true division is fused)"},
            ),
        ),
        expr_text=lambda t, a: f"({t[0]} / {t[1]})",
    ),
    Pointwise(
        "min",
        ScalarArgs,
        lambda a, x, k: f"fminf({x}, {k['value']})",
        lambda x, a, p: _torch().clamp(x, max=a.value),
        "min(x, value)",
        expr_function="min",
        expr_operands=("value",),
        spellings=(Spelling("input, other", ("torch.minimum", "torch.fmin"), ("minimum", "fmin"), operands=_BINARY),),
        commutative=True,
    ),
    Pointwise(
        "max",
        ScalarArgs,
        lambda a, x, k: f"fmaxf({x}, {k['value']})",
        lambda x, a, p: _torch().clamp(x, min=a.value),
        "max(x, value)",
        expr_function="max",
        expr_operands=("value",),
        spellings=(Spelling("input, other", ("torch.maximum", "torch.fmax"), ("maximum", "fmax"), operands=_BINARY),),
        commutative=True,
    ),
    Pointwise(
        "expr",
        ExprArgs,
        lambda a, x, k: a.parsed.to_cuda(x, k),
        lambda x, a, p: a.parsed.to_torch(x, p),
        "a pointwise expression over x, numbers and per-channel parameters",
        params=lambda a: a.parsed.params,
    ),
    Pointwise(
        "batch_norm",
        BatchNormArgs,
        _batch_norm_c,
        _batch_norm_ref,
        "eval-mode batch norm: (x - running_mean) / sqrt(running_var + eps) * weight + bias",
        params=lambda a: a.names(),
        param_init=_batch_norm_init,
        # one spelling for both modes: in training mode, or without running statistics, the call is
        # the statistic stage of NORMS["batch_norm"]; the module also counts its batches
        spellings=(
            Spelling(_BATCH_NORM, ("F.batch_norm",), operands=_BATCH_NORM_OPERANDS, form="batch_norm"),
            Spelling(
                f"{_BATCH_NORM}, num_batches_tracked=None",
                modules=("BatchNorm1d", "BatchNorm2d", "BatchNorm3d"),
                operands=(*_BATCH_NORM_OPERANDS, "num_batches_tracked"),
                form="batch_norm",
            ),
        ),
        expr_text=_batch_norm_text,
        channel_values=_batch_norm_channel,
    ),
]
POINTWISE: dict[str, Pointwise] = {row.name: row for row in _POINTWISE_ROWS}



class AlphaArgs(Args):
    alpha: float = 1.0


class ThresholdArgs(Args):
    threshold: float
    value: float


class LambdArgs(Args):
    lambd: float = 0.5


@dataclass(frozen=True)
class ExprOnly:
    """A PyTorch pointwise function that no op of the table names: the importer writes it as (part
    of) an `expr` stage, with `expr_text` as `Pointwise.expr_text`; `args` types its constants."""

    name: str
    expr_text: Callable[[list, dict], Optional[str]]
    spellings: tuple[Spelling, ...]
    args: type[Args] = NoArgs

    def expr_form(self, operands: list, fields: dict) -> Optional[str]:
        return self.expr_text(operands, fields)


def _pow_text(t, a):
    if "base" in a:  # base ** x, with a positive constant base
        return f"exp({t[0]} * {expr_number(math.log(a['base']))})"
    n = a["exponent"]
    if float(n).is_integer() and 1 <= n <= 4:
        return f"({t[0]} ** {int(n)})"
    return {0.5: f"sqrt({t[0]})", -0.5: f"(1 / sqrt({t[0]}))", -1.0: f"(1 / {t[0]})", -2.0: f"(1 / {t[0]} ** 2)"}.get(
        float(n)
    )


def _torch_function(fn: str, *more: str, text: str) -> ExprOnly:
    """A torch function of x alone (with its in-place form and Tensor methods)."""
    spelling = Spelling("input", (f"torch.{fn}", f"torch.{fn}_", *more), (fn, f"{fn}_"))
    return ExprOnly(fn, lambda t, a: text.format(x=t[0]), (spelling,))


_SELU = (1.0507009873554805, 1.6732632423543772)
_POWER = ("input", "exponent")

# The comparisons among them: their result is the model's bool tensor (a 0 / 1 value inside an expr).
COMPARISONS = ("gt", "ge", "lt", "le")

EXPR_ONLY: dict[str, ExprOnly] = {
    row.name: row
    for row in [
        ExprOnly(
            "neg",
            lambda t, a: f"(-{t[0]})",
            (Spelling("input", ("operator.neg", "torch.neg", "torch.negative"), ("neg", "neg_", "negative")),),
        ),
        ExprOnly(
            "pow",
            _pow_text,
            (
                Spelling("input, exponent", ("operator.pow", "torch.pow"), ("pow", "pow_"), operands=_POWER, form="power"),
                Spelling(
                    "input", ("torch.square",), ("square", "square_"), operands=_POWER, fixed={"exponent": 2.0}, form="power"
                ),
            ),
        ),
        # a copy (clone, contiguous, nn.Identity) inside a pointwise region: the value itself
        ExprOnly("identity", lambda t, a: t[0], ()),
        # x with no gradient through it (its value is x's): `original = x.clone().detach()`
        ExprOnly("detach", lambda t, a: f"detach({t[0]})", (Spelling("input", ("torch.detach",), ("detach",)),)),
        _torch_function("exp", text="exp({x})"),
        _torch_function("log", text="log({x})"),
        _torch_function("log1p", "torch.special.log1p", text="log1p({x})"),
        _torch_function("expm1", "torch.special.expm1", text="expm1({x})"),
        # (NaN gives 0 here, NaN in PyTorch)
        ExprOnly("sign", lambda t, a: f"(({t[0]} > 0) - ({t[0]} < 0))", (Spelling("input", ("torch.sign",), ("sign", "sign_")),)),
        _torch_function("sqrt", text="sqrt({x})"),
        _torch_function("rsqrt", text="(1 / sqrt({x}))"),
        _torch_function("reciprocal", text="(1 / {x})"),
        _torch_function("abs", "torch.absolute", text="abs({x})"),
        _torch_function("erf", "torch.special.erf", text="erf({x})"),
        ExprOnly(
            "elu",
            lambda t, a: f"(max({t[0]}, 0) + {expr_number(a['alpha'])} * (exp(min({t[0]}, 0)) - 1))",
            (Spelling("input, alpha=1.0, inplace=False", ("F.elu", "F.elu_"), (), ("ELU",)),),
            AlphaArgs,
        ),
        ExprOnly(
            "celu",
            lambda t, a: (
                f"(max({t[0]}, 0) + min(0, {expr_number(a['alpha'])} * (exp({t[0]} / {expr_number(a['alpha'])}) - 1)))"
            ),
            (Spelling("input, alpha=1.0, inplace=False", ("F.celu", "F.celu_"), (), ("CELU",)),),
            AlphaArgs,
        ),
        ExprOnly(
            "selu",
            lambda t, a: f"({_SELU[0]!r} * (max({t[0]}, 0) + {_SELU[1]!r} * (exp(min({t[0]}, 0)) - 1)))",
            (Spelling(_INPLACE, ("F.selu", "torch.selu", "F.selu_"), (), ("SELU",)),),
        ),
        ExprOnly(
            "logsigmoid", lambda t, a: f"(-softplus(-{t[0]}))", (Spelling("input", ("F.logsigmoid",), (), ("LogSigmoid",)),)
        ),
        ExprOnly(
            "threshold",
            lambda t, a: f"where({t[0]} > {expr_number(a['threshold'])}, {t[0]}, {expr_number(a['value'])})",
            (Spelling("input, threshold, value, inplace=False", ("F.threshold", "F.threshold_", "torch.threshold",
                                                                  "torch.threshold_"), (), ("Threshold",)),),
            ThresholdArgs,
        ),
        ExprOnly(
            "hardshrink",
            lambda t, a: f"where(abs({t[0]}) > {expr_number(a['lambd'])}, {t[0]}, 0)",
            (Spelling("input, lambd=0.5", ("F.hardshrink", "torch.hardshrink"), ("hardshrink",), ("Hardshrink",)),),
            LambdArgs,
        ),
        ExprOnly(
            "softshrink",
            lambda t, a: (f"where({t[0]} > {expr_number(a['lambd'])}, {t[0]} - {expr_number(a['lambd'])}, "
                          f"where({t[0]} < -{expr_number(a['lambd'])}, {t[0]} + {expr_number(a['lambd'])}, 0))"),
            (Spelling("input, lambd=0.5", ("F.softshrink",), (), ("Softshrink",)),),
            LambdArgs,
        ),
        ExprOnly(
            "hardsigmoid",
            lambda t, a: f"clamp({t[0]} / 6 + 0.5, 0, 1)",
            (Spelling(_INPLACE, ("F.hardsigmoid",), (), ("Hardsigmoid",)),),
        ),
        ExprOnly(
            "softsign", lambda t, a: f"({t[0]} / (1 + abs({t[0]})))", (Spelling("input", ("F.softsign",), (), ("Softsign",)),)
        ),
        # comparisons (1 where they hold, else 0, in an expr: the model's bool tensor) and torch.where
        *(
            ExprOnly(
                name,
                lambda t, a, sign=sign: f"({t[0]} {sign} {t[1]})",
                (Spelling("input, other", (f"operator.{name}", f"torch.{name}", f"torch.{long}"), (name, long),
                          operands=("input", "other")),),
            )
            for name, long, sign in (("gt", "greater", ">"), ("ge", "greater_equal", ">="), ("lt", "less", "<"),
                                     ("le", "less_equal", "<="))
        ),
        ExprOnly(
            "where",
            lambda t, a: f"where({t[0]}, {t[1]}, {t[2]})",
            (Spelling("condition, input, other", ("torch.where",), (), operands=("condition", "input", "other")),),
        ),
        # PReLU's slope, one per channel (applied along dim 1) or one for all: a per-channel operand
        ExprOnly(
            "prelu",
            lambda t, a: f"(max({t[0]}, 0) + {t[1]} * min({t[0]}, 0))",
            (Spelling("input, weight", ("F.prelu", "torch.prelu"), ("prelu",), ("PReLU",), operands=("input", "weight"),
                      form="prelu"),),
        ),
        ExprOnly(
            "tanhshrink", lambda t, a: f"({t[0]} - tanh({t[0]}))", (Spelling("input", ("F.tanhshrink",), (), ("Tanhshrink",)),)
        ),
    ]
}


def expr_function_mismatches(samples=(-3.0, -0.5, 0.0, 0.25, 2.0)) -> list[str]:
    """Where a pointwise row and the expr function it names (`expr_function`) disagree: arity, CUDA
    spelling, or PyTorch value on `samples` (operands fixed at 0.0 <= 0.5). Empty: they agree."""
    problems = []
    for row in _POINTWISE_ROWS:
        if row.expr_function is None:
            continue
        where = f"pointwise {row.name!r} / expr function {row.expr_function!r}"
        if row.expr_function not in expr_mod.FUNCTIONS:
            problems.append(f"{where}: not a function of specgen.expr")
            continue
        arity, spelling, _ = expr_mod.FUNCTIONS[row.expr_function]
        operands = dict(zip(row.expr_operands, (0.0, 0.5)))
        if arity != 1 + len(operands) or len(operands) != len(row.expr_operands):
            problems.append(f"{where}: expr takes {arity} argument(s), the row gives 1 + {len(row.expr_operands)}")
            continue
        args = row.args.model_validate(operands)
        names = {field: "{%d}" % (i + 1) for i, field in enumerate(row.expr_operands)}
        cuda = row.cuda(args, "{0}", names)
        if cuda != spelling:
            problems.append(f"{where}: CUDA {cuda!r} != {spelling!r}")
        try:
            torch = _torch()
        except ImportError:
            continue
        x = torch.tensor(samples, dtype=torch.float32)
        call = f"{row.expr_function}({', '.join(['x', *(repr(v) for v in operands.values())])})"
        want, got = row.torch_ref(x, args, {}), expr_mod.parse(call).to_torch(x, {})
        if not torch.equal(want, got):
            problems.append(f"{where}: PyTorch {got.tolist()} != {want.tolist()} on {list(samples)}")
    return problems


# ---------------------------------------------------------------------------------------------
# Pooling
# ---------------------------------------------------------------------------------------------

IntOrList = int | list[int] | tuple[int, ...]


class PoolArgs(Args):
    """Windowed pooling over every spatial dim, as nn.AvgPoolNd / nn.MaxPoolNd (floor mode)."""

    kernel: IntOrList
    stride: Optional[IntOrList] = None  # None: the kernel, as in PyTorch
    padding: IntOrList = 0

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data):
        return {"kernel": data} if isinstance(data, (int, list, tuple)) and not isinstance(data, bool) else data


class AvgPoolArgs(PoolArgs):
    count_include_pad: bool = True


class MaxPoolArgs(PoolArgs):
    dilation: IntOrList = 1


class OpTableError(RuntimeError):
    """A row of the op table lacks what a template needs (a bug in the table, not in a spec)."""


@dataclass(frozen=True)
class Pool:
    """A pool and the CUDA of its window accumulator, as %-format strings over the template's
    names: `init` the accumulator's start; `combine` an expression of %(acc)s and one more window
    element %(v)s; `finalize` the window's value from %(acc)s and %(count)s (the window's element
    count). A global pool that ends the chain is computed as its `reduction` (a REDUCTIONS row)."""

    name: str
    args: type[Args]
    reduce: Literal["avg", "max"]
    windowed: bool  # False: a global pool (output size 1 in every spatial dim)
    torch_ref: Callable[[Any, Any, int], Any]  # (x, canonical args, ndim) -> tensor
    reduction: Optional[str] = None
    init: Optional[str] = None
    combine: Optional[str] = None
    finalize: Optional[str] = None
    spellings: tuple[Spelling, ...] = ()  # how PyTorch code writes the pool, for the importer

    def cuda(self) -> dict[str, str]:
        """The row's CUDA snippets; an OpTableError names any that are missing."""
        return _snippets("pool", self.name, {"init": self.init, "combine": self.combine, "finalize": self.finalize})

    def global_reduction(self) -> "Reduction":
        """The REDUCTIONS row a global pool that ends the chain is computed as."""
        if self.reduction not in REDUCTIONS:
            raise OpTableError(f"pool {self.name!r} names reduction {self.reduction!r} in specgen.ops, which is not a row of REDUCTIONS")
        return REDUCTIONS[self.reduction]


def _snippets(kind: str, name: str, snippets: dict) -> dict[str, str]:
    missing = [k for k, v in snippets.items() if not isinstance(v, str) or not v]
    if missing:
        raise OpTableError(
            f"{kind} {name!r} has no CUDA {', '.join(missing)} in specgen.ops: "
            f"every {kind} row needs {', '.join(snippets)}"
        )
    return dict(snippets)


def _avg_pool_ref(x, a, nd):
    fn = getattr(_F(), f"avg_pool{nd}d")
    return fn(x, a.kernel, a.stride, a.padding, count_include_pad=a.count_include_pad)


def _max_pool_ref(x, a, nd):
    fn = getattr(_F(), f"max_pool{nd}d")
    return fn(x, a.kernel, a.stride, a.padding, a.dilation)


def _global_ref(kind):
    def ref(x, a, nd):
        dims = tuple(range(2, 2 + nd))
        return x.mean(dim=dims, keepdim=True) if kind == "avg" else x.amax(dim=dims, keepdim=True)

    return ref


_AVG = dict(reduction="mean", init="0.0f", combine="%(acc)s + %(v)s", finalize="%(acc)s / %(count)s")
_MAX = dict(reduction="amax", init="-CUDART_INF_F", combine="fmaxf(%(acc)s, %(v)s)", finalize="%(acc)s")

_ND = (1, 2, 3)
_WINDOW = "input, kernel_size, stride=None, padding=0"
_CEIL_MODE = {"ceil_mode": "ceil_mode=True is not supported (spec pools use floor mode)"}
_RETURN_INDICES = {"return_indices": "return_indices=True is not supported"}

POOLS: dict[str, Pool] = {
    row.name: row
    for row in [
        Pool(
            "avg_pool", AvgPoolArgs, "avg", True, _avg_pool_ref, **_AVG,
            spellings=(
                Spelling(
                    f"{_WINDOW}, ceil_mode=False, count_include_pad=True, divisor_override=None",
                    ("F.avg_pool{nd}d",),
                    modules=("AvgPool{nd}d",),
                    nd=_ND,
                    rename={"kernel_size": "kernel"},
                    refuse={"divisor_override": "divisor_override is not supported", **_CEIL_MODE},
                ),
            ),
        ),
        Pool(
            "max_pool", MaxPoolArgs, "max", True, _max_pool_ref, **_MAX,
            spellings=(
                Spelling(
                    f"{_WINDOW}, dilation=1, ceil_mode=False, return_indices=False",
                    ("F.max_pool{nd}d", "torch.max_pool{nd}d"),
                    modules=("MaxPool{nd}d",),
                    nd=_ND,
                    rename={"kernel_size": "kernel"},
                    refuse={**_CEIL_MODE, **_RETURN_INDICES},
                ),
            ),
        ),
        # nn.AdaptiveAvgPoolNd with an output of 1 is the global pool
        Pool(
            "global_avg_pool", NoArgs, "avg", False, _global_ref("avg"), **_AVG,
            spellings=(
                Spelling("input, output_size", ("F.adaptive_avg_pool{nd}d",), modules=("AdaptiveAvgPool{nd}d",), nd=_ND),
            ),
        ),
        Pool(
            "global_max_pool", NoArgs, "max", False, _global_ref("max"), **_MAX,
            spellings=(
                Spelling(
                    "input, output_size, return_indices=False",
                    ("F.adaptive_max_pool{nd}d",),
                    modules=("AdaptiveMaxPool{nd}d",),
                    nd=_ND,
                    refuse=_RETURN_INDICES,
                ),
            ),
        ),
    ]
}


# ---------------------------------------------------------------------------------------------
# Reductions
# ---------------------------------------------------------------------------------------------


class ReduceArgs(Args):
    """Reduce over `dims` of the current tensor, numbered as PyTorch numbers them (batch is 0)."""

    dims: list[int] = Field(min_length=1)
    keepdim: bool = False

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data):
        if isinstance(data, int) and not isinstance(data, bool):
            return {"dims": [data]}
        if isinstance(data, (list, tuple)):
            return {"dims": list(data)}
        if isinstance(data, dict) and isinstance(data.get("dims"), int) and not isinstance(data.get("dims"), bool):
            return {**data, "dims": [data["dims"]]}
        return data


@dataclass(frozen=True)
class Reduction:
    """A reduction and the CUDA of its accumulator, as %-format strings over the template's names.

    The accumulator is a pair of floats %(a)s, %(b)s (b starts at 0 and is used only where a
    reduction needs two, as logsumexp does). `init`: a's start; `fold`: a statement folding the
    value %(v)s into (a, b); `merge`: a statement merging another partial accumulator (%(a2)s,
    %(b2)s) into (a, b); `finalize`: the result's expression from (a, b) and %(count)s, the named
    constant holding the number of values reduced (emitted only for a finalize that uses it).
    `helpers`: device functions the snippets call, emitted once per kernel; `note`: what the
    accumulator holds, for the kernel's comment."""

    name: str
    torch_ref: Callable[[Any, tuple, bool], Any]
    init: Optional[str] = None
    fold: Optional[str] = None
    merge: Optional[str] = None
    finalize: Optional[str] = None
    helpers: str = ""
    note: str = ""
    spellings: tuple[Spelling, ...] = ()  # how PyTorch code writes the reduction, for the importer

    def cuda(self) -> dict[str, str]:
        """The row's CUDA snippets; an OpTableError names any that are missing."""
        return _snippets(
            "reduction", self.name, {"init": self.init, "fold": self.fold, "merge": self.merge, "finalize": self.finalize}
        )

    @property
    def uses_count(self) -> bool:
        return "%(count)s" in (self.finalize or "")


def _lse_ref(x, dims, keepdim):
    return _torch().logsumexp(x, dim=dims, keepdim=keepdim)


_LSE_HELPERS = """\
// logsumexp as a running (max m, scaled sum s): the value is m + log(s).
__device__ __forceinline__ void lse_fold(float& m, float& s, float v) {
  if (v > m) { s = s * expf(m - v) + 1.0f; m = v; }
  else if (v == m) { s += 1.0f; }
  else if (v > -CUDART_INF_F) { s += expf(v - m); }
}
__device__ __forceinline__ void lse_merge(float& m, float& s, float m2, float s2) {
  if (m2 > m) { s = s * expf(m - m2) + s2; m = m2; }
  else if (m2 == m) { s += s2; }
  else if (m2 > -CUDART_INF_F) { s += s2 * expf(m2 - m); }
}
__device__ __forceinline__ float lse_value(float m, float s) { return m == -CUDART_INF_F ? m : m + logf(s); }"""

_SUM = dict(init="0.0f", fold="%(a)s += %(v)s;", merge="%(a)s += %(a2)s;")

_SUM_SIG = "input, dim=None, keepdim=False, dtype=None"


def _reduction_spelling(fn: str, sig: str = "input, dim=(), keepdim=False") -> Spelling:
    return Spelling(sig, (f"torch.{fn}",), (fn,))


def _values_spelling(fn: str) -> Spelling:
    """torch.max(x, dim) reduces, returning (values, indices); torch.max(x, y) is the pointwise max."""
    return Spelling("input, dim=None, keepdim=False", (f"torch.{fn}",), (fn,), elementwise=fn)


REDUCTIONS: dict[str, Reduction] = {
    row.name: row
    for row in [
        Reduction(
            "sum",
            lambda x, d, k: _torch().sum(x, dim=d, keepdim=k),
            **_SUM,
            finalize="%(a)s",
            spellings=(_reduction_spelling("sum", _SUM_SIG),),
        ),
        Reduction(
            "mean",
            lambda x, d, k: _torch().mean(x, dim=d, keepdim=k),
            **_SUM,
            finalize="%(a)s / %(count)s",
            spellings=(_reduction_spelling("mean", _SUM_SIG),),
        ),
        Reduction(
            "amax",
            lambda x, d, k: _torch().amax(x, dim=d, keepdim=k),
            init="-CUDART_INF_F",
            fold="%(a)s = fmaxf(%(a)s, %(v)s);",
            merge="%(a)s = fmaxf(%(a)s, %(a2)s);",
            finalize="%(a)s",
            spellings=(_values_spelling("max"), _reduction_spelling("amax")),
        ),
        Reduction(
            "amin",
            lambda x, d, k: _torch().amin(x, dim=d, keepdim=k),
            init="CUDART_INF_F",
            fold="%(a)s = fminf(%(a)s, %(v)s);",
            merge="%(a)s = fminf(%(a)s, %(a2)s);",
            finalize="%(a)s",
            spellings=(_values_spelling("min"), _reduction_spelling("amin")),
        ),
        Reduction(
            "logsumexp",
            _lse_ref,
            init="-CUDART_INF_F",
            fold="lse_fold(%(a)s, %(b)s, %(v)s);",
            merge="lse_merge(%(a)s, %(b)s, %(a2)s, %(b2)s);",
            finalize="lse_value(%(a)s, %(b)s)",
            helpers=_LSE_HELPERS,
            note=" (running max, scaled sum)",
            spellings=(_reduction_spelling("logsumexp", "input, dim, keepdim=False"),),
        ),
    ]
}

# ---------------------------------------------------------------------------------------------
# Normalizations and softmax: statistic stages
# ---------------------------------------------------------------------------------------------
# A statistic stage normalizes each value with statistics of a group of values that spans many
# thread blocks (a channel group of a sample, a channel of the whole batch, a row, the positions
# softmax runs over). Its row says which dims a group spans (`span`), which statistic it needs
# ("moments": mean and biased variance; "lse": the running max and the sum of exp(x - max)),
# and the CUDA that turns the group's statistic (a, b) into the normalized value: `prepare` the
# second factor once per group, `normalize` each value %(x)s. The tail engine (specgen/tail.py)
# computes the statistic; the templates know no row by name.


class SpanError(ValueError):
    """A statistic stage that does not fit the tensor it sees; `field` names the argument."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(message)


@dataclass(frozen=True)
class Span:
    """The values one statistic group holds, on the tensor the stage sees (batch = dim 0): dims
    `first`..`last` (consecutive, 1-based), dim `first` split into `split` groups of channels (group
    norm; 1 otherwise), and the batch too when `across_batch` (training-mode batch norm)."""

    first: int
    last: int
    split: int = 1
    across_batch: bool = False


def _affine_names(data, prefix: str, switch: str, default_on: bool):
    """The before-validator of a norm's tensor names: `name` (default `prefix`) prefixes weight and
    bias unless they are named on their own; with `switch` false there are none."""
    if not isinstance(data, dict):
        return data
    data = dict(data)
    name = data.pop("name", prefix)
    if not isinstance(name, str) or not re.fullmatch(IDENTIFIER_PATTERN, name):
        raise ValueError(f"name must be an identifier (the prefix of the weight's and bias' names), got {name!r}")
    on = data.get(switch, default_on) is not False
    for field in ("weight", "bias"):
        if not on and data.get(field) is not None:
            raise ValueError(f"{switch}: false has no {field}, got {field}: {data[field]!r}")
        if on and data.get(field) is None:
            data[field] = f"{name}_{field}"
    return data


class _NormArgs(Args):
    """eps and the names of the affine weight and bias (None: not affine); `_switch` is the field
    that turns them on (affine, elementwise_affine)."""

    _switch: ClassVar[str] = "affine"

    eps: Annotated[float, Field(gt=0)] = 1e-5
    weight: Optional[str] = Field(default=None, pattern=IDENTIFIER_PATTERN)
    bias: Optional[str] = Field(default=None, pattern=IDENTIFIER_PATTERN)

    @classmethod
    def from_operands(cls, operands, fields):
        """The norm with its constants `fields` and (weight, bias): both `Param`s, or both None
        (not affine)."""
        weight, bias = operands
        if (weight is None) != (bias is None) or not all(t is None or isinstance(t, Param) for t in operands):
            return None
        if weight is None:
            return {**fields, cls._switch: False}
        return {**fields, cls._switch: True, "weight": weight.name, "bias": bias.name}

    @model_validator(mode="after")
    def _not_eps(self):
        if "eps" in (self.weight, self.bias):
            raise ValueError("'eps' is the op's constant; name the tensors otherwise")
        return self

    def names(self) -> tuple[str, ...]:
        return tuple(n for n in (self.weight, self.bias) if n is not None)


class GroupNormArgs(_NormArgs):
    """nn.GroupNorm: the channels split into `num_groups` groups; each sample's group (its channels
    and every position) is normalized with its mean and biased variance; `affine` adds a per-channel
    weight and bias (`group_norm: 8` is {num_groups: 8}; `name` prefixes the tensors, default gn)."""

    num_groups: Annotated[int, Field(gt=0, le=1 << 16)]
    affine: bool = True

    @model_validator(mode="before")
    @classmethod
    def _names(cls, data):
        if isinstance(data, int) and not isinstance(data, bool):
            data = {"num_groups": data}
        return _affine_names(data, "gn", "affine", True)


class InstanceNormArgs(_NormArgs):
    """nn.InstanceNormNd with its defaults (no running statistics): each sample's channel is
    normalized over its positions; `affine: true` adds a per-channel weight and bias (default
    prefix inorm)."""

    affine: bool = False

    @model_validator(mode="before")
    @classmethod
    def _names(cls, data):
        return _affine_names(data, "inorm", "affine", False)


class LayerNormArgs(_NormArgs):
    """nn.LayerNorm: the trailing dims, whose extents are `normalized_shape`, normalized per row;
    `elementwise_affine` adds a weight and bias of that shape (`layer_norm: 64` is
    {normalized_shape: [64]}; default prefix ln)."""

    _switch: ClassVar[str] = "elementwise_affine"

    normalized_shape: Annotated[list[Annotated[int, Field(gt=0, le=1 << 20)]], Field(min_length=1, max_length=4)]
    elementwise_affine: bool = True

    @model_validator(mode="before")
    @classmethod
    def _names(cls, data):
        if isinstance(data, (int, list, tuple)) and not isinstance(data, bool):
            data = {"normalized_shape": data}
        if isinstance(data, dict) and isinstance(data.get("normalized_shape"), int) and not isinstance(data.get("normalized_shape"), bool):
            data = {**data, "normalized_shape": [data["normalized_shape"]]}
        return _affine_names(data, "ln", "elementwise_affine", True)


class LayerNormChannelsArgs(_NormArgs):
    """A LayerNorm over the channels of each position: ConvNeXt's channels-first LayerNorm, timm's
    LayerNorm2d, `x.permute(0, 2, 3, 1)` -> nn.LayerNorm(C) -> `.permute(0, 3, 1, 2)`. Each position's
    channels are normalized with their mean and biased variance; `elementwise_affine` adds a weight
    and bias per channel (default prefix ln)."""

    _switch: ClassVar[str] = "elementwise_affine"

    elementwise_affine: bool = True

    @model_validator(mode="before")
    @classmethod
    def _names(cls, data):
        return _affine_names(data, "ln", "elementwise_affine", True)


class SoftmaxArgs(Args):
    """softmax / log_softmax over `dim`, numbered as PyTorch numbers it (batch is 0, negative from the
    end); a list of consecutive dims takes them as one (as a view that flattens them would)."""

    dim: Annotated[list[int], Field(min_length=1, max_length=4)]

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data):
        if isinstance(data, (int, list, tuple)) and not isinstance(data, bool):
            data = {"dim": data}
        if isinstance(data, dict) and isinstance(data.get("dim"), int) and not isinstance(data.get("dim"), bool):
            data = {**data, "dim": [data["dim"]]}
        return data

    def names(self) -> tuple[str, ...]:
        return ()


class CenterArgs(SoftmaxArgs):
    """center over `dim` (numbered as PyTorch numbers it: batch is 0, negative from the end), which
    must be trailing dims of the tensor it sees: x - x.mean(dim, keepdim=True)."""


def _channel_first(shape, op: str) -> int:
    """The channel extent at dim 1, or a SpanError: the norms over channels need it there."""
    if not shape.axes or shape.axes[0].role != "c":
        raise SpanError("", f"{op} normalizes per channel, but dim 1 is no longer the channels (an earlier reduction removed them)")
    return shape.axes[0].extent


def _group_norm_span(a: GroupNormArgs, shape) -> Span:
    channels = _channel_first(shape, "group_norm")
    if channels % a.num_groups:
        raise SpanError("num_groups", f"the {channels} channels do not split into {a.num_groups} groups (as in nn.GroupNorm, "
                                      f"num_groups must divide them)")
    if math.prod(shape.sizes) == a.num_groups:
        raise SpanError("num_groups", f"each of the {a.num_groups} groups would hold one value (the tensor is "
                                      f"{list(shape.sizes)} per sample): it would always normalize to 0, and nn.GroupNorm refuses it")
    return Span(1, len(shape.axes), split=a.num_groups)


def _instance_norm_span(a: InstanceNormArgs, shape) -> Span:
    _channel_first(shape, "instance_norm")
    if len(shape.axes) < 2 or math.prod(shape.sizes[1:]) < 2:
        raise SpanError("", f"instance_norm needs more than one position per channel (as in PyTorch), the tensor is "
                            f"{list(shape.sizes)} per sample")
    return Span(2, len(shape.axes))


def _layer_norm_span(a: LayerNormArgs, shape) -> Span:
    k = len(a.normalized_shape)
    trailing = list(shape.sizes[-k:]) if k <= len(shape.sizes) else None
    if trailing != list(a.normalized_shape):
        raise SpanError("normalized_shape", f"{list(a.normalized_shape)} must be the trailing extents of the tensor it "
                                            f"normalizes, which is {list(shape.sizes)} per sample (as in nn.LayerNorm)")
    return Span(len(shape.axes) - k + 1, len(shape.axes))


def _layer_norm_channels_span(a: LayerNormChannelsArgs, shape) -> Span:
    channels = _channel_first(shape, "layer_norm_channels")
    if channels < 2:
        raise SpanError("", "layer_norm_channels needs more than one channel: a group of one value always normalizes to 0")
    return Span(1, 1)


def _layer_norm_channels_ref(x, a, w, b, d):
    y = _F().layer_norm(x.movedim(1, -1), (x.shape[1],), _flat(w), _flat(b), a.eps)
    return y.movedim(-1, 1)


def _softmax_span(a: SoftmaxArgs, shape) -> Span:
    rank = 1 + len(shape.axes)
    dims = []
    for d in a.dim:
        n = d + rank if d < 0 else d
        if not 0 <= n < rank:
            raise SpanError("dim", f"dim {d} is out of range for a tensor of rank {rank} (batch included)")
        if n == 0:
            raise SpanError("dim", "dim 0 is the batch; specgen normalizes within a sample")
        if n in dims:
            raise SpanError("dim", f"dim {d} is listed twice")
        dims.append(n)
    dims.sort()
    if dims != list(range(dims[0], dims[-1] + 1)):
        raise SpanError("dim", f"the dims {dims} must be consecutive (they are taken as one flattened dim)")
    return Span(dims[0], dims[-1])


def _center_span(a: CenterArgs, shape) -> Span:
    span = _softmax_span(a, shape)
    if span.last != len(shape.axes):
        raise SpanError("dim", f"center subtracts the mean over trailing dims (the last one, {len(shape.axes)}, included); "
                               f"dims {a.dim} stop before it")
    return span


def _center_ref(x, a, p, dims):
    return x - x.mean(dim=tuple(dims), keepdim=True)


def _batch_norm_span(a: BatchNormArgs, shape) -> Span:
    _channel_first(shape, "batch_norm")
    return Span(2, len(shape.axes), across_batch=True)


def _norm_ref(fn):
    """A reference over the per-channel or elementwise tensors, reshaped as torch's functional wants."""

    def ref(x, a, p, dims):
        w = None if a.weight is None else p[a.weight]
        b = None if a.bias is None else p[a.bias]
        return fn(x, a, w, b, dims)

    return ref


def _flat(t):
    return None if t is None else t.reshape(-1)


def _softmax_ref(log: bool):
    def ref(x, a, p, dims):
        first, last = dims[0], dims[-1]
        fn = _torch().log_softmax if log else _torch().softmax
        if first == last:
            return fn(x, first)
        return fn(x.flatten(first, last), first).reshape(x.shape)

    return ref


@dataclass(frozen=True)
class Norm:
    """A statistic stage: its parameters, which values a group spans, the statistic, the CUDA of
    the normalization and the PyTorch reference `torch_ref(x, args, params, dims)` (dims: the
    absolute dims the group spans in x, batch = 0; params as the spec shapes them)."""

    name: str
    args: type[Args]
    span: Callable[[Any, Any], Span]
    statistic: Literal["moments", "lse"]
    prepare: str  # the group's second factor from its statistic (%(a)s, %(b)s), once per group
    normalize: str  # the normalized value of %(x)s with (%(a)s, %(b)s)
    torch_ref: Callable[[Any, Any, dict, tuple], Any]
    affine: Literal["channel", "element", "none"]  # per-channel weight and bias, of the normalized shape, or none
    doc: str = ""
    # How PyTorch code writes the stage, for the importer (see Spelling); batch norm's spellings are
    # on its POINTWISE row (one call, either kind of stage)
    spellings: tuple[Spelling, ...] = ()
    # what `prepare` computes, for the generated code's comments
    prepare_comment: str = ""

    def params(self, args) -> tuple[str, ...]:
        return args.names()

    def param_init(self, args) -> dict:
        return {n: ParamInit(False, 1.0 if n == args.weight else 0.0) for n in args.names()}

    def constants(self, args) -> dict[str, float]:
        return {"eps": args.eps} if "eps" in type(args).model_fields else {}


_MOMENTS = dict(statistic="moments", prepare="1.0f / sqrtf(%(b)s + %(eps)s)", normalize="(%(x)s - %(a)s) * %(b)s",
                prepare_comment="1 / sqrt(variance + eps)")

_AFFINE = ("input", "weight", "bias")
_RUNNING = "running statistics ({why}): instance_norm is fused only as nn.InstanceNormNd's default, which normalizes every sample with its own statistics"
_INSTANCE_NORM = "input, running_mean=None, running_var=None, weight=None, bias=None"
_NO_DIM = {"dim": "dim=None (PyTorch's implicit dim, deprecated) is not fused: give dim"}


def _softmax_spellings(fn: str) -> tuple[Spelling, ...]:
    """F.softmax (with its _stacklevel) and nn.Softmax; torch.softmax and the Tensor method; the same for log_softmax."""
    return (
        Spelling("input, dim=None, _stacklevel=3, dtype=None", (f"F.{fn}",), modules=("Softmax" if fn == "softmax" else "LogSoftmax",),
                 require=_NO_DIM),
        Spelling("input, dim, dtype=None", (f"torch.{fn}",) + (("torch.special.softmax",) if fn == "softmax" else ()), (fn,),
                 require=_NO_DIM),
    )


NORMS: dict[str, Norm] = {
    row.name: row
    for row in [
        Norm("group_norm", GroupNormArgs, _group_norm_span, **_MOMENTS, affine="channel",
             torch_ref=_norm_ref(lambda x, a, w, b, d: _F().group_norm(x, a.num_groups, _flat(w), _flat(b), a.eps)),
             doc="(x - mean) / sqrt(var + eps) * weight + bias over each sample's channel group",
             spellings=(Spelling("input, num_groups, weight=None, bias=None, eps=1e-05", ("F.group_norm",), (), ("GroupNorm",),
                                 operands=_AFFINE),)),
        Norm("instance_norm", InstanceNormArgs, _instance_norm_span, **_MOMENTS, affine="channel",
             torch_ref=_norm_ref(lambda x, a, w, b, d: _F().instance_norm(x, weight=_flat(w), bias=_flat(b), eps=a.eps)),
             doc="(x - mean) / sqrt(var + eps) [* weight + bias] over each sample's channel",
             spellings=(
                 Spelling(f"{_INSTANCE_NORM}, use_input_stats=True, momentum=0.1, eps=1e-05", ("F.instance_norm",), operands=_AFFINE,
                          refuse={n: _RUNNING.format(why=f"{n} passed in") for n in ("running_mean", "running_var")},
                          require={"use_input_stats": "use_input_stats=False normalizes with the running statistics, "
                                                      "which the instance_norm stage does not do"}),
                 # the module's arguments: use_input_stats follows track_running_stats, refused here
                 Spelling(f"{_INSTANCE_NORM}, eps=1e-05", modules=("InstanceNorm{nd}d",), nd=(1, 2, 3), operands=_AFFINE,
                          refuse={n: _RUNNING.format(why="track_running_stats=True") for n in ("running_mean", "running_var")}),
             )),
        Norm("layer_norm", LayerNormArgs, _layer_norm_span, **_MOMENTS, affine="element",
             torch_ref=_norm_ref(lambda x, a, w, b, d: _F().layer_norm(x, list(a.normalized_shape), w, b, a.eps)),
             doc="(x - mean) / sqrt(var + eps) * weight + bias over the trailing normalized_shape",
             spellings=(Spelling("input, normalized_shape, weight=None, bias=None, eps=1e-05", ("F.layer_norm",), (), ("LayerNorm",),
                                 operands=_AFFINE),)),
        Norm("layer_norm_channels", LayerNormChannelsArgs, _layer_norm_channels_span, **_MOMENTS, affine="channel",
             torch_ref=_norm_ref(_layer_norm_channels_ref),
             doc="(x - mean) / sqrt(var + eps) * weight + bias over each position's channels (ConvNeXt's channels-first LayerNorm)"),
        Norm("batch_norm", BatchNormArgs, _batch_norm_span, **_MOMENTS, affine="channel",
             torch_ref=_norm_ref(lambda x, a, w, b, d: _F().batch_norm(x, None, None, _flat(w), _flat(b), True, 0.0, a.eps)),
             doc="(x - mean) / sqrt(var + eps) * weight + bias over each channel of the whole batch"),
        Norm("softmax", SoftmaxArgs, _softmax_span, "lse", "%(b)s", "expf(%(x)s - %(a)s) / %(b)s", _softmax_ref(False),
             "none", "exp(x - max) / sum(exp(x - max)) over dim",
             # nn.Softmax2d: the softmax over the channels of a [N, C, H, W] tensor
             spellings=(*_softmax_spellings("softmax"), Spelling("input", modules=("Softmax2d",), fixed={"dim": -3})),
             prepare_comment="the sum"),
        Norm("log_softmax", SoftmaxArgs, _softmax_span, "lse", "logf(%(b)s)", "(%(x)s - %(a)s) - %(b)s", _softmax_ref(True),
             "none", "x - max - log(sum(exp(x - max))) over dim", spellings=_softmax_spellings("log_softmax"),
             prepare_comment="log of the sum"),
        # x - x.mean(dim, keepdim=True): written as that pair of calls, which the importer matches itself
        Norm("center", CenterArgs, _center_span, "moments", "%(b)s", "(%(x)s - %(a)s)", _center_ref, "none",
             "x - mean over trailing dims", prepare_comment="the variance (unused: centering subtracts the mean only)"),
    ]
}


def stage_kind(op: str, args) -> str:
    """The kind of one stage: a batch norm with batch statistics is a statistic stage ("norm"), in
    eval mode a pointwise op; every other op has one kind (STAGE_KINDS)."""
    if op == "batch_norm":
        return "norm" if args.uses_batch_stats else "pointwise"
    return STAGE_KINDS[op]


STAGE_KINDS: dict[str, str] = {
    **{n: "pointwise" for n in POINTWISE},
    **{n: "pool" for n in POOLS},
    **{n: "reduce" for n in REDUCTIONS},
    **{n: "norm" for n in NORMS if n not in POINTWISE},  # batch_norm: see stage_kind
}


def args_model(op: str) -> type[Args]:
    kind = STAGE_KINDS[op]
    if kind == "pointwise":
        return POINTWISE[op].args
    if kind == "pool":
        return POOLS[op].args
    if kind == "norm":
        return NORMS[op].args
    return ReduceArgs


def is_finite_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
