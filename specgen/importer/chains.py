"""Chains: each convolution starts one, which grows while the next node is something a spec can
say (a pointwise region, a pool, a reduction, a shape or identity op), and ends at a value used
more than once (or returned), at an op outside the vocabulary, or where the spec would not
validate. Every node left running as PyTorch gets its reason here."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn as nn
from torch.fx import Node

from specgen import ops, tmarun
from specgen.importer.exprs import Regions, ancestors, cut_points
from specgen.importer.graph import (
    CONV_MODULE_KEY,
    Capture,
    dtype_of,
    is_accessor,
    is_values_accessor,
    merged_dims,
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
    Counter,
    Dim1,
    IdentityOp,
    LinearOp,
    NormOp,
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

# A chain's dtype -> its spec's precision (None: float32, whose precision the caller or cuDNN's TF32 flag decides).
PRECISION_OF = {torch.float32: None, torch.bfloat16: "bf16", torch.float16: "fp16"}

_SAME = object()  # _commit's default permutation: the chain's value's


def _inverse(perm: tuple) -> tuple:
    """The permutation that undoes `perm` (x.permute(*perm).permute(*_inverse(perm)) is x)."""
    return tuple(perm.index(d) for d in range(len(perm)))


class _OtherLinear(Reject):
    """A Linear over a 2-D value (a classifier's over [N, features]): PyTorch's, said in the report
    but not warned about."""


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
    inputs: dict = field(default_factory=dict)  # spec extra input name -> the model's node that computes it
    stop: Optional[str] = None  # why the chain ended
    rejected: dict = field(default_factory=dict)  # node -> why it did not join
    dtype: object = None  # the chain's dtype: float32, bfloat16 or float16 (every value of it)
    # how its training-mode batch norms with running statistics take their mode: None (it has none),
    # "module" (the layer's mode: after .eval() the running statistics) or "call" (F.batch_norm's
    # training=True: the batch's statistics in either mode)
    mode: Optional[str] = None
    # the chain's own values that a save stage names, in chain order: node -> (name, the chain's
    # state before the save, to go back to where a use of the value does not join the chain after all)
    saves: dict = field(default_factory=dict)
    # the value the fused layer reads: the conv's input, or the input of a nearest upsample taken
    # into the conv (`conv.upsample`)
    source: Optional[Node] = None
    # the dims order the model reads the fused layer's output in, where a stage's output stays
    # permuted (ConvNeXt's LayerNorm over the channels, whose output feeds Linear layers
    # channels-last): the rewrite permutes the fused output so; None: as the spec lays it out
    out_perm: Optional[tuple] = None
    # the dims order that makes the fused layer's input from `input_node`: a Linear's chain reads
    # the [N, H, W, C] value it is applied to as [N, C, H, W] (x.permute(0, 3, 1, 2)); None: as it is
    in_perm: Optional[tuple] = None
    # a Linear's chain over tokens: the model's value is [N, L, C], which the spec holds as the 2-D
    # [N, C, L, 1] (the Linear a 1x1 conv over L x 1 positions); the fused layer reads the value
    # unsqueezed at dim -2, then permuted by `in_perm`, and the model sees the output permuted by
    # `out_perm` with that unit dim dropped again
    tokens: bool = False
    # an extra input the model holds as the chain value permuted (a transformer's residual added
    # to a Linear's output over tokens) -> the tensor methods that make the fused layer's input from
    # it (`permuted_back_steps` when it joined); an extra input not here is read as it is
    input_steps: dict = field(default_factory=dict)

    @property
    def linear(self) -> bool:
        """Started by a Linear: the fused layer's weight is the Linear's [C_out, C_in] (a conv's never 2-D)."""
        return len(self.weight.shape) == 2

    @property
    def model_view(self) -> tuple:
        """The shape of `out` as the model sees it (`view` permuted by `out_perm`; over tokens, the
        spec's unit W dropped)."""
        view = tuple(self.view)
        if self.out_perm is not None:
            view = tuple(view[d] for d in self.out_perm)
        return view[:-2] + view[-1:] if self.tokens else view

    def spec_order(self, shape, perm=_SAME) -> tuple:
        """`shape`, a shape as the model sees the chain's value (or one that broadcasts against it,
        aligned to its last dims), in the spec's dims order: the unit W put back where the value is
        tokens, the permutation `perm` (by default `out_perm`) undone."""
        perm = self.out_perm if perm is _SAME else perm
        if perm is None:
            return tuple(shape)
        aligned = (1,) * (len(perm) - self.tokens - len(shape)) + tuple(shape)
        if self.tokens:
            aligned = aligned[:-1] + (1,) + aligned[-1:]
        return tuple(aligned[i] for i in _inverse(perm))

    def _to_spec_layout(self, perm: tuple) -> list:
        """The tensor methods, with their arguments, that lay a value the model holds out as the
        spec does: tokens' unit W put in (an unsqueeze), then `perm`."""
        return ([("unsqueeze", (-2,))] if self.tokens else []) + [("permute", perm)]

    def read_steps(self) -> list:
        """The tensor methods that make the fused layer's input from the value it reads
        (`input_node`): none, or a Linear's (`in_perm`)."""
        return [] if self.in_perm is None else self._to_spec_layout(self.in_perm)

    def permuted_back_steps(self) -> list:
        """The tensor methods that make a tensor shaped as the model holds the chain value now
        (`model_view`) into the spec's layout (`out_perm` undone)."""
        return self._to_spec_layout(_inverse(self.out_perm))

    def out_steps(self) -> list:
        """The tensor methods, with their arguments, that make the model's view of the fused layer's
        output (after any reshape to `view`): its permute (`out_perm`), tokens' unit W squeezed."""
        if self.out_perm is None:
            return []
        return [("permute", self.out_perm)] + ([("squeeze", (-2,))] if self.tokens else [])

    @property
    def input_node(self) -> Node:
        if self.source is not None:
            return self.source
        return self.conv.args[0] if self.conv.args else self.conv.kwargs["input"]

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

    def __init__(self, model: nn.Module, inputs: tuple, precision: Optional[str] = None):
        # The precision of float32 chains: the caller's, else what cuDNN would do (TF32 when allowed).
        self.precision32 = precision or ("tf32" if torch.backends.cudnn.allow_tf32 else "fp32")
        # A Linear's (a 1x1 conv over channels-last values): what cuBLAS would do, whose TF32 flag
        # is off by default (nn.Linear is then plain fp32, as the fp32 mode's 3xTF32 is)
        self.precision_linear = precision or ("tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32")
        super().__init__(model, inputs)
        recognizer = Recognizer(self.gm)
        self.describe, self.classify = recognizer.describe, recognizer.classify
        self.size_nodes = recognizer.size_nodes  # sizes read as numbers: erased with the chains that read them
        self.covered: dict[Node, _Chain] = {}
        self.regions = Regions(self)
        self.chains: list[_Chain] = []
        self.reasons: dict[Node, str] = {}
        self.warn: set[Node] = set()  # fallbacks about a convolution chain (logged as warnings)
        self.spec_names: set[str] = set()
        self.layers: dict = {}  # id(chain) -> its fused layer, once built (measuring and rewriting share it)
        self.standalone_choices: list = []  # the joins' and pools' Choices, once the fused graph is written
        # The example inputs arrive channels-last (from_module's channels-last candidate): each
        # chain is timed on channels-last inputs, as it will run.
        self.channels_last = any(isinstance(t, torch.Tensor) and tmarun.channels_last_format(t.dim()) is not None
                                 and tmarun.channels_last(t) for t in inputs)

    def analyze(self) -> None:
        """Start a chain at every convolution not already in one, and grow it."""
        for node in self.nodes:
            if node.op in ("call_module", "call_function") and node not in self.covered:
                desc = self.classify(node)
                if isinstance(desc, (ConvOp, LinearOp)):
                    self._chain(node, desc)

    def _record(self, nodes, reason: str, subject: bool = False) -> None:
        """Remember why `nodes` do not join a chain (with each node's description first if `subject`)."""
        for n in nodes:
            if n.op != "output" and not isinstance(self.classify(n), ConvOp):
                self.reasons.setdefault(n, f"{self.describe(n)}: {reason}" if subject else reason)
                self.warn.add(n)

    def _chain(self, conv: Node, desc) -> None:
        try:
            chain = _start_linear(self, conv, desc) if isinstance(desc, LinearOp) else _start(self, conv, desc)
        except Reject as rej:
            self.reasons[conv] = rej.reason
            if not isinstance(rej, _OtherLinear):
                self.warn.add(conv)
            return
        while self._extend(chain):
            pass
        self._settle_saves(chain)
        if not chain.stages and not _alone_pays(chain):
            why = chain.stop or "its output is not followed by a fusable op"
            what = "Linear" if chain.linear else "convolution"
            self.reasons[conv] = f"{self.describe(conv)}: nothing to fuse after this {what}: {why}"
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
        where = chain.conv.target if chain.conv.op == "call_module" else \
            chain.conv.meta.get(CONV_MODULE_KEY, chain.weight.path)
        return sanitize(f"{self.prefix}_{where}", "layer")

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
        if chain.out_perm is not None:
            return self._extend_permuted(chain, users)
        taken = [u for u in users if u in self.covered]
        if taken:  # another chain took it, with this value as its extra input
            chain.stop = f"{cur.name} is an extra input of the fused chain {self.covered[taken[0]].spec.name}"
            return False
        written = self._written_layer_norm(chain, cur, users)
        if written is not None:
            try:
                self._take_written_layer_norm(chain, *written)
            except Reject as rej:
                chain.stop = rej.reason
                self._record(written[0], rej.reason)
                return False
            return True
        centered = self._centering(cur, users)
        if centered is not None:
            try:
                self._take_center(chain, *centered)
            except Reject as rej:
                chain.stop = rej.reason
                self._record(list(centered[:2]), rej.reason)
                return False
            return True
        if len(users) > 1 and self._save_for_norm(chain, cur, users):
            return True
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
        channels_ln = self._channels_layer_norm(chain, user)
        if channels_ln is not None:
            try:
                self._take_channels_layer_norm(chain, user, *channels_ln)
            except Reject as rej:
                chain.stop = rej.reason
                self._record([n for n in (user, *channels_ln[::2]) if n is not None], rej.reason)
                return False
            if channels_ln[2] is None:  # (its output stays channels-last: nothing after it joins)
                chain.stop = (f"{self.describe(channels_ln[0])}'s output stays channels-last (no permute back after it): "
                              f"the fused chain ends there, its output permuted as the model reads it")
                return False
            return True
        desc = self.classify(user)
        try:
            if isinstance(desc, Reject):
                raise desc
            if isinstance(desc, (ConvOp, LinearOp)):
                chain.stop = f"{cur.name} feeds another {'convolution' if isinstance(desc, ConvOp) else 'Linear'} ({user.name})"
                return False
            if isinstance(desc, PW):
                raise Reject(chain.rejected.get(user, f"{self.describe(user)} does not fit the chain"))
            if getattr(desc, "input", None) is not cur:
                raise Reject(f"{self.describe(user)}: uses {cur.name} other than as its input")
            if isinstance(desc, PoolOp):
                self._take_pool(chain, user, desc)
            elif isinstance(desc, ReduceOp):
                self._take_reduce(chain, user, desc)
            elif isinstance(desc, NormOp):
                self._take_norm(chain, user, desc)
            elif isinstance(desc, ShapeOp) and self._flattened_norm(chain, user):
                self._take_flattened_norm(chain, user)
            elif isinstance(desc, (ShapeOp, IdentityOp)):
                self._take_view(chain, user, desc)
            else:
                raise Reject(f"{self.describe(user)} is not a supported op")
        except Reject as rej:
            chain.stop = rej.reason
            self._record([user], rej.reason)
            return False
        return True

    def _extend_permuted(self, chain: _Chain, users: list) -> bool:
        """The next step of a chain whose value the model holds permuted (a Linear's output, channels
        last): pointwise regions were tried first (their per-channel operands along the last dim);
        the permute back joins as a view, after which the chain goes on as any other; anything else
        ends it, its output permuted as the model reads it."""
        cur = chain.out
        if len(users) == 1 and users[0].op != "output" and users[0].args[:1] == (cur,) \
                and _permutation(users[0], len(chain.out_perm)) == _inverse(chain.out_perm):
            self._commit(chain, [], [users[0]], users[0], perm=None)
            return True
        desc = self.classify(users[0]) if len(users) == 1 else None
        if len(users) == 1 and users[0] in chain.rejected:  # (a pointwise op that could not join: why)
            chain.stop = chain.rejected[users[0]]
            self._record(users, chain.stop)
        elif isinstance(desc, (ConvOp, LinearOp)):
            chain.stop = f"{cur.name} feeds another {'convolution' if isinstance(desc, ConvOp) else 'Linear'} ({users[0].name})"
        elif chain.tokens:
            chain.stop = (f"{cur.name} holds tokens ({list(chain.model_view)}): after a Linear over them only pointwise "
                          f"ops join the fused chain")
        else:
            chain.stop = (f"{cur.name} is channels-last ({list(chain.model_view)}): after pointwise ops only its "
                          f"permute back to [N, C, ...] joins the fused chain, which ends there, its output permuted "
                          f"as the model reads it")
        return False

    def _commit(self, chain: _Chain, stages: list, nodes: list, out: Node, check=None, perm=_SAME) -> None:
        """Add `stages` (covering `nodes`, ending at `out`) to the chain; `check(spec)` may refuse
        the spec they make before anything changes. `perm`: `out` is the chain's value permuted so
        (`_Chain.out_perm`; by default as the chain's value before them was)."""
        if perm is _SAME:
            perm = chain.out_perm
        spec = chain.spec
        if stages:
            data = {**chain.data, "epilogue": chain.stages + stages}
            try:
                spec = validate(data)
            except SpecError as err:
                raise Reject(f"the spec would not validate: {'; '.join(err.problems)}") from None
            if spec.inputs() and not chain.spec.inputs():
                _check_input_engine(spec)
            if check is not None:
                check(spec)
        view = shape_of(out)
        if view is not None and perm is not None:  # (the value before the permute: out's dim k is its dim perm[k])
            view = chain.spec_order(view, perm)
        spec_out = spec.output_shape(chain.batch)
        if view is None or not same_layout(view, spec_out):
            raise Reject(f"the spec's output {list(spec_out)} does not match the model's {view}")
        if stages:
            chain.data = data
        chain.spec, chain.out, chain.view = spec, out, view
        chain.out_perm = perm
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
        if shape is None or dtype_of(node) != chain.dtype:
            raise Reject(f"{where}: does not produce a {chain.dtype} tensor")
        if isinstance(desc, IdentityOp) and tuple(shape) != tuple(chain.view):
            raise Reject(f"{where}: changes the shape")
        if not same_layout(shape, chain.view):
            raise Reject(
                f"{where}: reshapes {list(chain.view)} to {list(shape)}; only size-1 dims may be dropped, "
                f"inserted or merged (and the batch must stay dim 0)"
            )
        self._commit(chain, [], [node], node)

    # -- a value used again after a statistic stage: x + f(norm(x)) ---------------------------

    def _save_for_norm(self, chain: _Chain, cur: Node, users: list) -> bool:
        """Where `cur` feeds one statistic stage and pointwise ops after it (a residual around a
        norm, as in `x = conv(x); y = f(group_norm(x)); x + y`), a save stage names it and the
        chain goes on through the norm; the pointwise ops read it as `{saved: name}`. False (and
        nothing changed) where the pattern does not hold."""
        descs = {u: self.classify(u) for u in users}
        norms = [u for u in users if isinstance(descs[u], NormOp) and descs[u].input is cur]
        if len(norms) != 1 or cur in chain.saves:
            return False
        norm = norms[0]
        if not all(isinstance(descs[u], PW) and self.order[u] > self.order[norm] for u in users if u is not norm):
            return False
        name = unique(sanitize(f"{cur.name}_saved", "saved"), set(chain.tensors) | set(chain.inputs) | {n for n, _ in chain.saves.values()})
        state = self._snapshot(chain)
        try:
            self._commit(chain, [{"save": name}], [], cur)
            self._take_norm(chain, norm, descs[norm])
        except Reject:
            self._restore(chain, state)
            return False
        chain.saves[cur] = (name, state)
        return True

    @staticmethod
    def _snapshot(chain: _Chain) -> tuple:
        """What `_restore` brings back: the chain as it is now."""
        return (dict(chain.data), chain.spec, chain.out, chain.view, len(chain.nodes), dict(chain.names),
                dict(chain.tensors), dict(chain.inputs), chain.mode, chain.stop)

    def _restore(self, chain: _Chain, state: tuple) -> None:
        (chain.data, chain.spec, chain.out, chain.view, n, chain.names, chain.tensors, chain.inputs,
         chain.mode, chain.stop) = state
        del chain.nodes[n:]

    def _settle_saves(self, chain: _Chain) -> None:
        """A saved value whose every use joined the chain stays inside it; otherwise the chain goes
        back to end at that value (a fused chain's inner values are not the model's to read). Going
        back drops the later saves and may drop an earlier value's use: checked again until none is
        left outside."""
        while True:
            covered = set(chain.nodes)
            for k, (node, (_, state)) in enumerate(chain.saves.items()):
                outside = [u for u in value_users(node) if u not in covered]
                if outside:
                    break
            else:
                return
            self._restore(chain, state)
            chain.saves = dict(list(chain.saves.items())[:k])
            users = value_users(node)
            chain.stop = f"{node.name} is used by {len(users)} nodes ({', '.join(u.name for u in users)})"
            self._record(outside, f"its input {node.name} is used again after a statistic stage, where the fused "
                                  f"chain could not take that use", subject=True)

    # -- statistic stages: normalizations and softmax ------------------------------------------

    def _take_norm(self, chain: _Chain, node: Node, desc: NormOp, nodes=None, dims=None) -> None:
        """A statistic stage at `node`; `dims` (the dims of the chain's view it normalizes over)
        where a flattening view before it decided them, and `nodes` then the views around it."""
        where = self.describe(node)
        saved = (dict(chain.names), dict(chain.tensors), dict(chain.inputs))
        try:
            if dtype_of(node) != chain.dtype:
                raise Reject(f"produces {dtype_of(node)}, the chain is {chain.dtype}")
            view, spec_out = tuple(chain.view), tuple(chain.spec_out)
            attrs = dict(desc.attrs)
            if desc.dims is not None:
                attrs["dim"] = _spec_dims(view, spec_out, desc.dims if dims is None else dims)
            elif view != spec_out:
                raise Reject(f"it normalizes the value shaped {list(view)}, which the spec holds as {list(spec_out)}")
            names = [self._norm_operand(chain, value, desc.operands) for value in desc.operands]
            args = ops.NORMS[desc.op].args.from_operands(tuple(names), attrs)
            if args is None:  # pragma: no cover - the builders give what from_operands takes
                raise Reject(f"its tensors do not make a {desc.op} stage")
            mode = _mode(chain, desc, args)
            self._commit(chain, [{desc.op: args}], nodes or [node], node if nodes is None else nodes[-1],
                         check=lambda spec: self._check_norm(chain, spec))
            chain.mode = mode
        except Reject as rej:
            chain.names, chain.tensors, chain.inputs = saved
            raise Reject(f"{where}: {rej.reason}") from None

    def _norm_operand(self, chain: _Chain, value, operands: tuple) -> Optional[ops.Param]:
        """A statistic stage's tensor, named in the chain: a per-channel one (Dim1), a batch counter,
        or one used whole (a layer norm's weight, of its normalized shape)."""
        if value is None:
            return None
        if isinstance(value, Counter):
            return ops.Param(self._counter(chain, value.value, operands))
        if isinstance(value, Dim1):
            ref = self.regions.leaf(chain, value)
        else:
            ref = self.regions.whole(chain, value)
        return ops.Param(self.regions.param_name(chain, ref))

    def _counter(self, chain: _Chain, value, operands: tuple) -> str:
        """The name of a batch norm's num_batches_tracked: the model's buffer, or (F.batch_norm, which
        counts nothing) a new one of the fused layer, named after the running mean."""
        if value is not None:
            ref = self.regions.whole(chain, value, dtype=torch.int64)
            if ref.tensor.dim() != 0:
                raise Reject(f"{ref.path} has shape {list(ref.tensor.shape)}; a batch counter is a 0-dim int64 tensor")
            return self.regions.param_name(chain, ref)
        mean = self.regions.leaf(chain, operands[0])
        counter = torch.zeros((), dtype=torch.int64, device=mean.tensor.device)
        base = mean.path.replace("running_mean", "num_batches_tracked")
        path = base if base != mean.path else f"{mean.path}_num_batches_tracked"
        return self.regions.param_name(chain, TensorRef(path, counter, ()))

    def _check_norm(self, chain: _Chain, spec: LayerSpec) -> None:
        """The spec with a statistic stage: each tensor the model holds has the values the spec
        gives it, and the layer can be planned in its precision (the tail engine computes in float32)."""
        wanted = {**spec.params(), **{name: shape for name, (shape, _, _) in spec.buffers().items()}}
        for name, tensor in chain.tensors.items():
            if name in wanted and tensor.numel() not in (1, math.prod(wanted[name])):  # a scalar: expanded
                raise Reject(f"{name} has shape {list(tensor.shape)}, the spec wants {list(wanted[name])}")
        if spec.precision in ("bf16", "fp16"):
            try:  # (on the GPU it will run on: a softmax over the channels is fused in 16 bits on Hopper only)
                _plan_here(spec)
            except SpecError as err:
                raise Reject(f"a {spec.precision} layer with it cannot be planned: {'; '.join(err.problems)}") from None

    def _flattened_norm(self, chain: _Chain, node: Node) -> bool:
        """Whether `node` flattens dims of the chain's value for a softmax over them that a view
        back to the chain's shape follows (x.view(b, c, -1), softmax(dim=2), .view(b, c, d, h, w))."""
        shape = shape_of(node)
        if shape is None or same_layout(shape, chain.view) or merged_dims(chain.view, shape) is None:
            return False
        users = value_users(node)
        if len(users) != 1 or users[0].op == "output":
            return False
        desc = self.classify(users[0])
        if not isinstance(desc, NormOp) or desc.dims is None or desc.input is not node:
            return False
        after = value_users(users[0])
        if len(after) != 1 or after[0].op == "output":
            return False
        back = self.classify(after[0])
        shape = shape_of(after[0])
        return isinstance(back, ShapeOp) and back.input is users[0] and shape is not None and same_layout(shape, chain.view)

    def _take_flattened_norm(self, chain: _Chain, node: Node) -> None:
        """The three nodes _flattened_norm found as one stage over the dims the view merged."""
        flat = shape_of(node)
        groups = merged_dims(chain.view, flat)
        norm = value_users(node)[0]
        back = value_users(norm)[0]
        desc = self.classify(norm)
        dims = []
        for d in desc.dims:
            n = d + len(flat) if isinstance(d, int) and d < 0 else d
            if not isinstance(n, int) or not 0 <= n < len(flat):
                raise Reject(f"{self.describe(norm)}: dim {d} is out of range for a tensor shaped {list(flat)}")
            lo, hi = groups[n]
            dims.extend(range(lo, hi + 1))
        self._take_norm(chain, norm, desc, nodes=[node, norm, back], dims=dims)

    # -- a LayerNorm over the channels: the channels moved last, LayerNorm(C), moved back ------------

    def _channels_layer_norm(self, chain: _Chain, node: Node):
        """(the LayerNorm, its description, the permute back) where `node` moves the chain's channels
        last (x.permute(0, 2, 3, 1), x.movedim(1, -1)), its only user is a LayerNorm over that dim
        alone and the LayerNorm's only user moves them back: ConvNeXt's channels-first LayerNorm,
        timm's LayerNorm2d; the permute back None where the LayerNorm's output stays channels-last
        (ConvNeXt's block: Linear layers read it); else None."""
        view = tuple(chain.view)
        rank = len(view)
        if rank < 3 or _permutation(node, rank) != (0, *range(2, rank), 1):
            return None
        users = value_users(node)
        if len(users) != 1 or users[0].op == "output":
            return None
        desc = self.classify(users[0])
        if not isinstance(desc, NormOp) or desc.op != "layer_norm" or desc.input is not node:
            return None
        if [int(n) for n in desc.attrs.get("normalized_shape", ())] != [view[1]]:
            return None
        after = value_users(users[0])
        if len(after) != 1 or after[0].op == "output" or after[0].args[0] is not users[0] \
                or _permutation(after[0], rank) != (0, rank - 1, *range(1, rank - 1)):
            return users[0], desc, None  # (its output stays channels-last: ConvNeXt's block, Linear layers after it)
        return users[0], desc, after[0]

    def _take_channels_layer_norm(self, chain: _Chain, node: Node, norm: Node, desc: NormOp, back: Optional[Node]) -> None:
        """The nodes _channels_layer_norm found as one layer_norm_channels stage (without a permute
        back, the chain's output is the LayerNorm's, permuted channels-last: `_Chain.out_perm`)."""
        where = self.describe(norm)
        saved = (dict(chain.names), dict(chain.tensors), dict(chain.inputs))
        last = back if back is not None else norm
        try:
            if dtype_of(last) != chain.dtype:
                raise Reject(f"produces {dtype_of(last)}, the chain is {chain.dtype}")
            if tuple(chain.view) != tuple(chain.spec_out):
                raise Reject(f"it normalizes the value shaped {list(chain.view)}, which the spec holds as {list(chain.spec_out)}")
            names = [self._norm_operand(chain, value, desc.operands) for value in desc.operands]
            args = ops.NORMS["layer_norm_channels"].args.from_operands(tuple(names), {"eps": desc.attrs.get("eps", 1e-5)})
            if args is None:  # pragma: no cover - the builders give what from_operands takes
                raise Reject("its tensors do not make a layer_norm_channels stage")
            rank = len(chain.view)
            self._commit(chain, [{"layer_norm_channels": args}], [n for n in (node, norm, back) if n is not None], last,
                         check=lambda spec: self._check_norm(chain, spec),
                         perm=None if back is not None else (0, *range(2, rank), 1))
        except Reject as rej:
            chain.names, chain.tensors, chain.inputs = saved
            raise Reject(f"{where}: {rej.reason}") from None

    # -- a LayerNorm over the channels written out: mean, squared deviations, sqrt -------------------

    def _written_layer_norm(self, chain: _Chain, cur: Node, users: list):
        """(the nodes, the output node, eps) where `cur`'s users compute a LayerNorm over the channels
        written out, as ConvNeXt's reference code, SAM's and detectron2's LayerNorm2d write it:
        u = x.mean(1, keepdim=True); s = (x - u).pow(2).mean(1, keepdim=True); (x - u) / torch.sqrt(s + eps)
        (x - u once or twice; its square as pow(2), ** 2, square() or a product with itself; or
        torch.rsqrt(s + eps) * (x - u)); else None. Nothing of it may be used elsewhere."""
        rank = len(chain.view)
        if rank < 3:
            return None

        def pw(node, op):
            desc = self.classify(node)
            return desc if isinstance(desc, PW) and desc.op == op and not desc.inplace else None

        def only_user(node):
            found = value_users(node)
            return found[0] if len(found) == 1 and found[0].op != "output" else None

        def channel_mean(node, of):
            red = self.classify(node)
            return (isinstance(red, ReduceOp) and red.op == "mean" and red.input is of and red.keepdim
                    and not red.tuple_out and [d % rank for d in red.dims if isinstance(d, int)] == [1]
                    and len(red.dims) == 1)

        means = [u for u in users if channel_mean(u, cur)]
        if len(means) != 1:
            return None
        u = means[0]
        subs = [s for s in users if s is not u and (d := pw(s, "sub")) is not None and tuple(d.operands[:2]) == (cur, u)]
        if not subs or len(subs) > 2 or len(subs) + 1 != len(users) or set(value_users(u)) != set(subs):
            return None
        # the variance: one deviation squared, then its mean over the channels
        for d_v in subs:
            d_users = value_users(d_v)
            squares = [q for q in d_users if ((p := pw(q, "pow")) is not None and tuple(p.operands) == (d_v,)
                                              and p.attrs.get("exponent") == 2)
                       or ((m := pw(q, "mul")) is not None and tuple(m.operands) == (d_v, d_v))]
            if len(squares) == 1:
                break
        else:
            return None
        q = squares[0]
        v = only_user(q)
        if v is None or not channel_mean(v, q):
            return None
        ve = only_user(v)
        add = pw(ve, "add") if ve is not None else None
        if add is None or len(add.operands) != 2 or v not in add.operands:
            return None
        eps = add.operands[1] if add.operands[0] is v else add.operands[0]
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
            return None
        root = only_user(ve)
        if root is None:
            return None
        out = only_user(root)
        if out is None:
            return None
        if pw(root, "sqrt") is not None and (div := pw(out, "div")) is not None and len(div.operands) == 2 \
                and div.operands[1] is root:
            d_n = div.operands[0]
        elif pw(root, "rsqrt") is not None and (mul := pw(out, "mul")) is not None and len(mul.operands) == 2 \
                and root in mul.operands:
            d_n = mul.operands[1] if mul.operands[0] is root else mul.operands[0]
        else:
            return None
        if d_n not in subs:
            return None
        if {n for s in subs for n in value_users(s)} != {q, out}:  # the deviations: read by these two alone
            return None
        nodes = sorted({u, *subs, q, v, ve, root, out}, key=self.order.get)
        return nodes, out, float(eps)

    def _take_written_layer_norm(self, chain: _Chain, nodes: list, out: Node, eps: float) -> None:
        where = self.describe(out)
        if dtype_of(out) != chain.dtype or tuple(shape_of(out) or ()) != tuple(chain.view):
            raise Reject(f"{where}: does not produce the chain's {chain.dtype} value of shape {list(chain.view)}")
        if tuple(chain.view) != tuple(chain.spec_out):
            raise Reject(f"{where}: it normalizes the value shaped {list(chain.view)}, which the spec holds as "
                         f"{list(chain.spec_out)}")
        try:
            self._commit(chain, [{"layer_norm_channels": {"eps": eps, "elementwise_affine": False}}], nodes, out,
                         check=lambda spec: self._check_norm(chain, spec))
        except Reject as rej:
            raise Reject(f"{where}: {rej.reason}") from None

    # -- centering: x - x.mean(dims, keepdim=True) ----------------------------------------------

    def _centering(self, cur: Node, users: list):
        """(the mean, the subtraction, the mean's reduction) where `cur`'s only users are a mean of
        it with keepdim and the subtraction of that mean from it; else None."""
        if len(users) != 2:
            return None
        for mean, sub in (users, users[::-1]):
            red, pw = self.classify(mean), self.classify(sub)
            if not (isinstance(red, ReduceOp) and red.op == "mean" and red.input is cur and not red.tuple_out):
                continue
            if isinstance(pw, PW) and pw.op == "sub" and not pw.inplace and tuple(pw.operands[:2]) == (cur, mean) \
                    and value_users(mean) == [sub]:
                return mean, sub, red
        return None

    def _take_center(self, chain: _Chain, mean: Node, sub: Node, red: ReduceOp) -> None:
        where = self.describe(mean)
        if not red.keepdim:
            raise Reject(f"{where}: x - x.mean(dims) without keepdim=True broadcasts the mean against other dims")
        if dtype_of(sub) != chain.dtype or tuple(shape_of(sub) or ()) != tuple(chain.view):
            raise Reject(f"{self.describe(sub)}: does not produce the chain's {chain.dtype} value of shape {list(chain.view)}")
        try:
            dims = _spec_dims(tuple(chain.view), tuple(chain.spec_out), list(red.dims))
            self._commit(chain, [{"center": {"dim": dims}}], [mean, sub], sub,
                         check=lambda spec: self._check_norm(chain, spec))
        except Reject as rej:
            raise Reject(f"{where}: {rej.reason}") from None

    # -- pointwise regions (found and written by exprs.Regions) -------------------------------

    def _take_region(self, chain: _Chain, exit_: Node, members: dict, deps: dict) -> bool:
        cur = chain.out
        prev = cur
        for cut in cut_points(cur, exit_, members, deps, self.order):
            segment = ancestors(cut, deps, stop=prev)
            saved = (dict(chain.names), dict(chain.tensors), dict(chain.inputs))
            try:
                stage = self.regions.stage(chain, prev, cut, segment, members)
                self._commit(chain, [] if stage is None else [stage], sorted(segment, key=self.order.get), cut)
            except Reject as rej:
                chain.names, chain.tensors, chain.inputs = saved
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
        chain = self.covered.get(source)
        if chain is not None and chain.stop:  # (its input is a fused chain's output: why the chain ended there)
            return f"{self.describe(node)}: the fused chain {chain.spec.name} ends before it: {chain.stop}"
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


def _weight_and_bias(imp: Analysis, desc, where: str, dtype) -> tuple[TensorRef, Optional[TensorRef]]:
    """The layer's weight and bias (None without one), tensors of the model of the input's dtype."""
    try:
        weight = _tensor_of(imp, desc.weight, "weight")
        bias = _tensor_of(imp, desc.bias, "bias")
    except Reject as rej:
        raise Reject(f"{where}: {rej.reason}") from None
    for t in (weight, bias):
        if t is not None and t.tensor.dtype != dtype:
            raise Reject(f"{where}: the {t.path} is {t.tensor.dtype}, the input {dtype}; a layer's tensors share one dtype")
    return weight, bias


def _start(imp: Analysis, conv: Node, desc: ConvOp) -> _Chain:
    """A chain of the convolution alone (its spec has no stage yet), or a Reject saying why the
    convolution cannot start one."""
    where = imp.describe(conv)
    inp = desc.input
    in_shape = shape_of(inp) if isinstance(inp, Node) else None
    if in_shape is None:
        raise Reject(f"{where}: its input is not a tensor value of the graph")
    dtype = dtype_of(inp)
    if dtype not in PRECISION_OF:
        raise Reject(f"{where}: the input is {dtype}; only float32, bfloat16 and float16 layers are fused")
    if len(in_shape) != desc.nd + 2:
        raise Reject(f"{where}: the input has shape {list(in_shape)}; a batched input [N, C, ...] is needed")
    weight, bias = _weight_and_bias(imp, desc, where, dtype)
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
        # 16-bit layers run in their dtype; float32 ones as PyTorch would run them (TF32 where
        # cuDNN may use it), unless the caller said otherwise
        "precision": PRECISION_OF[dtype] or imp.precision32,
    }
    if desc.transposed:
        data["conv"].update(transposed=True, output_padding=output_padding)
    try:
        spec = validate(data)
    except SpecError as err:
        raise Reject(f"{where}: the spec would not validate: {'; '.join(err.problems)}") from None
    chain = _Chain(conv, desc, data, spec, batch=in_shape[0], nodes=[conv], out=conv, weight=weight, bias=bias, dtype=dtype)
    up = None if desc.transposed else _nearest_upsample(imp, inp)
    if up is not None:  # the conv reads a nearest upsample of a value: the upsample joins the chain
        source, scales = up
        folded = {**data, "input": {"channels": in_shape[1], "size": list(shape_of(source)[2:])},
                  "conv": {**data["conv"], "upsample": scales}}
        try:
            chain.spec, chain.data = validate(folded), folded
            chain.nodes, chain.source = [inp, conv], source
        except SpecError:
            pass  # (a geometry without an equivalent transposed conv: the conv reads the upsampled value)
    chain.view = shape_of(conv)
    if chain.view is None or tuple(chain.view) != tuple(chain.spec_out):
        raise Reject(f"{where}: the spec's output {list(chain.spec_out)} differs from the model's {chain.view}")
    return chain


def _start_linear(imp: Analysis, node: Node, desc: LinearOp) -> _Chain:
    """A chain of a Linear over the last dim of a 3-D to 5-D value: over the channels of a
    channels-last [N, H, W, C] or [N, D, H, W, C] (ConvNeXt's MLP after its LayerNorm), the 1x1
    convolution of that value read as [N, C, H, W] (`_Chain.in_perm`, a view: no copy where the
    value is contiguous, which makes the conv's input channels-last); over tokens [N, L, C] (a
    transformer's MLP), the 1x1 convolution of [N, C, L, 1] (`_Chain.tokens`). Its output is held as
    the model sees it (`_Chain.out_perm`)."""
    where = imp.describe(node)
    inp = desc.input
    shape = shape_of(inp) if isinstance(inp, Node) else None
    if shape is None:
        raise Reject(f"{where}: its input is not a tensor value of the graph")
    if len(shape) not in (3, 4, 5):
        raise _OtherLinear(f"{where}: a Linear over a {len(shape)}-D tensor runs as PyTorch; only a Linear over the "
                           f"last dim of a 3-D to 5-D value (tokens [N, L, C], channels-last [N, H, W, C]) is fused")
    dtype = dtype_of(inp)
    if dtype != torch.float32:
        # (a bfloat16 ConvNeXt-T at batch 64 with its Linear chains fused failed a launch in the
        # benchmark's CUDA-graph replay, not yet explained: 16-bit Linear layers stay PyTorch's)
        raise Reject(f"{where}: the input is {dtype}; a Linear is fused in float32 models only (fp32 / tf32)")
    weight, bias = _weight_and_bias(imp, desc, where, dtype)
    if len(weight.shape) != 2 or weight.shape[1] != shape[-1] or not weight.tensor.is_contiguous():
        raise Reject(f"{where}: the weight has shape {list(weight.shape)} for an input of {shape[-1]} features")
    tokens = len(shape) == 3
    size = [shape[1], 1] if tokens else list(shape[1:-1])
    rank, nd = len(size) + 2, len(size)
    out_perm = (0, *range(2, rank), 1)  # (the spec's [N, C, ...] as the model holds it: channels last)
    data = {
        "name": "chain",
        "input": {"channels": shape[-1], "size": size},
        "conv": {"out_channels": weight.shape[0], "kernel": [1] * nd, "stride": 1, "padding": 0, "dilation": 1,
                 "groups": 1, "bias": bias is not None},
        "epilogue": [],
        "precision": imp.precision_linear,
    }
    try:
        spec = validate(data)
    except SpecError as err:
        raise Reject(f"{where}: the spec would not validate: {'; '.join(err.problems)}") from None
    conv = ConvOp(inp, nd, weight, bias, 1, 0, 1, 1)
    chain = _Chain(node, conv, data, spec, batch=shape[0], nodes=[node], out=node, weight=weight, bias=bias, dtype=dtype,
                   in_perm=_inverse(out_perm), out_perm=out_perm, tokens=tokens)
    if not tokens and _permutation(inp, rank) == chain.out_perm and len(value_users(inp)) == 1 \
            and isinstance(inp.args[0], Node):
        # the model moved an [N, C, H, W] value's channels last for the Linear: the permute joins,
        # and the fused layer reads that value as it lies
        chain.source, chain.in_perm, chain.nodes = inp.args[0], None, [inp, node]
    chain.view = tuple(chain.spec_out)
    if shape_of(node) is None or chain.model_view != tuple(shape_of(node)):
        raise Reject(f"{where}: the spec's output {list(chain.spec_out)} differs from the model's {shape_of(node)}")
    return chain


_INTERPOLATE = (torch.nn.functional.interpolate, torch.nn.functional.upsample, torch.nn.functional.upsample_nearest)


def _nearest_upsample(imp: Analysis, node) -> Optional[tuple[Node, list[int]]]:
    """(the value, the integer factor per spatial dim) where `node` is a nearest-neighbour upsample
    of a value (nn.Upsample / nn.UpsamplingNearest2d, F.interpolate) that only the conv reads, else
    None. nearest-exact is nearest at integer factors; a scale_factor given must be those factors."""
    if not isinstance(node, Node) or len(node.users) != 1:
        return None
    if node.op == "call_module":
        module = imp.fetch(node.target)
        if not isinstance(module, nn.Upsample) or not node.args:
            return None
        source, mode, scale = node.args[0], module.mode, module.scale_factor
    elif node.op == "call_function" and node.target in _INTERPOLATE:
        args = dict(zip(("input", "size", "scale_factor", "mode", "align_corners"), node.args)) | dict(node.kwargs)
        if args.get("antialias"):
            return None
        source, scale = args.get("input"), args.get("scale_factor")
        mode = "nearest" if node.target is torch.nn.functional.upsample_nearest else args.get("mode", "nearest")
    else:
        return None
    if mode not in ("nearest", "nearest-exact") or not isinstance(source, Node):
        return None
    before, after = shape_of(source), shape_of(node)
    if before is None or after is None or len(before) != len(after) or len(after) < 3 or tuple(before[:2]) != tuple(after[:2]):
        return None
    if dtype_of(source) != dtype_of(node) or any(b < 1 or a % b for b, a in zip(before[2:], after[2:])):
        return None
    factors = [a // b for b, a in zip(before[2:], after[2:])]
    if scale is not None:
        given = list(scale) if isinstance(scale, (list, tuple)) else [scale] * len(factors)
        if len(given) != len(factors) or any(float(g) != f for g, f in zip(given, factors)):
            return None
    return source, factors


# Engines that run fp32 mode's 3xTF32 on the tensor cores (plan.py)
_TENSOR_CORE_ENGINES = ("tma", "igemm")


def _alone_pays(chain: _Chain) -> bool:
    """Whether a chain with nothing after its convolution or Linear is fused all the same: in fp32
    mode PyTorch runs it with TF32 off, on the FFMA units (cuDNN, cuBLAS's SGEMM), where 3xTF32 on
    the tensor cores is faster (a transformer's qkv Linear, whose reshape ends its chain); in any
    other mode the layer alone is PyTorch's own kernel's work. from_module still times it as any
    chain, and keeps PyTorch's where that is faster."""
    if chain.data.get("precision") != "fp32":
        return False
    try:
        plan = _plan_here(validate({**chain.data, "name": "alone"}))
    except SpecError:
        return False
    return plan["engine"] in _TENSOR_CORE_ENGINES


def _plan_here(spec: LayerSpec) -> dict:
    """The spec's plan on the GPU it will run on (the built-in sm_90 without one); SpecError if none."""
    from specgen import target
    from specgen.plan import build_plan

    return build_plan(spec, target=target.resolve(None))


def _check_input_engine(spec: LayerSpec) -> None:
    """A Reject where no engine this layer plans for, on the GPU it will run on (the built-in sm_90
    without one), reads an extra input (plan.INPUT_ENGINES)."""
    try:
        _plan_here(spec)
    except SpecError as err:
        raise Reject(f"with an extra input the layer cannot be planned: {err.problems[0]}") from None


def _mode(chain: _Chain, desc: NormOp, args: dict) -> Optional[str]:
    """The chain's mode (see _Chain.mode) once it takes this stage; a Reject where a module's
    training-mode batch norm and F.batch_norm(training=True) would share one layer, whose mode
    cannot follow both."""
    if not (args.get("training") and args.get("running_mean")):
        return chain.mode
    mode = "call" if desc.fixed_mode else "module"
    if chain.mode not in (None, mode):
        raise Reject("F.batch_norm(training=True) normalizes with the batch's statistics in either mode and a "
                     "module's batch norm after .eval() with its running ones: one fused layer cannot do both")
    return mode


def _permutation(node: Node, rank: int) -> Optional[tuple]:
    """The dims order a permute or movedim node gives its input of `rank` dims (x.permute(0, 2, 3, 1),
    torch.permute(x, dims), x.movedim(1, -1), torch.movedim), negatives normalized; else None."""
    if node.op not in ("call_method", "call_function") or node.kwargs:
        return None
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", None)
    if node.op == "call_function" and node.target not in (torch.permute, torch.movedim):
        return None
    args = list(node.args[1:])
    if name == "permute":
        dims = args[0] if len(args) == 1 and isinstance(args[0], (tuple, list)) else args
        if len(dims) != rank or not all(isinstance(d, int) for d in dims):
            return None
        order = tuple(d % rank for d in dims)
        return order if sorted(order) == list(range(rank)) else None
    if name == "movedim" and len(args) == 2 and all(isinstance(a, int) for a in args):
        src, dst = args[0] % rank, args[1] % rank
        order = [d for d in range(rank) if d != src]
        order.insert(dst, src)
        return tuple(order)
    return None


def _spec_dims(view: tuple, spec_out: tuple, dims: list) -> list:
    """A statistic stage's dims, numbered as the model sees the value (`view`), numbered as the spec
    does: the same where both agree; else the dims of size > 1 mapped, with any size-1 dims of the
    spec between them."""
    if view == spec_out:
        return list(dims)
    rank = len(view)
    picked = []
    for d in dims:
        n = d + rank if d < 0 else d
        if not 0 <= n < rank:
            raise Reject(f"dim {d} is out of range")
        if n == 0:
            raise Reject("it normalizes over the batch dim (dim 0), which a spec never does")
        if view[n] != 1:
            picked.append(view_to_spec_dim(view, spec_out, n))
    if not picked:
        raise Reject(f"it normalizes over dims of size 1 only ({list(dims)} of {list(view)})")
    lo, hi = min(picked), max(picked)
    between = range(lo, hi + 1)
    if all(spec_out[k] == 1 for k in between if k not in picked):
        return list(between)
    return sorted(set(picked))


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

