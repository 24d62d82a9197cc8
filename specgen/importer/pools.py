"""Max pools that no fused chain takes (a UNet encoder pools a value its skip also reads; a pool
in ceil mode): run by one `specgen.maxpool.MaxPoolLayer` each instead of PyTorch's pool, which
writes the index of each maximum besides its value."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.fx import Node

from specgen import maxpool
from specgen.standalone import dtype_name, prebuild
from specgen.importer import standalone_choice
from specgen.importer.chains import Analysis
from specgen.importer.graph import _per_dim, dtype_of, shape_of
from specgen.importer.report import Choice
from specgen.log import get_logger

ENABLED = True  # (off: the pools no chain takes stay PyTorch's)
_MODULES = {nn.MaxPool1d: 1, nn.MaxPool2d: 2, nn.MaxPool3d: 3}
_FUNCTIONS = {F.max_pool1d: 1, F.max_pool2d: 2, F.max_pool3d: 3, torch.max_pool1d: 1, torch.max_pool2d: 2,
              torch.max_pool3d: 3}
_ARGS = ("input", "kernel_size", "stride", "padding", "dilation", "ceil_mode", "return_indices")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Pool:
    """One max pool the kernel runs: its node, the value it pools and the plan."""

    node: Node
    value: Node
    plan: maxpool.MaxPoolPlan

    def describe(self) -> str:
        p = self.plan
        return f"{self.node.name}: max_pool{len(p.size)}d({self.value.name}, {p.describe()})"


def _pool(imp: Analysis, node: Node) -> Optional[Pool]:
    """`node` as a Pool, or None where it is not a max pool without indices over a float value of
    known shape that the kernel takes."""
    if node.op == "call_module":
        module = imp.fetch(node.target)
        nd = _MODULES.get(type(module))
        if nd is None or len(node.args) != 1 or node.kwargs:
            return None
        args = {"input": node.args[0], "kernel_size": module.kernel_size, "stride": module.stride,
                "padding": module.padding, "dilation": module.dilation, "ceil_mode": module.ceil_mode,
                "return_indices": module.return_indices}
    elif node.op == "call_function" and node.target in _FUNCTIONS:
        nd = _FUNCTIONS[node.target]
        args = dict(zip(_ARGS, node.args)) | dict(node.kwargs)
    else:
        return None
    value = args.get("input")
    if not isinstance(value, Node) or shape_of(value) is None or len(shape_of(value)) != nd + 2 \
            or dtype_of(value) not in _DTYPES or args.get("return_indices", False) \
            or not isinstance(args.get("ceil_mode", False), bool):
        return None
    kernel = _per_dim(args.get("kernel_size"), nd)
    stride = kernel if args.get("stride") in (None, [], ()) else _per_dim(args.get("stride"), nd)
    padding, dilation = _per_dim(args.get("padding", 0), nd), _per_dim(args.get("dilation", 1), nd)
    if kernel is None or stride is None or padding is None or dilation is None:
        return None
    shape = shape_of(value)
    try:
        plan = maxpool.MaxPoolPlan(shape[1], tuple(shape[2:]), kernel, stride, dtype_name(dtype_of(value)), padding,
                                   dilation, args.get("ceil_mode", False))
    except ValueError:
        return None
    if shape_of(node) is None or tuple(shape_of(node)) != (shape[0], shape[1], *plan.out_size):
        return None
    return Pool(node, value, plan)


def find(imp: Analysis, fused_chains: list) -> list[Pool]:
    """The model's max pools a MaxPoolLayer runs: those none of `fused_chains` covers (a chain kept
    as PyTorch's code leaves its pool to the kernel too); none while ENABLED is off."""
    if not ENABLED:
        return []
    covered = {n for chain in fused_chains for n in chain.nodes}
    return [p for p in (_pool(imp, n) for n in imp.nodes if n not in covered) if p is not None]


def fuse(imp: Analysis, graph: fx.Graph, pools: list[Pool], layers: dict, taken: set, replaced: dict,
         measure: bool = False, gpu_only: bool = False) -> list[Choice]:
    """Replace each of `pools` (found by `find` before the chains were) in `graph` by a
    MaxPoolLayer call: `layers` the graph's modules so far by name, `replaced` what computes each
    fused chain's output, join or pool now (a pool of a pool reads the first one's layer).
    `measure`: each kernel timed first against PyTorch's pool (`standalone_choice`; `gpu_only`:
    inside CUDA graphs), the pool left as it is where the kernel is not faster. Returns one Choice
    per pool."""
    log = get_logger()
    built = prebuild([maxpool.build_request(p.plan) for p in pools])
    choices = []
    for pool, result in zip(pools, built):
        layer = maxpool.MaxPoolLayer(pool.plan, built=result)
        choice = standalone_choice.decide(imp, pool.node, layer, lambda x, plan=pool.plan: maxpool.reference(x, plan),
                                          [pool.value], measure, gpu_only)
        choices.append(choice)
        if not choice.fused:
            log.info("%s: %s kept as PyTorch (not faster as one kernel): %s", imp.name, pool.describe(), choice)
            continue
        standalone_choice.run_by_kernel(imp, graph, pool.node, layer, (pool.value,), "max", layers, taken, replaced)
        log.info("%s: %s runs as one specgen kernel", imp.name, pool.describe())
    return choices
