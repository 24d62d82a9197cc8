"""The same layer in plain PyTorch, built from the spec: the ground truth for tests and `check`,
and the path a FusedLayer takes on the CPU.

`forward` is dtype-agnostic, so calling it with float64 tensors gives the float64 reference.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
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
    """The layer applied to x, stage by stage, with torch ops (any float dtype, any device). A
    training-mode batch norm normalizes with the batch's statistics; nothing is updated here
    (`forward_with_stats` also returns them, `update_running_stats` applies them)."""
    return stages(spec)(x, weight, bias, params)


def forward_with_stats(spec: LayerSpec, x: torch.Tensor, weight, bias, params: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, batch statistics): the statistics of the training-mode batch norms that keep running
    statistics (spec.running_stat_stages()), one after the other, each [mean (C), biased variance
    (C)] over the batch and the positions: the layout the kernels write them in."""
    found: list = []
    y = stages(spec)(x, weight, bias, params, found)
    stats = torch.cat(found) if found else x.new_empty((0,))
    return y, stats


def stats_size(spec: LayerSpec) -> int:
    """Floats of forward_with_stats' statistics: 2 C per training-mode batch norm with running statistics."""
    shapes = spec.shapes()
    return sum(2 * shapes[i].axis("c").extent for i in spec.running_stat_stages())


@dataclass(frozen=True)
class RunningStats:
    """One training-mode batch norm's running statistics, as plain values (read on every forward,
    so torch.compile traces the update without graph breaks)."""

    running_mean: str
    running_var: str
    num_batches_tracked: str
    channels: int
    positions: int  # values per channel and sample
    momentum: float | None


def running_stats(spec: LayerSpec) -> tuple[RunningStats, ...]:
    """The training-mode batch norms that keep running statistics, in the order of their batch statistics."""
    shapes = spec.shapes()
    out = []
    for i in spec.running_stat_stages():
        a = spec.epilogue[i].args
        out.append(RunningStats(a.running_mean, a.running_var, a.num_batches_tracked, shapes[i].axis("c").extent,
                                math.prod(shapes[i].sizes[1:]), a.momentum))
    return tuple(out)


def update_running_stats(module: nn.Module, stages: tuple[RunningStats, ...], stats: torch.Tensor, batch: int) -> None:
    """nn.BatchNormNd's update of its running statistics in training mode, from a layer's batch
    statistics (forward_with_stats' layout), on `module`'s buffers in place: num_batches_tracked
    += 1; f = momentum, or 1 / num_batches_tracked for momentum null; running_mean = (1 - f) *
    running_mean + f * mean; running_var likewise with the unbiased variance (n / (n - 1) times
    the biased one, n the values per channel in the batch)."""
    offset = 0
    with torch.no_grad():
        for st in stages:
            n = batch * st.positions
            mean, var = stats[offset:offset + st.channels], stats[offset + st.channels:offset + 2 * st.channels]
            offset += 2 * st.channels
            tracked = getattr(module, st.num_batches_tracked)
            tracked.add_(1)
            factor = (1.0 / tracked) if st.momentum is None else st.momentum  # a tensor for a cumulative average
            for name, value in ((st.running_mean, mean), (st.running_var, var * (n / max(n - 1, 1)))):
                running = getattr(module, name)
                running.mul_(1 - factor).add_(value.reshape(running.shape).to(running.dtype) * factor)


def one_value_batch_norm(spec: LayerSpec) -> bool:
    """Whether a batch norm with batch statistics sees one value per channel and sample (then a batch
    of one has no variance: check_batch_stats_size refuses it)."""
    shapes = spec.shapes()
    return any(s.op == "batch_norm" and s.kind == "norm" and math.prod(shapes[i].sizes[1:]) == 1 for i, s in enumerate(spec.epilogue))


def check_batch_stats_size(spec: LayerSpec, batch: int) -> None:
    """nn.BatchNormNd's refusal in training mode: one value per channel has no variance."""
    shapes = spec.shapes()
    for i, stage in enumerate(spec.epilogue):
        if stage.op == "batch_norm" and stage.kind == "norm" and batch * math.prod(shapes[i].sizes[1:]) == 1:
            raise ValueError(
                f"{spec.name}: epilogue[{i}] batch_norm: expected more than 1 value per channel when training, got "
                f"input size {[batch, *shapes[i].sizes]}"
            )


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

    elif spec.upsampled():  # the conv reads its input upsampled (nearest), as nn.Upsample then nn.ConvNd
        plain = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[spec.ndim]
        scale = tuple(float(u) for u in g["upsample"])

        def conv(x, weight, bias, stride, padding, dilation, groups):
            return plain(F.interpolate(x, scale_factor=scale, mode="nearest"), weight, bias, stride, padding, dilation, groups)

    else:
        conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[spec.ndim]
    steps = []
    param_shapes = spec.params()
    for i, stage in enumerate(spec.epilogue):
        if stage.op == "save":  # the value here, by name, for a later {saved: name} operand
            steps.append(functools.partial(_save, stage.args.name))
        elif stage.kind == "pointwise":
            row, args = ops.POINTWISE[stage.op], stage.args
            names = tuple(row.params(args))
            # extra inputs and saved values: of the value's own shape, used as they come
            inputs = tuple(row.inputs(args)) + tuple(row.saved(args))
            # one call on a dummy tensor warms whatever the op caches (e.g. a parsed expression),
            # so no parsing happens inside a traced forward
            channels = {n: s[0] for n, s in param_shapes.items() if n in names}
            c = next(iter(channels.values()), 1)
            dummy = torch.zeros((1, c) + (1,) * spec.ndim)
            row.torch_ref(dummy, args, {**{n: torch.zeros((c,) + (1,) * spec.ndim) for n in names},
                                        **{n: dummy for n in inputs}})
            steps.append(functools.partial(_pointwise, row.torch_ref, args, names, inputs))
        elif stage.kind == "pool":
            geometry = spec.pool_geometry(stage, f"epilogue[{i}]")
            args = SimpleNamespace(**{**stage.args.model_dump(), **geometry})
            steps.append(functools.partial(_pool, ops.POOLS[stage.op].torch_ref, args, spec.ndim))
        elif stage.kind == "norm":
            span = spec.norm_span(i)
            collect = i in spec.running_stat_stages()
            steps.append(functools.partial(_norm, ops.NORMS[stage.op].torch_ref, stage.args, tuple(range(span.first, span.last + 1)), collect))
        else:
            steps.append(functools.partial(_reduce, ops.REDUCTIONS[stage.op].torch_ref, spec.reduce_dims(i), stage.args.keepdim))

    def run(x, weight, bias, params, stats=None):
        y = conv(x, weight, bias, stride, padding, dilation, groups)
        params = dict(params)  # (a save stage adds its value)
        for step in steps:
            y = step(y, params, stats)
        return y

    return run


