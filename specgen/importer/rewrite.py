"""Fusing: the fused layers (sharing the model's tensors), never-slower timing of each chain, and
the rewrite of the traced graph with each chain replaced by one call of its fused layer."""

from __future__ import annotations

import builtins
import contextlib
import math
import operator
from typing import Any, Optional

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
import torch.nn as nn
from torch.fx import Node

from specgen import measured, pipeline, tmarun
from specgen.importer import joins, pools
from specgen.importer.chains import Analysis
from specgen.importer.graph import META_METHODS, channels_last_of, shape_of, unique
from specgen.importer.report import Choice
from specgen.module import FusedLayer, _tensor, spec_shaped


class ImportedLayer(FusedLayer):
    """A FusedLayer built by `from_module` around tensors of the original model.

    Its `conv` (or `conv.weight` / `conv.bias`) and per-channel attributes are the original
    model's very tensors. A per-channel tensor keeps the shape the model gave it ((C, 1, 1),
    (1, C, 1, 1), or (C,) for norms' weights and batch norm statistics); the layer's op sees it
    viewed in the spec's (C, 1, ...) shape, which keeps gradients flowing to the shared parameter
    (a scalar tensor, such as a 0-dim nn.Parameter, is seen expanded to every channel).
    A training-mode batch norm's running statistics and num_batches_tracked are the model's
    buffers under the spec's names, updated in place as nn.BatchNormNd updates them (a
    functional batch norm, which counts no batches, gets a counter of the layer's own).
    """

    _SHAPE_HINT = "; the model was fused for its example's shape (an input of other sizes past the channels runs a kernel for them)"
    _OTHER_SIZES = True  # (the sizes came from the example: another size is specialized when first called)

    def __init__(self, spec_or_path, *, arch: str | None = None, batch_stats_always: bool = False):
        """`batch_stats_always`: its training-mode batch norms are F.batch_norm(training=True) calls,
        which normalize with the batch's statistics (and update the running ones) in either mode."""
        super().__init__(spec_or_path, arch=arch)
        self._spec_shapes = dict(self.spec.params())
        self._scalar_params: dict = {}  # one-element tensors the spec sees per channel: name -> spec shape (_new_layer)
        self._batch_stats_always = batch_stats_always

    def train(self, mode: bool = True):
        if self._batch_stats_always:  # no eval twin to prepare: it never runs
            return nn.Module.train(self, mode)
        return super().train(mode)

    def forward(self, x: torch.Tensor, *inputs: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if self._batch_stats_always and not self.training and isinstance(x, torch.Tensor):
            if x.shape[1:] != self._input_shape:
                return self._at_size(x).forward(x, *inputs, out=out)  # (forward: the hooks ran for this call)
            self._check_extra_inputs(x, inputs)
            return self._forward_training(x, out, inputs)
        return super().forward(x, *inputs, out=out)

    def _spec_shaped(self, name: str) -> torch.Tensor:
        return spec_shaped(getattr(self, name), self._spec_shapes[name])

    def _launch_params(self) -> dict:
        # The kernels read C contiguous values whatever the tensor's shape: the model's own tensor
        # as it is (a reshape per tensor and call costs microseconds of host time), a scalar expanded.
        params = {name: _tensor(self, name) for name in self._spec_shapes}
        for name, want in self._scalar_params.items():
            params[name] = spec_shaped(params[name], want)
        return params

    def _op_tensors(self) -> list:
        """The op's tensor arguments after x: weight, bias (when the conv has one), then the
        per-channel tensors in spec.params() order, each in its spec shape."""
        tensors = [self._op_weight(self.conv.weight)]
        if self.spec.conv.bias:
            tensors.append(self.conv.bias)
        tensors.extend(self._spec_shaped(name) for name in self._spec_shapes)
        return tensors

    def spec_params(self) -> dict:
        return {name: self._spec_shaped(name) for name in self._spec_shapes}


@contextlib.contextmanager
def buffers_kept(*modules: nn.Module):
    """The modules' buffers (running statistics, batch counters) as they were before, after the
    block: timing runs a training-mode model many times, which must not count as training it."""
    saved = {id(b): (b, b.detach().clone()) for m in modules for b in m.buffers()}
    try:
        yield
    finally:
        with torch.no_grad():
            for buf, value in saved.values():
                buf.copy_(value)


def original(imp: Analysis, chain) -> Optional[fx.GraphModule]:
    """The chain as the model computes it (its nodes and the parameter reads they need), a
    module of the conv's input and the chain's extra inputs; None when it reads any other value
    of the model."""
    inp = chain.input_node
    extras = list(chain.inputs.values())
    needed: set[Node] = set()
    todo = [chain.out]
    while todo:
        node = todo.pop()
        if node in needed or node is inp or node in extras:
            continue
        if node.op == "placeholder":
            return None
        needed.add(node)
        todo.extend(node.all_input_nodes)
    graph = fx.Graph()
    env = {inp: graph.placeholder("x")}
    for i, node in enumerate(extras):
        env[node] = graph.placeholder(f"extra{i}")
    for node in imp.nodes:
        if node in needed:
            env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(env[chain.out])
    capturable(graph)
    root = {n.target: imp.fetch(n.target) for n in needed if n.op in ("call_module", "get_attr")}
    return fx.GraphModule(root, graph, class_name=f"Original_{chain.spec.name}")


def capturable(graph: fx.Graph) -> int:
    """Rewrite each `torch.tensor(<number>, ...)` (a constant made in forward, copied from the host
    on every call) as `torch.full((), <number>, ...)`: the same tensor, filled on the device, so
    that a CUDA graph can capture the forward (a host-to-device copy of pageable memory cannot be
    captured). Returns how many calls were rewritten."""
    count = 0
    for node in graph.nodes:
        if node.op == "call_function" and node.target is torch.tensor and len(node.args) == 1 \
                and isinstance(node.args[0], (bool, int, float)) and set(node.kwargs) <= {"dtype", "device", "requires_grad"}:
            node.target, node.args = torch.full, ((), node.args[0])
            count += 1
    return count


def measure(imp: Analysis, chain, gpu_only: bool = False) -> Choice:
    """Time the chain as PyTorch and as its kernel on its GPU (or take the cached decision).
    `gpu_only`: each inside a CUDA graph (`measured.compare_graphed`: no host time, as a chain
    costs in `specgen.replay`'s graph), cached apart; how="graph measured" / "graph cached"."""
    name = chain.spec.name
    device = chain.weight.tensor.device
    if not _is_gpu(device):
        return Choice(name, True, how=f"not measured (the model is on {device.type})")
    layer = fused_layer(imp, chain)
    plain = original(imp, chain)
    if plain is None or layer.key is None:
        return Choice(name, True, how="not measured (the chain reads another model input)")
    context = measured.torch_context()
    if gpu_only:
        context["graph"] = True
    # the input as the model hands it to the chain: channels-last where the model's input is (run
    # channels-last), or where the example run found this chain's input so (ConvNeXt's blocks); a
    # Linear's [N, H, W, C] input, contiguous, is read permuted: [N, C, H, W] channels-last; a
    # join's output, where the join will write it channels-last for this chain (`joins`: the join's
    # own timing decided first)
    inp = chain.input_node
    joined = chain.in_perm is None and not imp.channels_last and not channels_last_of(inp) \
        and joins.writes_channels_last_for(imp, chain, layer, measure=True, gpu_only=gpu_only)
    first = chain.in_perm is None and (imp.channels_last or channels_last_of(inp) or joined)
    formats = [first, *(imp.channels_last or channels_last_of(node) for node in chain.inputs.values())]
    channels_last = first or chain.in_perm is not None
    if channels_last:
        context["channels_last"] = True
        if joined:  # (PyTorch's chain then reads the cat's own output, NC(D)HW)
            context["joined"] = True
    else:  # (the kernel a call at this batch runs, where it is not the layer's own: a decision per kernel)
        ran = pipeline.batch_variant(layer.specialize(), chain.batch)
        if ran.key != layer.key:
            context["kernel_at_batch"] = ran.key
    key = measured.decision_key(layer.key, measured.gpu_identity(device), measured.batch_bucket(chain.batch), context)

    def timed() -> tuple[float, float]:
        shapes = [shape_of(inp), *(shape_of(n) for n in chain.inputs.values())]
        inputs = [list(t) for t in measured.random_inputs(shapes, formats, chain.dtype, device)]
        compare = measured.compare_graphed if gpu_only else measured.compare
        # (the layer reads a Linear's input, and any extra input the model holds permuted, as the
        # fused graph hands them: permuted views)
        steps = [chain.read_steps(), *(chain.input_steps.get(n, []) for n in chain.inputs.values())]
        with buffers_kept(imp.model, layer):  # a training-mode batch norm updates its running statistics on every call
            if joined and not any(steps):  # (the kernel reads the join's channels-last output; PyTorch's chain, the cat's NC(D)HW one)
                given = [(*a, a[0].contiguous()) for a in inputs]
                return compare(lambda a: layer(*a[:-1]), lambda a: plain(a[-1], *a[1:-1]), given)
            if any(steps):
                return compare(lambda a: layer(*(_read(t, s) for t, s in zip(a, steps))), lambda a: plain(*a),
                               [tuple(a) for a in inputs])
            if chain.inputs:  # the extra inputs too, fresh random tensors of their shapes
                return compare(lambda a: layer(*a), lambda a: plain(*a), [tuple(a) for a in inputs])
            return compare(layer, plain, [a[0] for a in inputs])

    ms, pt, how = measured.cached_or_timed(key, timed, {"layer": name, "batch": chain.batch})
    return Choice(name, ms < pt, ms, pt, ("graph " if gpu_only else "") + how)


def _graph_read(graph: fx.Graph, value: Node, steps: list) -> Node:
    """`value` through `steps` (as `_read`), as nodes of `graph` inserted where it inserts now."""
    for method, args in steps:
        value = graph.call_method(method, (value, *args))
    return value


def _read(t: torch.Tensor, steps: list) -> torch.Tensor:
    """`t` through `steps`, (method, args) pairs (`_Chain.read_steps`, `out_steps`, ...): the fused
    layer's input made from the value it reads, or the model's view of its output."""
    for method, args in steps:
        t = getattr(t, method)(*args)
    return t


def to_channels_last(t):
    """A model input, channels-last where it is a 4-D or 5-D tensor (the fused graph's first step
    when its activations run channels-last)."""
    return tmarun.laid_out(t, True) if isinstance(t, torch.Tensor) else t


def as_channels_last(t: torch.Tensor) -> torch.Tensor:
    """`t` with its channels innermost in memory: a fused chain's output where the original chain's
    was so (a permute back after a LayerNorm over the channels: ConvNeXt's stem), so that the
    model's later ops see the memory format they saw (its residual adds keep it, and the next
    chains then read it in place). No copy where the kernel wrote it so."""
    return t if tmarun.channels_last(t) else tmarun.laid_out(t, True)


def to_contiguous(out, given=None):
    """The model's outputs with every 4-D and 5-D tensor contiguous again, as the original model
    gives them on contiguous inputs (the fused graph's last step when its activations run
    channels-last); left as they are where the first input `given` came channels-last itself."""
    if isinstance(given, torch.Tensor) and not given.is_contiguous():
        return out

    def restore(t):
        return t.contiguous() if isinstance(t, torch.Tensor) and t.dim() in (4, 5) else t

    return pytree.tree_map(restore, out)


def run_channels_last(graph: fx.Graph) -> None:
    """Make `graph` take its inputs as they come and run channels-last inside: each input is laid out
    channels-last first (one copy per input), and the outputs made contiguous last. A channels-last
    input reaches every layer in the format its channels-last kernel reads in place and writes."""
    first = None
    for node in list(graph.nodes):
        if node.op == "placeholder":
            first = first or node
            with graph.inserting_after(node):
                laid = graph.call_function(to_channels_last, (node,))
            node.replace_all_uses_with(laid, delete_user_cb=lambda user: user is not laid)
        elif node.op == "output":
            with graph.inserting_before(node):
                restored = graph.call_function(to_contiguous, (node.args[0], first))
            node.args = (restored,)


def fused_graph(imp: Analysis, measure: bool = False, gpu_only: bool = False) -> fx.GraphModule:
    """The traced graph with each chain replaced by one ImportedLayer call, each concatenation of
    an upsampled value by one ConcatLayer call (`joins`) and each max pool left to PyTorch by one
    MaxPoolLayer call (`pools`); where the analysis ran on
    channels-last inputs, inputs are laid out channels-last on the way in (`run_channels_last`).
    `measure`: a join's or pool's kernel replaces PyTorch's code only where timed faster
    (`standalone_choice`; `gpu_only`: timed inside CUDA graphs, for the graph `specgen.replay`
    captures); the choices, one per join and pool, go to `imp.standalone_choices`."""
    graph = imp.graph
    layers: dict[str, nn.Module] = {}
    taken = {n.target.split(".")[0] for n in imp.nodes if n.op in ("call_module", "get_attr")} | set(dir(imp.gm))
    replaced: dict[Node, Node] = {}  # a fused chain's output -> what computes it now
    joined = joins.find(imp)  # (before the chains replace the values they read)
    pooled = pools.find(imp, imp.chains)  # (the chains left are the fused ones)
    if joined:
        joins.restore_output_format(graph)
    for chain in imp.chains:
        name = unique(chain.spec.name, taken | set(layers))
        layers[name] = fused_layer(imp, chain)
        imp.gm.add_submodule(name, layers[name])
        conv = chain.nodes[0]  # (the first node the chain covers: the conv, or an upsample it reads)
        inp = replaced.get(chain.input_node, chain.input_node)  # (an upsample's source: perhaps a fused chain's output)
        # extra inputs (a shortcut the model computes after the conv, perhaps another fused chain's
        # output): the call goes where the chain's output was, after all of them
        extras = [replaced.get(node, node) for node in chain.inputs.values()]
        with graph.inserting_before(chain.out if extras else conv):
            reads = [_graph_read(graph, inp, chain.read_steps())]
            reads += [_graph_read(graph, value, chain.input_steps.get(node, [])) for node, value in zip(chain.inputs.values(), extras)]
            fused = graph.call_module(name, tuple(reads))
            final = fused
            if tuple(chain.view) != tuple(chain.spec_out):
                final = graph.call_method("reshape", (fused, -1, *chain.view[1:]))
            if chain.out_perm is not None:  # (the model reads it permuted: ConvNeXt's LayerNorm over the channels)
                final = _graph_read(graph, final, chain.out_steps())
            elif channels_last_of(chain.out) and not imp.channels_last:  # (the original's output lay so)
                final = graph.call_function(as_channels_last, (final,))
        chain.out.replace_all_uses_with(final)
        replaced[chain.out] = final
        covered = set(chain.nodes)
        for node in chain.nodes:  # uses that read only sizes: give them a stand-in
            readers = [u for u in node.users if u not in covered]
            if readers:
                with graph.inserting_before(conv):
                    ghost = graph.call_function(_shape_ghost, (inp, tuple(shape_of(node)[1:])))
                for u in readers:
                    u.replace_input_with(node, ghost)
        _erase(graph, sorted(chain.nodes, key=imp.order.get, reverse=True), imp.regions.leaf_nodes | imp.size_nodes)
    imp.standalone_choices = joins.fuse(imp, graph, joined, layers, taken, replaced, measure, gpu_only)
    imp.standalone_choices += pools.fuse(imp, graph, pooled, layers, taken, replaced, measure, gpu_only)
    capturable(graph)  # (constants the chains left to the model)
    if imp.channels_last:
        run_channels_last(graph)
    graph.lint()
    root: dict[str, Any] = {}
    for node in graph.nodes:
        if node.op in ("call_module", "get_attr"):
            root[node.target] = imp.fetch(node.target)
    fused = fx.GraphModule(root, graph, class_name=f"Fused{imp.name}")
    fused.training = imp.model.training
    return fused


def fused_layer(imp: Analysis, chain) -> ImportedLayer:
    """The chain's fused layer (built once: measuring and rewriting share it)."""
    if id(chain) not in imp.layers:
        imp.layers[id(chain)] = _new_layer(imp, chain)
    return imp.layers[id(chain)]


def _new_layer(imp: Analysis, chain) -> ImportedLayer:
    layer = ImportedLayer(chain.spec, batch_stats_always=chain.mode == "call")
    layer.training = imp.model.training
    if chain.desc.module is not None:
        layer.conv = chain.desc.module
    else:
        _share(layer.conv, "weight", chain.weight.tensor)
        if chain.linear:  # (a Linear's weight [C_out, C_in]: the op sees it as the 1x1 conv's)
            layer._flat_weight = tuple(chain.spec.weight_shape())
        if chain.bias is not None:
            _share(layer.conv, "bias", chain.bias.tensor)
    for name, tensor in chain.tensors.items():
        _share(layer, name, tensor)
        want = layer._spec_shapes.get(name)
        if want is not None and tensor.numel() == 1 and math.prod(want) != 1:
            layer._scalar_params[name] = want
    return layer


def _is_gpu(device: torch.device) -> bool:
    return device.type == "cuda"


def _shape_ghost(like: torch.Tensor, tail: tuple) -> torch.Tensor:
    """A zero-copy stand-in for a fused intermediate: `like`'s batch, dtype and device, a fixed tail.

    Code that reads only the size of a value fused away (`x.view(x.size(0), -1)`) reads it here."""
    return like.new_empty(()).expand(like.shape[0], *tail)


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
    if node.op == "call_method" and node.target in META_METHODS:
        return True
    return node.op == "call_function" and node.target in (_shape_ghost, builtins.getattr, operator.getitem)

