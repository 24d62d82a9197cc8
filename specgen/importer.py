"""Import PyTorch models: find convolution chains that specgen can fuse and build their specs.

    report = specgen.explain(model, x)      # report.specs: the fusable chains; report.fallbacks: the rest, and why
    fused = specgen.from_module(model, x)   # the same model, each chain run by one FusedLayer

How it works. The model is captured with torch.fx (a symbolic trace, no GPU needed) and run once
on the example inputs to record every value's shape and dtype. Every convolution then starts a
chain that grows while the next node is something a spec can say:

* pointwise ops, however they are written (module, functional, method, operator), map to spec ops
  through one table, `_ROWS`. A connected pointwise DAG over the chain value, numbers and
  per-channel tensors (hardswish written out by hand, `x * torch.sigmoid(x)`, ...) becomes one
  `expr` stage; a plain sequence of ops becomes the named stages (`leaky_relu`, `add`, ...);
* pools and reductions map to their spec ops; shape ops (view, reshape, flatten, squeeze,
  unsqueeze) that only drop or insert size-1 dims are absorbed, and the fused layer's output is
  reshaped back to what the model returned;
* convolutions and transposed convolutions (module and functional forms) start chains;
* eval-mode batch norm and dropout fuse as what they compute in eval mode (a `batch_norm` stage
  over the running statistics, the identity): the fused model keeps that behaviour even if it is
  later switched to training mode.

A chain ends at a value that is used more than once (or returned), at an op outside the
vocabulary, or where the spec would not validate; a chain with nothing after its convolution is
not fused. Every node that runs as PyTorch is a fallback, with its reason.

`from_module` rewrites the traced graph: each chain becomes a call to a FusedLayer whose
`conv.weight`, `conv.bias` and per-channel parameters are the very tensors of the original model
(same nn.Parameter objects), so training either trains both. Everything else runs as the
original PyTorch code. Only float32 chains are fused; shapes are those of the example inputs
(the batch size is free).

Never slower: on a GPU, `from_module` compiles every chain's kernel in one parallel build, then
times each chain as the original PyTorch code and as its fused layer (`specgen.measured`), and
keeps the original code wherever the kernel is not faster. Each decision is cached per kernel,
GPU and batch bucket, and shown with both times in the report (`report.choices`).
`keep_slower=True` fuses every chain unmeasured; without a GPU nothing is measured.
"""

from __future__ import annotations

import ast
import builtins
import math
import operator
import re
from dataclasses import dataclass, field, replace
from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.fx import Node

from specgen import measured, ops, pipeline
from specgen.expr import RESERVED as EXPR_RESERVED
from specgen.log import get_logger
from specgen.module import FusedLayer
from specgen.spec import LayerSpec, SpecError, validate

__all__ = [
    "explain",
    "from_module",
    "ImportReport",
    "Fallback",
    "Choice",
    "ModelImportError",
    "ImportedLayer",
    "spec_yaml_text",
]

# =============================================================================================
# Public types
# =============================================================================================


class ModelImportError(ValueError):
    """The model cannot be examined at all: it is not an nn.Module, or it fails on the example inputs."""


class Fallback(NamedTuple):
    """One node of the model that runs as PyTorch: its torch.fx node name and why it is not fused."""

    node: str
    reason: str


class Choice(NamedTuple):
    """Whether one fusable chain runs as its specialized kernel, and the times that decided it.

    `how`: "measured" (timed now), "cached" (timed earlier on this GPU kind and batch bucket) or
    "not measured (why)"; the times are milliseconds per call, None when not measured."""

    layer: str
    fused: bool
    specgen_ms: Optional[float] = None
    pytorch_ms: Optional[float] = None
    how: str = "not measured"

    def __str__(self) -> str:
        if self.specgen_ms is None or self.pytorch_ms is None:
            return f"fused, {self.how}"
        verdict = "fused" if self.fused else "kept as PyTorch"
        return f"{verdict}: specgen {self.specgen_ms:.4f} ms, PyTorch {self.pytorch_ms:.4f} ms ({self.how})"


@dataclass
class ImportReport:
    """What `explain` found: the specs (in model order) and the nodes that run as PyTorch.

    `choices` holds one Choice per spec (same order): whether `from_module` runs it as its kernel
    or kept the PyTorch code because the kernel was not faster, with both times."""

    model: str
    specs: list[LayerSpec]
    fallbacks: list[Fallback]
    choices: list[Choice] = field(default_factory=list)
    # from_module's last check: (fused, original) milliseconds of the whole model; None: not timed
    whole_model: tuple | None = None

    @property
    def fused_specs(self) -> list[LayerSpec]:
        """The specs that run as specialized kernels (all of them, unless measured slower)."""
        kept = {c.layer for c in self.choices if not c.fused}
        return [spec for spec in self.specs if spec.name not in kept]

    def __str__(self) -> str:
        kept = len(self.specs) - len(self.fused_specs)
        also = f" ({kept} more kept as PyTorch: not faster fused)" if kept else ""
        lines = [f"{self.model}: {len(self.specs) - kept} fused layer(s){also}, {len(self.fallbacks)} node(s) run as PyTorch"]
        choice = {c.layer: c for c in self.choices}
        for spec in self.specs:
            stages = ", ".join(stage.op for stage in spec.epilogue)
            line = f"  {spec.name}: conv{spec.ndim}d {spec.input.channels}->{spec.conv.out_channels} | {stages}"
            if spec.name in choice and choice[spec.name].specgen_ms is not None:
                line += f"  [{choice[spec.name]}]"
            lines.append(line)
        for fb in self.fallbacks:
            lines.append(f"  not fused: {fb.node}: {fb.reason}")
        if self.whole_model is not None:
            fused_ms, plain_ms = self.whole_model
            verdict = "fused" if fused_ms < plain_ms else "kept the original (not faster fused)"
            lines.append(f"  whole model: fused {fused_ms:.3f} ms, original {plain_ms:.3f} ms: {verdict}")
        return "\n".join(lines)

    def yaml(self) -> str:
        """The specs as YAML: one mapping for one spec, a list for several (what `load_specs` reads)."""
        return spec_yaml_text(self.specs)


def spec_yaml_text(specs: list[LayerSpec]) -> str:
    """Specs as YAML, in canonical form (defaults filled in, geometry spelled per dim), leaving out
    unset optional fields; one mapping for one spec, a list for several. Reads back with parse_yaml."""
    import yaml

    data = [_plain(spec) for spec in specs]
    payload = data[0] if len(data) == 1 else data
    return yaml.safe_dump(payload, sort_keys=False, default_flow_style=None, width=100)


def _plain(spec: LayerSpec) -> dict:
    data = spec.canonical()
    if data.get("tile") is None:
        data.pop("tile", None)
    for stage in data["epilogue"]:
        ((op, args),) = stage.items()
        fields = ops.args_model(op).model_fields
        stage[op] = {k: v for k, v in args.items() if k in fields and v is not None}
    return data


class ImportedLayer(FusedLayer):
    """A FusedLayer built by `from_module` around tensors of the original model.

    Its `conv` (or `conv.weight` / `conv.bias`) and per-channel attributes are the original
    model's very tensors. A per-channel tensor keeps the shape the model gave it ((C, 1, 1),
    (1, C, 1, 1), or (C,) for batch norm statistics); the layer's op sees it viewed in the spec's
    (C, 1, ...) shape, which keeps gradients flowing to the shared parameter.
    """

    def __init__(self, spec_or_path, *, arch: str | None = None):
        super().__init__(spec_or_path, arch=arch)
        self._spec_shapes = dict(self.spec.params())

    def _spec_shaped(self, name: str) -> torch.Tensor:
        tensor = getattr(self, name)
        want = self._spec_shapes[name]
        return tensor if tuple(tensor.shape) == want else tensor.reshape(want)

    def _op_tensors(self) -> list:
        """The op's tensor arguments after x: weight, bias (when the conv has one), then the
        per-channel tensors in spec.params() order, each in its spec shape."""
        tensors = [self.conv.weight]
        if self.spec.conv.bias:
            tensors.append(self.conv.bias)
        tensors.extend(self._spec_shaped(name) for name in self._spec_shapes)
        return tensors

    def spec_params(self) -> dict:
        return {name: self._spec_shaped(name) for name in self._spec_shapes}


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


class _Reject(Exception):
    """A node (or operand) that cannot join a chain; `reason` says why, for the report."""

    @property
    def reason(self) -> str:
        return str(self.args[0])


def _bind(sig: _Sig, args: tuple, kwargs: dict) -> dict:
    if len(args) > len(sig.names):
        raise _Reject(f"takes at most {len(sig.names)} arguments here, got {len(args)}")
    bound = dict(zip(sig.names, args))
    for key, value in kwargs.items():
        if key not in sig.names and key == "axis" and "dim" in sig.names:
            key = "dim"
        if key not in sig.names or key in bound:
            raise _Reject(f"unexpected argument {key!r}")
        bound[key] = value
    for name in sig.names:
        if name not in bound:
            if name not in sig.defaults:
                raise _Reject(f"missing argument {name!r}")
            bound[name] = sig.defaults[name]
    return bound


# =============================================================================================
# What a node means: the descriptions the table's builders return
# =============================================================================================


@dataclass(frozen=True, eq=False)
class _Tensor:
    """A tensor of the model used as an operand (a parameter, a buffer or a traced constant)."""

    path: str  # where it lives in the model, e.g. "sum_tensor" or "bn.running_mean"
    tensor: torch.Tensor
    shape: tuple  # the shape it is used with (after any view of it in forward)
    along_dim1: bool = False  # batch-norm style: a (C,) tensor applied along dim 1


@dataclass(frozen=True, eq=False)
class _Dim1:
    """Marks an operand that applies along dim 1 whatever its shape (batch norm statistics)."""

    value: Any


@dataclass(eq=False)
class _PW:
    """A pointwise op: `op` names a row of `_PW_OPS`; operands are Nodes, numbers, None, _Tensor or _PW."""

    op: str
    operands: tuple
    attrs: dict = field(default_factory=dict)
    inplace: bool = False


@dataclass(eq=False)
class _Pool:
    input: Any
    stage: dict
    nd: int


@dataclass(eq=False)
class _Reduce:
    input: Any
    op: str
    dims: list
    keepdim: bool
    tuple_out: bool = False  # torch.max/min with dim: (values, indices)


@dataclass(eq=False)
class _Shape:
    """view/reshape/flatten/squeeze/unsqueeze: absorbed when only size-1 dims change (judged on shapes)."""

    input: Any


@dataclass(eq=False)
class _Identity:
    input: Any


@dataclass(eq=False)
class _Conv:
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


# =============================================================================================
# Pointwise ops: how each becomes a spec stage on its own (`direct`) or part of an `expr`
# =============================================================================================


