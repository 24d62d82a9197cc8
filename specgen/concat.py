"""Values joined along the channels, some nearest-upsampled: `torch.cat([up(x), skip], 1)`, a UNet
decoder's join, in one generated kernel (templates/concat.cu.j2).

PyTorch makes the upsampled tensor (one pass), then the concatenation (another), and the conv that
reads it lays it out for its tensor cores (a third: the TMA engine's layout pass). `ConcatLayer`
writes the concatenation once, reading each source where it lies (NC(D)HW or channels-last, the
upsampled ones at their own size), in the layout its reader wants: channels-last where the conv
after it reads such an input in place (`from_module` decides, `torchop.reads_channels_last_in_place`),
else NC(D)HW. Every extent, channel count, offset and factor is a literal of the kernel; only the
sources' layouts (a bit each) and the batch are read at run time. The values are copied exactly.

On CPU tensors, and where autograd records the call, the layer runs PyTorch's own ops (`reference`).
Under torch.compile it is the custom op `torch.ops.specgen.<kernel name>` (one per plan: a fake
implementation gives the output's shape and layout, and its backward slices the gradient per source
and sums each upsampled block), so `torch.compile(fullgraph=True)` traces a model that holds it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specgen import tmarun
from specgen.standalone import DTYPES, StandalonePlan, StandaloneLayer, check_count, lies_channels_last, register_op
from specgen.upsample import MAX_SCALE

MAX_SOURCES = 8  # values one concatenation joins (each a pointer argument and a branch of the kernel)
_INT32_MAX = 2**31 - 1
TILES = (32, 64)  # a block's tile sizes: channels x positions (each thread moves tile^2 / 256 values)


@dataclass(frozen=True)
class Source:
    """One value of the concatenation: its channels, its spatial extents, and the nearest-upsampling
    factor per spatial dim (1: read as it is)."""

    channels: int
    size: tuple[int, ...]
    factors: tuple[int, ...]


@dataclass(frozen=True)
class ConcatPlan(StandalonePlan):
    """A concatenation along dim 1 of `sources` into [batch, sum of channels, *size] of `dtype`
    ("float32", "bfloat16" or "float16"), written channels-last where `channels_last`. ValueError
    (naming the field) where it is not one."""

    KIND = "concat"

    sources: tuple[Source, ...]
    size: tuple[int, ...]
    dtype: str
    channels_last: bool = False
    tile: int = 32  # a block's tile: `tile` channels x `tile` positions (32, or 64: slower where measured, `benchmarks/concat_join.py`)

    def __post_init__(self):
        if not isinstance(self.size, tuple) or not 1 <= len(self.size) <= 3:
            raise ValueError(f"size: expected 1 to 3 spatial extents, got {self.size!r}")
        for i, s in enumerate(self.size):
            check_count(s, f"size[{i}]", 1)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: expected one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.tile not in TILES or isinstance(self.tile, bool):
            raise ValueError(f"tile: expected one of {', '.join(map(str, TILES))}, got {self.tile!r}")
        if not isinstance(self.channels_last, bool):
            raise ValueError(f"channels_last: expected a bool, got {self.channels_last!r}")
        if self.channels_last and len(self.size) == 1:
            raise ValueError("channels_last: a 1-D value [N, C, L] has no channels-last layout")
        if not isinstance(self.sources, tuple) or not 1 <= len(self.sources) <= MAX_SOURCES:
            raise ValueError(f"sources: expected 1 to {MAX_SOURCES} values, got {self.sources!r}")
        for k, src in enumerate(self.sources):
            where = f"sources[{k}]"
            if not isinstance(src, Source):
                raise ValueError(f"{where}: expected a Source, got {src!r}")
            check_count(src.channels, f"{where}.channels", 1)
            if not isinstance(src.size, tuple) or not isinstance(src.factors, tuple) \
                    or len(src.size) != len(self.size) or len(src.factors) != len(self.size):
                raise ValueError(f"{where}: expected {len(self.size)} extents and factors, got size {src.size!r}, "
                                 f"factors {src.factors!r}")
            for d, (s, f, o) in enumerate(zip(src.size, src.factors, self.size)):
                check_count(s, f"{where}.size[{d}]", 1)
                check_count(f, f"{where}.factors[{d}]", 1, MAX_SCALE)
                if s * f != o:
                    raise ValueError(f"{where}: extent {s} upsampled {f}x along spatial dim {d} is {s * f}, "
                                     f"but the output's is {o}")
        if self.channels * self.positions > _INT32_MAX:
            raise ValueError(f"size: {self.channels} channels x {self.positions} positions is more values per "
                             f"sample than the kernel indexes (2^31 - 1)")

    @property
    def channels(self) -> int:
        return sum(s.channels for s in self.sources)

    @property
    def positions(self) -> int:
        return math.prod(self.size)

    @property
    def tiles(self) -> int:
        """Blocks per sample: tiles of (positions, channels)."""
        return -(-self.positions // self.tile) * -(-self.channels // self.tile)



def render(plan: ConcatPlan) -> str:
    """The plan's .cu (extents padded to D, H, W with leading 1s)."""
    from specgen import __version__
    from specgen.render import environment

    pad = (1,) * (3 - len(plan.size))
    sources, first = [], 0
    for k, s in enumerate(plan.sources):
        up = [f for f in s.factors if f != 1]
        expr = f"x{k}" if not up else f"upsample_nearest(x{k}, {list(s.factors)})"
        sources.append({"channels": s.channels, "first": first, "size": pad + s.size, "factors": pad + s.factors,
                        "shape": s.size, "expr": expr})
        first += s.channels
    text = environment().get_template("concat.cu.j2").render(
        version=__version__, kernel_name=plan.kernel_name, ctype=DTYPES[plan.dtype][0], channels=plan.channels,
        out_size=pad + plan.size, out_shape=plan.size, tile=plan.tile, dims=len(plan.size), positions=plan.positions, tiles=plan.tiles,
        sources=sources, channels_last=plan.channels_last)
    return text


