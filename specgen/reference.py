"""The same layer in plain PyTorch, built from the spec: the ground truth for tests and `check`,
and the path a FusedLayer takes on the CPU.

`forward` is dtype-agnostic, so calling it with float64 tensors gives the float64 reference.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

from specgen import ops
from specgen.spec import LayerSpec, load


def make_conv(spec: LayerSpec) -> nn.Module:
    """nn.Conv1d/2d/3d (nn.ConvTranspose1d/2d/3d for a transposed conv) with the spec's geometry
    and PyTorch's default initialization."""
    g = spec.conv_geometry()
    common = {"stride": g["stride"], "padding": g["padding"], "dilation": g["dilation"],
              "groups": spec.conv.groups, "bias": spec.conv.bias}
    if spec.conv.transposed:
        cls = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}[spec.ndim]
        common["output_padding"] = g["output_padding"]
    else:
        cls = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[spec.ndim]
    return cls(spec.input.channels, spec.conv.out_channels, g["kernel"], **common)


def forward(spec: LayerSpec, x: torch.Tensor, weight, bias, params: dict) -> torch.Tensor:
    """The layer applied to x, stage by stage, with torch ops (any float dtype, any device)."""
    return stages(spec)(x, weight, bias, params)


def _stages(spec: LayerSpec):
    """The layer as one function of (x, weight, bias, params) built from plain torch calls.

    Everything that reads the spec (geometry, canonical dims, op arguments) happens here, once,
    so the function itself holds only tensor ops: torch.compile traces it without graph breaks."""
    g = spec.conv_geometry()
    stride, padding, dilation, groups = g["stride"], g["padding"], g["dilation"], spec.conv.groups
    if spec.conv.transposed:
        transposed = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}[spec.ndim]
        output_padding = g["output_padding"]

        def conv(x, weight, bias, stride, padding, dilation, groups):
            return transposed(x, weight, bias, stride, padding, output_padding, groups, dilation)

    else:
        conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[spec.ndim]
    steps = []
    param_shapes = spec.params()
    for i, stage in enumerate(spec.epilogue):
        if stage.kind == "pointwise":
            row, args = ops.POINTWISE[stage.op], stage.args
            names = tuple(row.params(args))
            # one call on a dummy tensor warms whatever the op caches (e.g. a parsed expression),
            # so no parsing happens inside a traced forward
            channels = {n: s[0] for n, s in param_shapes.items() if n in names}
            c = next(iter(channels.values()), 1)
            dummy = torch.zeros((1, c) + (1,) * spec.ndim)
            row.torch_ref(dummy, args, {n: torch.zeros((c,) + (1,) * spec.ndim) for n in names})
            steps.append(functools.partial(_pointwise, row.torch_ref, args, names))
        elif stage.kind == "pool":
            geometry = spec.pool_geometry(stage, f"epilogue[{i}]")
            args = SimpleNamespace(**{**stage.args.model_dump(), **geometry})
            steps.append(functools.partial(_pool, ops.POOLS[stage.op].torch_ref, args, spec.ndim))
        else:
            steps.append(functools.partial(_reduce, ops.REDUCTIONS[stage.op].torch_ref, spec.reduce_dims(i), stage.args.keepdim))

    def run(x, weight, bias, params):
        y = conv(x, weight, bias, stride, padding, dilation, groups)
        for step in steps:
            y = step(y, params)
        return y

    return run


_built: dict[int, tuple] = {}


def stages(spec: LayerSpec):
    """The layer's function for this spec object (built once per object; specs are frozen)."""
    hit = _built.get(id(spec))
    if hit is None or hit[0] is not spec:
        hit = _built[id(spec)] = (spec, _stages(spec))
    return hit[1]


def _pointwise(torch_ref, args, names, y, params):
    views = {name: params[name].reshape(params[name].shape[0], *([1] * (y.dim() - 2))) for name in names}
    return torch_ref(y, args, views)


def _pool(torch_ref, args, ndim, y, params):
    return torch_ref(y, args, ndim)


def _reduce(torch_ref, dims, keepdim, y, params):
    return torch_ref(y, dims, keepdim)


def add_spec_params(module: nn.Module, spec: LayerSpec) -> None:
    """Register the spec's per-channel tensors on `module` under their spec names, shaped (C, 1, ...):
    learnable parameters drawn from a standard normal, except where the op says otherwise (batch
    norm: weight 1 and bias 0 as parameters, running mean 0 and variance 1 as buffers, as in
    nn.BatchNormNd)."""
    inits = spec.param_inits()
    for name, shape in spec.params().items():
        init = inits.get(name, ops.ParamInit())
        value = torch.randn(shape) if init.fill is None else torch.full(shape, init.fill)
        if init.buffer:
            module.register_buffer(name, value)
        else:
            module.register_parameter(name, nn.Parameter(value))


class Reference(nn.Module):
    """The plain PyTorch model of a spec: `conv` plus one nn.Parameter per per-channel parameter."""

    def __init__(self, spec_or_path):
        super().__init__()
        self.spec = load(spec_or_path)
        self.conv = make_conv(self.spec)
        self._run = stages(self.spec)
        self._param_names = tuple(self.spec.params())
        add_spec_params(self, self.spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._run(x, self.conv.weight, self.conv.bias, self.named_spec_params())

    def named_spec_params(self) -> dict:
        return {name: getattr(self, name) for name in self._param_names}


def forward64(spec: LayerSpec, x, weight, bias, params: dict) -> torch.Tensor:
    """The float64 reference, on x's device: every tensor upcast to float64."""
    d = lambda t: None if t is None else t.detach().double()  # noqa: E731
    return forward(spec, d(x), d(weight), d(bias), {k: d(v) for k, v in params.items()})
