"""What a node computes: every spelling of every op the importer knows, bound to one signature.

The op table (specgen.ops) says how PyTorch code writes each pointwise op, pool, reduction and
statistic stage (normalizations and softmax): each row's `spellings` (module types, functions,
Tensor methods, Python operators, and how their arguments map to the op's). This module turns
those names into lookup tables of the live torch objects, and each call into a description (`PW`,
`PoolOp`, `ReduceOp`, `NormOp` ...) or a `Reject` that says why it is not fused. It has its own rows only for what is not an op of the table, the frame of a
chain: the convolutions that start chains, the dropout, identity and shape ops a chain passes
through, and numbers made into tensors in forward.
"""

from __future__ import annotations

import ast
import math
import operator
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.fx import Node

from specgen import ops
from specgen.importer.graph import PADDING_KEY, batch_free_value, function_label, hashable, shape_of

# =============================================================================================
# What a node means: the descriptions the builders return
# =============================================================================================


class Reject(Exception):
    """A node (or operand) that cannot join a chain; `reason` says why, for the report."""

    @property
    def reason(self) -> str:
        return str(self.args[0])


@dataclass(frozen=True, eq=False)
class TensorRef:
    """A tensor of the model used as an operand (a parameter, a buffer or a traced constant)."""

    path: str  # where it lives in the model, e.g. "sum_tensor" or "bn.running_mean"
    tensor: torch.Tensor
    shape: tuple  # the shape it is used with (after any view of it in forward)
    along_dim1: bool = False  # batch-norm style: a (C,) tensor applied along dim 1


@dataclass(frozen=True, eq=False)
class Dim1:
    """Marks an operand that applies along dim 1 whatever its shape (batch norm statistics)."""

    value: Any


@dataclass(eq=False)
class PW:
    """A pointwise op: `op` names a row of ops.POINTWISE or ops.EXPR_ONLY; operands are Nodes,
    numbers, None, TensorRef or PW; `attrs` are the op's constants."""

    op: str
    operands: tuple
    attrs: dict = field(default_factory=dict)
    inplace: bool = False


@dataclass(frozen=True, eq=False)
class Counter:
    """Marks an operand that counts batches (a batch norm's num_batches_tracked; None: the layer
    counts in a buffer of its own)."""

    value: Any


@dataclass(eq=False)
class NormOp:
    """A statistic stage: `op` names a row of ops.NORMS; `operands` are its tensors after the input,
    in the order its args model's from_operands takes them (Dim1 for a per-channel tensor, a
    Counter for a batch counter, a bare value for a tensor used whole, None for one not given);
    `attrs` its constants; `dims` the dims its `dim` names, as the model's code numbers them."""

    input: Any
    op: str
    operands: tuple
    attrs: dict
    dims: Optional[list] = None
    # a training-mode batch norm whose mode is its call's (F.batch_norm(training=True)), not the
    # module's: it normalizes with the batch's statistics after .eval() too
    fixed_mode: bool = False


@dataclass(eq=False)
class PoolOp:
    input: Any
    stage: dict
    nd: int


@dataclass(eq=False)
class ReduceOp:
    input: Any
    op: str
    dims: list
    keepdim: bool
    tuple_out: bool = False  # torch.max/min with dim: (values, indices)


@dataclass(eq=False)
class ShapeOp:
    """view/reshape/flatten/squeeze/unsqueeze: absorbed when only size-1 dims change (judged on shapes)."""

    input: Any


def _inserts_dims_only(index) -> bool:
    """Whether indexing with `index` (x[None, :, None], x[..., None]) only inserts size-1 dims: its
    items are None, whole slices and at most one Ellipsis, and one at least is None."""
    items = index if isinstance(index, tuple) else (index,)
    whole = slice(None, None, None)
    return (any(i is None for i in items) and sum(i is Ellipsis for i in items) <= 1
            and all(i is None or i is Ellipsis or (isinstance(i, slice) and i == whole) for i in items))


@dataclass(eq=False)
class IdentityOp:
    input: Any


@dataclass(eq=False)
class ConstantOp:
    """A number made into a tensor in forward (torch.tensor(0.0, device=x.device)): an operand
    that is that number."""

    value: float