class _XTerm:
    def __repr__(self) -> str:
        return "x"


X = _XTerm()  # the chain value, in direct-stage terms


@dataclass(frozen=True)
class _Named:
    name: str  # a per-channel parameter, by its spec name


_OPAQUE = object()  # an operand that is neither x, a number nor a parameter


def _num(value) -> str:
    value = float(value)
    if not math.isfinite(value):
        raise _Reject(f"constant {value!r} is not finite")
    return repr(value)


def _operand(term) -> Optional[dict]:
    if isinstance(term, float) and math.isfinite(term):
        return {"value": term}
    if isinstance(term, _Named):
        return {"param": term.name}
    return None


def _unary_stage(op: str, *fields: str) -> Callable:
    def direct(terms, attrs):
        if list(terms) != [X]:
            return None
        return {op: {f: attrs[f] for f in fields}}

    return direct


def _binary_stage(op: str, commutative: bool) -> Callable:
    def direct(terms, attrs):
        if len(terms) != 2:
            return None
        a, b = terms
        if a is X and _operand(b) is not None:
            return {op: _operand(b)}
        if commutative and b is X and _operand(a) is not None:
            return {op: _operand(a)}
        return None

    return direct


def _scalar_stage(op: str) -> Callable:
    def direct(terms, attrs):
        if len(terms) == 2 and terms[0] is X and isinstance(terms[1], float):
            return {op: {"value": terms[1]}}
        if len(terms) == 2 and terms[1] is X and isinstance(terms[0], float):
            return {op: {"value": terms[0]}}
        return None

    return direct


def _clamp_stage(terms, attrs):
    x, lo, hi = terms
    if x is not X or not all(t is None or isinstance(t, float) for t in (lo, hi)) or (lo is None and hi is None):
        return None
    return {"clamp": {k: v for k, v in (("min", lo), ("max", hi)) if v is not None}}


def _clamp_text(t, a):
    x, lo, hi = t
    if lo is not None and hi is not None:
        return f"clamp({x}, {lo}, {hi})"
    if lo is not None:
        return f"max({x}, {lo})"
    if hi is not None:
        return f"min({x}, {hi})"
    return x


def _pow_text(t, a):
    n = a["exponent"]
    if float(n).is_integer() and 1 <= n <= 4:
        return f"({t[0]} ** {int(n)})"
    return {0.5: f"sqrt({t[0]})", -0.5: f"(1 / sqrt({t[0]}))", -1.0: f"(1 / {t[0]})", -2.0: f"(1 / {t[0]} ** 2)"}.get(
        float(n)
    )


def _bn_text(t, a):
    x, mean, var, weight, bias = t
    text = f"({x} - {mean}) / sqrt({var} + {_num(a['eps'])})"
    if weight is not None:
        text = f"{text} * {weight}"
    if bias is not None:
        text = f"{text} + {bias}"
    return f"({text})"


def _bn_stage(terms, attrs):
    """Eval-mode batch norm whose statistics (and weight, bias) are per-channel tensors of the
    model: one batch_norm stage naming them (their names follow the module's, e.g. bn_running_mean)."""
    x, mean, var, weight, bias = terms
    if x is not X or not all(isinstance(t, _Named) for t in (mean, var)):
        return None
    if not all(t is None or isinstance(t, _Named) for t in (weight, bias)) or (weight is None) != (bias is None):
        return None
    args = {"eps": attrs["eps"], "running_mean": mean.name, "running_var": var.name}
    if weight is None:
        args["affine"] = False
    else:
        args.update(weight=weight.name, bias=bias.name)
    return {"batch_norm": args}


_GELU_TEXT = {
    "none": lambda x: f"(0.5 * {x} * (1 + erf({x} * 0.7071067811865476)))",
    "tanh": lambda x: f"(0.5 * {x} * (1 + tanh(0.7978845608028654 * ({x} + 0.044715 * {x} ** 3))))",
}
_SELU = (1.0507009873554805, 1.6732632423543772)


@dataclass(frozen=True)
class _PwOp:
    """render(operand texts, attrs) -> expr text, or None when the grammar cannot say it;
    direct(operand terms, attrs) -> a spec stage, or None (then the op is written as an expr)."""

    render: Callable[[list, dict], Optional[str]]
    direct: Callable[[list, dict], Optional[dict]] = lambda terms, attrs: None


_PW_OPS: dict[str, _PwOp] = {
    "relu": _PwOp(lambda t, a: f"relu({t[0]})", _unary_stage("relu")),
    "leaky_relu": _PwOp(
        lambda t, a: f"(max({t[0]}, 0) + {_num(a['negative_slope'])} * min({t[0]}, 0))",
        _unary_stage("leaky_relu", "negative_slope"),
    ),
    "gelu": _PwOp(lambda t, a: _GELU_TEXT[a["approximate"]](t[0]), _unary_stage("gelu", "approximate")),
    "sigmoid": _PwOp(lambda t, a: f"sigmoid({t[0]})", _unary_stage("sigmoid")),
    "tanh": _PwOp(lambda t, a: f"tanh({t[0]})", _unary_stage("tanh")),
    "mish": _PwOp(lambda t, a: f"({t[0]} * tanh(log(1 + exp({t[0]}))))", _unary_stage("mish")),
    "hardswish": _PwOp(lambda t, a: f"({t[0]} * clamp({t[0]} + 3, 0, 6) / 6)", _unary_stage("hardswish")),
    "hardtanh": _PwOp(
        lambda t, a: f"clamp({t[0]}, {_num(a['min_val'])}, {_num(a['max_val'])})",
        _unary_stage("hardtanh", "min_val", "max_val"),
    ),
    "clamp": _PwOp(_clamp_text, _clamp_stage),
    "silu": _PwOp(lambda t, a: f"({t[0]} * sigmoid({t[0]}))", _unary_stage("silu")),
    # softplus switches to the identity above its threshold: no where-free expr form
    "softplus": _PwOp(lambda t, a: None, _unary_stage("softplus", "beta", "threshold")),
    "add": _PwOp(lambda t, a: f"({t[0]} + {t[1]})", _binary_stage("add", True)),
    "sub": _PwOp(lambda t, a: f"({t[0]} - {t[1]})", _binary_stage("sub", False)),
    "mul": _PwOp(lambda t, a: f"({t[0]} * {t[1]})", _binary_stage("mul", True)),
    "div": _PwOp(lambda t, a: f"({t[0]} / {t[1]})", _binary_stage("div", False)),
    "minimum": _PwOp(lambda t, a: f"min({t[0]}, {t[1]})", _scalar_stage("min")),
    "maximum": _PwOp(lambda t, a: f"max({t[0]}, {t[1]})", _scalar_stage("max")),
    "neg": _PwOp(lambda t, a: f"(-{t[0]})"),
    "pow": _PwOp(_pow_text),
    "exp_base": _PwOp(lambda t, a: f"exp({t[0]} * {_num(math.log(a['base']))})"),  # base ** x
    "exp": _PwOp(lambda t, a: f"exp({t[0]})"),
    "log": _PwOp(lambda t, a: f"log({t[0]})"),
    "sqrt": _PwOp(lambda t, a: f"sqrt({t[0]})"),
    "rsqrt": _PwOp(lambda t, a: f"(1 / sqrt({t[0]}))"),
    "reciprocal": _PwOp(lambda t, a: f"(1 / {t[0]})"),
    "abs": _PwOp(lambda t, a: f"abs({t[0]})"),
    "erf": _PwOp(lambda t, a: f"erf({t[0]})"),
    "elu": _PwOp(lambda t, a: f"(max({t[0]}, 0) + {_num(a['alpha'])} * (exp(min({t[0]}, 0)) - 1))"),
    "celu": _PwOp(
        lambda t, a: f"(max({t[0]}, 0) + min(0, {_num(a['alpha'])} * (exp({t[0]} / {_num(a['alpha'])}) - 1)))"
    ),
    "selu": _PwOp(lambda t, a: f"({_SELU[0]!r} * (max({t[0]}, 0) + {_SELU[1]!r} * (exp(min({t[0]}, 0)) - 1)))"),
    "hardsigmoid": _PwOp(lambda t, a: f"clamp({t[0]} / 6 + 0.5, 0, 1)"),
    "softsign": _PwOp(lambda t, a: f"({t[0]} / (1 + abs({t[0]})))"),
    "tanhshrink": _PwOp(lambda t, a: f"({t[0]} - tanh({t[0]}))"),
    "batch_norm": _PwOp(_bn_text, _bn_stage),
}


# =============================================================================================
# Builders: bound arguments -> a description (or _Reject with the reason)
# =============================================================================================


def _pw(op: str, operands: tuple[str, ...] = ("input",), attrs: tuple[str, ...] = ()) -> Callable[[dict], _PW]:
    def build(b: dict) -> _PW:
        return _PW(op, tuple(b[name] for name in operands), {a: b[a] for a in attrs}, bool(b.get("inplace")))

    return build


def _check_number(value, what: str):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _Reject(f"{what} must be a number here, got {value!r}")
    return float(value)


def _leaky_relu(b):
    _check_number(b["negative_slope"], "negative_slope")
    return _pw("leaky_relu", attrs=("negative_slope",))(b)


def _gelu(b):
    if b["approximate"] not in ("none", "tanh"):
        raise _Reject(f"approximate={b['approximate']!r} is not 'none' or 'tanh'")
    return _pw("gelu", attrs=("approximate",))(b)


def _hardtanh(b):
    for name in ("min_val", "max_val"):
        b[name] = _check_number(b[name], name)
    return _pw("hardtanh", attrs=("min_val", "max_val"))(b)


def _relu6(b):
    return _hardtanh({**b, "min_val": 0.0, "max_val": 6.0})


def _softplus(b):
    for name in ("beta", "threshold"):
        b[name] = _check_number(b[name], name)
    return _pw("softplus", attrs=("beta", "threshold"))(b)


def _alpha_op(op: str) -> Callable:
    def build(b):
        b["alpha"] = _check_number(b["alpha"], "alpha")
        return _pw(op, attrs=("alpha",))(b)

    return build


def _clamp(b):
    if b["min"] is None and b["max"] is None:
        raise _Reject("clamp without min and max")
    return _PW("clamp", (b["input"], b["min"], b["max"]), inplace=bool(b.get("inplace")))


def _clamp_min(b):
    return _PW("clamp", (b["input"], b["min"], None), inplace=bool(b.get("inplace")))


def _clamp_max(b):
    return _PW("clamp", (b["input"], None, b["max"]), inplace=bool(b.get("inplace")))


def _add_sub(op: str) -> Callable:
    def build(b):
        other, alpha = b["other"], b["alpha"]
        if alpha != 1:
            alpha = _check_number(alpha, "alpha")
            other = other * alpha if isinstance(other, (int, float)) else _PW("mul", (other, alpha))
        return _PW(op, (b["input"], other), inplace=bool(b.get("inplace")))

    return build


