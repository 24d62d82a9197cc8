"""The captured model: its torch.fx graph, the shape and dtype of every value (from one run on the
example inputs), and small helpers on nodes, shapes and names."""

from __future__ import annotations

import builtins
import contextvars
import operator
import re
from dataclasses import dataclass
from typing import Optional

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.fx import Node

from specgen import tmarun
from specgen.importer.report import ModelImportError


@dataclass(frozen=True)
class _TensorInfo:
    """What the example run recorded about a tensor value."""

    shape: tuple
    dtype: torch.dtype
    # its channels innermost in memory (channels_last(_3d)): a model whose residual adds or permutes
    # leave its activations so hands its chains such inputs (ConvNeXt), whatever its input's format
    channels_last: bool = False


def _info(value):
    """_TensorInfo for a tensor, a tuple of them for a tuple holding tensors, else None."""
    if isinstance(value, torch.Tensor):
        return _TensorInfo(tuple(value.shape), value.dtype, value.dim() > 3 and tmarun.channels_last(value))
    if isinstance(value, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in value):
        return tuple(_info(v) for v in value)
    return None


# The start of spec names (default: the model's class name, lowercased); set while the children
# of an untraceable model are imported one by one (the parent's, then the child's attribute name).
SPEC_PREFIX: contextvars.ContextVar[str] = contextvars.ContextVar("specgen_spec_prefix", default="")

_META_KEY = "specgen_tensor"
_VALUE_KEY = "specgen_value"  # a number or a tuple of ints the node computed (a size, a product of sizes)


def _plain(value):
    """`value` if it is a number or a tuple / list / torch.Size of ints, else None."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    if isinstance(value, (tuple, list)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return tuple(value)
    return None


class _ShapeRecorder(fx.Interpreter):
    """Runs the traced model and records every node's shape and dtype in node.meta (and the value
    of a node that computes a number or a tuple of ints)."""

    def run_node(self, n: Node):
        result = super().run_node(n)
        n.meta[_META_KEY] = _info(result)
        n.meta[_VALUE_KEY] = _plain(result)
        return result


class Capture:
    """One model, traced (torch.fx, a symbolic trace: no GPU needed) and run once on the example
    inputs to record every value's shape and dtype. Raises for an untraceable model, and
    ModelImportError when the model fails on the inputs."""

    def __init__(self, model: nn.Module, inputs: tuple):
        self.model = model
        self.inputs = inputs
        self.name = type(model).__name__
        self.prefix = SPEC_PREFIX.get() or self.name.lower()  # what its spec names start with
        self.gm: fx.GraphModule = fx.symbolic_trace(model)  # raises for untraceable models
        self.graph = self.gm.graph
        thread_inplace(self.gm)
        explicit_padding(self.gm)
        self._propagate()
        self.nodes = list(self.graph.nodes)
        self.order = {n: i for i, n in enumerate(self.nodes)}

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

    def fetch(self, target: str):
        """The module, parameter or buffer at `target` (a dotted path in the traced module)."""
        return fetch(self.gm, target)


def _returns_its_input(gm: fx.GraphModule, node: Node) -> bool:
    """Whether `node` mutates its first argument in place and returns that very tensor: an in-place
    Tensor method (`y.mul_(0.5)`), a torch or F function of that form (`torch.sigmoid_(y)`,
    `F.relu_(y)`), a function or module called with inplace=True."""
    if not node.args or not isinstance(node.args[0], Node):
        return False
    if node.op == "call_method":
        return isinstance(node.target, str) and node.target.endswith("_") and not node.target.startswith("_")
    if node.op == "call_function":
        name = getattr(node.target, "__name__", "")
        module = getattr(node.target, "__module__", "") or ""
        if name.endswith("_") and not name.startswith("_") and module.startswith("torch"):
            return True
        return node.kwargs.get("inplace") is True and module.startswith("torch")
    if node.op == "call_module":
        return getattr(gm.get_submodule(node.target), "inplace", False) is True
    return False


def thread_inplace(gm: fx.GraphModule) -> None:
    """Later uses of a value mutated in place read the in-place op's result instead, as they would
    after `y = y.mul_(0.5)`. The in-place op returns that very tensor, so the graph computes the same
    as before; but `y.mul_(0.5); y.add_(1.0); return y`, a chain of statements that the trace records
    as several uses of y, becomes the chain y -> mul_ -> add_ that a fused layer can take whole."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    changed = False
    for node in list(gm.graph.nodes):
        if _returns_its_input(gm, node):
            value = node.args[0]
            moved = value.replace_all_uses_with(node, delete_user_cb=lambda user, at=order[node]: order[user] > at)
            changed = changed or bool(moved)
    if changed:
        gm.recompile()