def build_request(plan: ConcatPlan, arch: str | None = None):
    from specgen import cache

    return cache.BuildRequest(plan.kernel_name, render(plan), plan.canonical_json(), arch)


def reference(values, factors) -> torch.Tensor:
    """PyTorch's own: each value nearest-upsampled by its factors, then torch.cat along dim 1."""
    parts = [v if all(f == 1 for f in fs) else F.interpolate(v, scale_factor=[float(f) for f in fs], mode="nearest")
             for v, fs in zip(values, factors)]
    return torch.cat(parts, 1)


def _source_grad(grad: torch.Tensor, first: int, source: Source) -> torch.Tensor:
    """The gradient of one source of a concatenation: its channels of `grad`, each upsampled
    block summed back to the value it copied."""
    g = grad[:, first:first + source.channels]
    if all(f == 1 for f in source.factors):
        return g.contiguous()
    split = [g.shape[0], source.channels]
    for s, f in zip(source.size, source.factors):
        split += [s, f]
    return g.reshape(split).sum(dim=tuple(range(3, len(split), 2)))


def custom_op(plan: ConcatPlan):
    """The plan's custom op, `torch.ops.specgen.<kernel name>(values) -> Tensor`, registered once."""
    fmt = _memory_format(plan)
    dtype = DTYPES[plan.dtype][1]
    firsts = [sum(s.channels for s in plan.sources[:k]) for k in range(len(plan.sources))]

    def fake(values):
        return torch.empty((values[0].shape[0], plan.channels, *plan.size), dtype=dtype, device=values[0].device,
                           memory_format=fmt)

    def setup_context(ctx, inputs, output):
        pass

    def backward(ctx, grad):
        return [_source_grad(grad, first, src) for first, src in zip(firsts, plan.sources)]

    return register_op(ConcatLayer, plan, "(Tensor[] values) -> Tensor", fake, setup_context, backward)


