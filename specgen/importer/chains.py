"""Chains: each convolution starts one, which grows while the next node is something a spec can
say (a pointwise region, a pool, a reduction, a shape or identity op), and ends at a value used
more than once (or returned), at an op outside the vocabulary, or where the spec would not
validate. Every node left running as PyTorch gets its reason here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn as nn
from torch.fx import Node

from specgen.importer.exprs import Regions, ancestors, cut_points
from specgen.importer.graph import (
    Capture,
    dtype_of,
    is_accessor,
    is_values_accessor,
    recorded,
    same_layout,
    sanitize,
    shape_of,
    spec_to_view_dim,
    unique,
    value_users,
    view_to_spec_dim,
)
from specgen.importer.recognize import (
    ConvOp,
    IdentityOp,
    PoolOp,
    PW,
    Recognizer,
    ReduceOp,
    Reject,
    ShapeOp,
    TensorRef,
    ints,
)
from specgen.importer.report import Choice, Fallback, ImportReport
from specgen.spec import LayerSpec, SpecError, validate


@dataclass(eq=False)
class _Chain:
    conv: Node
    desc: ConvOp
    data: dict  # the spec under construction (name filled in at the end)
    spec: LayerSpec
    batch: int
    nodes: list = field(default_factory=list)  # covered nodes, graph order
    out: Node = None
    view: tuple = ()  # shape of `out` as the model sees it
    weight: TensorRef = None
    bias: Optional[TensorRef] = None
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
                return extent, (spec_to_view_dim(self.view, self.spec_out, i + 1) if extent != 1 else None)
        return None, None


class Analysis(Capture):
    """One model, captured; `analyze` finds its chains, `report` says what runs as PyTorch and why."""

    def __init__(self, model: nn.Module, inputs: tuple):
        super().__init__(model, inputs)
        recognizer = Recognizer(self.gm)
        self.describe, self.classify = recognizer.describe, recognizer.classify
        self.regions = Regions(self)
        self.chains: list[_Chain] = []
        self.covered: dict[Node, _Chain] = {}
        self.reasons: dict[Node, str] = {}
        self.warn: set[Node] = set()  # fallbacks about a convolution chain (logged as warnings)
        self.spec_names: set[str] = set()
        self.layers: dict = {}  # id(chain) -> its fused layer, once built (measuring and rewriting share it)

    def analyze(self) -> None:
        """Start a chain at every convolution not already in one, and grow it."""
        for node in self.nodes:
            if node.op in ("call_module", "call_function") and node not in self.covered:
                desc = self.classify(node)
                if isinstance(desc, ConvOp):
                    self._chain(node, desc)

    def _record(self, nodes, reason: str, subject: bool = False) -> None:
        """Remember why `nodes` do not join a chain (with each node's description first if `subject`)."""
        for n in nodes:
            if n.op != "output" and not isinstance(self.classify(n), ConvOp):
                self.reasons.setdefault(n, f"{self.describe(n)}: {reason}" if subject else reason)
                self.warn.add(n)

    def _chain(self, conv: Node, desc: ConvOp) -> None:
        try:
            chain = _start(self, conv, desc)
        except Reject as rej:
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
        name = unique(self._layer_name(chain), self.spec_names)
        self.spec_names.add(name)
        chain.data["name"] = name
        chain.spec = validate(chain.data)
        self.chains.append(chain)
        for n in chain.nodes:
            self.covered[n] = chain

    def _layer_name(self, chain: _Chain) -> str:
        where = chain.conv.target if chain.conv.op == "call_module" else chain.weight.path
        return sanitize(f"{self.name.lower()}_{where}", "layer")

    # -- growing a chain ----------------------------------------------------------------------

    def _extend(self, chain: _Chain) -> bool:
        """Add the next stage(s) to the chain; False (with chain.stop set) when it ends."""
        cur = chain.out
        users = value_users(cur)
        if any(u.op == "output" for u in users):
            chain.stop = chain.stop or f"{cur.name} is returned by the model"
            self._record(
                [u for u in users if u.op != "output"],
                f"its input {cur.name} is also returned by the model, so the fused chain ends at {cur.name}",
                subject=True,
            )
            return False
        region = self.regions.find(chain)
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
            if isinstance(desc, Reject):
                raise desc
            if isinstance(desc, ConvOp):
                chain.stop = f"{cur.name} feeds another convolution ({user.name})"
                return False
            if isinstance(desc, PW):
                raise Reject(chain.rejected.get(user, f"{self.describe(user)} does not fit the chain"))
            if getattr(desc, "input", None) is not cur:
                raise Reject(f"{self.describe(user)}: uses {cur.name} other than as its input")
            if isinstance(desc, PoolOp):
                self._take_pool(chain, user, desc)
            elif isinstance(desc, ReduceOp):
                self._take_reduce(chain, user, desc)
            elif isinstance(desc, (ShapeOp, IdentityOp)):
                self._take_view(chain, user, desc)
            else:
                raise Reject(f"{self.describe(user)} is not a supported op")
        except Reject as rej:
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
                raise Reject(f"the spec would not validate: {'; '.join(err.problems)}") from None
        view = shape_of(out)
        spec_out = spec.output_shape(chain.batch)
        if view is None or not same_layout(view, spec_out):
            raise Reject(f"the spec's output {list(spec_out)} does not match the model's {view}")
        if stages:
            chain.data = data
        chain.spec, chain.out, chain.view = spec, out, view
        chain.nodes.extend(nodes)

    def _take_pool(self, chain: _Chain, node: Node, desc: PoolOp) -> None:
        where = self.describe(node)
        if tuple(chain.view) != tuple(chain.spec_out) or len(chain.view) != desc.nd + 2 or desc.nd != chain.spec.ndim:
            raise Reject(f"{where}: pools over {desc.nd} spatial dims of a tensor shaped {list(chain.view)}")
        try:
            self._commit(chain, [desc.stage], [node], node)
        except Reject as rej:
            raise Reject(f"{where}: {rej.reason}") from None

    def _take_reduce(self, chain: _Chain, node: Node, desc: ReduceOp) -> None:
        where = self.describe(node)
        view, spec_out = tuple(chain.view), tuple(chain.spec_out)
        rank = len(view)
        dims = []
        for d in desc.dims:
            n = d + rank if d < 0 else d
            if not 0 <= n < rank:
                raise Reject(f"{where}: dim {d} is out of range")
            if n == 0:
                raise Reject(f"{where}: it reduces the batch dim (dim 0), which a spec never reduces")
            dims.append(n)
        if view == spec_out:
            spec_dims = sorted(set(dims))
        else:  # the model sees a view with other size-1 dims: map the dims of size > 1
            spec_dims = sorted({view_to_spec_dim(view, spec_out, d) for d in dims if view[d] != 1})
        nodes, out = [node], node
        if desc.tuple_out:  # (values, indices): the values only, and an unpacked but unused indices
            accessors = [u for u in node.users if is_values_accessor(u, node)]
            unused = [u for u in node.users if u not in accessors and is_accessor(u) and not u.users]
            if len(accessors) != 1 or len(accessors) + len(unused) != len(node.users):
                raise Reject(f"{where}: its indices are used (only the values of a (values, indices) result are fused)")
            nodes.extend([accessors[0], *unused])
            out = accessors[0]
        stages = [{desc.op: {"dims": spec_dims, "keepdim": desc.keepdim}}] if spec_dims else []
        try:
            self._commit(chain, stages, nodes, out)
        except Reject as rej:
            raise Reject(f"{where}: {rej.reason}") from None

    def _take_view(self, chain: _Chain, node: Node, desc) -> None:
        where = self.describe(node)
        shape = shape_of(node)
        if shape is None or dtype_of(node) != torch.float32:
            raise Reject(f"{where}: does not produce a float32 tensor")
        if isinstance(desc, IdentityOp) and tuple(shape) != tuple(chain.view):
            raise Reject(f"{where}: changes the shape")
        if not same_layout(shape, chain.view):
            raise Reject(
                f"{where}: reshapes {list(chain.view)} to {list(shape)}; only size-1 dims may be dropped, "
                f"inserted or merged (and the batch must stay dim 0)"
            )
        self._commit(chain, [], [node], node)

    # -- pointwise regions (found and written by exprs.Regions) -------------------------------

    def _take_region(self, chain: _Chain, exit_: Node, members: dict, deps: dict) -> bool:
        cur = chain.out
        prev = cur
        for cut in cut_points(cur, exit_, members, deps, self.order):
            segment = ancestors(cut, deps, stop=prev)
            saved = (dict(chain.names), dict(chain.tensors))
            try:
                stage = self.regions.stage(chain, prev, cut, segment, members)
                self._commit(chain, [stage], sorted(segment, key=self.order.get), cut)
            except Reject as rej:
                chain.names, chain.tensors = saved
                chain.stop = rej.reason
                self._record(sorted(segment, key=self.order.get), rej.reason, subject=True)
                return False
            prev = cut
        return True

    # -- the report ---------------------------------------------------------------------------

    def absorbed(self) -> set:
        """Nodes that only feed fused chains with parameter values: gone once the chains are fused."""
        dead: set[Node] = set()
        for node in reversed(self.nodes):
            if node in self.regions.leaf_nodes and node.users and all(u in self.covered or u in dead for u in node.users):
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
            m = recorded(node)
            if m is None or is_accessor(node):
                continue
            out.append(Fallback(node.name, self._reason(node)))
        return out

    def _reason(self, node: Node) -> str:
        if node in self.reasons:
            return self.reasons[node]
        desc = self.classify(node)
        if isinstance(desc, Reject):
            return desc.reason
        inputs = [a for a in node.all_input_nodes if recorded(a) is not None and a.op != "get_attr"]
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


# ---- the chain's start: the convolution --------------------------------------------------------


def _tensor_of(imp: Capture, value, what: str) -> Optional[TensorRef]:
    if value is None or isinstance(value, TensorRef):
        return value
    if isinstance(value, Node) and value.op == "get_attr":
        obj = imp.fetch(value.target)
        if isinstance(obj, torch.Tensor):
            return TensorRef(value.target, obj, tuple(obj.shape))
    raise Reject(f"the {what} is computed in forward; only a parameter or buffer of the model can be shared")


def _start(imp: Analysis, conv: Node, desc: ConvOp) -> _Chain:
    """A chain of the convolution alone (its spec has no stage yet), or a Reject saying why the
    convolution cannot start one."""
    where = imp.describe(conv)
    inp = desc.input
    in_shape = shape_of(inp) if isinstance(inp, Node) else None
    if in_shape is None:
        raise Reject(f"{where}: its input is not a tensor value of the graph")
    if dtype_of(inp) != torch.float32:
        raise Reject(f"{where}: the input is {dtype_of(inp)}; only float32 layers are fused")
    if len(in_shape) != desc.nd + 2:
        raise Reject(f"{where}: the input has shape {list(in_shape)}; a batched input [N, C, ...] is needed")
    try:
        weight = _tensor_of(imp, desc.weight, "weight")
        bias = _tensor_of(imp, desc.bias, "bias")
    except Reject as rej:
        raise Reject(f"{where}: {rej.reason}") from None
    for t in (weight, bias):
        if t is not None and t.tensor.dtype != torch.float32:
            raise Reject(f"{where}: the {t.path} is {t.tensor.dtype}; only float32 layers are fused")
    kernel = list(weight.shape[2:])
    if len(weight.shape) != desc.nd + 2:
        raise Reject(f"{where}: the weight has shape {list(weight.shape)}")
    try:
        stride = ints(desc.stride, "stride")
        dilation = ints(desc.dilation, "dilation")
        if desc.transposed:
            padding = ints(desc.padding, "padding")
            output_padding = ints(desc.output_padding, "output_padding")
        else:
            padding = _padding(desc.padding, kernel, stride, dilation, desc.nd)
    except Reject as rej:
        raise Reject(f"{where}: {rej.reason}") from None
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
        raise Reject(f"{where}: the spec would not validate: {'; '.join(err.problems)}") from None
    chain = _Chain(conv, desc, data, spec, batch=in_shape[0], nodes=[conv], out=conv, weight=weight, bias=bias)
    chain.view = shape_of(conv)
    if chain.view is None or tuple(chain.view) != tuple(chain.spec_out):
        raise Reject(f"{where}: the spec's output {list(chain.spec_out)} differs from the model's {chain.view}")
    return chain


def _padding(padding, kernel, stride, dilation, nd):
    if padding == "valid":
        return 0
    if padding == "same":
        if any(s != 1 for s in (stride if isinstance(stride, list) else [stride])):
            raise Reject("padding='same' needs stride 1")
        dil = dilation if isinstance(dilation, list) else [dilation] * nd
        totals = [d * (k - 1) for d, k in zip(dil, kernel)]
        if any(t % 2 for t in totals):
            raise Reject("padding='same' with an even kernel span pads unevenly, which a spec cannot say")
        return [t // 2 for t in totals]
    return ints(padding, "padding")