# On an F.pad node `explicit_padding` wrote: the padding it stands for (what the report says of it)
PADDING_KEY = "specgen_padding"
# On a functional conv `explicit_padding` wrote for a conv module: the module's path (its chain's name)
CONV_MODULE_KEY = "specgen_conv_module"
_CONV_FUNCTIONS = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONV_MODULES = {nn.Conv1d: 1, nn.Conv2d: 2, nn.Conv3d: 3}


def _conv_call(gm: fx.GraphModule, node: Node) -> Optional[tuple[int, dict]]:
    """(spatial dims, arguments by name) of a forward convolution called as a module or a function
    with literal geometry, else None. A module's weight and bias are given as their paths (str), a
    function's as the nodes it reads."""
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        nd = _CONV_MODULES.get(type(module))
        if nd is None or len(node.args) != 1 or node.kwargs:
            return None
        return nd, {"input": node.args[0], "weight": f"{node.target}.weight",
                    "bias": None if module.bias is None else f"{node.target}.bias", "stride": module.stride,
                    "padding": module.padding, "dilation": module.dilation, "groups": module.groups,
                    "padding_mode": module.padding_mode, "kernel": tuple(module.kernel_size)}
    nd = next((n for n, fn in _CONV_FUNCTIONS.items() if node.target is fn), None) if node.op == "call_function" else None
    if nd is None:
        return None
    names = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
    if len(node.args) > len(names) or not set(node.kwargs) <= set(names):
        return None
    bound = {"bias": None, "stride": 1, "padding": 0, "dilation": 1, "groups": 1, **dict(zip(names, node.args)), **node.kwargs}
    weight = bound["weight"]
    if not (isinstance(weight, Node) and weight.op == "get_attr"):
        return None
    return nd, {**bound, "padding_mode": "zeros", "kernel": tuple(fetch(gm, weight.target).shape[2:])}


def fetch(gm: fx.GraphModule, target: str):
    """The module, parameter or buffer at `target` (a dotted path in `gm`)."""
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _per_dim(value, nd: int) -> Optional[tuple]:
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,) * nd
    if isinstance(value, (tuple, list)) and len(value) == nd and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return tuple(value)
    return None