@dataclass(eq=False)
class ConvOp:
    input: Any
    nd: int
    weight: Any
    bias: Any
    stride: Any
    padding: Any
    dilation: Any
    groups: int
    module: Optional[nn.Module] = None
    transposed: bool = False  # nn.ConvTranspose / F.conv_transpose: weight [C_in, C_out / groups, k...]
    output_padding: Any = 0


@dataclass(eq=False)
class LinearOp:
    """nn.Linear / F.linear: over the last dim of a 3-D to 5-D value (tokens [N, L, C], or the
    channels of a channels-last [N, H, W, C] as ConvNeXt's block applies its MLP), a 1x1
    convolution that starts a chain (`chains._start_linear`); over a 2-D value it runs as PyTorch."""

    input: Any
    weight: Any
    bias: Any


def pointwise_row(op: str):
    """The op table's row of a PW's op: a spec op, or a function written only as an expr."""
    return ops.POINTWISE.get(op) or ops.EXPR_ONLY[op]


# =============================================================================================
# Argument binding: every spelling of an op is bound to one signature, written as text
# =============================================================================================


@dataclass(frozen=True)
class _Sig:
    names: tuple[str, ...]
    defaults: dict


def _sig(text: str) -> _Sig:
    """'input, dim=None, keepdim=False' -> names and literal defaults."""
    names, defaults = [], {}
    for part in text.split(","):
        name, eq, default = part.strip().partition("=")
        names.append(name.strip())
        if eq:
            defaults[name.strip()] = ast.literal_eval(default.strip())
    return _Sig(tuple(names), defaults)


def _bind(sig: _Sig, args: tuple, kwargs: dict) -> dict:
    if len(args) > len(sig.names):
        raise Reject(f"takes at most {len(sig.names)} arguments here, got {len(args)}")
    bound = dict(zip(sig.names, args))
    for key, value in kwargs.items():
        if key not in sig.names and key == "axis" and "dim" in sig.names:
            key = "dim"
        if key not in sig.names or key in bound:
            raise Reject(f"unexpected argument {key!r}")
        bound[key] = value
    for name in sig.names:
        if name not in bound:
            if name not in sig.defaults:
                raise Reject(f"missing argument {name!r}")
            bound[name] = sig.defaults[name]
    return bound


# =============================================================================================
# Builders: bound arguments -> a description (or Reject with the reason)
# =============================================================================================


def _check_number(value, what: str):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise Reject(f"{what} must be a number here, got {value!r}")
    return float(value)


def ints(value, what: str):
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return list(value)
    raise Reject(f"{what} must be an int or a tuple of ints, got {value!r}")


def _refuse(spelling: ops.Spelling, b: dict) -> None:
    """Reject a call that gives an argument the spelling refuses (None, False or 0: not given)."""
    for name, why in spelling.refuse.items():
        value = b.get(name)
        if not (value is None or value is False or (type(value) is int and value == 0)):
            raise Reject(why.format(value=value))


def _require(spelling: ops.Spelling, b: dict) -> None:
    """Reject a call that leaves out (None or False) an argument the spelling requires."""
    for name, why in spelling.require.items():
        if b.get(name) is None or b.get(name) is False:
            raise Reject(why)


def _constant(args: type[ops.Args], name: str, value):
    """One of the op's constants, checked against its field in the op's args model."""
    annotation = args.model_fields[name].annotation
    if annotation is float:
        return _check_number(value, name)
    if typing.get_origin(annotation) is typing.Literal:
        choices = typing.get_args(annotation)
        if value not in choices:
            raise Reject(f"{name}={value!r} is not {' or '.join(repr(c) for c in choices)}")
    return value


def _sig_names(spelling: ops.Spelling) -> tuple[str, ...]:
    return _sig(spelling.sig).names if spelling.sig is not None else ("input",)


def _pointwise(row, spelling: ops.Spelling) -> Callable[[dict], PW]:
    """The standard mapping: the spelling's operands in order, its other arguments that are fields
    of the op's args model as the op's constants."""
    names = dict.fromkeys((*_sig_names(spelling), *spelling.fixed))
    constants = [n for n in names if n not in spelling.operands and n in row.args.model_fields]

    def build(b: dict) -> PW:
        b = {**b, **spelling.fixed}
        _refuse(spelling, b)
        attrs = {name: _constant(row.args, name, b[name]) for name in constants}
        operands = [b[name] for name in spelling.operands]
        if spelling.scale is not None:
            operand, by = spelling.scale
            alpha = b[by]
            if alpha != 1:
                alpha = _check_number(alpha, by)
                i = spelling.operands.index(operand)
                other = operands[i]
                operands[i] = other * alpha if isinstance(other, (int, float)) else PW("mul", (other, alpha))
        if len(operands) > 2 and all(o is None for o in operands[1:]):
            raise Reject(f"{row.name} without {' and '.join(spelling.operands[1:])}")
        return PW(row.name, tuple(operands), attrs, bool(b.get("inplace")))

    return build