_built: dict[int, tuple] = {}


def stages(spec: LayerSpec):
    """The layer's function for this spec object (built once per object; specs are frozen)."""
    hit = _built.get(id(spec))
    if hit is None or hit[0] is not spec:
        hit = _built[id(spec)] = (spec, _stages(spec))
    return hit[1]


def _pointwise(torch_ref, args, names, inputs, y, params, stats=None):
    views = {name: params[name].reshape(params[name].shape[0], *([1] * (y.dim() - 2))) for name in names}
    for name in inputs:
        views[name] = params[name]
    return torch_ref(y, args, views)


def _save(name, y, params, stats=None):
    params[name] = y
    return y


def _pool(torch_ref, args, ndim, y, params, stats=None):
    return torch_ref(y, args, ndim)


def _reduce(torch_ref, dims, keepdim, y, params, stats=None):
    return torch_ref(y, dims, keepdim)


def _norm(torch_ref, args, dims, collect, y, params, stats=None):
    """A statistic stage; a training-mode batch norm that keeps running statistics also appends its
    batch mean and biased variance (per channel) to `stats` when it is a list."""
    if collect and stats is not None:
        over = (0, *dims)
        stats.append(torch.cat([y.detach().mean(over), y.detach().var(over, unbiased=False)]))
    return torch_ref(y, args, {n: params[n] for n in args.names()}, dims)


def add_spec_params(module: nn.Module, spec: LayerSpec) -> None:
    """Register the spec's per-channel tensors on `module` under their spec names, shaped (C, 1, ...):
    learnable parameters drawn from a standard normal, except where the op says otherwise (batch
    norm: weight 1 and bias 0 as parameters, running mean 0 and variance 1 as buffers, as in
    nn.BatchNormNd; the norms' weights 1 and biases 0, a layer norm's of its normalized shape);
    and a training-mode batch norm's running statistics and num_batches_tracked as buffers."""
    inits = spec.param_inits()
    for name, shape in spec.params().items():
        init = inits.get(name, ops.ParamInit())
        value = torch.randn(shape) if init.fill is None else torch.full(shape, init.fill)
        if init.buffer:
            module.register_buffer(name, value)
        else:
            module.register_parameter(name, nn.Parameter(value))
    for name, (shape, fill, dtype) in spec.buffers().items():  # a training-mode batch norm's running statistics
        module.register_buffer(name, torch.full(shape, fill, dtype=getattr(torch, dtype)))


class Reference(nn.Module):
    """The plain PyTorch model of a spec: `conv` plus one nn.Parameter per per-channel parameter.
    Its training-mode batch norms behave as nn.BatchNormNd: in training mode they normalize with the
    batch's statistics and update the running ones, after .eval() they use the running ones."""

    def __init__(self, spec_or_path):
        super().__init__()
        self.spec = load(spec_or_path)
        self.conv = make_conv(self.spec)
        self._run = stages(self.spec)
        self._param_names = tuple(self.spec.params())
        self._input_names = tuple(self.spec.inputs())
        self._twin = self.spec.eval_twin()
        self._running_stats = running_stats(self.spec)
        add_spec_params(self, self.spec)

    def forward(self, x: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
        """The layer on x and the spec's extra inputs (spec.inputs(), in that order)."""
        if len(inputs) != len(self._input_names):
            raise TypeError(f"{self.spec.name}: takes x and {len(self._input_names)} extra input(s), got {len(inputs)}")
        extra = dict(zip(self._input_names, inputs))
        if self._twin is None:
            return self._run(x, self.conv.weight, self.conv.bias, {**self.named_spec_params(), **extra})
        if not self.training:
            params = {n: getattr(self, n) for n in self._twin.params()}
            return forward(self._twin, x, self.conv.weight, self.conv.bias, {**params, **extra})
        check_batch_stats_size(self.spec, x.shape[0])
        y, stats = forward_with_stats(self.spec, x, self.conv.weight, self.conv.bias, {**self.named_spec_params(), **extra})
        update_running_stats(self, self._running_stats, stats, x.shape[0])
        return y

    def named_spec_params(self) -> dict:
        return {name: getattr(self, name) for name in self._param_names}


def forward64(spec: LayerSpec, x, weight, bias, params: dict) -> torch.Tensor:
    """The float64 reference, on x's device: every tensor upcast to float64."""
    d = lambda t: None if t is None else t.detach().double()  # noqa: E731
    return forward(spec, d(x), d(weight), d(bias), {k: d(v) for k, v in params.items()})
