"""The same layer in plain PyTorch, built from the spec: the ground truth for tests and `check`,
and the path a FusedLayer takes on the CPU.

`forward` is dtype-agnostic, so calling it with float64 tensors gives the float64 reference.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

from specgen import ops
from specgen.spec import LayerSpec, load


def make_conv(spec: LayerSpec) -> nn.Module:
    """nn.Conv1d/2d/3d with the spec's geometry and PyTorch's default initialization."""
    g = spec.conv_geometry()
    cls = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[spec.ndim]
    return cls(
        spec.input.channels,
        spec.conv.out_channels,
        g["kernel"],
        stride=g["stride"],
        padding=g["padding"],
        dilation=g["dilation"],
        groups=spec.conv.groups,
        bias=spec.conv.bias,
    )


def forward(spec: LayerSpec, x: torch.Tensor, weight, bias, params: dict) -> torch.Tensor:
    """The layer applied to x, stage by stage, with torch ops (any float dtype, any device)."""
    g = spec.conv_geometry()
    conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[spec.ndim]
    y = conv(x, weight, bias, g["stride"], g["padding"], g["dilation"], spec.conv.groups)
    for i, stage in enumerate(spec.epilogue):
        if stage.kind == "pointwise":
            row = ops.POINTWISE[stage.op]
            views = {
                name: params[name].reshape(params[name].shape[0], *([1] * (y.dim() - 2)))
                for name in row.params(stage.args)
            }
            y = row.torch_ref(y, stage.args, views)
        elif stage.kind == "pool":
            pool = ops.POOLS[stage.op]
            geometry = spec.pool_geometry(stage, f"epilogue[{i}]")
            args = SimpleNamespace(**{**stage.args.model_dump(), **geometry})
            y = pool.torch_ref(y, args, spec.ndim)
        else:
            dims = spec.reduce_dims(i)
            y = ops.REDUCTIONS[stage.op].torch_ref(y, dims, stage.args.keepdim)
    return y


class Reference(nn.Module):
    """The plain PyTorch model of a spec: `conv` plus one nn.Parameter per per-channel parameter."""

    def __init__(self, spec_or_path):
        super().__init__()
        self.spec = load(spec_or_path)
        self.conv = make_conv(self.spec)
        for name, shape in self.spec.params().items():
            self.register_parameter(name, nn.Parameter(torch.randn(shape)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return forward(self.spec, x, self.conv.weight, self.conv.bias, self.named_spec_params())

    def named_spec_params(self) -> dict:
        return {name: getattr(self, name) for name in self.spec.params()}


def forward64(spec: LayerSpec, x, weight, bias, params: dict) -> torch.Tensor:
    """The float64 reference on the CPU... or on x's device: everything upcast to float64."""
    d = lambda t: None if t is None else t.detach().double()  # noqa: E731
    return forward(spec, d(x), d(weight), d(bias), {k: d(v) for k, v in params.items()})