def _power(row, spelling: ops.Spelling) -> Callable[[dict], PW]:
    """x ** c with a constant exponent; c ** x with a positive constant base."""

    def build(b):
        b = {**b, **spelling.fixed}
        base, exponent = (b[name] for name in spelling.operands)
        if isinstance(exponent, (int, float)) and not isinstance(exponent, bool):
            return PW(row.name, (base,), {"exponent": float(exponent)}, bool(b.get("inplace")))
        if isinstance(base, (int, float)) and not isinstance(base, bool) and base > 0:
            return PW(row.name, (exponent,), {"base": float(base)})
        raise Reject("a power is fused only with a constant exponent (or a positive constant base)")

    return build


def _batch_norm(row, spelling: ops.Spelling) -> Callable[[dict], Any]:
    """Batch norm as nn.BatchNormNd computes it: in eval mode over its running statistics, a
    pointwise op (each statistic applied along dim 1); in training mode, or without running
    statistics (track_running_stats=False, or F.batch_norm given none), the statistic stage over
    the batch's statistics, updating the running ones where there are any. A module's `training`
    is its mode; a function's is the call's own, whatever the model's mode."""
    fixed_mode = not spelling.modules

    def build(b):
        eps = _check_number(b["eps"], "eps")
        mean, var, training = b["running_mean"], b["running_var"], b["training"]
        if not isinstance(training, bool):
            raise Reject(f"training must be True or False here, got {training!r}")
        if (mean is None) != (var is None):
            given, missing = ("running_mean", "running_var") if var is None else ("running_var", "running_mean")
            raise Reject(f"{given} without {missing}")
        dim1 = tuple(None if b[k] is None else Dim1(b[k]) for k in ("running_mean", "running_var", "weight", "bias"))
        if not training and mean is not None:
            return PW(row.name, (b["input"], *dim1), {"eps": eps})
        if mean is None:  # no running statistics: the batch's, in either mode
            return NormOp(b["input"], row.name, (*dim1, None), {"eps": eps, "track_running_stats": False})
        momentum, counter = b["momentum"], b.get("num_batches_tracked")
        if momentum is None and counter is None:
            raise Reject("momentum=None (a cumulative average of the running statistics) needs the batches counted, "
                         "which F.batch_norm does not do: give a momentum")
        attrs = {"eps": eps, "training": True, "momentum": None if momentum is None else _check_number(momentum, "momentum")}
        return NormOp(b["input"], row.name, (*dim1, Counter(counter)), attrs, fixed_mode=fixed_mode)

    return build


def _prelu(row, spelling: ops.Spelling) -> Callable[[dict], PW]:
    """PReLU: a slope per channel applies along dim 1 (as a batch norm's weight does, whatever the
    tensor's rank); a single slope applies to every value."""

    def build(b):
        weight = b["weight"]
        if isinstance(weight, TensorRef):
            count = weight.tensor.numel()
        else:
            shape = shape_of(weight) if isinstance(weight, Node) else ()
            count = None if shape is None else math.prod(shape)  # (None: unknown, taken as one per channel)
        return PW(row.name, (b["input"], weight if count == 1 else Dim1(weight)))

    return build


_FORMS = {"power": _power, "batch_norm": _batch_norm, "prelu": _prelu}