def _div(b):
    if b["rounding_mode"] is not None:
        raise _Reject(f"rounding_mode={b['rounding_mode']!r} (only true division is fused)")
    return _pw("div", ("input", "other"))(b)


def _pow(b):
    base, exponent = b["input"], b["exponent"]
    if isinstance(exponent, (int, float)) and not isinstance(exponent, bool):
        return _PW("pow", (base,), {"exponent": float(exponent)}, bool(b.get("inplace")))
    if isinstance(base, (int, float)) and not isinstance(base, bool) and base > 0:
        return _PW("exp_base", (exponent,), {"base": float(base)})
    raise _Reject("a power is fused only with a constant exponent (or a positive constant base)")


def _square(b):
    return _PW("pow", (b["input"],), {"exponent": 2.0}, bool(b.get("inplace")))


def _min_max(kind: str) -> Callable:
    """torch.max(x, other) is elementwise; torch.max(x, dim) a reduction returning (values, indices)."""

    def build(b):
        other = b["dim"]
        if isinstance(other, Node):
            if b["keepdim"]:
                raise _Reject("keepdim with a tensor operand")
            return _PW("maximum" if kind == "max" else "minimum", (b["input"], other))
        if other is None:
            raise _Reject("without dim it reduces every dim, including the batch")
        if isinstance(other, bool) or not isinstance(other, int):
            raise _Reject(f"dim must be an int, got {other!r}")
        return _Reduce(b["input"], "amax" if kind == "max" else "amin", [other], bool(b["keepdim"]), tuple_out=True)

    return build


def _reduce(op: str) -> Callable:
    def build(b):
        if b.get("dtype") not in (None, torch.float32):
            raise _Reject(f"dtype={b['dtype']} (only float32 is fused)")
        dim = b["dim"]
        if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
            raise _Reject("it reduces every dim, including the batch")
        dims = [dim] if isinstance(dim, int) else list(dim) if isinstance(dim, (list, tuple)) else None
        if dims is None or any(isinstance(d, bool) or not isinstance(d, int) for d in dims):
            raise _Reject(f"dim must be ints, got {dim!r}")
        return _Reduce(b["input"], op, dims, bool(b["keepdim"]))

    return build


def _ints(value, what: str):
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return list(value)
    raise _Reject(f"{what} must be an int or a tuple of ints, got {value!r}")


def _pool_common(b) -> dict:
    if b.get("ceil_mode"):
        raise _Reject("ceil_mode=True is not supported (spec pools use floor mode)")
    if b.get("return_indices"):
        raise _Reject("return_indices=True is not supported")
    stride = b.get("stride")
    out = {"kernel": _ints(b["kernel_size"], "kernel_size"), "padding": _ints(b["padding"], "padding")}
    if stride not in (None, (), []):
        out["stride"] = _ints(stride, "stride")
    return out


def _avg_pool(nd: int) -> Callable:
    def build(b):
        if b.get("divisor_override") is not None:
            raise _Reject("divisor_override is not supported")
        args = {**_pool_common(b), "count_include_pad": bool(b["count_include_pad"])}
        return _Pool(b["input"], {"avg_pool": args}, nd)

    return build


def _max_pool(nd: int) -> Callable:
    def build(b):
        args = {**_pool_common(b), "dilation": _ints(b["dilation"], "dilation")}
        return _Pool(b["input"], {"max_pool": args}, nd)

    return build


def _adaptive(kind: str, nd: int) -> Callable:
    def build(b):
        if b.get("return_indices"):
            raise _Reject("return_indices=True is not supported")
        size = b["output_size"]
        sizes = list(size) if isinstance(size, (list, tuple)) else [size]
        if any(s != 1 for s in sizes):
            raise _Reject(f"output_size={size!r}: only an output of 1 (a global pool) is fused")
        return _Pool(b["input"], {f"global_{kind}_pool": {}}, nd)

    return build


def _batch_norm(b):
    if b["training"]:
        raise _Reject(
            "in training mode batch norm normalizes with the batch's own statistics, which a fused layer "
            "does not compute (call model.eval() to fuse it with its running statistics)"
        )
    if b["running_mean"] is None or b["running_var"] is None:
        raise _Reject("without running statistics batch norm normalizes with the batch's own statistics")
    _check_number(b["eps"], "eps")
    operands = tuple(None if b[k] is None else _Dim1(b[k]) for k in ("running_mean", "running_var", "weight", "bias"))
    return _PW("batch_norm", (b["input"], *operands), {"eps": float(b["eps"])})


def _batch_norm_module(m: nn.Module, path: str) -> dict:
    def ref(name):
        t = getattr(m, name, None)
        return None if t is None else _Tensor(f"{path}.{name}", t, tuple(t.shape))

    use_batch_stats = m.training or m.running_mean is None
    return {
        "running_mean": ref("running_mean"),
        "running_var": ref("running_var"),
        "weight": ref("weight"),
        "bias": ref("bias"),
        "training": use_batch_stats,
        "eps": m.eps,
    }


def _dropout(b):
    if b["training"] and b["p"] > 0:
        raise _Reject("dropout in training mode is random (call model.eval() to fuse it as the identity)")
    return _Identity(b["input"])


def _identity(b):
    return _Identity(b["input"])


def _shape(b):
    return _Shape(b["input"])


def _conv(nd: int, transposed: bool = False) -> Callable:
    def build(b):
        if b.get("padding_mode", "zeros") != "zeros":
            raise _Reject(f"padding_mode={b['padding_mode']!r} (only zero padding is fused)")
        groups = b["groups"]
        if isinstance(groups, bool) or not isinstance(groups, int):
            raise _Reject(f"groups must be an int, got {groups!r}")
        return _Conv(
            b["input"], nd, b["weight"], b["bias"], b["stride"], b["padding"], b["dilation"], groups, b.get("module"),
            transposed, b.get("output_padding", 0),
        )

    return build


