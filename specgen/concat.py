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

import hashlib
import json
import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from specgen.standalone import THREADS, StandaloneLayer
from specgen.upsample import MAX_SCALE

MAX_SOURCES = 8  # values one concatenation joins (each a pointer argument and a branch of the kernel)
_INT32_MAX = 2**31 - 1
TILES = (32, 64)  # a block's tile sizes: channels x positions (each thread moves tile^2 / 256 values)
GRID_Y_MAX = 65535  # samples one launch covers (its grid's y extent)
DTYPES = {"float32": ("float", torch.float32), "bfloat16": ("__nv_bfloat16", torch.bfloat16),
          "float16": ("__half", torch.float16)}


def check_count(value, what: str, low: int, high: int | None = None) -> int:
    """`value`, an int from `low` to `high`; ValueError naming `what` otherwise (a bool is not one)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"from {low} to {high}" if high is not None else f"at least {low}"
        raise ValueError(f"{what}: expected an integer {bound}, got {value!r}")
    return value


@dataclass(frozen=True)
class Source:
    """One value of the concatenation: its channels, its spatial extents, and the nearest-upsampling
    factor per spatial dim (1: read as it is)."""

    channels: int
    size: tuple[int, ...]
    factors: tuple[int, ...]


@dataclass(frozen=True)
class ConcatPlan:
    """A concatenation along dim 1 of `sources` into [batch, sum of channels, *size] of `dtype`
    ("float32", "bfloat16" or "float16"), written channels-last where `channels_last`. ValueError
    (naming the field) where it is not one."""

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

    def canonical_json(self) -> str:
        return json.dumps({"concat": asdict(self)}, sort_keys=True, separators=(",", ":"))

    @property
    def kernel_name(self) -> str:
        return "specgen_concat_" + hashlib.sha256(self.canonical_json().encode()).hexdigest()[:16]


def dtype_name(dtype: torch.dtype) -> str:
    """The plan's name of a torch dtype ("float32", "bfloat16", "float16"); ValueError for another."""
    for name, (_, t) in DTYPES.items():
        if t == dtype:
            return name
    raise ValueError(f"dtype: expected one of {', '.join(DTYPES)}, got {dtype}")


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


def _layout_bit(t: torch.Tensor) -> int | None:
    """0 where `t` lies [N][C][positions] contiguous, 1 where channels-last, None otherwise."""
    if t.is_contiguous():
        return 0
    fmt = {4: torch.channels_last, 5: torch.channels_last_3d}.get(t.dim())
    return 1 if fmt is not None and t.is_contiguous(memory_format=fmt) else None


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


_ops: dict[str, object] = {}  # plan's kernel name -> its custom op
_op_layers: dict[str, "ConcatLayer"] = {}  # ... and the layer its op launches with


def custom_op(plan: ConcatPlan):
    """The plan's custom op, `torch.ops.specgen.<kernel name>(values) -> Tensor`, registered once."""
    name = plan.kernel_name
    op = _ops.get(name)
    if op is not None:
        return op
    fmt = _memory_format(plan)
    dtype = DTYPES[plan.dtype][1]

    def impl(values: list[torch.Tensor]) -> torch.Tensor:
        layer = _op_layers.get(name)
        if layer is None:
            layer = _op_layers[name] = ConcatLayer(plan)
        layer._check(values)
        if values[0].device.type != "cuda":
            return reference(values, layer._factors).contiguous(memory_format=fmt)
        return layer._launch(values)

    impl.__name__ = name
    op = torch.library.custom_op(f"specgen::{name}", impl, mutates_args=(), schema="(Tensor[] values) -> Tensor")

    def fake(values):
        return torch.empty((values[0].shape[0], plan.channels, *plan.size), dtype=dtype, device=values[0].device,
                           memory_format=fmt)

    def setup_context(ctx, inputs, output):
        pass

    def backward(ctx, grad):
        firsts = [sum(s.channels for s in plan.sources[:k]) for k in range(len(plan.sources))]
        return [_source_grad(grad, first, src) for first, src in zip(firsts, plan.sources)]

    op.register_fake(fake)
    op.register_autograd(backward, setup_context=setup_context)
    _ops[name] = op
    return op


def _memory_format(plan: ConcatPlan) -> torch.memory_format:
    if not plan.channels_last:
        return torch.contiguous_format
    return {4: torch.channels_last, 5: torch.channels_last_3d}[2 + len(plan.size)]


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

    def extra_repr(self) -> str:
        return (f"sources={[list(s) for s in self._shapes]}, factors={[list(f) for f in self._factors]}, "
                f"dtype={self.plan.dtype}, channels_last={self.plan.channels_last}")

    def forward(self, *values: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return self._op(list(values))
        self._check(values)
        if values[0].device.type != "cuda" or (torch.is_grad_enabled() and any(v.requires_grad for v in values)):
            return reference(values, self._factors).contiguous(memory_format=self._fmt)
        return self._launch(values)

    def _check(self, values) -> None:
        if len(values) != len(self._shapes):
            raise ValueError(f"{type(self).__name__}: expected {len(self._shapes)} tensors, got {len(values)}")
        batch = values[0].shape[0]
        for k, (v, shape) in enumerate(zip(values, self._shapes)):
            if tuple(v.shape[1:]) != shape or v.shape[0] != batch or v.dtype != self._dtype:
                raise ValueError(f"{type(self).__name__}: input {k}: expected [{batch}, {', '.join(map(str, shape))}] "
                                 f"of {self._dtype}, got {list(v.shape)} of {v.dtype}")
        if any(v.device != values[0].device for v in values):
            raise ValueError(f"{type(self).__name__}: inputs on several devices: {sorted({str(v.device) for v in values})}")

    def _launch(self, values) -> torch.Tensor:
        from specgen import runtime

        plan = self.plan
        values = [v if _layout_bit(v) is not None else v.contiguous() for v in values]
        layouts = sum(_layout_bit(v) << k for k, v in enumerate(values))
        batch = values[0].shape[0]
        out = torch.empty((batch, plan.channels, *plan.size), dtype=self._dtype, device=values[0].device,
                          memory_format=self._fmt)
        if batch == 0:
            return out
        kernel = self._kernel(out.get_device())
        n = len(values)
        pack = runtime.arg_pack((kernel.function.value, "concat"), ("ptr",) * (n + 1) + ("int", "int"))
        stream = torch.cuda.current_stream(out.device).cuda_stream
        item = out.element_size()
        for first in range(0, batch, GRID_Y_MAX):  # (a launch covers at most GRID_Y_MAX samples)
            count = min(GRID_Y_MAX, batch - first)
            for k, v in enumerate(values):
                pack.put(k, v.data_ptr() + first * v[0].numel() * item)
            pack.put(n, out.data_ptr() + first * plan.channels * plan.positions * item)
            pack.put(n + 1, layouts)
            pack.put(n + 2, count)
            runtime.launch_packed(kernel, kernel.function, plan.tiles, THREADS, 0, pack, stream, count)
        return out