def _pool(row: ops.Pool, spelling: ops.Spelling, nd: int) -> Callable[[dict], PoolOp]:
    """A windowed pool's fields from PyTorch's arguments; a global pool is an adaptive pool to 1."""
    arg_of = {spelling.rename.get(n, n): n for n in _sig_names(spelling)}

    def window(b):
        _refuse(spelling, b)
        args = {}
        for name, info in row.args.model_fields.items():
            value = b[arg_of[name]]
            if info.annotation is bool:
                args[name] = bool(value)
            elif info.default is None and value in (None, (), []):
                continue  # stride: left out, the kernel's, as in PyTorch
            else:
                args[name] = ints(value, arg_of[name])
        return PoolOp(b["input"], {row.name: args}, nd)

    def to_one(b):
        _refuse(spelling, b)
        size = b["output_size"]
        sizes = list(size) if isinstance(size, (list, tuple)) else [size]
        if all(s == 1 for s in sizes):
            return PoolOp(b["input"], {row.name: {}}, nd)
        # An adaptive pool whose output size divides the input's is a windowed pool with
        # kernel = stride = input / output (VGG's adaptive_avg_pool2d((7, 7)) on 14 x 14: 2 x 2).
        shape = shape_of(b["input"]) if isinstance(b["input"], Node) else None
        spatial = list(shape[-nd:]) if shape is not None and len(shape) >= nd + 1 else None
        if spatial is not None and len(sizes) == 1:
            sizes = sizes * nd
        if spatial is None or len(sizes) != nd:
            raise Reject(f"output_size={size!r}: only an output of 1 (a global pool) or one dividing the input is fused")
        outs = [n if s is None else s for s, n in zip(sizes, spatial)]
        if any(isinstance(s, bool) or not isinstance(s, int) or s < 1 or n % s for s, n in zip(outs, spatial)):
            raise Reject(f"output_size={size!r} does not divide the input's {spatial}: its windows differ in size")
        kernel = [n // s for s, n in zip(outs, spatial)]
        if all(k == 1 for k in kernel):
            return IdentityOp(b["input"])  # (the output is the input's size: the values as they are)
        windowed = "avg_pool" if row.reduce == "avg" else "max_pool"
        return PoolOp(b["input"], {windowed: {"kernel": kernel, "stride": kernel}}, nd)

    return window if row.windowed else to_one


def _reduce(op: str) -> Callable[[dict], ReduceOp]:
    def build(b):
        if b.get("dtype") not in (None, torch.float32):
            raise Reject(f"dtype={b['dtype']} (only float32 is fused)")
        dim = b["dim"]
        if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
            raise Reject("it reduces every dim, including the batch")
        dims = [dim] if isinstance(dim, int) else list(dim) if isinstance(dim, (list, tuple)) else None
        if dims is None or any(isinstance(d, bool) or not isinstance(d, int) for d in dims):
            raise Reject(f"dim must be ints, got {dim!r}")
        return ReduceOp(b["input"], op, dims, bool(b["keepdim"]))

    return build


def _values_or_elementwise(op: str, elementwise: str) -> Callable[[dict], Any]:
    """torch.max(x, other) is elementwise; torch.max(x, dim) a reduction returning (values, indices)."""

    def build(b):
        other = b["dim"]
        if isinstance(other, Node):
            if b["keepdim"]:
                raise Reject("keepdim with a tensor operand")
            return PW(elementwise, (b["input"], other))
        if other is None:
            raise Reject("without dim it reduces every dim, including the batch")
        if isinstance(other, bool) or not isinstance(other, int):
            raise Reject(f"dim must be an int, got {other!r}")
        return ReduceOp(b["input"], op, [other], bool(b["keepdim"]), tuple_out=True)

    return build


def _norm_constant(args: type[ops.Args], name: str, value):
    """One of a statistic stage's constants: a number, an int, or ints for a list field (a single
    int as a list of one: normalized_shape=64, dim=1)."""
    annotation = args.model_fields[name].annotation
    if annotation is float:
        return _check_number(value, name)
    value = ints(value, name)
    if typing.get_origin(annotation) is list and isinstance(value, int):
        return [value]
    if annotation is int and not isinstance(value, int):
        raise Reject(f"{name} must be an int, got {value!r}")
    return value


def _norm(row: ops.Norm, spelling: ops.Spelling) -> Callable[[dict], NormOp]:
    """A statistic stage: the spelling's operands after the input are its weight and bias (both or
    neither), its other arguments that name fields of the row's args model its constants; a `dim`
    stays in the model's numbering (the chain maps it onto the spec's)."""
    arg_of = {spelling.rename.get(n, n): n for n in dict.fromkeys((*_sig_names(spelling), *spelling.fixed))}
    constants = [f for f in row.args.model_fields if f in arg_of and arg_of[f] not in spelling.operands]
    tensors = spelling.operands[1:]

    def build(b):
        b = {**b, **spelling.fixed}
        _require(spelling, b)
        _refuse(spelling, b)
        if b.get("dtype") not in (None, torch.float32):
            raise Reject(f"dtype={b['dtype']} (only float32 is fused)")
        attrs = {f: _norm_constant(row.args, f, b[arg_of[f]]) for f in constants}
        given = [n for n in tensors if b[n] is not None]
        if given and len(given) != len(tensors):
            missing = [n for n in tensors if n not in given]
            raise Reject(f"{' and '.join(given)} without {' and '.join(missing)}: the {row.name} stage has both or neither")
        wrap = Dim1 if row.affine == "channel" else (lambda t: t)
        operands = tuple(None if b[n] is None else wrap(b[n]) for n in tensors)
        dims = attrs.pop("dim", None)
        return NormOp(b["input"], row.name, operands, attrs, dims)

    return build


def _row_builder(row, spelling: ops.Spelling, nd: Optional[int]) -> Callable[[dict], Any]:
    if isinstance(row, ops.Norm):
        return _norm(row, spelling)
    if isinstance(row, ops.Pool):
        return _pool(row, spelling, nd)
    if isinstance(row, ops.Reduction):
        return _values_or_elementwise(row.name, spelling.elementwise) if spelling.elementwise else _reduce(row.name)
    return _FORMS[spelling.form](row, spelling) if spelling.form else _pointwise(row, spelling)


# ---- the frame: what starts a chain, and what a chain passes through ---------------------------


def _conv(nd: int, transposed: bool = False) -> Callable:
    def build(b):
        if b.get("padding_mode", "zeros") != "zeros":
            raise Reject(f"padding_mode={b['padding_mode']!r} (only zero padding is fused)")
        groups = b["groups"]
        if isinstance(groups, bool) or not isinstance(groups, int):
            raise Reject(f"groups must be an int, got {groups!r}")
        return ConvOp(
            b["input"], nd, b["weight"], b["bias"], b["stride"], b["padding"], b["dilation"], groups, b.get("module"),
            transposed, b.get("output_padding", 0),
        )

    return build


def _conv_module(m: nn.Module, path: str) -> dict:
    bias = None if m.bias is None else TensorRef(f"{path}.bias", m.bias, tuple(m.bias.shape))
    read = {
        "weight": TensorRef(f"{path}.weight", m.weight, tuple(m.weight.shape)),
        "bias": bias,
        "stride": m.stride,
        "padding": m.padding,
        "dilation": m.dilation,
        "groups": m.groups,
        "padding_mode": m.padding_mode,
        "module": m,
    }
    if m.transposed:
        read["output_padding"] = m.output_padding
    return read


def _linear_module(m: nn.Module, path: str) -> dict:
    bias = None if m.bias is None else TensorRef(f"{path}.bias", m.bias, tuple(m.bias.shape))
    return {"weight": TensorRef(f"{path}.weight", m.weight, tuple(m.weight.shape)), "bias": bias}


def _dropout(b):
    if b["training"] and b["p"] > 0:
        raise Reject("dropout in training mode is random (call model.eval() to fuse it as the identity)")
    return IdentityOp(b["input"])


def _constant_tensor(b):
    data = b["data"]
    if isinstance(data, bool) or not isinstance(data, (int, float)):
        raise Reject("only a number made into a tensor is read as a constant")
    if b["dtype"] not in (None, torch.float32):
        raise Reject(f"dtype={b['dtype']}: a constant is read as a float32 number")
    return ConstantOp(float(data))


@dataclass(frozen=True)
class _FrameRow:
    """A spelling of something that is not an op of the table; `build(nd)` makes its builder."""

    build: Callable[[Optional[int]], Callable[[dict], Any]]
    spelling: ops.Spelling
    read: Optional[Callable[[nn.Module, str], dict]] = None  # None: the module's attributes named in sig


_CONV = "input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1"
_CONV_T = "input, weight, bias=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1"
_DROPOUTS = ("dropout", "dropout1d", "dropout2d", "dropout3d")
_ND = (1, 2, 3)

_FRAME = [
    _FrameRow(
        _conv,
        ops.Spelling(_CONV, ("F.conv{nd}d", "torch.conv{nd}d"), modules=("Conv{nd}d",), nd=_ND),
        _conv_module,
    ),
    _FrameRow(
        lambda nd: _conv(nd, transposed=True),
        ops.Spelling(
            _CONV_T, ("F.conv_transpose{nd}d", "torch.conv_transpose{nd}d"), modules=("ConvTranspose{nd}d",), nd=_ND
        ),
        _conv_module,
    ),
    _FrameRow(
        lambda nd: lambda b: LinearOp(b["input"], b["weight"], b["bias"]),
        ops.Spelling("input, weight, bias=None", ("F.linear",), modules=("Linear",)),
        _linear_module,
    ),
    # no-ops in eval mode
    _FrameRow(
        lambda nd: _dropout,
        ops.Spelling(
            "input, p=0.5, training=True, inplace=False",
            tuple(f"F.{n}" for n in _DROPOUTS),
            modules=tuple(n.capitalize() for n in _DROPOUTS),
        ),
    ),
    # a number made into a tensor in forward, as an operand
    _FrameRow(
        lambda nd: _constant_tensor,
        ops.Spelling("data, dtype=None, device=None, requires_grad=False, pin_memory=False", ("torch.tensor",)),
    ),
    _FrameRow(
        lambda nd: lambda b: IdentityOp(b["input"]),
        # (a dtype conversion is fused only where it keeps the chain's dtype: checked on the recorded value)
        ops.Spelling(None, methods=("contiguous", "float", "half", "bfloat16", "to", "clone"), modules=("Identity",)),
    ),
    # shape ops (absorbed when they only drop or insert size-1 dims)
    _FrameRow(
        lambda nd: lambda b: ShapeOp(b["input"]),
        ops.Spelling(
            None,
            ("torch.flatten", "torch.reshape", "torch.squeeze", "torch.unsqueeze"),
            ("view", "reshape", "flatten", "squeeze", "unsqueeze"),
            ("Flatten", "Unflatten"),
        ),
    ),
]


# =============================================================================================
# The lookup tables, derived from the op table's spellings and the frame's
# =============================================================================================


@dataclass(frozen=True)
class _Entry:
    """What one spelling means: `build` turns the bound arguments into a description; `sig` binds
    function and method calls (None: only the tensor matters); `read` gives a module's arguments."""

    build: Callable[[dict], Any]
    sig: Optional[_Sig]
    read: Callable[[nn.Module, str], dict]


def _attributes(names: tuple[str, ...]) -> Callable[[nn.Module, str], dict]:
    """Module -> the arguments of its functional form, read from attributes of the same names
    (a tensor attribute as a TensorRef)."""

    def read(m, path):
        out = {}
        for name in names:
            value = getattr(m, name, None)
            if isinstance(value, torch.Tensor):
                value = TensorRef(f"{path}.{name}", value, tuple(value.shape))
            out[name] = value
        return out

    return read


def _spellings():
    """(builder of nd, spelling, module reader or None) for the frame's rows, then the op table's."""
    for row in _FRAME:
        yield row.build, row.spelling, row.read
    for table in (ops.POINTWISE, ops.EXPR_ONLY, ops.POOLS, ops.REDUCTIONS, ops.NORMS):
        for op in table.values():
            for spelling in op.spellings:
                yield (lambda nd, op=op, spelling=spelling: _row_builder(op, spelling, nd)), spelling, None


_NAMESPACES = {"torch": torch, "F": F, "operator": operator, "torch.special": torch.special}


def _resolve_function(name: str):
    space, _, attr = name.rpartition(".")
    return getattr(_NAMESPACES[space], attr, None)


@dataclass(frozen=True)
class _Tables:
    """Every spelling, by what the traced graph holds: the function object, the Tensor method's
    name, the nn class; functions and methods with whether the spelling is in-place."""

    functions: dict[Any, tuple[_Entry, bool]]
    methods: dict[str, tuple[_Entry, bool]]
    modules: dict[type, _Entry]
    names: dict[str, list[str]]  # the spellings found in this torch, for supported_names()


def _tables() -> _Tables:
    functions, methods, modules = {}, {}, {}
    names: dict[str, set] = {"functions": set(), "methods": set(), "modules": set()}
    for make, spelling, read in _spellings():
        sig = None if spelling.sig is None else _sig(spelling.sig)
        for nd in spelling.nd or (None,):
            entry = _Entry(make(nd), sig, read or _attributes(_sig_names(spelling)[1:]))
            for name in (n.format(nd=nd) for n in spelling.functions):
                fn = _resolve_function(name)
                if fn is not None:
                    functions.setdefault(fn, (entry, name.endswith("_")))
                    names["functions"].add(name)
            for name in (n.format(nd=nd) for n in spelling.methods):
                methods.setdefault(name, (entry, name.endswith("_")))
                names["methods"].add(name)
            for name in (n.format(nd=nd) for n in spelling.modules):
                cls = getattr(nn, name, None)
                if cls is not None:
                    modules[cls] = entry
                    names["modules"].add(f"nn.{name}")
    return _Tables(functions, methods, modules, {kind: sorted(found) for kind, found in names.items()})


_TABLES = _tables()


def supported_names() -> dict[str, list[str]]:
    """The recognized spellings, for documentation: functions, Tensor methods and nn modules."""
    return {kind: list(found) for kind, found in _TABLES.names.items()}


# =============================================================================================
# Nodes
# =============================================================================================


class Recognizer:
    """What each node of a traced module computes: a description, or a Reject saying why it is
    not fusable (remembered per node)."""

    def __init__(self, gm):
        self.gm = gm
        self._descs: dict[Node, Any] = {}
        self._size_memo: dict = {}
        # nodes computing sizes whose values a description took as numbers (`batch_free_value`)
        self.size_nodes: set[Node] = set()

    def _resolved(self, value):
        """`value` with each node that computes sizes free of the batch (`x.size()[2:]`,
        `x.shape[2] * x.shape[3]`) replaced by what it computed, for the layer's fixed shape."""
        if isinstance(value, Node):
            static = batch_free_value(value, self._size_memo)
            if static is None:
                return value
            self.size_nodes.add(value)
            return static
        if isinstance(value, (tuple, list)):
            return type(value)(self._resolved(v) for v in value)
        return value

    def describe(self, node: Node) -> str:
        """How the model's code wrote `node`: 'nn.ReLU (act)', 'Tensor.view', 'torch.cumsum'."""
        if node.op == "call_module":
            cls = type(self.gm.get_submodule(node.target))
            prefix = "nn." if getattr(nn, cls.__name__, None) is cls else ""
            return f"{prefix}{cls.__name__} ({node.target})"
        if node.op == "call_method":
            return f"Tensor.{node.target}"
        if node.op == "call_function":
            return function_label(node.target)
        return node.name

    def classify(self, node: Node):
        """The description of what `node` computes, or a Reject saying why it is not fusable."""
        if node not in self._descs:
            try:
                self._descs[node] = self._classify(node)
            except Reject as rej:
                glue = " " if rej.reason.startswith(("is ", "has ", "overrides ")) else ": "
                self._descs[node] = Reject(f"{self.describe(node)}{glue}{rej.reason}")
        return self._descs[node]

    def _classify(self, node: Node):
        if node.op == "call_module":
            module = self.gm.get_submodule(node.target)
            for cls in type(module).__mro__:
                if cls in _TABLES.modules:
                    break
            else:
                raise Reject("is not a supported op")
            if type(module).forward is not cls.forward:
                raise Reject(f"overrides the forward of nn.{cls.__name__}")
            if module._forward_hooks or module._forward_pre_hooks:
                raise Reject("has forward hooks, which a fused layer would skip")
            if len(node.args) != 1 or node.kwargs:
                raise Reject("is called with more than the input")
            entry = _TABLES.modules[cls]
            return entry.build({"input": node.args[0], **entry.read(module, node.target)})
        if node.op == "call_function" and node.target is operator.getitem and len(node.args) == 2 \
                and _inserts_dims_only(node.args[1]):
            return ShapeOp(node.args[0])  # p[None, :, None, None]: a view with size-1 dims inserted
        if PADDING_KEY in node.meta:
            raise Reject(f"the padded copy of the input for {node.meta[PADDING_KEY]} runs as PyTorch "
                         "(the conv after it is fused, unpadded)")
        if node.op == "call_function":
            found = _TABLES.functions.get(node.target) if hashable(node.target) else None
        elif node.op == "call_method":
            found = _TABLES.methods.get(node.target)
        else:
            return None
        if found is None:
            raise Reject("is not a supported op")
        entry, inplace = found
        if entry.sig is None:
            bound = {"input": node.args[0] if node.args else node.kwargs.get("input")}
        else:
            args = tuple(self._resolved(a) for a in node.args)
            bound = _bind(entry.sig, args, {k: self._resolved(v) for k, v in node.kwargs.items()})
        if inplace:
            bound["inplace"] = True
        return entry.build(bound)
