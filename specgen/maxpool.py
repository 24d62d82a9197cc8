"""A max pool on its own (`nn.MaxPoolNd` / `F.max_poolNd` that no fused chain takes: a UNet
encoder pools a value its skip connection also reads), with PyTorch's padding, dilation and ceil
mode, in one generated kernel (templates/maxpool.cu.j2).

PyTorch's CUDA max pool writes the index of each maximum (int64) besides the value, which an
inference model never reads: for a 16-bit model four times the bytes of the values. This kernel
writes the values alone, in the input's layout (NC(D)HW or channels-last, read at run time), every
extent, window and stride a literal. On CPU tensors, and where autograd records the call, the
layer runs PyTorch's own pool; under torch.compile it is the custom op
`torch.ops.specgen.<kernel name>` (its backward recomputes PyTorch's pool and differentiates it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specgen import tmarun
from specgen.standalone import DTYPES, StandalonePlan, THREADS, StandaloneLayer, check_count, lies_channels_last, register_op

_INT32_MAX = 2**31 - 1
_POOLS = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}


@dataclass(frozen=True)
class MaxPoolPlan(StandalonePlan):
    """max_poolNd of a [batch, channels, *size] value of `dtype` with window `kernel`, `stride`,
    `padding` (0 where None) and `dilation` (1 where None) per spatial dim, and `ceil_mode`, as
    PyTorch pools (the padding reads as -inf; a window past the end in ceil mode reads what is
    there). ValueError (naming the field) where PyTorch would refuse it or the kernel cannot."""

    KIND = "max_pool"

    channels: int
    size: tuple[int, ...]
    kernel: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str
    padding: tuple[int, ...] | None = None
    dilation: tuple[int, ...] | None = None
    ceil_mode: bool = False

    def __post_init__(self):
        nd = len(self.size) if isinstance(self.size, tuple) else 0
        if self.padding is None:
            object.__setattr__(self, "padding", (0,) * nd)
        if self.dilation is None:
            object.__setattr__(self, "dilation", (1,) * nd)
        check_count(self.channels, "channels", 1)
        for field, low in (("size", 1), ("kernel", 1), ("stride", 1), ("padding", 0), ("dilation", 1)):
            value = getattr(self, field)
            if not isinstance(value, tuple) or not 1 <= len(value) <= 3 or len(value) != len(self.size):
                raise ValueError(f"{field}: expected 1 to 3 values, one per spatial dim of size, got {value!r}")
            for d, v in enumerate(value):
                check_count(v, f"{field}[{d}]", low)
        if not isinstance(self.ceil_mode, bool):
            raise ValueError(f"ceil_mode: expected true or false, got {self.ceil_mode!r}")
        for d, (s, k, p, dl) in enumerate(zip(self.size, self.kernel, self.padding, self.dilation)):
            if p > k // 2:  # (PyTorch's own rule)
                raise ValueError(f"padding[{d}]: at most half the window ({k} // 2 = {k // 2}), as in PyTorch, got {p}")
            if s + 2 * p < dl * (k - 1) + 1:
                raise ValueError(f"kernel[{d}]: a window spanning {dl * (k - 1) + 1} is larger than the extent {s} "
                                 f"with padding {p} on each side")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: expected one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.channels * math.prod(self.size) > _INT32_MAX:
            raise ValueError(f"size: {self.channels} channels x {math.prod(self.size)} positions is more values per "
                             f"sample than the kernel indexes (2^31 - 1)")

    @property
    def out_size(self) -> tuple[int, ...]:
        """Extents out, as PyTorch works them out (in ceil mode a last window starts inside the
        input or its left padding)."""
        out = []
        for s, k, st, p, dl in zip(self.size, self.kernel, self.stride, self.padding, self.dilation):
            n = (s + 2 * p - dl * (k - 1) - 1 + (st - 1 if self.ceil_mode else 0)) // st + 1
            if self.ceil_mode and (n - 1) * st >= s + p:
                n -= 1
            out.append(n)
        return tuple(out)

    def describe(self) -> str:
        """kernel, stride and what differs from PyTorch's defaults, as the report prints them."""
        words = [f"kernel {list(self.kernel)}", f"stride {list(self.stride)}"]
        if any(self.padding):
            words.append(f"padding {list(self.padding)}")
        if any(d != 1 for d in self.dilation):
            words.append(f"dilation {list(self.dilation)}")
        if self.ceil_mode:
            words.append("ceil mode")
        return ", ".join(words)


