"""Pointwise regions: the DAG of pointwise ops hanging off a chain's value, its operands resolved to
numbers and per-channel tensors of the model, and each segment written as one spec stage: the
op's own stage where the segment is one op of the table on x, else an `expr` (each op's text in
the expr grammar comes from its row of specgen.ops)."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Optional

import torch
import torch.nn as nn
from torch.fx import Node

from specgen import ops
from specgen.expr import RESERVED as EXPR_RESERVED
from specgen.importer.graph import broadcasts_into, dtype_of, sanitize, shape_of, unique, value_users
from specgen.importer.recognize import ConstantOp, Dim1, IdentityOp, PW, Reject, ShapeOp, TensorRef, pointwise_row
from specgen.module import FusedLayer


class _XTerm:
    def __repr__(self) -> str:
        return "x"


X = _XTerm()  # the chain value, in direct-stage terms
_OPAQUE = object()  # an operand that is neither x, a number nor a parameter


class InputRef:
    """An operand the model computes (or takes as its input) of the chain value's shape and dtype:
    an extra input of the fused layer, passed at run time (a residual's shortcut). `shape`: its
    shape per sample where it is [C, 1, ...], one value per sample and channel (a time embedding
    viewed as [N, C, 1, 1]); None where it is the chain value's."""

    def __init__(self, node: Node, shape: Optional[tuple] = None, permuted: bool = False):
        self.node = node
        self.shape = shape
        self.permuted = permuted  # of the chain value's shape as the model holds it permuted (`_Chain.out_perm`)

    def __repr__(self) -> str:
        return f"InputRef({self.node.name})"


# Per-channel parameter names that a spec or a FusedLayer cannot take.
_RESERVED_PARAM_NAMES = (
    set(EXPR_RESERVED)
    | {"conv", "weight", "bias", "spec", "arch", "key"}
    | set(dir(FusedLayer))
    | set(dir(nn.Module()))
)


def _num(value) -> str:
    try:
        return ops.expr_number(value)
    except ValueError as err:
        raise Reject(str(err)) from None


def _direct_stage(ir: PW, terms: list) -> Optional[dict]:
    """The op's own spec stage for x and the other operands `terms` (numbers, ops.Param, None), or
    None where its arguments cannot say them (then the op is written as an expr)."""
    row = pointwise_row(ir.op)
    if not isinstance(row, ops.Pointwise):
        return None
    if terms[0] is X:
        operands = terms[1:]
    elif row.commutative and len(terms) == 2 and terms[1] is X:
        operands = terms[:1]
    else:
        return None
    args = row.args.from_operands(tuple(operands), ir.attrs)
    return None if args is None else {row.name: args}


class Regions:
    """Finds a chain's pointwise regions and writes their stages, for one analysis (the nodes,
    their descriptions and the model's tensors). `leaf_nodes` collects the nodes read as operands:
    parameter reads and computations on parameters only."""

    def __init__(self, analysis):
        self.nodes, self.order = analysis.nodes, analysis.order
        self.classify, self.describe, self.fetch = analysis.classify, analysis.describe, analysis.fetch
        self.leaf_nodes: set[Node] = set()
        self.covered = analysis.covered  # nodes of the chains built so far: never in another
        self._param_only_memo: dict[Node, bool] = {}

    def find(self, chain):
        """The largest pointwise DAG hanging off the chain value with a single exit.

        Returns (exit node, {member: resolved PW}, {member: its x-dependent operands}) or None.
        Members are pointwise nodes whose operands are the chain value, other members, numbers or
        per-channel tensors; every member but the exit is used only inside the region, and so is
        the chain value."""
        cur = chain.out
        members: dict[Node, PW] = {}
        deps: dict[Node, list[Node]] = {}
        limit = max((self.order[u] for u in cur.users), default=-1)
        i = self.order[cur] + 1
        while i <= limit and i < len(self.nodes):
            node = self.nodes[i]
            i += 1
            if node in self.covered or not any(a is cur or a in members for a in node.all_input_nodes):
                continue
            desc = self.classify(node)
            if isinstance(desc, IdentityOp):  # a copy of a region value (x.clone()): the value itself
                desc = PW("identity", (desc.input,))
            if not isinstance(desc, PW):
                continue
            try:
                resolved, xdeps = self._resolve_member(chain, node, desc, members)
            except Reject as rej:
                chain.rejected[node] = rej.reason
                continue
            members[node], deps[node] = resolved, xdeps
            limit = max([limit] + [self.order[u] for u in node.users])
        cur_users = set(value_users(cur))
        for exit_ in reversed(list(members)):
            if dtype_of(exit_) != chain.dtype:  # (a comparison's bool tensor is no stage's value)
                continue
            area = ancestors(exit_, deps)
            if not cur_users <= area:
                continue
            if all(set(value_users(v)) <= area for v in area if v is not exit_):
                return exit_, {n: members[n] for n in members if n in area}, deps
        return None

    def _resolve_member(self, chain, node: Node, desc: PW, members: dict):
        where = self.describe(node)
        inside = set(members) | {chain.out}
        shape = shape_of(node)
        if dtype_of(node) != chain.dtype and not (desc.op in ops.COMPARISONS and dtype_of(node) == torch.bool):
            raise Reject(f"{where}: produces {dtype_of(node)}, the chain is {chain.dtype}")
        if shape is None or tuple(shape) != chain.model_view:
            raise Reject(f"{where}: its result has shape {shape and list(shape)}, not the chain's {list(chain.model_view)}")
        if desc.inplace:
            target = desc.operands[0]
            if not (isinstance(target, Node) and target in inside and value_users(target) == [node]):
                raise Reject(f"{where}: in-place on a value that is used again")
        xdeps: list[Node] = []
        try:
            resolved = self._resolve(chain, desc, inside, xdeps)
        except Reject as rej:
            raise Reject(f"{where}: {rej.reason}") from None
        return resolved, xdeps

    def _resolve(self, chain, term, inside: set, xdeps: list):
        """A PW with every operand either an x-dependent node (collected in xdeps) or a leaf."""
        if isinstance(term, PW):
            return PW(term.op, tuple(self._resolve(chain, o, inside, xdeps) for o in term.operands), term.attrs)
        if isinstance(term, Node) and term in inside:
            xdeps.append(term)
            return term
        if isinstance(term, Dim1) and isinstance(term.value, Node) and term.value in inside:
            raise Reject("a statistic depends on the chain value")
        return self._leaf(chain, term)

    # -- operands: numbers and the model's per-channel tensors --------------------------------

    def _leaf(self, chain, value, along_dim1: bool = False):
        """A number, a per-channel tensor of the model, or a pointwise expression over those."""
        if isinstance(value, Dim1):
            return self._leaf(chain, value.value, along_dim1=True)
        if value is None:
            return None
        if isinstance(value, bool):
            raise Reject(f"operand {value!r} is a boolean")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, TensorRef):
            ref = value
        elif isinstance(value, Node):
            ref = self._leaf_node(chain, value, along_dim1)
            if not isinstance(ref, TensorRef):
                return ref
        else:
            raise Reject(f"operand {value!r} is not a number or a tensor")
        self._check_per_channel(chain, ref, along_dim1)
        return replace(ref, along_dim1=along_dim1)

    def leaf(self, chain, value) -> TensorRef:
        """A per-channel tensor of the model applied along dim 1 (`value` a Dim1: a norm's weight or
        bias, a batch norm's running statistic), checked against the chain's channels."""
        if not self._read(value.value):
            raise Reject(_not_shared(value.value))
        ref = self._leaf(chain, value)
        if not isinstance(ref, TensorRef):
            raise Reject(_not_shared(value.value))
        return ref

    def _read(self, value) -> bool:
        """Whether `value` is a tensor of the model as it is (a module's attribute, a parameter or
        buffer read, or a view of one), not one computed from it."""
        if isinstance(value, TensorRef):
            return True
        if not isinstance(value, Node):
            return False
        if value.op == "get_attr":
            return True
        desc = self.classify(value)
        return isinstance(desc, ShapeOp) and self._read(desc.input)

    def whole(self, chain, value, dtype=None) -> TensorRef:
        """A tensor of the model used whole (a layer norm's weight of its normalized shape, a batch
        counter), of the chain's dtype or `dtype`."""
        if not self._read(value):
            raise Reject(_not_shared(value))
        ref = value if isinstance(value, TensorRef) else self._leaf_node(chain, value, False)
        if not isinstance(ref, TensorRef):
            raise Reject(_not_shared(value))
        want = chain.dtype if dtype is None else dtype
        if ref.tensor.dtype != want:
            raise Reject(f"{ref.path} is {ref.tensor.dtype}, not {want}")
        return ref

    def _leaf_node(self, chain, node: Node, along_dim1: bool):
        result = self._leaf_value(chain, node, along_dim1)
        if not isinstance(result, InputRef):  # an extra input stays the model's to compute
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
                    pure = isinstance(desc, ShapeOp) or (isinstance(desc, PW) and not desc.inplace)
                    # a constant reads its inputs' device only
                    memo[n] = isinstance(desc, ConstantOp) or (pure and all(memo.get(a, False) for a in n.all_input_nodes))
                else:
                    memo[n] = False
        return self._param_only_memo.get(node, False)

    def _leaf_value(self, chain, node: Node, along_dim1: bool):
        if not self._param_only(node):
            shape = shape_of(node)
            view = tuple(chain.view)
            if chain.out_perm is not None:
                # the chain value as the model holds it, permuted (channels last, or tokens): an
                # operand of its shape is an extra input, which the fused layer reads permuted back
                if shape is None or tuple(shape) != chain.model_view:
                    raise Reject(f"operand {node.name} is computed by the model with shape {shape and list(shape)}; "
                                 f"of a chain value the model holds as {list(chain.model_view)} only numbers, "
                                 f"per-channel parameters and tensors of that shape join the chain")
                if dtype_of(node) != chain.dtype:
                    raise Reject(f"operand {node.name} is {dtype_of(node)}, the chain is {chain.dtype}")
                return InputRef(node, permuted=True)
            per_sample_channel = view[:2] + (1,) * (len(view) - 2)
            if not along_dim1 and shape is not None and tuple(shape) in (view, per_sample_channel):
                if dtype_of(node) != chain.dtype:
                    raise Reject(f"operand {node.name} is {dtype_of(node)}, the chain is {chain.dtype}")
                # an extra input of the layer: of the chain value's shape, or one value per sample and channel
                return InputRef(node, None if tuple(shape) == view else per_sample_channel[1:])
            raise Reject(
                f"operand {node.name} is computed by the model with shape {shape and list(shape)}; "
                f"numbers, per-channel parameters and tensors of the chain value's shape {list(view)} "
                f"(or {list(per_sample_channel)}, one value per sample and channel) join a chain"
            )
        if node.op == "get_attr":
            obj = self.fetch(node.target)
            if not isinstance(obj, torch.Tensor):
                raise Reject(f"operand {node.target} is not a tensor")
            if node.target.startswith("_tensor_constant") and obj.numel() == 1 and not along_dim1:
                return float(obj.item())  # a constant made in forward, e.g. torch.tensor(0.5)
            return TensorRef(node.target, obj, tuple(obj.shape))
        desc = self.classify(node)
        if isinstance(desc, ConstantOp) and not along_dim1:
            return desc.value
        if isinstance(desc, ShapeOp) and isinstance(desc.input, Node):
            base = self._leaf_node(chain, desc.input, along_dim1)
            if isinstance(base, TensorRef):
                return replace(base, shape=shape_of(node))
            return base
        if isinstance(desc, PW) and not desc.inplace:  # computed from parameters only
            shape = shape_of(node)
            if shape is None or not broadcasts_into(shape, chain.model_view):
                raise Reject(f"operand {node.name} would broadcast the chain to a larger shape")
            return PW(desc.op, tuple(self._leaf(chain, o) for o in desc.operands), desc.attrs)
        raise Reject(
            f"operand {node.name} is computed by the model; only numbers and per-channel parameters can join a chain"
        )

    def _check_per_channel(self, chain, ref: TensorRef, along_dim1: bool) -> None:
        if ref.tensor.dtype != chain.dtype:
            raise Reject(f"{ref.path} is {ref.tensor.dtype}, the chain is {chain.dtype}")
        extent, dim = chain.channel()
        if extent is None:
            raise Reject(f"{ref.path} is per-channel but the channel dim was reduced away")
        shape, view = tuple(ref.shape), tuple(chain.view)
        numel = math.prod(shape)
        if chain.out_perm is not None and not along_dim1 and numel != 1:
            # the model holds the chain value permuted (channels last): the operand broadcasts against
            # that, and lies along the channels where it does after the permute back
            if not broadcasts_into(shape, chain.model_view):
                raise Reject(f"{ref.path} of shape {list(shape)} would broadcast the chain to a larger shape")
            shape = chain.spec_order(shape)
        if along_dim1:
            if numel != extent or (extent != 1 and dim != 1):
                raise Reject(f"{ref.path} has {numel} values along dim 1, not the {extent} channels")
            return
        if numel == 1:  # a scalar tensor (a 0-dim nn.Parameter): the layer sees it expanded to every channel
            return
        if numel != extent:
            raise Reject(
                f"{ref.path} has shape {list(ref.shape)}; only numbers, scalar tensors and per-channel tensors "
                f"({extent} values along the channel dim) are fused"
            )
        if not broadcasts_into(shape, view):
            raise Reject(f"{ref.path} of shape {list(shape)} would broadcast the chain to a larger shape")
        aligned = (1,) * (len(view) - len(shape)) + shape
        if extent != 1 and aligned[dim] != extent:
            raise Reject(f"{ref.path} of shape {list(ref.shape)} does not lie along the channel dim of {list(chain.model_view)}")

    # -- a segment as one spec stage ----------------------------------------------------------

    def stage(self, chain, x_node: Node, top: Node, segment: set, members: dict) -> Optional[dict]:
        """The spec stage computing `top` from `x_node`: a named op when the segment is one node
        with x once among its operands, else an expr; None when the segment only copies x."""
        ir = members[top]
        if segment == {top}:
            terms = [self._direct_term(chain, o, x_node) for o in ir.operands]
            if sum(t is X for t in terms) == 1:
                stage = _direct_stage(ir, terms)
                if stage is not None:
                    return stage
        text = self._render(chain, top, x_node, members)
        return None if text == "x" else {"expr": {"code": text}}

    def _direct_term(self, chain, term, x_node: Node):
        if term is x_node:
            return X
        if term is None or isinstance(term, float):
            return term
        if isinstance(term, TensorRef):
            return ops.Param(self.param_name(chain, term))
        if isinstance(term, InputRef):
            if term.node in chain.saves:  # the chain's own earlier value, named by a save stage
                return ops.Saved(chain.saves[term.node][0])
            return ops.Input(self.input_name(chain, term), term.shape)
        return _OPAQUE

    def _render(self, chain, term, x_node: Node, members: dict) -> Optional[str]:
        if term is x_node:
            return "x"
        if isinstance(term, Node):
            term = members[term]
        if isinstance(term, PW):
            texts = [self._render(chain, o, x_node, members) for o in term.operands]
            try:
                text = pointwise_row(term.op).expr_form(texts, term.attrs)
            except ValueError as err:  # a constant that is not finite
                raise Reject(str(err)) from None
            if text is None:
                raise Reject(f"{term.op} inside a larger pointwise expression has no expr form")
            return text
        if term is None:
            return None
        if isinstance(term, float):
            return _num(term)
        if isinstance(term, TensorRef):
            return self.param_name(chain, term)
        if isinstance(term, InputRef):
            raise Reject(f"{term.node.name}, a tensor the model computes, is fused only as the other operand of one add, "
                         f"sub, mul or div of the chain value, not inside a larger expression")
        raise Reject(f"cannot write {term!r} in an expression")  # pragma: no cover

    def param_name(self, chain, ref: TensorRef) -> str:
        key = id(ref.tensor)
        if key not in chain.names:
            name = sanitize(ref.path, "p")
            if name in _RESERVED_PARAM_NAMES:
                name = f"{name}_param"
            name = unique(name, set(chain.tensors) | _RESERVED_PARAM_NAMES)
            chain.names[key] = name
            chain.tensors[name] = ref.tensor
        return chain.names[key]

    def input_name(self, chain, ref: InputRef) -> str:
        """The spec name of an extra input (the model's node name, made unique)."""
        for name, node in chain.inputs.items():
            if node is ref.node:
                return name
        name = sanitize(ref.node.name, "input")
        if name in _RESERVED_PARAM_NAMES:
            name = f"{name}_input"
        name = unique(name, set(chain.tensors) | set(chain.inputs) | _RESERVED_PARAM_NAMES)
        chain.inputs[name] = ref.node
        if ref.permuted:
            chain.input_steps[ref.node] = chain.permuted_back_steps()
        return name


def _not_shared(value) -> str:
    what = value.name if isinstance(value, Node) else repr(value)
    return f"operand {what} is computed in forward; only a parameter or buffer of the model can be shared"


def ancestors(node: Node, deps: dict, stop: Optional[Node] = None) -> set:
    """`node` and the region members it depends on (not crossing `stop`)."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in seen or n is stop or n not in deps:
            continue
        seen.add(n)
        todo.extend(deps[n])
    return seen


def cut_points(cur: Node, exit_: Node, members: dict, deps: dict, order: dict) -> list[Node]:
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

