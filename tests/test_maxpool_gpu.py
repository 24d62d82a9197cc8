"""The max-pool kernel on the GPU (marker `gpu`; skipped without CUDA): exact against PyTorch's
pool for each dtype and layout, 1-D to 3-D, overlapping and uneven windows, padding, dilation and
ceil mode, batches 1 and 3, on memory poisoned first, each call twice (the second by the recorded
launch, on a new input); a NaN in a window is the result; torch.compile traces it whole."""

from __future__ import annotations

import itertools

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

from specgen.maxpool import MaxPoolLayer, MaxPoolPlan  # noqa: E402

pytestmark = [pytest.mark.gpu]

# name -> (channels, size, kernel, stride[, padding, dilation, ceil_mode])
SHAPES = {
    "unet_2x2": (32, (16, 18), (2, 2), (2, 2)),
    "overlap_3x3_s2": (19, (15, 13), (3, 3), (2, 2)),
    "uneven_3d": (5, (5, 7, 9), (2, 3, 2), (2, 2, 3)),
    "pool_1d": (7, (33,), (4,), (3,)),
    "stem_padded_ceil": (24, (15, 16), (3, 3), (2, 2), (1, 1), (1, 1), True),
    "ceil_only": (9, (7, 10), (2, 3), (2, 2), (0, 0), (1, 1), True),
    "dilated_3d_ceil": (6, (6, 7, 9), (2, 3, 3), (2, 2, 3), (1, 1, 0), (2, 1, 2), True),
    "dilated_1d_padded": (5, (21,), (3,), (2,), (1,), (3,), False),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_CL = {4: torch.channels_last, 5: torch.channels_last_3d}
_POOL = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}


@pytest.mark.parametrize("name, dtype", list(itertools.product(SHAPES, DTYPES)))
def test_the_kernel_is_pytorch_s_pool_exactly(name, dtype):
    c, size, kernel, stride, *more = SHAPES[name]
    plan = MaxPoolPlan(c, size, kernel, stride, dtype, *more)
    layer = MaxPoolLayer(plan)
    gen = torch.Generator(device="cuda").manual_seed(7)
    for batch, cl, _ in itertools.product((1, 3), (False, True) if len(size) > 1 else (False,), range(2)):  # (twice: replayed)
        x = torch.randn((batch, c, *size), generator=gen, device="cuda").to(DTYPES[dtype])
        if batch == 3:
            x.view(-1)[::97] = float("nan")  # (a NaN in some windows: the result there)
        if cl:
            x = x.contiguous(memory_format=_CL[x.dim()])
        want = _POOL[len(size)](x, list(kernel), list(stride), list(plan.padding), list(plan.dilation), plan.ceil_mode)
        torch.full((want.numel() + 64,), float("nan"), device="cuda", dtype=want.dtype)  # (a freed block of NaNs)
        with torch.no_grad():
            got = layer(x)
        fmt = _CL[x.dim()] if cl else torch.contiguous_format
        assert got.is_contiguous(memory_format=fmt) and got.shape == want.shape
        assert torch.equal(got.isnan(), want.isnan()), (batch, cl)
        assert torch.equal(got.nan_to_num(), want.nan_to_num()), (batch, cl)


def test_torch_compile_traces_it_whole():
    layer = MaxPoolLayer(MaxPoolPlan(16, (12, 12), (2, 2), (2, 2), "bfloat16"))
    x = torch.randn(3, 16, 12, 12, device="cuda").bfloat16()
    with torch.no_grad():
        got = torch.compile(layer, fullgraph=True)(x)
    assert torch.equal(got, F.max_pool2d(x, 2))