def render(plan: MaxPoolPlan) -> str:
    """The plan's .cu (extents padded to D, H, W with leading 1s)."""
    from specgen import __version__
    from specgen.render import environment

    pad = (1,) * (3 - len(plan.size))
    return environment().get_template("maxpool.cu.j2").render(
        version=__version__, kernel_name=plan.kernel_name, ctype=DTYPES[plan.dtype][0], channels=plan.channels,
        dims=len(plan.size), size=plan.size, out_size=plan.out_size, kernel=plan.kernel, stride=plan.stride,
        padding=plan.padding, dilation=plan.dilation, ceil_mode=plan.ceil_mode,
        in3=pad + plan.size, out3=pad + plan.out_size, k3=pad + plan.kernel, s3=pad + plan.stride,
        p3=(0,) * len(pad) + plan.padding, d3=pad + plan.dilation, window=math.prod(plan.kernel),
        in_positions=math.prod(plan.size), out_positions=math.prod(plan.out_size))


def build_request(plan: MaxPoolPlan, arch: str | None = None):
    from specgen import cache

    return cache.BuildRequest(plan.kernel_name, render(plan), plan.canonical_json(), arch)


def reference(x: torch.Tensor, plan: MaxPoolPlan) -> torch.Tensor:
    """PyTorch's own pool."""
    return _POOLS[len(plan.size)](x, list(plan.kernel), list(plan.stride), list(plan.padding), list(plan.dilation),
                                  plan.ceil_mode)


def _format_of(x: torch.Tensor) -> torch.memory_format:
    """The memory format the pool writes for input `x`: its own (channels-last, else contiguous)."""
    return tmarun.channels_last_format(x.dim()) if lies_channels_last(x) else torch.contiguous_format


def custom_op(plan: MaxPoolPlan):
    """The plan's custom op, `torch.ops.specgen.<kernel name>(x) -> Tensor`, registered once."""
    dtype = DTYPES[plan.dtype][1]

    def fake(x):
        return torch.empty((x.shape[0], plan.channels, *plan.out_size), dtype=dtype, device=x.device,
                           memory_format=_format_of(x))

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            x = x.detach().requires_grad_()
            (gx,) = torch.autograd.grad(reference(x, plan), x, grad)
        return gx

    return register_op(MaxPoolLayer, plan, "(Tensor x) -> Tensor", fake, setup_context, backward)


class MaxPoolLayer(StandaloneLayer):
    """`max_poolNd(x, kernel, stride)` by one specialized kernel on CUDA tensors (built for the
    plan's extents; any batch), PyTorch's pool elsewhere."""

    _request = staticmethod(build_request)
    _custom_op = staticmethod(custom_op)

    def __init__(self, plan: MaxPoolPlan, arch: str | None = None, built=None):
        """`built`: the kernel's build result where the caller built it already (`cache.build_many`)."""
        super().__init__(plan, arch, built)
        self._dtype = DTYPES[plan.dtype][1]
        self._shape = (plan.channels, *plan.size)
        self._in_values = plan.channels * math.prod(plan.size)  # values per sample
        self._out_values = plan.channels * math.prod(plan.out_size)

    def extra_repr(self) -> str:
        p = self.plan
        return f"channels={p.channels}, size={list(p.size)}, {p.describe()}, dtype={p.dtype}"

    def _check(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor) or tuple(x.shape[1:]) != self._shape or x.dtype != self._dtype:
            got = f"{list(x.shape)} of {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{type(self).__name__}: expected [batch, {', '.join(map(str, self._shape))}] of "
                             f"{self._dtype}, got {got}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return self._op(x)
        if torch.is_grad_enabled() and isinstance(x, torch.Tensor) and x.requires_grad:
            self._check(x)
            return reference(x, self.plan)  # (differentiable)
        return self._run(x)

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        """The kernel on a CUDA tensor, PyTorch's pool elsewhere (what the custom op runs)."""
        out = self._replay((x,))  # (a call like the last one: its launch repeated)
        if out is not None:
            return out
        self._check(x)
        return self._launch(x) if x.is_cuda else reference(x, self.plan)

    def _launch(self, x: torch.Tensor) -> torch.Tensor:
        plan = self.plan
        given = x
        cl = lies_channels_last(x)
        if not cl and not x.is_contiguous():
            x = x.contiguous()
        batch = x.shape[0]
        out = torch.empty((batch, plan.channels, *plan.out_size), dtype=self._dtype, device=x.device,
                          memory_format=tmarun.channels_last_format(x.dim()) if cl else torch.contiguous_format)
        if batch:
            item = x.element_size()
            self._queue(x.get_device(), [x.data_ptr(), out.data_ptr()], [self._in_values * item, self._out_values * item],
                        (int(cl),), -(-self._out_values // THREADS), batch, record=((x,), out) if x is given else None)
        return out
