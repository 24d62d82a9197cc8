"""Concatenations along the channels with an upsampled value among them (a UNet decoder's
`torch.cat([up(x), skip], 1)`): run by one `specgen.concat.ConcatLayer` instead of PyTorch's
upsample and cat, written channels-last where the fused layer that reads it takes such an input
in place (no layout pass of its own)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.fx as fx
from torch.fx import Node

from specgen import concat, standalone
from specgen.standalone import dtype_name
from specgen.importer import standalone_choice
from specgen.importer.chains import Analysis, _nearest_upsample
from specgen.importer.graph import channels_last_of, dtype_of, shape_of
from specgen.importer.report import Choice
from specgen.log import get_logger

_CAT = (torch.cat, torch.concat, torch.concatenate)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Join:
    """One concatenation the kernel runs: the cat node, the values it reads (an upsample's source in
    place of the upsample), their factors, and the upsample nodes it covers."""

    node: Node
    values: tuple
    factors: tuple
    covers: tuple  # the upsample nodes joined into it

    def describe(self) -> str:
        parts = [f"{v.name}" if all(f == 1 for f in fs) else f"upsample({v.name}, {list(fs)})"
                 for v, fs in zip(self.values, self.factors)]
        return f"{self.node.name}: cat([{', '.join(parts)}], 1)"


def _join(imp: Analysis, node: Node) -> Optional[Join]:
    """`node` as a Join, or None where it is not a torch.cat along dim 1 of 3-D to 5-D float values
    of one dtype, at least one of them a nearest upsample (by integer factors) only the cat reads."""
    if node.op != "call_function" or node.target not in _CAT or "out" in node.kwargs:
        return None
    args = dict(zip(("tensors", "dim"), node.args)) | dict(node.kwargs)
    tensors, dim, shape = args.get("tensors"), args.get("dim", 0), shape_of(node)
    if not isinstance(tensors, (list, tuple)) or not 1 <= len(tensors) <= concat.MAX_SOURCES or shape is None \
            or not 3 <= len(shape) <= 5 or not isinstance(dim, int) or dim % len(shape) != 1 \
            or dtype_of(node) not in _DTYPES:
        return None
    values, factors, covers = [], [], []
    for t in tensors:
        if not isinstance(t, Node) or shape_of(t) is None or len(shape_of(t)) != len(shape) or dtype_of(t) != dtype_of(node):
            return None
        up = _nearest_upsample(imp, t) if tensors.count(t) == 1 else None
        if up is not None and shape_of(up[0]) is not None:
            values.append(up[0])
            factors.append(tuple(up[1]))
            covers.append(t)
        else:
            values.append(t)
            factors.append((1,) * (len(shape) - 2))
    if not covers:
        return None  # (a plain cat: PyTorch's one pass is what the kernel would do)
    for v, fs in zip(values, factors):
        if tuple(s * f for s, f in zip(shape_of(v)[2:], fs)) != tuple(shape[2:]) or shape_of(v)[0] != shape[0]:
            return None
    join = Join(node, tuple(values), tuple(factors), tuple(covers))
    try:
        _plan(join, False)
    except ValueError:  # (a join the kernel does not take: past its extents, say)
        return None
    return join


def find(imp: Analysis) -> list[Join]:
    """The model's concatenations a ConcatLayer runs."""
    return [j for j in (_join(imp, n) for n in imp.nodes) if j is not None]


def _sole_reader(node: Node, layers: dict):
    """The fused layer that alone reads `node`, as its input x (not an extra input), else None."""
    users = list(node.users)
    if len(users) != 1 or users[0].op != "call_module" or users[0].target not in layers:
        return None
    user = users[0]
    if not user.args or user.args[0] is not node or node in user.args[1:] or node in user.kwargs.values():
        return None
    return layers[user.target]


def _reads_in_place(layer) -> bool:
    """Whether `layer` (a FusedLayer) reads a channels-last input where it lies; False where that
    cannot be told here (no GPU: nothing is planned for one)."""
    from specgen import torchop

    if not torch.cuda.is_available():
        return False
    try:
        return torchop.reads_channels_last_in_place(layer.specialize())
    except Exception as err:  # noqa: BLE001  (a plan that cannot be made: the cat writes NC(D)HW, as PyTorch's does)
        get_logger().info("%s: channels-last input not planned (%s: %s)", layer.spec.name, type(err).__name__, err)
        return False