def _memory_format(plan: ConcatPlan) -> torch.memory_format:
    return tmarun.channels_last_format(2 + len(plan.size)) if plan.channels_last else torch.contiguous_format


class ConcatLayer(StandaloneLayer):
    """`torch.cat([upsample_nearest(x_k, factors[k]) ...], 1)` by one specialized kernel on CUDA
    tensors (built for the plan's extents; any batch), PyTorch's ops elsewhere."""

    _request = staticmethod(build_request)
    _custom_op = staticmethod(custom_op)

    def __init__(self, plan: ConcatPlan, arch: str | None = None, built=None):
        """`built`: the kernel's build result where the caller built it already (`cache.build_many`)."""
        super().__init__(plan, arch, built)
        self._factors = [s.factors for s in plan.sources]
        self._shapes = [(s.channels, *s.size) for s in plan.sources]
        self._dtype = DTYPES[plan.dtype][1]
        self._fmt = _memory_format(plan)
        # values per sample of each source, then of the output (how far each pointer moves a sample)
        self._sample_values = [s.channels * math.prod(s.size) for s in plan.sources] + [plan.channels * plan.positions]

    def extra_repr(self) -> str:
        return (f"sources={[list(s) for s in self._shapes]}, factors={[list(f) for f in self._factors]}, "
                f"dtype={self.plan.dtype}, channels_last={self.plan.channels_last}")

    def forward(self, *values: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return self._op(list(values))
        if torch.is_grad_enabled() and any(v.requires_grad for v in values):
            self._check(values)
            return self._reference(values)  # (differentiable)
        return self._run(values)

    def _run(self, values) -> torch.Tensor:
        """The kernel on CUDA tensors, PyTorch's ops elsewhere (what the custom op runs)."""
        out = self._replay(values)  # (a call like the last one: its launch repeated)
        if out is not None:
            return out
        self._check(values)
        return self._launch(values) if values[0].is_cuda else self._reference(values)

    def _reference(self, values) -> torch.Tensor:
        return reference(values, self._factors).contiguous(memory_format=self._fmt)

    def _check(self, values) -> None:
        if len(values) != len(self._shapes):
            raise ValueError(f"{type(self).__name__}: expected {len(self._shapes)} tensors, got {len(values)}")
        for k, v in enumerate(values):
            if not isinstance(v, torch.Tensor):
                raise ValueError(f"{type(self).__name__}: input {k}: expected a tensor, got {type(v).__name__}")
        batch = values[0].shape[0]
        for k, (v, shape) in enumerate(zip(values, self._shapes)):
            if tuple(v.shape[1:]) != shape or v.shape[0] != batch or v.dtype != self._dtype:
                raise ValueError(f"{type(self).__name__}: input {k}: expected [{batch}, {', '.join(map(str, shape))}] "
                                 f"of {self._dtype}, got {list(v.shape)} of {v.dtype}")
        if any(v.device != values[0].device for v in values):
            raise ValueError(f"{type(self).__name__}: inputs on several devices: {sorted({str(v.device) for v in values})}")

    def _launch(self, values) -> torch.Tensor:
        plan = self.plan
        # each source as it lies (NC(D)HW or channels-last: a bit each), any other layout made contiguous
        layouts = [lies_channels_last(v) for v in values]
        given = values
        values = [v if cl or v.is_contiguous() else v.contiguous() for v, cl in zip(values, layouts)]
        batch = values[0].shape[0]
        out = torch.empty((batch, plan.channels, *plan.size), dtype=self._dtype, device=values[0].device,
                          memory_format=self._fmt)
        if batch:
            item = out.element_size()
            as_given = all(v is g for v, g in zip(values, given))
            self._queue(out.get_device(), [v.data_ptr() for v in values] + [out.data_ptr()],
                        [n * item for n in self._sample_values], (sum(cl << k for k, cl in enumerate(layouts)),),
                        plan.tiles, batch, record=(tuple(values), out) if as_given else None)
        return out