def _pads_of(conv: dict, nd: int) -> Optional[list[tuple[int, int]]]:
    """(before, after) per spatial dim of the conv's padding, 'same' as PyTorch pads it (the kernel's
    span less one, the smaller half before); None where it is not literal."""
    padding = conv["padding"]
    if padding == "valid":
        return [(0, 0)] * nd
    if padding == "same":
        dilation = _per_dim(conv["dilation"], nd)
        if dilation is None or len(conv["kernel"]) != nd:
            return None
        return [(t // 2, t - t // 2) for t in (d * (k - 1) for d, k in zip(dilation, conv["kernel"]))]
    per = _per_dim(padding, nd)
    return None if per is None else [(p, p) for p in per]


def _replace_conv(gm: fx.GraphModule, node: Node, nd: int, conv: dict, source: Node, padding: tuple) -> None:
    """`node` as the functional conv of `source` with `padding`; a module's weight and bias read by get_attr."""
    with gm.graph.inserting_before(node):
        weight, bias = (gm.graph.get_attr(t) if isinstance(t, str) else t for t in (conv["weight"], conv["bias"]))
        call = gm.graph.call_function(_CONV_FUNCTIONS[nd], (source, weight, bias, conv["stride"], padding,
                                                            conv["dilation"], conv["groups"]))
    if node.op == "call_module":
        call.meta[CONV_MODULE_KEY] = node.target
    node.replace_all_uses_with(call)
    gm.graph.erase_node(node)


def explicit_padding(gm: fx.GraphModule) -> None:
    """Convolutions padded otherwise than the same zeros on both sides, written as PyTorch runs them:
    the input padded first (`F.pad`, left running as PyTorch), then the conv unpadded, which a fused
    chain can take. So a conv with padding_mode 'reflect', 'replicate' or 'circular', or with
    padding='same' over an even kernel span (one more zero after than before), starts a chain like
    any other. And the other way round, a zero `F.pad` that pads each spatial dim evenly before a
    conv is taken into the conv's own padding, sparing the padded copy."""
    changed = False
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is F.pad:
            changed = _fold_zero_pad(gm, node) or changed
            continue
        found = _conv_call(gm, node)
        pads = None if found is None else _pads_of(found[1], found[0])
        if pads is None:
            continue
        nd, conv = found
        if conv["padding_mode"] == "zeros" and all(a == b for a, b in pads):
            continue
        mode = {"zeros": "constant"}.get(conv["padding_mode"], conv["padding_mode"])
        flat = tuple(v for pair in reversed(pads) for v in pair)  # F.pad's order: the last dim first
        with gm.graph.inserting_before(node):
            padded = gm.graph.call_function(F.pad, (conv["input"], flat), {"mode": mode})
        why = f"padding_mode={conv['padding_mode']!r}" if conv["padding_mode"] != "zeros" else \
            "padding='same' over an even kernel span (one more zero after than before)"
        label = node.target if node.op == "call_module" else node.name
        padded.meta[PADDING_KEY] = f"{label}'s {why}"
        _replace_conv(gm, node, nd, conv, padded, (0,) * nd)
        changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()


def _fold_zero_pad(gm: fx.GraphModule, pad: Node) -> bool:
    """Take a zero F.pad that pads each spatial dim evenly into the one conv that reads it."""
    names = ("input", "pad", "mode", "value")
    if len(pad.args) > len(names) or not set(pad.kwargs) <= set(names) or len(pad.users) != 1:
        return False
    bound = {"mode": "constant", "value": None, **dict(zip(names, pad.args)), **pad.kwargs}
    flat = bound["pad"]
    if bound["mode"] != "constant" or bound["value"] not in (None, 0, 0.0):
        return False
    if not (isinstance(flat, (tuple, list)) and flat and len(flat) % 2 == 0
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in flat)):
        return False
    user = next(iter(pad.users))
    found = _conv_call(gm, user)
    if found is None:
        return False
    nd, conv = found
    pairs = [(flat[i], flat[i + 1]) for i in range(0, len(flat), 2)][::-1]  # outermost padded dim first
    own = _pads_of(conv, nd) if conv["padding_mode"] == "zeros" else None
    if conv["input"] is not pad or own is None or len(pairs) > nd or any(a != b for a, b in [*pairs, *own]):
        return False
    extra = [0] * (nd - len(pairs)) + [a for a, _ in pairs]
    _replace_conv(gm, user, nd, conv, bound["input"], tuple(p + e for (p, _), e in zip(own, extra)))
    gm.graph.erase_node(pad)
    return True


# ---- sizes read in forward ---------------------------------------------------------------------

# Integer arithmetic over sizes that a static value may go through.
_SIZE_ARITHMETIC = {operator.add, operator.sub, operator.mul, operator.floordiv, operator.truediv, operator.mod}


def _size_tags(node: Node, memo: dict):
    """The value `node` computes from tensor sizes alone, each number tagged with whether it
    depends on a batch size: (value, batch) for a number, a tuple of those for a tuple; None for
    anything else. A tensor's dim 0 is taken as its batch (what `from_module` leaves free)."""
    if node not in memo:
        memo[node] = _size_value(node, memo)
    return memo[node]


def _size_value(node: Node, memo: dict):
    """`_size_tags` of `node`, computed (its inputs' through the memo)."""
    value, args = node.meta.get(_VALUE_KEY), node.args
    if value is None:
        return None
    if (node.op == "call_method" and node.target == "size" and not node.kwargs) or \
            (node.op == "call_function" and node.target is builtins.getattr and len(args) == 2 and args[1] == "shape"):
        if len(args) == 1 or node.target is builtins.getattr:
            return tuple((v, i == 0) for i, v in enumerate(value))
        if len(args) == 2 and isinstance(args[1], int) and isinstance(args[0], Node):
            rank = len(shape_of(args[0]) or ())
            return (value, rank > 0 and args[1] % rank == 0)
        return None
    if node.op == "call_method" and node.target in ("dim", "ndimension") and isinstance(value, int):
        return (value, False)
    if node.op == "call_function" and node.target is operator.getitem and len(args) == 2 and isinstance(args[0], Node):
        base = _size_tags(args[0], memo)
        if isinstance(base, tuple) and base and isinstance(base[0], tuple) and isinstance(args[1], (int, slice)):
            try:
                return base[args[1]]
            except IndexError:
                return None
        return None
    if node.op == "call_function" and node.target in _SIZE_ARITHMETIC and len(args) == 2:
        batch = False
        for a in args:
            if isinstance(a, Node):
                tags = _size_tags(a, memo)
                if not (isinstance(tags, tuple) and len(tags) == 2 and not isinstance(tags[0], tuple)):
                    return None
                batch = batch or tags[1]
            elif not isinstance(a, (int, float)) or isinstance(a, bool):
                return None
        return (value, batch)
    return None


def batch_free_value(node: Node, memo: dict):
    """What `node` computes from tensor sizes when none of it depends on a batch size (a pool's
    window `x.size()[2:]`, a divisor `x.shape[2] * x.shape[3]`), as a plain number or tuple; None
    otherwise. The fused layer is specialized for those sizes, as for every size but the batch."""
    tags = _size_tags(node, memo)
    if tags is None:
        return None
    if isinstance(tags[0], tuple):
        return None if any(batch for _, batch in tags) else tuple(v for v, _ in tags)
    return None if tags[1] else tags[0]


# ---- values and their uses ---------------------------------------------------------------------

META_METHODS = {"size", "dim", "numel", "ndimension", "nelement", "get_device"}
_META_ATTRS = {"shape", "dtype", "device", "ndim", "is_cuda", "layout"}


def _is_meta_use(user: Node, of: Node) -> bool:
    """A use that reads only the value's size, dtype or device (x.size(0), x.shape, x.dtype ...)."""
    if not user.args or user.args[0] is not of or any(a is of for a in user.args[1:]) or user.kwargs:
        return False
    if user.op == "call_method":
        return user.target in META_METHODS
    return user.op == "call_function" and user.target is builtins.getattr and user.args[1] in _META_ATTRS


def value_users(node: Node) -> list[Node]:
    """The nodes that use `node`'s value (not only its size, dtype or device)."""
    return [u for u in node.users if not _is_meta_use(u, node)]


def recorded(node: Node):
    """What the example run recorded for `node`: a _TensorInfo, a tuple of them, or None."""
    return node.meta.get(_META_KEY)


def channels_last_of(node: Node) -> bool:
    """Whether the example run's value of `node` had its channels innermost in memory."""
    return bool(getattr(recorded(node), "channels_last", False))


def shape_of(node: Node) -> Optional[tuple]:
    m = recorded(node)
    return tuple(m.shape) if hasattr(m, "shape") else None


def dtype_of(node: Node):
    m = recorded(node)
    return getattr(m, "dtype", None)


def is_values_accessor(user: Node, of: Node) -> bool:
    """`user` reads the values of the (values, indices) result `of`: of[0] or of.values."""
    if user.op != "call_function" or not user.args or user.args[0] is not of:
        return False
    if user.target is operator.getitem:
        return user.args[1] == 0
    return user.target is builtins.getattr and user.args[1] == "values"


def is_accessor(node: Node) -> bool:
    """x[i] or x.values/x.indices of a multi-output op: reported with that op, not on its own."""
    if node.op != "call_function" or node.target not in (operator.getitem, builtins.getattr) or not node.args:
        return False
    source = node.args[0]
    return isinstance(source, Node) and isinstance(recorded(source), (tuple, list))


# ---- shapes: the model's view of a value and the spec's ------------------------------------------


def _non1(shape) -> tuple:
    return tuple(s for s in shape if s != 1)


def same_layout(view: tuple, spec: tuple) -> bool:
    """Same batch, and the same dims of size > 1 in the same order (size-1 dims may differ)."""
    return len(view) >= 1 and len(spec) >= 1 and view[0] == spec[0] and _non1(view[1:]) == _non1(spec[1:])


def view_to_spec_dim(view: tuple, spec: tuple, d: int) -> int:
    k = sum(1 for i in range(1, d) if view[i] != 1)
    return [i for i in range(1, len(spec)) if spec[i] != 1][k]


def spec_to_view_dim(view: tuple, spec: tuple, d: int) -> int:
    if view == spec:
        return d
    k = sum(1 for i in range(1, d) if spec[i] != 1)
    return [i for i in range(1, len(view)) if view[i] != 1][k]


def merged_dims(view: tuple, shape: tuple) -> Optional[list[tuple[int, int]]]:
    """For a reshape of `view` to `shape` that only merges consecutive dims (x.view(b, c, -1)): for
    each dim of `shape`, the first and last dim of `view` it holds; None for any other reshape, or
    one that merges the batch (dim 0) with another dim of size > 1."""
    groups, i = [], 0
    for extent in shape:
        lo, size = i, 1
        while i < len(view) and (i == lo or size < extent):
            size *= view[i]
            i += 1
        if size != extent or i == lo:
            return None
        groups.append((lo, i - 1))
    if i != len(view) or not groups or any(view[k] != 1 for k in range(groups[0][0] + 1, groups[0][1] + 1)):
        return None
    return groups


def broadcasts_into(shape: tuple, view: tuple) -> bool:
    if len(shape) > len(view):
        return False
    aligned = (1,) * (len(view) - len(shape)) + tuple(shape)
    return all(a in (1, v) for a, v in zip(aligned, view))


# ---- names -----------------------------------------------------------------------------------


def sanitize(raw: str, fallback: str) -> str:
    """`raw` as an identifier of at most 63 characters (a spec or parameter name)."""
    name = re.sub(r"[^A-Za-z0-9_]", "_", raw).strip("_")
    name = re.sub(r"_+", "_", name)
    if not name:
        name = fallback
    if not name[0].isalpha():
        name = f"{fallback}_{name}"
    return name[:63]


def unique(name: str, taken) -> str:
    if name not in taken:
        return name
    for i in range(2, 10_000):
        suffix = f"_{i}"
        candidate = name[: 63 - len(suffix)] + suffix
        if candidate not in taken:
            return candidate
    raise RuntimeError("no unique name left")  # pragma: no cover


_LABELS: dict = {}


def function_label(fn) -> str:
    """'torch.cumsum', 'F.softmax', 'operator.getitem': how the model's code most likely spelled it."""
    if not _LABELS:
        spaces = (("builtins", builtins), ("operator", operator), ("torch.special", torch.special), ("F", F), ("torch", torch))
        for label, space in spaces:
            for attr in dir(space):
                obj = getattr(space, attr, None)
                if callable(obj) and hashable(obj):
                    _LABELS[obj] = attr if label == "builtins" else f"{label}.{attr}"
    if hashable(fn) and fn in _LABELS:
        return _LABELS[fn]
    return f"{getattr(fn, '__module__', None) or '?'}.{getattr(fn, '__name__', fn)}"


def hashable(obj) -> bool:
    try:
        hash(obj)
    except TypeError:
        return False
    return True