def writes_channels_last_for(imp: Analysis, chain, layer, measure: bool = False, gpu_only: bool = False) -> bool:
    """Whether a join will write `chain`'s input channels-last for it, as `fuse` decides: the
    chain's conv alone reads a join's output, as its input x, and its kernel (`layer`) reads
    channels-last in place; with `measure`, also that the join's kernel wins its own timing
    (`choose`: decided now, and found cached when `fuse` asks again). The chain is then timed on
    such an input (`rewrite.measure`): the kernel it will run."""
    node = chain.input_node
    if not isinstance(node, Node) or chain.read_steps() or node in chain.inputs.values():
        return False
    users = list(node.users)
    join = _join(imp, node) if len(users) == 1 and users[0] in chain.nodes and len(shape_of(node) or ()) > 3 else None
    if join is None or not _reads_in_place(layer):
        return False
    return not measure or choose(imp, join, concat.ConcatLayer(_plan(join, True)), gpu_only).fused


def prebuild(imp: Analysis) -> None:
    """Compile the kernels of the model's joins in one parallel build, in both output layouts
    where there are two (`fuse` picks one by the conv that reads the join)."""
    plans = [_plan(j, cl) for j in find(imp) for cl in ((False, True) if len(shape_of(j.node)) > 3 else (False,))]
    standalone.prebuild([concat.build_request(p) for p in plans])


def _plan(join: Join, channels_last: bool) -> concat.ConcatPlan:
    shape = shape_of(join.node)
    return concat.ConcatPlan(
        tuple(concat.Source(shape_of(v)[1], tuple(shape_of(v)[2:]), fs) for v, fs in zip(join.values, join.factors)),
        tuple(shape[2:]), dtype_name(dtype_of(join.node)), channels_last)


def choose(imp: Analysis, join: Join, layer, gpu_only: bool = False, timed: bool = True) -> Choice:
    """Whether `join` runs as `layer` (its ConcatLayer): timed against PyTorch's upsample and cat
    (unmeasured where not `timed`)."""
    return standalone_choice.decide(imp, join.node, layer, lambda *vs, fs=join.factors: concat.reference(vs, fs),
                                    list(join.values), timed, gpu_only)


def fuse(imp: Analysis, graph: fx.Graph, joins: list[Join], layers: dict, taken: set, replaced: dict,
         measure: bool = False, gpu_only: bool = False) -> list[Choice]:
    """Replace each of `joins` (found by `find` before the chains were) in `graph`, the fused graph
    being written, by a ConcatLayer call: `layers` its modules so far by name, `replaced` what
    computes each fused chain's or join's output now (a join of a join reads the first one's
    layer). `measure`: each kernel timed first against PyTorch's upsample and cat
    (`standalone_choice`; `gpu_only`: inside CUDA graphs), the join left as it is where the kernel
    is not faster. Returns one Choice per join."""
    log = get_logger()
    plans = []
    for join in joins:
        reader = _sole_reader(join.node, layers)
        plans.append(_plan(join, len(shape_of(join.node)) > 3 and reader is not None and _reads_in_place(reader)))
    built = standalone.prebuild([concat.build_request(p) for p in plans])
    choices = []
    for join, plan, result in zip(joins, plans, built):
        layer = concat.ConcatLayer(plan, built=result)
        choice = choose(imp, join, layer, gpu_only, timed=measure)
        choices.append(choice)
        if not choice.fused:
            log.info("%s: %s kept as PyTorch (not faster as one kernel): %s", imp.name, join.describe(), choice)
            continue
        standalone_choice.run_by_kernel(imp, graph, join.node, layer, join.values, "join", layers, taken, replaced)
        for up in join.covers:
            if not up.users:
                graph.erase_node(up)
        log.info("%s: %s runs as one specgen kernel%s", imp.name, join.describe(),
                 ", written channels-last for the layer that reads it" if plan.channels_last else "")
    return choices


def restore_output_format(graph: fx.Graph) -> None:
    """Make the graph's 4-D and 5-D outputs contiguous where the original model's were (a
    channels-last join's format can reach them through the layers after it, which keep their
    input's format, as PyTorch's conv does): called on the traced graph, before it is rewritten."""
    output = next(n for n in graph.nodes if n.op == "output")

    def restore(value):
        if isinstance(value, Node) and value.op != "placeholder":
            shape = shape_of(value) if "specgen_tensor" in value.meta else None
            if shape is not None and len(shape) in (4, 5) and not channels_last_of(value):
                with graph.inserting_before(output):
                    return graph.call_method("contiguous", (value,))
        return value

    output.args = tuple(fx.node.map_aggregate(a, restore) for a in output.args)