def _conv_module(m: nn.Module, path: str) -> dict:
    bias = None if m.bias is None else _Tensor(f"{path}.bias", m.bias, tuple(m.bias.shape))
    read = {
        "weight": _Tensor(f"{path}.weight", m.weight, tuple(m.weight.shape)),
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


def _attrs(*names: str) -> Callable[[nn.Module, str], dict]:
    """Module -> the keyword arguments of its functional form, read from attributes of the same names."""

    def read(m, path):
        return {name: getattr(m, name) for name in names}

    return read


def _pool_module(*names: str) -> Callable[[nn.Module, str], dict]:
    def read(m, path):
        out = {name: getattr(m, name, None) for name in names}
        out["kernel_size"] = m.kernel_size
        return out

    return read


# =============================================================================================
# The table: every spelling of every recognized op, in one place
# =============================================================================================


@dataclass(frozen=True)
class _Row:
    """One op and its spellings. `sig` binds functions and methods (the tensor is `input`); None
    means only `input` (the first argument) matters. `modules` maps an nn class name to a reader of
    the module's attributes as keyword arguments."""

    build: Callable[[dict], Any]
    sig: Optional[str]
    functions: tuple[str, ...] = ()
    methods: tuple[str, ...] = ()
    modules: dict = field(default_factory=dict)


_INPLACE = _attrs("inplace")
_NOTHING = _attrs()

_ROWS: list[_Row] = [
    # -- convolution ---------------------------------------------------------------------------
    *(
        _Row(
            _conv(nd),
            "input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1",
            functions=(f"F.conv{nd}d", f"torch.conv{nd}d"),
            modules={f"Conv{nd}d": _conv_module},
        )
        for nd in (1, 2, 3)
    ),
    *(
        _Row(
            _conv(nd, transposed=True),
            "input, weight, bias=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1",
            functions=(f"F.conv_transpose{nd}d", f"torch.conv_transpose{nd}d"),
            modules={f"ConvTranspose{nd}d": _conv_module},
        )
        for nd in (1, 2, 3)
    ),
    # -- pointwise ops with a spec op of their own ---------------------------------------------
    _Row(
        _pw("relu"),
        "input, inplace=False",
        ("torch.relu", "F.relu", "torch.relu_", "F.relu_"),
        ("relu", "relu_"),
        {"ReLU": _INPLACE},
    ),
    _Row(
        _leaky_relu,
        "input, negative_slope=0.01, inplace=False",
        ("F.leaky_relu", "F.leaky_relu_"),
        (),
        {"LeakyReLU": _attrs("negative_slope", "inplace")},
    ),
    _Row(_gelu, "input, approximate='none'", ("F.gelu",), (), {"GELU": _attrs("approximate")}),
    _Row(
        _pw("sigmoid"), "input", ("torch.sigmoid", "F.sigmoid", "torch.sigmoid_"), ("sigmoid", "sigmoid_"), {"Sigmoid": _NOTHING}
    ),
    _Row(_pw("tanh"), "input", ("torch.tanh", "F.tanh", "torch.tanh_"), ("tanh", "tanh_"), {"Tanh": _NOTHING}),
    _Row(_pw("mish"), "input, inplace=False", ("F.mish",), (), {"Mish": _INPLACE}),
    _Row(_pw("hardswish"), "input, inplace=False", ("F.hardswish",), (), {"Hardswish": _INPLACE}),
    _Row(
        _hardtanh,
        "input, min_val=-1.0, max_val=1.0, inplace=False",
        ("F.hardtanh", "F.hardtanh_"),
        (),
        {"Hardtanh": _attrs("min_val", "max_val", "inplace")},  # nn.ReLU6 is a Hardtanh(0, 6)
    ),
    _Row(_relu6, "input, inplace=False", ("F.relu6",), ()),
    _Row(
        _clamp,
        "input, min=None, max=None",
        ("torch.clamp", "torch.clip", "torch.clamp_", "torch.clip_"),
        ("clamp", "clip", "clamp_", "clip_"),
    ),
    _Row(_clamp_min, "input, min", ("torch.clamp_min", "torch.clamp_min_"), ("clamp_min", "clamp_min_")),
    _Row(_clamp_max, "input, max", ("torch.clamp_max", "torch.clamp_max_"), ("clamp_max", "clamp_max_")),
    _Row(_pw("silu"), "input, inplace=False", ("F.silu",), (), {"SiLU": _INPLACE}),
    _Row(_softplus, "input, beta=1.0, threshold=20.0", ("F.softplus",), (), {"Softplus": _attrs("beta", "threshold")}),
    _Row(
        _add_sub("add"),
        "input, other, alpha=1",
        ("operator.add", "operator.iadd", "torch.add"),
        ("add", "add_"),
    ),
    _Row(
        _add_sub("sub"),
        "input, other, alpha=1",
        ("operator.sub", "operator.isub", "torch.sub", "torch.subtract"),
        ("sub", "sub_", "subtract", "subtract_"),
    ),
    _Row(
        _pw("mul", ("input", "other")),
        "input, other",
        ("operator.mul", "operator.imul", "torch.mul", "torch.multiply"),
        ("mul", "mul_", "multiply", "multiply_"),
    ),
    _Row(
        _div,
        "input, other, rounding_mode=None",
        ("operator.truediv", "operator.itruediv", "torch.div", "torch.divide", "torch.true_divide"),
        ("div", "div_", "divide", "divide_", "true_divide", "true_divide_"),
    ),
    _Row(_pw("minimum", ("input", "other")), "input, other", ("torch.minimum", "torch.fmin"), ("minimum", "fmin")),
    _Row(_pw("maximum", ("input", "other")), "input, other", ("torch.maximum", "torch.fmax"), ("maximum", "fmax")),
    _Row(_min_max("min"), "input, dim=None, keepdim=False", ("torch.min",), ("min",)),
    _Row(_min_max("max"), "input, dim=None, keepdim=False", ("torch.max",), ("max",)),
    # -- pointwise ops written as expressions --------------------------------------------------
    _Row(_pw("neg"), "input", ("operator.neg", "torch.neg", "torch.negative"), ("neg", "neg_", "negative")),
    _Row(_pow, "input, exponent", ("operator.pow", "torch.pow"), ("pow", "pow_")),
    _Row(_square, "input", ("torch.square",), ("square", "square_")),
    *(
        _Row(_pw(fn), "input", (f"torch.{fn}", f"torch.{fn}_", *extra), (fn, f"{fn}_"))
        for fn, extra in (
            ("exp", ()),
            ("log", ()),
            ("sqrt", ()),
            ("rsqrt", ()),
            ("reciprocal", ()),
            ("abs", ("torch.absolute",)),
            ("erf", ("torch.special.erf",)),
        )
    ),
    _Row(_alpha_op("elu"), "input, alpha=1.0, inplace=False", ("F.elu", "F.elu_"), (), {"ELU": _attrs("alpha", "inplace")}),
    _Row(
        _alpha_op("celu"), "input, alpha=1.0, inplace=False", ("F.celu", "F.celu_"), (), {"CELU": _attrs("alpha", "inplace")}
    ),
    _Row(_pw("selu"), "input, inplace=False", ("F.selu", "torch.selu", "F.selu_"), (), {"SELU": _INPLACE}),
    _Row(_pw("hardsigmoid"), "input, inplace=False", ("F.hardsigmoid",), (), {"Hardsigmoid": _INPLACE}),
    _Row(_pw("softsign"), "input", ("F.softsign",), (), {"Softsign": _NOTHING}),
    _Row(_pw("tanhshrink"), "input", ("F.tanhshrink",), (), {"Tanhshrink": _NOTHING}),
    _Row(
        _batch_norm,
        "input, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1, eps=1e-05",
        ("F.batch_norm",),
        (),
        {"BatchNorm1d": _batch_norm_module, "BatchNorm2d": _batch_norm_module, "BatchNorm3d": _batch_norm_module},
    ),
    # -- no-ops in eval mode -------------------------------------------------------------------
    _Row(
        _dropout,
        "input, p=0.5, training=True, inplace=False",
        ("F.dropout", "F.dropout1d", "F.dropout2d", "F.dropout3d"),
        (),
        {name: _attrs("p", "training", "inplace") for name in ("Dropout", "Dropout1d", "Dropout2d", "Dropout3d")},
    ),
    _Row(_identity, None, (), ("contiguous", "float", "clone"), {"Identity": _NOTHING}),
    # -- shape ops (absorbed when they only drop or insert size-1 dims) ------------------------
    _Row(
        _shape,
        None,
        ("torch.flatten", "torch.reshape", "torch.squeeze", "torch.unsqueeze"),
        ("view", "reshape", "flatten", "squeeze", "unsqueeze"),
        {"Flatten": _NOTHING, "Unflatten": _NOTHING},
    ),
    # -- pools -----------------------------------------------------------------------------------
    _Row(
        _avg_pool(1),
        "input, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True",
        ("F.avg_pool1d",),
        (),
        {"AvgPool1d": _pool_module("stride", "padding", "ceil_mode", "count_include_pad")},
    ),
    *(
        _Row(
            _avg_pool(nd),
            "input, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True, divisor_override=None",
            (f"F.avg_pool{nd}d",),
            (),
            {f"AvgPool{nd}d": _pool_module("stride", "padding", "ceil_mode", "count_include_pad", "divisor_override")},
        )
        for nd in (2, 3)
    ),
    *(
        _Row(
            _max_pool(nd),
            "input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False, return_indices=False",
            (f"F.max_pool{nd}d", f"torch.max_pool{nd}d"),
            (),
            {f"MaxPool{nd}d": _pool_module("stride", "padding", "dilation", "ceil_mode", "return_indices")},
        )
        for nd in (1, 2, 3)
    ),
    *(
        _Row(
            _adaptive("avg", nd),
            "input, output_size",
            (f"F.adaptive_avg_pool{nd}d",),
            (),
            {f"AdaptiveAvgPool{nd}d": _attrs("output_size")},
        )
        for nd in (1, 2, 3)
    ),
    *(
        _Row(
            _adaptive("max", nd),
            "input, output_size, return_indices=False",
            (f"F.adaptive_max_pool{nd}d",),
            (),
            {f"AdaptiveMaxPool{nd}d": _attrs("output_size", "return_indices")},
        )
        for nd in (1, 2, 3)
    ),
    # -- reductions ------------------------------------------------------------------------------
    _Row(_reduce("sum"), "input, dim=None, keepdim=False, dtype=None", ("torch.sum",), ("sum",)),
    _Row(_reduce("mean"), "input, dim=None, keepdim=False, dtype=None", ("torch.mean",), ("mean",)),
    _Row(_reduce("amax"), "input, dim=(), keepdim=False", ("torch.amax",), ("amax",)),
    _Row(_reduce("amin"), "input, dim=(), keepdim=False", ("torch.amin",), ("amin",)),
    _Row(_reduce("logsumexp"), "input, dim, keepdim=False", ("torch.logsumexp",), ("logsumexp",)),
]


_NAMESPACES = {"torch": torch, "F": F, "operator": operator, "torch.special": torch.special}


def _resolve_function(name: str):
    space, _, attr = name.rpartition(".")
    return getattr(_NAMESPACES[space], attr, None)


_BY_FUNCTION: dict[Any, tuple[_Row, bool]] = {}  # function -> (row, in-place spelling)
_BY_METHOD: dict[str, tuple[_Row, bool]] = {}
_BY_MODULE: dict[type, tuple[_Row, Callable]] = {}
for _row in _ROWS:
    for _name in _row.functions:
        _fn = _resolve_function(_name)
        if _fn is not None:
            _BY_FUNCTION.setdefault(_fn, (_row, _name.endswith("_")))
    for _name in _row.methods:
        _BY_METHOD.setdefault(_name, (_row, _name.endswith("_")))
    for _name, _reader in _row.modules.items():
        _cls = getattr(nn, _name, None)
        if _cls is not None:
            _BY_MODULE[_cls] = (_row, _reader)


def supported_names() -> dict[str, list[str]]:
    """The recognized spellings, for documentation: functions, Tensor methods and nn modules."""
    return {
        "functions": sorted({n for r in _ROWS for n in r.functions if _resolve_function(n) is not None}),
        "methods": sorted({n for r in _ROWS for n in r.methods}),
        "modules": sorted({f"nn.{n}" for r in _ROWS for n in r.modules if hasattr(nn, n)}),
    }


# =============================================================================================
# Small helpers on nodes and shapes
# =============================================================================================

@dataclass(frozen=True)
class _TensorInfo:
    """What the example run recorded about a tensor value."""

    shape: tuple
    dtype: torch.dtype


def _info(value):
    """_TensorInfo for a tensor, a tuple of them for a tuple holding tensors, else None."""
    if isinstance(value, torch.Tensor):
        return _TensorInfo(tuple(value.shape), value.dtype)
    if isinstance(value, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in value):
        return tuple(_info(v) for v in value)
    return None


class _ShapeRecorder(fx.Interpreter):
    """Runs the traced model and records every node's shape and dtype in node.meta."""

    def run_node(self, n: Node):
        result = super().run_node(n)
        n.meta[_META_KEY] = _info(result)
        return result


_META_KEY = "specgen_tensor"
_META_METHODS = {"size", "dim", "numel", "ndimension", "nelement", "get_device"}
_META_ATTRS = {"shape", "dtype", "device", "ndim", "is_cuda", "layout"}


def _is_meta_use(user: Node, of: Node) -> bool:
    """A use that reads only the value's size, dtype or device (x.size(0), x.shape, x.dtype ...)."""
    if not user.args or user.args[0] is not of or any(a is of for a in user.args[1:]) or user.kwargs:
        return False
    if user.op == "call_method":
        return user.target in _META_METHODS
    return user.op == "call_function" and user.target is builtins.getattr and user.args[1] in _META_ATTRS


def _value_users(node: Node) -> list[Node]:
    return [u for u in node.users if not _is_meta_use(u, node)]


def _meta(node: Node):
    return node.meta.get(_META_KEY)


def _shape_of(node: Node) -> Optional[tuple]:
    m = _meta(node)
    return tuple(m.shape) if hasattr(m, "shape") else None


def _dtype_of(node: Node):
    m = _meta(node)
    return getattr(m, "dtype", None)


def _non1(shape) -> tuple:
    return tuple(s for s in shape if s != 1)


def _same_layout(view: tuple, spec: tuple) -> bool:
    """Same batch, and the same dims of size > 1 in the same order (size-1 dims may differ)."""
    return len(view) >= 1 and len(spec) >= 1 and view[0] == spec[0] and _non1(view[1:]) == _non1(spec[1:])


def _view_to_spec_dim(view: tuple, spec: tuple, d: int) -> int:
    k = sum(1 for i in range(1, d) if view[i] != 1)
    return [i for i in range(1, len(spec)) if spec[i] != 1][k]


def _spec_to_view_dim(view: tuple, spec: tuple, d: int) -> int:
    if view == spec:
        return d
    k = sum(1 for i in range(1, d) if spec[i] != 1)
    return [i for i in range(1, len(view)) if view[i] != 1][k]


def _sanitize(raw: str, fallback: str) -> str:
    name = re.sub(r"[^A-Za-z0-9_]", "_", raw).strip("_")
    name = re.sub(r"_+", "_", name)
    if not name:
        name = fallback
    if not name[0].isalpha():
        name = f"{fallback}_{name}"
    return name[:63]


def _unique(name: str, taken) -> str:
    if name not in taken:
        return name
    for i in range(2, 10_000):
        suffix = f"_{i}"
        candidate = name[: 63 - len(suffix)] + suffix
        if candidate not in taken:
            return candidate
    raise RuntimeError("no unique name left")  # pragma: no cover


# Per-channel parameter names that a spec or a FusedLayer cannot take.
_RESERVED_PARAM_NAMES = (
    set(EXPR_RESERVED)
    | {"conv", "weight", "bias", "spec", "arch", "key"}
    | set(dir(FusedLayer))
    | set(dir(nn.Module()))
)


def _shape_ghost(like: torch.Tensor, tail: tuple) -> torch.Tensor:
    """A zero-copy stand-in for a fused intermediate: `like`'s batch, dtype and device, a fixed tail.

    Code that reads only the size of a value fused away (`x.view(x.size(0), -1)`) reads it here."""
    return like.new_empty(()).expand(like.shape[0], *tail)


# =============================================================================================
# Chains
# =============================================================================================


@dataclass(eq=False)
class _Chain:
    conv: Node
    desc: _Conv
    data: dict  # the spec under construction (name filled in at the end)
    spec: LayerSpec
    batch: int
    nodes: list = field(default_factory=list)  # covered nodes, graph order
    out: Node = None
    view: tuple = ()  # shape of `out` as the model sees it
    weight: _Tensor = None
    bias: Optional[_Tensor] = None
    names: dict = field(default_factory=dict)  # id(tensor) -> spec parameter name
    tensors: dict = field(default_factory=dict)  # spec parameter name -> tensor
    stop: Optional[str] = None  # why the chain ended
    rejected: dict = field(default_factory=dict)  # node -> why it did not join

    @property
    def stages(self) -> list:
        return self.data["epilogue"]

    @property
    def spec_out(self) -> tuple:
        return self.spec.output_shape(self.batch)

    def channel(self) -> tuple[Optional[int], Optional[int]]:
        """(extent, dim in the model's view) of the channel axis, or (None, None) once reduced away."""
        axes = self.spec.shapes()[-1].axes
        for i, ax in enumerate(axes):
            if ax.role == "c":
                extent = ax.extent
                return extent, (_spec_to_view_dim(self.view, self.spec_out, i + 1) if extent != 1 else None)
        return None, None


class _Importer:
    """One model, traced and shape-propagated; `analyze` finds the chains, `rewrite` fuses them."""

    def __init__(self, model: nn.Module, inputs: tuple):
        self.model = model
        self.inputs = inputs
        self.name = type(model).__name__
        self.gm: fx.GraphModule = fx.symbolic_trace(model)  # raises for untraceable models
        self.graph = self.gm.graph
        self._propagate()
        self.nodes = list(self.graph.nodes)
        self.order = {n: i for i, n in enumerate(self.nodes)}
        self._descs: dict[Node, Any] = {}
        self.chains: list[_Chain] = []
        self.covered: dict[Node, _Chain] = {}
        self.reasons: dict[Node, str] = {}
        self.warn: set[Node] = set()  # fallbacks about a convolution chain (logged as warnings)
        self.spec_names: set[str] = set()
        self.leaf_nodes: set[Node] = set()  # parameter reads and computations on parameters only
        self._param_only_memo: dict[Node, bool] = {}

    # -- capture ---------------------------------------------------------------------------------

    def _propagate(self) -> None:
        """Run the traced model on (copies of) the example inputs to record every value's shape and dtype.

        Buffers are restored afterwards, so running statistics of training-mode batch norms stay
        as they were."""
        buffers = [(b, b.detach().clone()) for b in self.model.buffers()]
        inputs = [x.detach().clone() if isinstance(x, torch.Tensor) else x for x in self.inputs]
        try:
            with torch.no_grad():
                _ShapeRecorder(self.gm).run(*inputs)
        except Exception as err:  # the model's own error on these inputs
            detail = (str(err).strip().splitlines() or [""])[0][:500]
            shapes = [tuple(x.shape) if isinstance(x, torch.Tensor) else x for x in self.inputs]
            raise ModelImportError(
                f"{self.name} fails on the example inputs {shapes}: {type(err).__name__}: {detail}"
            ) from None
        finally:
            with torch.no_grad():
                for buf, saved in buffers:
                    buf.copy_(saved)

    def _fetch(self, target: str):
        obj = self.gm
        for part in target.split("."):
            obj = getattr(obj, part)
        return obj

    # -- what a node is ------------------------------------------------------------------------

    def describe(self, node: Node) -> str:
        if node.op == "call_module":
            cls = type(self.gm.get_submodule(node.target))
            prefix = "nn." if getattr(nn, cls.__name__, None) is cls else ""
            return f"{prefix}{cls.__name__} ({node.target})"
        if node.op == "call_method":
            return f"Tensor.{node.target}"
        if node.op == "call_function":
            return _function_label(node.target)
        return node.name

    def classify(self, node: Node):
        """The description of what `node` computes, or a _Reject saying why it is not fusable."""
        if node not in self._descs:
            try:
                self._descs[node] = self._classify(node)
            except _Reject as rej:
                glue = " " if rej.reason.startswith(("is ", "has ", "overrides ")) else ": "
                self._descs[node] = _Reject(f"{self.describe(node)}{glue}{rej.reason}")
        return self._descs[node]

    def _classify(self, node: Node):
        if node.op == "call_module":
            module = self.gm.get_submodule(node.target)
            for cls in type(module).__mro__:
                if cls in _BY_MODULE:
                    break
            else:
                raise _Reject("is not a supported op")
            if type(module).forward is not cls.forward:
                raise _Reject(f"overrides the forward of nn.{cls.__name__}")
            if module._forward_hooks or module._forward_pre_hooks:
                raise _Reject("has forward hooks, which a fused layer would skip")
            if len(node.args) != 1 or node.kwargs:
                raise _Reject("is called with more than the input")
            row, reader = _BY_MODULE[cls]
            bound = {"input": node.args[0], **reader(module, node.target)}
            return row.build(bound)
        if node.op == "call_function":
            entry = _BY_FUNCTION.get(node.target) if _hashable(node.target) else None
        elif node.op == "call_method":
            entry = _BY_METHOD.get(node.target)
        else:
            return None
        if entry is None:
            raise _Reject("is not a supported op")
        row, inplace = entry
        if row.sig is None:
            bound = {"input": node.args[0] if node.args else node.kwargs.get("input")}
        else:
            bound = _bind(_SIGS[row.sig], tuple(node.args), dict(node.kwargs))
        if inplace:
            bound["inplace"] = True
        return row.build(bound)

    # -- analysis ------------------------------------------------------------------------------

    def analyze(self) -> None:
        for node in self.nodes:
            if node.op in ("call_module", "call_function") and node not in self.covered:
                desc = self.classify(node)
                if isinstance(desc, _Conv):
                    self._chain(node, desc)

    def _record(self, nodes, reason: str, subject: bool = False) -> None:
        """Remember why `nodes` do not join a chain (with each node's description first if `subject`)."""
        for n in nodes:
            if n.op != "output" and not isinstance(self.classify(n), _Conv):
                self.reasons.setdefault(n, f"{self.describe(n)}: {reason}" if subject else reason)
                self.warn.add(n)

    def _chain(self, conv: Node, desc: _Conv) -> None:
        try:
            chain = self._start(conv, desc)
        except _Reject as rej:
            self.reasons[conv] = rej.reason
            self.warn.add(conv)
            return
        while self._extend(chain):
            pass
        if not chain.stages:
            why = chain.stop or "its output is not followed by a fusable op"
            self.reasons[conv] = f"{self.describe(conv)}: nothing to fuse after this convolution: {why}"
            self.warn.add(conv)
            return
        name = _unique(self._layer_name(chain), self.spec_names)
        self.spec_names.add(name)
        chain.data["name"] = name
        chain.spec = validate(chain.data)
        self.chains.append(chain)
        for n in chain.nodes:
            self.covered[n] = chain

    def _layer_name(self, chain: _Chain) -> str:
        where = chain.conv.target if chain.conv.op == "call_module" else chain.weight.path
        return _sanitize(f"{self.name.lower()}_{where}", "layer")

    def _tensor_of(self, value, what: str) -> Optional[_Tensor]:
        if value is None or isinstance(value, _Tensor):
            return value
        if isinstance(value, Node) and value.op == "get_attr":
            obj = self._fetch(value.target)
            if isinstance(obj, torch.Tensor):
                return _Tensor(value.target, obj, tuple(obj.shape))
        raise _Reject(f"the {what} is computed in forward; only a parameter or buffer of the model can be shared")

    def _start(self, conv: Node, desc: _Conv) -> _Chain:
        where = self.describe(conv)
        inp = desc.input
        in_shape = _shape_of(inp) if isinstance(inp, Node) else None
        if in_shape is None:
            raise _Reject(f"{where}: its input is not a tensor value of the graph")
        if _dtype_of(inp) != torch.float32:
            raise _Reject(f"{where}: the input is {_dtype_of(inp)}; only float32 layers are fused")
        if len(in_shape) != desc.nd + 2:
            raise _Reject(f"{where}: the input has shape {list(in_shape)}; a batched input [N, C, ...] is needed")
        try:
            weight = self._tensor_of(desc.weight, "weight")
            bias = self._tensor_of(desc.bias, "bias")
        except _Reject as rej:
            raise _Reject(f"{where}: {rej.reason}") from None
        for t in (weight, bias):
            if t is not None and t.tensor.dtype != torch.float32:
                raise _Reject(f"{where}: the {t.path} is {t.tensor.dtype}; only float32 layers are fused")
        kernel = list(weight.shape[2:])
        if len(weight.shape) != desc.nd + 2:
            raise _Reject(f"{where}: the weight has shape {list(weight.shape)}")
        try:
            stride = _ints(desc.stride, "stride")
            dilation = _ints(desc.dilation, "dilation")
            if desc.transposed:
                padding = _ints(desc.padding, "padding")
                output_padding = _ints(desc.output_padding, "output_padding")
            else:
                padding = self._padding(desc.padding, kernel, stride, dilation, desc.nd)
        except _Reject as rej:
            raise _Reject(f"{where}: {rej.reason}") from None
        data = {
            "name": "chain",
            "input": {"channels": in_shape[1], "size": list(in_shape[2:])},
            "conv": {
                # a transposed conv's weight is [C_in, C_out / groups, k...]
                "out_channels": weight.shape[1] * desc.groups if desc.transposed else weight.shape[0],
                "kernel": kernel,
                "stride": stride,
                "padding": padding,
                "dilation": dilation,
                "groups": desc.groups,
                "bias": bias is not None,
            },
            "epilogue": [],
        }
        if desc.transposed:
            data["conv"].update(transposed=True, output_padding=output_padding)
        try:
            spec = validate(data)
        except SpecError as err:
            raise _Reject(f"{where}: the spec would not validate: {'; '.join(err.problems)}") from None
        chain = _Chain(conv, desc, data, spec, batch=in_shape[0], nodes=[conv], out=conv, weight=weight, bias=bias)
        chain.view = _shape_of(conv)
        if chain.view is None or tuple(chain.view) != tuple(chain.spec_out):
            raise _Reject(f"{where}: the spec's output {list(chain.spec_out)} differs from the model's {chain.view}")
        return chain

    @staticmethod
    def _padding(padding, kernel, stride, dilation, nd):
        if padding == "valid":
            return 0
        if padding == "same":
            if any(s != 1 for s in (stride if isinstance(stride, list) else [stride])):
                raise _Reject("padding='same' needs stride 1")
            dil = dilation if isinstance(dilation, list) else [dilation] * nd
            totals = [d * (k - 1) for d, k in zip(dil, kernel)]
            if any(t % 2 for t in totals):
                raise _Reject("padding='same' with an even kernel span pads unevenly, which a spec cannot say")
            return [t // 2 for t in totals]
        return _ints(padding, "padding")

    # -- growing a chain ---------------------------------------------------------------------

    def _extend(self, chain: _Chain) -> bool:
        """Add the next stage(s) to the chain; False (with chain.stop set) when it ends."""
        cur = chain.out
        users = _value_users(cur)
        if any(u.op == "output" for u in users):
            chain.stop = chain.stop or f"{cur.name} is returned by the model"
            self._record(
                [u for u in users if u.op != "output"],
                f"its input {cur.name} is also returned by the model, so the fused chain ends at {cur.name}",
                subject=True,
            )
            return False
        region = self._region(chain)
        if region is not None:
            return self._take_region(chain, *region)
        if not users:
            chain.stop = f"{cur.name} is not used"
            return False
        if len(users) > 1:
            names = ", ".join(u.name for u in users)
            reason = (
                f"its input {cur.name} is used by {len(users)} nodes ({names}); "
                f"a fused chain ends at a value that is used more than once"
            )
            chain.stop = f"{cur.name} is used by {len(users)} nodes ({names})"
            self._record(users, reason, subject=True)
            return False
        user = users[0]
        desc = self.classify(user)
        try:
            if isinstance(desc, _Reject):
                raise desc
            if isinstance(desc, _Conv):
                chain.stop = f"{cur.name} feeds another convolution ({user.name})"
                return False
            if isinstance(desc, _PW):
                raise _Reject(chain.rejected.get(user, f"{self.describe(user)} does not fit the chain"))
            if getattr(desc, "input", None) is not cur:
                raise _Reject(f"{self.describe(user)}: uses {cur.name} other than as its input")
            if isinstance(desc, _Pool):
                self._take_pool(chain, user, desc)
            elif isinstance(desc, _Reduce):
                self._take_reduce(chain, user, desc)
            elif isinstance(desc, (_Shape, _Identity)):
                self._take_view(chain, user, desc)
            else:
                raise _Reject(f"{self.describe(user)} is not a supported op")
        except _Reject as rej:
            chain.stop = rej.reason
            self._record([user], rej.reason)
            return False
        return True

    def _commit(self, chain: _Chain, stages: list, nodes: list, out: Node) -> None:
        spec = chain.spec
        if stages:
            data = {**chain.data, "epilogue": chain.stages + stages}
            try:
                spec = validate(data)
            except SpecError as err:
                raise _Reject(f"the spec would not validate: {'; '.join(err.problems)}") from None
        view = _shape_of(out)
        spec_out = spec.output_shape(chain.batch)
        if view is None or not _same_layout(view, spec_out):
            raise _Reject(f"the spec's output {list(spec_out)} does not match the model's {view}")
        if stages:
            chain.data = data
        chain.spec, chain.out, chain.view = spec, out, view
        chain.nodes.extend(nodes)

    def _take_pool(self, chain: _Chain, node: Node, desc: _Pool) -> None:
        where = self.describe(node)
        if tuple(chain.view) != tuple(chain.spec_out) or len(chain.view) != desc.nd + 2 or desc.nd != chain.spec.ndim:
            raise _Reject(f"{where}: pools over {desc.nd} spatial dims of a tensor shaped {list(chain.view)}")
        try:
            self._commit(chain, [desc.stage], [node], node)
        except _Reject as rej:
            raise _Reject(f"{where}: {rej.reason}") from None

    def _take_reduce(self, chain: _Chain, node: Node, desc: _Reduce) -> None:
        where = self.describe(node)
        view, spec_out = tuple(chain.view), tuple(chain.spec_out)
        rank = len(view)
        dims = []
        for d in desc.dims:
            n = d + rank if d < 0 else d
            if not 0 <= n < rank:
                raise _Reject(f"{where}: dim {d} is out of range")
            if n == 0:
                raise _Reject(f"{where}: it reduces the batch dim (dim 0), which a spec never reduces")
            dims.append(n)
        if view == spec_out:
            spec_dims = sorted(set(dims))
        else:  # the model sees a view with other size-1 dims: map the dims of size > 1
            spec_dims = sorted({_view_to_spec_dim(view, spec_out, d) for d in dims if view[d] != 1})
        nodes, out = [node], node
        if desc.tuple_out:  # (values, indices): the values only, and an unpacked but unused indices
            accessors = [u for u in node.users if _is_values_accessor(u, node)]
            unused = [u for u in node.users if u not in accessors and _is_accessor(u) and not u.users]
            if len(accessors) != 1 or len(accessors) + len(unused) != len(node.users):
                raise _Reject(f"{where}: its indices are used (only the values of a (values, indices) result are fused)")
            nodes.extend([accessors[0], *unused])
            out = accessors[0]
        stages = [{desc.op: {"dims": spec_dims, "keepdim": desc.keepdim}}] if spec_dims else []
        try:
            self._commit(chain, stages, nodes, out)
        except _Reject as rej:
            raise _Reject(f"{where}: {rej.reason}") from None

    def _take_view(self, chain: _Chain, node: Node, desc) -> None:
        where = self.describe(node)
        shape = _shape_of(node)
        if shape is None or _dtype_of(node) != torch.float32:
            raise _Reject(f"{where}: does not produce a float32 tensor")
        if isinstance(desc, _Identity) and tuple(shape) != tuple(chain.view):
            raise _Reject(f"{where}: changes the shape")
        if not _same_layout(shape, chain.view):
            raise _Reject(
                f"{where}: reshapes {list(chain.view)} to {list(shape)}; only size-1 dims may be dropped, "
                f"inserted or merged (and the batch must stay dim 0)"
            )
        self._commit(chain, [], [node], node)

    # -- pointwise regions -------------------------------------------------------------------

    def _region(self, chain: _Chain):
        """The largest pointwise DAG hanging off the chain value with a single exit.

        Returns (exit node, {member: resolved _PW}, {member: its x-dependent operands}) or None.
        Members are pointwise nodes whose operands are the chain value, other members, numbers or
        per-channel tensors; every member but the exit is used only inside the region, and so is
        the chain value."""
        cur = chain.out
        members: dict[Node, _PW] = {}
        deps: dict[Node, list[Node]] = {}
        limit = max((self.order[u] for u in cur.users), default=-1)
        i = self.order[cur] + 1
        while i <= limit and i < len(self.nodes):
            node = self.nodes[i]
            i += 1
            if not any(a is cur or a in members for a in node.all_input_nodes):
                continue
            desc = self.classify(node)
            if not isinstance(desc, _PW):
                continue
            try:
                resolved, xdeps = self._resolve_member(chain, node, desc, members)
            except _Reject as rej:
                chain.rejected[node] = rej.reason
                continue
            members[node], deps[node] = resolved, xdeps
            limit = max([limit] + [self.order[u] for u in node.users])
        cur_users = set(_value_users(cur))
        for exit_ in reversed(list(members)):
            area = _ancestors(exit_, deps)
            if not cur_users <= area:
                continue
            if all(set(_value_users(v)) <= area for v in area if v is not exit_):
                return exit_, {n: members[n] for n in members if n in area}, deps
        return None

    def _resolve_member(self, chain: _Chain, node: Node, desc: _PW, members: dict):
        where = self.describe(node)
        inside = set(members) | {chain.out}
        shape = _shape_of(node)
        if _dtype_of(node) != torch.float32:
            raise _Reject(f"{where}: produces {_dtype_of(node)}; only float32 is fused")
        if shape is None or tuple(shape) != tuple(chain.view):
            raise _Reject(f"{where}: its result has shape {shape and list(shape)}, not the chain's {list(chain.view)}")
        if desc.inplace:
            target = desc.operands[0]
            if not (isinstance(target, Node) and target in inside and _value_users(target) == [node]):
                raise _Reject(f"{where}: in-place on a value that is used again")
        xdeps: list[Node] = []
        try:
            resolved = self._resolve(chain, desc, inside, xdeps)
        except _Reject as rej:
            raise _Reject(f"{where}: {rej.reason}") from None
        return resolved, xdeps

    def _resolve(self, chain: _Chain, term, inside: set, xdeps: list):
        """A _PW with every operand either an x-dependent node (collected in xdeps) or a leaf."""
        if isinstance(term, _PW):
            return _PW(term.op, tuple(self._resolve(chain, o, inside, xdeps) for o in term.operands), term.attrs)
        if isinstance(term, Node) and term in inside:
            xdeps.append(term)
            return term
        if isinstance(term, _Dim1) and isinstance(term.value, Node) and term.value in inside:
            raise _Reject("a statistic depends on the chain value")
        return self._leaf(chain, term)

    def _leaf(self, chain: _Chain, value, along_dim1: bool = False):
        """A number, a per-channel tensor of the model, or a pointwise expression over those."""
        if isinstance(value, _Dim1):
            return self._leaf(chain, value.value, along_dim1=True)
        if value is None:
            return None
        if isinstance(value, bool):
            raise _Reject(f"operand {value!r} is a boolean")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, _Tensor):
            ref = value
        elif isinstance(value, Node):
            ref = self._leaf_node(chain, value, along_dim1)
            if not isinstance(ref, _Tensor):
                return ref
        else:
            raise _Reject(f"operand {value!r} is not a number or a tensor")
        self._check_per_channel(chain, ref, along_dim1)
        return replace(ref, along_dim1=along_dim1)

    def _leaf_node(self, chain: _Chain, node: Node, along_dim1: bool):
        result = self._leaf_value(chain, node, along_dim1)
        self.leaf_nodes.add(node)
        return result

    def _param_only(self, node: Node) -> bool:
        """Whether `node` is computed from parameters and numbers only (get_attr, and shape or
        pointwise ops over those). Computed for the whole graph at once, in graph order."""
        if not self._param_only_memo:
            memo = self._param_only_memo
            for n in self.nodes:
                if n.op == "get_attr":
                    memo[n] = True
                elif n.op in ("call_function", "call_method", "call_module"):
                    desc = self.classify(n)
                    pure = isinstance(desc, _Shape) or (isinstance(desc, _PW) and not desc.inplace)
                    memo[n] = pure and all(memo.get(a, False) for a in n.all_input_nodes)
                else:
                    memo[n] = False
        return self._param_only_memo.get(node, False)

    def _leaf_value(self, chain: _Chain, node: Node, along_dim1: bool):
        if not self._param_only(node):
            raise _Reject(
                f"operand {node.name} is computed by the model; only numbers and per-channel parameters can join a chain"
            )
        if node.op == "get_attr":
            obj = self._fetch(node.target)
            if not isinstance(obj, torch.Tensor):
                raise _Reject(f"operand {node.target} is not a tensor")
            if node.target.startswith("_tensor_constant") and obj.numel() == 1 and not along_dim1:
                return float(obj.item())  # a constant made in forward, e.g. torch.tensor(0.5)
            return _Tensor(node.target, obj, tuple(obj.shape))
        desc = self.classify(node)
        if isinstance(desc, _Shape) and isinstance(desc.input, Node):
            base = self._leaf_node(chain, desc.input, along_dim1)
            if isinstance(base, _Tensor):
                return replace(base, shape=_shape_of(node))
            return base
        if isinstance(desc, _PW) and not desc.inplace:  # computed from parameters only
            shape = _shape_of(node)
            if shape is None or not _broadcasts_into(shape, chain.view):
                raise _Reject(f"operand {node.name} would broadcast the chain to a larger shape")
            return _PW(desc.op, tuple(self._leaf(chain, o) for o in desc.operands), desc.attrs)
        raise _Reject(
            f"operand {node.name} is computed by the model; only numbers and per-channel parameters can join a chain"
        )

    def _check_per_channel(self, chain: _Chain, ref: _Tensor, along_dim1: bool) -> None:
        if ref.tensor.dtype != torch.float32:
            raise _Reject(f"{ref.path} is {ref.tensor.dtype}; only float32 is fused")
        extent, dim = chain.channel()
        if extent is None:
            raise _Reject(f"{ref.path} is per-channel but the channel dim was reduced away")
        shape, view = tuple(ref.shape), tuple(chain.view)
        numel = math.prod(shape)
        if along_dim1:
            if numel != extent or (extent != 1 and dim != 1):
                raise _Reject(f"{ref.path} has {numel} values along dim 1, not the {extent} channels")
            return
        if numel != extent:
            kind = "is a scalar tensor" if numel == 1 else f"has shape {list(shape)}"
            raise _Reject(
                f"{ref.path} {kind}; only numbers and per-channel tensors ({extent} values along the channel dim) are fused"
            )
        if not _broadcasts_into(shape, view):
            raise _Reject(f"{ref.path} of shape {list(shape)} would broadcast the chain to a larger shape")
        aligned = (1,) * (len(view) - len(shape)) + shape
        if extent != 1 and aligned[dim] != extent:
            raise _Reject(f"{ref.path} of shape {list(shape)} does not lie along the channel dim {dim} of {list(view)}")

    def _take_region(self, chain: _Chain, exit_: Node, members: dict, deps: dict) -> bool:
        cur = chain.out
        prev = cur
        for cut in _cut_points(cur, exit_, members, deps, self.order):
            segment = _ancestors(cut, deps, stop=prev)
            saved = (dict(chain.names), dict(chain.tensors))
            try:
                stage = self._segment_stage(chain, prev, cut, segment, members)
                self._commit(chain, [stage], sorted(segment, key=self.order.get), cut)
            except _Reject as rej:
                chain.names, chain.tensors = saved
                chain.stop = rej.reason
                self._record(sorted(segment, key=self.order.get), rej.reason, subject=True)
                return False
            prev = cut
        return True

    def _segment_stage(self, chain: _Chain, x_node: Node, top: Node, segment: set, members: dict) -> dict:
        """The spec stage computing `top` from `x_node`: a named op when the segment is one node
        with x once among its operands, else an expr."""
        ir = members[top]
        if segment == {top}:
            terms = [self._direct_term(chain, o, x_node) for o in ir.operands]
            if sum(t is X for t in terms) == 1:
                stage = _PW_OPS[ir.op].direct(terms, ir.attrs)
                if stage is not None:
                    return stage
        text = self._render(chain, top, x_node, members)
        return {"expr": {"code": text}}

    def _direct_term(self, chain: _Chain, term, x_node: Node):
        if term is x_node:
            return X
        if term is None or isinstance(term, float):
            return term
        if isinstance(term, _Tensor):
            return _Named(self._param_name(chain, term))
        return _OPAQUE

    def _render(self, chain: _Chain, term, x_node: Node, members: dict) -> Optional[str]:
        if term is x_node:
            return "x"
        if isinstance(term, Node):
            term = members[term]
        if isinstance(term, _PW):
            texts = [self._render(chain, o, x_node, members) for o in term.operands]
            text = _PW_OPS[term.op].render(texts, term.attrs)
            if text is None:
                raise _Reject(f"{term.op} inside a larger pointwise expression has no expr form")
            return text
        if term is None:
            return None
        if isinstance(term, float):
            return _num(term)
        if isinstance(term, _Tensor):
            return self._param_name(chain, term)
        raise _Reject(f"cannot write {term!r} in an expression")  # pragma: no cover

    def _param_name(self, chain: _Chain, ref: _Tensor) -> str:
        key = id(ref.tensor)
        if key not in chain.names:
            name = _sanitize(ref.path, "p")
            if name in _RESERVED_PARAM_NAMES:
                name = f"{name}_param"
            name = _unique(name, set(chain.tensors) | _RESERVED_PARAM_NAMES)
            chain.names[key] = name
            chain.tensors[name] = ref.tensor
        return chain.names[key]

    # -- the report ----------------------------------------------------------------------------

    def absorbed(self) -> set:
        """Nodes that only feed fused chains with parameter values: gone once the chains are fused."""
        dead: set[Node] = set()
        for node in reversed(self.nodes):
            if node in self.leaf_nodes and node.users and all(u in self.covered or u in dead for u in node.users):
                dead.add(node)
        return dead

    def fallbacks(self) -> list[Fallback]:
        out = []
        absorbed = self.absorbed()
        for node in self.nodes:
            if node.op not in ("call_module", "call_function", "call_method"):
                continue
            if node in self.covered or node in absorbed:
                continue
            m = _meta(node)
            if m is None or _is_accessor(node):
                continue
            out.append(Fallback(node.name, self._reason(node)))
        return out

    def _reason(self, node: Node) -> str:
        if node in self.reasons:
            return self.reasons[node]
        desc = self.classify(node)
        if isinstance(desc, _Reject):
            return desc.reason
        inputs = [a for a in node.all_input_nodes if _meta(a) is not None and a.op != "get_attr"]
        if not inputs:
            return f"{self.describe(node)}: it does not follow a convolution"
        source = inputs[0]
        if source.op == "placeholder":
            return f"{self.describe(node)}: it does not follow a convolution (its input {source.name} is a model input)"
        return f"{self.describe(node)}: it does not follow a fused chain (its input {source.name} runs as PyTorch)"

    def report(self, choices: Optional[list[Choice]] = None) -> ImportReport:
        if choices is None:
            choices = [Choice(c.spec.name, True) for c in self.chains]
        return ImportReport(self.name, [c.spec for c in self.chains], self.fallbacks(), choices)

    # -- never slower: each chain timed as PyTorch and as its kernel ----------------------------

    def original(self, chain: _Chain) -> Optional[fx.GraphModule]:
        """The chain as the model computes it (its nodes and the parameter reads they need), a
        module of the conv's input; None when it reads any other value of the model."""
        conv = chain.conv
        inp = conv.args[0] if conv.args else conv.kwargs["input"]
        needed: set[Node] = set()
        todo = [chain.out]
        while todo:
            node = todo.pop()
            if node in needed or node is inp:
                continue
            if node.op == "placeholder":
                return None
            needed.add(node)
            todo.extend(node.all_input_nodes)
        graph = fx.Graph()
        env = {inp: graph.placeholder("x")}
        for node in self.nodes:
            if node in needed:
                env[node] = graph.node_copy(node, lambda n: env[n])
        graph.output(env[chain.out])
        root = {n.target: self._fetch(n.target) for n in needed if n.op in ("call_module", "get_attr")}
        return fx.GraphModule(root, graph, class_name=f"Original_{chain.spec.name}")

    def measure(self, chain: _Chain) -> Choice:
        """Time the chain as PyTorch and as its kernel on its GPU (or take the cached decision)."""
        name = chain.spec.name
        device = chain.weight.tensor.device
        if not _is_gpu(device):
            return Choice(name, True, how=f"not measured (the model is on {device.type})")
        layer = self._layer(chain)
        original = self.original(chain)
        if original is None or layer.key is None:
            return Choice(name, True, how="not measured (the chain reads another model input)")
        key = measured.decision_key(
            layer.key, measured.gpu_identity(device), measured.batch_bucket(chain.batch), measured.torch_context()
        )
        record = measured.load(key)
        if record is not None:
            ms, pt = record["specgen_ms"], record["pytorch_ms"]
            return Choice(name, ms < pt, ms, pt, "cached")
        inp = chain.conv.args[0] if chain.conv.args else chain.conv.kwargs["input"]
        shape = _shape_of(inp)
        generator = torch.Generator(device=device).manual_seed(0)
        inputs = [torch.randn(shape, device=device, generator=generator) for _ in range(2)]
        ms, pt = measured.compare(layer, original, inputs)
        measured.store(key, {"layer": name, "batch": chain.batch, "specgen_ms": ms, "pytorch_ms": pt})
        return Choice(name, ms < pt, ms, pt, "measured")

    # -- rewriting -----------------------------------------------------------------------------

    def rewrite(self) -> fx.GraphModule:
        """The traced graph with each chain replaced by one ImportedLayer call."""
        graph = self.graph
        layers: dict[str, nn.Module] = {}
        taken = {n.target.split(".")[0] for n in self.nodes if n.op in ("call_module", "get_attr")} | set(dir(self.gm))
        for chain in self.chains:
            name = _unique(chain.spec.name, taken | set(layers))
            layers[name] = self._layer(chain)
            self.gm.add_submodule(name, layers[name])
            conv = chain.conv
            inp = conv.args[0] if conv.args else conv.kwargs["input"]
            with graph.inserting_before(conv):
                fused = graph.call_module(name, (inp,))
                final = fused
                if tuple(chain.view) != tuple(chain.spec_out):
                    final = graph.call_method("reshape", (fused, -1, *chain.view[1:]))
            chain.out.replace_all_uses_with(final)
            covered = set(chain.nodes)
            for node in chain.nodes:  # uses that read only sizes: give them a stand-in
                readers = [u for u in node.users if u not in covered]
                if readers:
                    with graph.inserting_before(conv):
                        ghost = graph.call_function(_shape_ghost, (inp, tuple(_shape_of(node)[1:])))
                    for u in readers:
                        u.replace_input_with(node, ghost)
            _erase(graph, sorted(chain.nodes, key=self.order.get, reverse=True), self.leaf_nodes)
        graph.lint()
        root: dict[str, Any] = {}
        for node in graph.nodes:
            if node.op in ("call_module", "get_attr"):
                root[node.target] = self._fetch(node.target)
        fused = fx.GraphModule(root, graph, class_name=f"Fused{self.name}")
        fused.training = self.model.training
        return fused

    def _layer(self, chain: _Chain) -> ImportedLayer:
        """The chain's fused layer (built once: measuring and rewriting share it)."""
        built = getattr(self, "_layers", None)
        if built is None:
            built = self._layers = {}
        if id(chain) not in built:
            built[id(chain)] = self._new_layer(chain)
        return built[id(chain)]

    def _new_layer(self, chain: _Chain) -> ImportedLayer:
        layer = ImportedLayer(chain.spec)
        layer.training = self.model.training
        if chain.desc.module is not None:
            layer.conv = chain.desc.module
        else:
            _share(layer.conv, "weight", chain.weight.tensor)
            if chain.bias is not None:
                _share(layer.conv, "bias", chain.bias.tensor)
        for name, tensor in chain.tensors.items():
            _share(layer, name, tensor)
        return layer


_SIGS = {row.sig: _sig(row.sig) for row in _ROWS if row.sig is not None}


_LABELS: dict = {}


def _function_label(fn) -> str:
    """'torch.cumsum', 'F.softmax', 'operator.getitem': how the model's code most likely spelled it."""
    if not _LABELS:
        spaces = (("builtins", builtins), ("operator", operator), ("torch.special", torch.special), ("F", F), ("torch", torch))
        for label, space in spaces:
            for attr in dir(space):
                obj = getattr(space, attr, None)
                if callable(obj) and _hashable(obj):
                    _LABELS[obj] = attr if label == "builtins" else f"{label}.{attr}"
    if _hashable(fn) and fn in _LABELS:
        return _LABELS[fn]
    return f"{getattr(fn, '__module__', None) or '?'}.{getattr(fn, '__name__', fn)}"


def _hashable(obj) -> bool:
    try:
        hash(obj)
    except TypeError:
        return False
    return True


def _is_values_accessor(user: Node, of: Node) -> bool:
    if user.op != "call_function" or not user.args or user.args[0] is not of:
        return False
    if user.target is operator.getitem:
        return user.args[1] == 0
    return user.target is builtins.getattr and user.args[1] == "values"


def _is_accessor(node: Node) -> bool:
    """x[i] or x.values/x.indices of a multi-output op: reported with that op, not on its own."""
    if node.op != "call_function" or node.target not in (operator.getitem, builtins.getattr) or not node.args:
        return False
    source = node.args[0]
    return isinstance(source, Node) and isinstance(_meta(source), (tuple, list))


def _broadcasts_into(shape: tuple, view: tuple) -> bool:
    if len(shape) > len(view):
        return False
    aligned = (1,) * (len(view) - len(shape)) + tuple(shape)
    return all(a in (1, v) for a, v in zip(aligned, view))


def _ancestors(node: Node, deps: dict, stop: Optional[Node] = None) -> set:
    """`node` and the region members it depends on (not crossing `stop`)."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in seen or n is stop or n not in deps:
            continue
        seen.add(n)
        todo.extend(deps[n])
    return seen


def _cut_points(cur: Node, exit_: Node, members: dict, deps: dict, order: dict) -> list[Node]:
    """Members every path from the exit back to the chain value goes through, in graph order."""

    def reaches_cur(avoid: Node) -> bool:
        seen, todo = set(), [exit_]
        while todo:
            n = todo.pop()
            if n is cur:
                return True
            if n in seen or n is avoid or n not in deps:
                continue
            seen.add(n)
            todo.extend(deps[n])
        return False

    cuts = [n for n in members if n is exit_ or not reaches_cur(n)]
    return sorted(cuts, key=order.get)


def _share(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Make `module.<name>` the very tensor given: a Parameter stays a parameter, anything else a buffer."""
    if hasattr(module, name):
        delattr(module, name)
    if isinstance(tensor, nn.Parameter):
        module.register_parameter(name, tensor)
    else:
        module.register_buffer(name, tensor)


def _erase(graph: fx.Graph, nodes: list[Node], pure: set) -> None:
    """Erase the given nodes, then whatever only they used: parameter reads, computations on
    parameters only (`pure`) and size reads."""
    todo = list(nodes)
    forced, erased = set(nodes), set()
    while todo:
        node = todo.pop(0)
        if node in erased or node.users or (node not in forced and node not in pure and not _disposable(node)):
            continue
        inputs = list(node.all_input_nodes)
        graph.erase_node(node)
        erased.add(node)
        todo.extend(inputs)


def _disposable(node: Node) -> bool:
    if node.op == "get_attr":
        return True
    if node.op == "call_method" and node.target in _META_METHODS:
        return True
    return node.op == "call_function" and node.target in (_shape_ghost, builtins.getattr, operator.getitem)


# =============================================================================================
# Entry points
# =============================================================================================


def _importer(model, example_inputs) -> _Importer | str:
    """An analyzed importer, or the reason the model cannot be traced."""
    if not isinstance(model, nn.Module):
        raise ModelImportError(f"expected an nn.Module, got {type(model).__name__}")
    if not example_inputs:
        raise ModelImportError("give at least one example input (a tensor shaped like the model's input)")
    try:
        imp = _Importer(model, tuple(example_inputs))
    except ModelImportError:
        raise
    except Exception as err:  # torch.fx cannot trace it (data-dependent control flow, ...)
        first = (str(err).strip().splitlines() or [""])[0]
        return f"torch.fx cannot trace {type(model).__name__}: {type(err).__name__}: {first[:300]}"
    imp.analyze()
    return imp


def _specialize_all(imp: _Importer) -> None:
    """Compile every chain's kernel in one parallel build (only the misses compile); the fused
    layers built afterwards find them in the process's memo."""
    if imp.chains and torch.cuda.is_available():
        pipeline.specialize_many([chain.spec for chain in imp.chains])


def _is_gpu(device: torch.device) -> bool:
    return device.type == "cuda"


def _unmeasurable(imp: _Importer) -> Optional[str]:
    """Why the chains cannot be timed here, or None."""
    if not torch.cuda.is_available():
        return "no GPU"
    first = next((t for t in imp.inputs if isinstance(t, torch.Tensor)), None)
    if first is None or not first.is_cuda:
        return f"the example input is on {'cpu' if first is None else first.device.type}"
    return None


def _choices(imp: _Importer, keep_slower: bool) -> list[Choice]:
    """One Choice per chain: kept as its kernel unless measured not faster than PyTorch."""
    why = "keep_slower=True" if keep_slower else _unmeasurable(imp)
    if why is not None:
        return [Choice(chain.spec.name, True, how=f"not measured ({why})") for chain in imp.chains]
    log = get_logger()
    choices = []
    for chain in imp.chains:
        choice = imp.measure(chain)
        if not choice.fused:
            log.info("%s: %s kept as PyTorch (not faster fused): %s", imp.name, choice.layer, choice)
        choices.append(choice)
    return choices


def explain(model: nn.Module, *example_inputs, measure: bool = False) -> ImportReport:
    """What specgen can fuse in `model`, run on `example_inputs`: `.specs` and `.fallbacks`.

    With `measure=True` (and the model and inputs on a GPU) every chain is compiled and timed as
    `from_module` does, and `.choices` says which ones would stay PyTorch, with both times.
    The model is not changed (buffers such as batch norm statistics are restored after the
    shape-recording run). Raises ModelImportError when the model fails on the inputs."""
    imp = _importer(model, example_inputs)
    if isinstance(imp, str):
        return ImportReport(type(model).__name__, [], [Fallback(type(model).__name__, imp)])
    if not measure:
        return imp.report()
    _specialize_all(imp)
    return imp.report(_choices(imp, keep_slower=False))


def from_module(model: nn.Module, *example_inputs, keep_slower: bool = False) -> nn.Module:
    """`model` with every fusable chain run by a FusedLayer sharing the model's parameters.

    On a GPU, all chains' kernels compile in one parallel build, and a chain whose kernel is not
    faster than its PyTorch code (timed once, cached per GPU and batch bucket) keeps the PyTorch
    code; `keep_slower=True` fuses every chain without timing. Unfused nodes run as the original
    PyTorch code; each is logged (logger `specgen`) with its reason: as a warning when it
    concerns a convolution chain, at info level otherwise. The returned module's
    `specgen_report` is the explain() report with `.choices` (both times per chain).
    Example-input shapes are baked into the fused layers (the batch size stays free). On a GPU the
    whole fused model is timed once more against the original, and the original is returned
    (with `specgen_report` set, `.whole_model` holding both times) unless the fused one is faster."""
    log = get_logger()
    imp = _importer(model, example_inputs)
    if isinstance(imp, str):
        log.warning("%s runs as PyTorch: %s", type(model).__name__, imp)
        return model
    _specialize_all(imp)
    choices = _choices(imp, keep_slower)
    report = imp.report(choices)
    by_name = {n.name: n for n in imp.nodes}
    for fb in report.fallbacks:
        level = log.warning if by_name.get(fb.node) in imp.warn else log.info
        level("%s: %s runs as PyTorch: %s", imp.name, fb.node, fb.reason)
    names = ", ".join(s.name for s in report.fused_specs) or "none"
    log.info("%s: %d chain(s) fused: %s", imp.name, len(report.fused_specs), names)
    if not imp.chains:
        return model
    imp.chains = [chain for chain, choice in zip(imp.chains, choices) if choice.fused]
    fused = imp.rewrite()
    fused.specgen_report = report
    if imp.chains and not keep_slower and _unmeasurable(imp) is None:
        # Chains that win alone can still lose together (caches, launch gaps): the whole model is
        # timed once more, and the original is kept unless the fused one is faster.
        from specgen import measured

        inputs = [tuple(example_inputs)]
        fused_ms, plain_ms = measured.compare(lambda a: fused(*a), lambda a: model(*a), inputs)
        report.whole_model = (fused_ms, plain_ms)
        if fused_ms >= plain_ms:
            log.warning(
                "%s: the fused model (%.3f ms) is not faster than the original (%.3f ms) at this batch: "
                "keeping the original (keep_slower=True fuses anyway)", imp.name, fused_ms, plain_ms,
            )
            model.specgen_report = report  # the original, with the report that says why
            return model
    return fused
