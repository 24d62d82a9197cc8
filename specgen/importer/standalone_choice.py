"""Never slower, for the joins and pools no chain takes: each `specgen.concat` / `specgen.maxpool`
kernel is timed against the PyTorch code it would replace (an upsample and a cat; a max pool), as
`rewrite.measure` times a chain, and PyTorch's code stays where the kernel is not faster.

Both contenders run on fresh normal random inputs of the shapes, dtype and memory formats the
model hands them (channels-last where the example run's value was, or where the model runs
channels-last), timed by `measured.compare`; the decision is cached with the chains' decisions,
keyed by the kernel's cache key, the GPU, the batch bucket, the torch settings and the formats.
`decide` and `run_by_kernel` are the steps `joins.fuse` and `pools.fuse` share."""

from __future__ import annotations

from typing import Callable

import torch
import torch.fx as fx
from torch.fx import Node

from specgen import measured
from specgen.importer.chains import Analysis
from specgen.importer.graph import channels_last_of, dtype_of, shape_of, unique
from specgen.importer.report import Choice


def device_of(imp: Analysis):
    """The CUDA device the model's first tensor input lies on, or None (nothing to time on)."""
    first = next((t for t in imp.inputs if isinstance(t, torch.Tensor)), None)
    return first.device if first is not None and first.is_cuda else None


def measure(imp: Analysis, node: Node, layer, reference: Callable, values: list[Node], gpu_only: bool = False) -> Choice:
    """Whether `layer` (a ConcatLayer or MaxPoolLayer replacing `node`, reading `values`) runs:
    timed against `reference` (PyTorch's code, called the same way), or the cached decision.
    `gpu_only`: each inside a CUDA graph (`measured.compare_graphed`: the GPU time alone, as in
    `specgen.replay`'s graph, where a small batch's host time is gone), cached apart."""
    name = node.name
    device = device_of(imp)
    if device is None:
        return Choice(name, True, how="not measured (the model is not on a GPU)")
    formats = [bool(imp.channels_last or channels_last_of(v)) for v in values]
    shapes = [shape_of(v) for v in values]
    batch = shapes[0][0]
    context = measured.torch_context() | {"standalone": True, "channels_last": formats, "graph": gpu_only}
    key = measured.decision_key(layer.build().key, measured.gpu_identity(device), measured.batch_bucket(batch), context)

    def timed() -> tuple[float, float]:
        inputs = measured.random_inputs(shapes, formats, dtype_of(node), device)
        compare = measured.compare_graphed if gpu_only else measured.compare
        return compare(lambda a: layer(*a), lambda a: reference(*a), inputs)

    ms, pt, how = measured.cached_or_timed(key, timed, {"layer": name, "batch": batch})
    return Choice(name, ms < pt, ms, pt, ("graph " if gpu_only else "") + how)


def decide(imp: Analysis, node: Node, layer, reference: Callable, values: list[Node], timed: bool,
           gpu_only: bool = False) -> Choice:
    """`measure`'s choice where `timed`, else the kernel's unmeasured (keep_slower, no GPU)."""
    return measure(imp, node, layer, reference, values, gpu_only) if timed else Choice(node.name, True, how="not measured")


def run_by_kernel(imp: Analysis, graph: fx.Graph, node: Node, layer, values: tuple, suffix: str, layers: dict,
                  taken: set, replaced: dict) -> None:
    """Replace `node` in `graph` by a call of `layer` (a new submodule named after the node and
    `suffix`, unique among `taken` and `layers`) on `values`, each read where `replaced` says it
    is computed now; the node's output is then the call's (`replaced[node]`)."""
    name = unique(f"{node.name}_{suffix}", taken | set(layers))
    layers[name] = layer
    imp.gm.add_submodule(name, layer)
    with graph.inserting_before(node):
        new = graph.call_module(name, tuple(replaced.get(v, v) for v in values))
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    replaced[node] = new
