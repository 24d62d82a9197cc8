"""The FFMA engine on bf16 / fp16 layers, reading and writing their 16-bit tensors itself: at the
mode's bar against PyTorch in that dtype, and bit for bit the fp32 kernel's result on the widened
tensors rounded once (what the engine computed before it read 16 bits, and the same arithmetic)."""
from __future__ import annotations

import pytest
import torch
from gpu_helpers import as_channels_last, compare, poisoned, randomize, random_input
from sixteen_bit_specs import FFMA_16, spec

from specgen import FusedLayer

pytestmark = pytest.mark.gpu

PRECISIONS = ["bf16", "fp16"]
DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _layer(name: str, precision: str, prefix: str = "h16") -> FusedLayer:
    return FusedLayer(spec(name, precision, prefix)).cuda()


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("name", [*FFMA_16, "pool_split"])
def test_16_bit_layers_on_the_ffma_engine_meet_the_modes_bar(name, precision):
    layer = _layer(name, precision)
    for batch, seed in ((1, 1), (3, 2)):
        compare(layer, batch, seed)
        compare(layer, batch, seed + 10, channels_last=True)


# The plan's tiling, which fixes each output's order of sums: equal in both modes, so the sums are
# the same and the two results may be compared bit for bit.
_TILING = ("box", "ct", "pt", "tiles", "threads", "reductions", "levels", "lanes", "cluster", "weights_in_smem")


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("name", [n for n in FFMA_16 if n != "dw_spatial_mean"])  # (fp32: a tap-sum rewrite)
def test_the_16_bit_kernel_equals_the_fp32_kernel_on_widened_tensors_rounded_once(name, precision):
    low, wide = _layer(name, precision), _layer(name, "fp32", "h32")
    lp, wp = low.specialize().plan, wide.specialize().plan
    assert lp["engine"] == wp["engine"] == "ffma"
    assert {k: lp[k] for k in _TILING} == {k: wp[k] for k in _TILING}
    gen = torch.Generator(device="cuda").manual_seed(7)
    randomize(low, gen)
    with torch.no_grad():
        wide.conv.weight.copy_(low.conv.weight.float())
        if low.conv.bias is not None:
            wide.conv.bias.copy_(low.conv.bias.float())
    x = random_input(low.spec, 5, gen)
    out = poisoned(low.spec.output_shape(5), DTYPE[precision])
    with torch.no_grad():
        low(x, out=out)
        want = wide(x.float()).to(DTYPE[precision])
        from_cl = low(as_channels_last(x))
    torch.cuda.synchronize()
    assert torch.equal(out, want)
    assert torch.equal(from_cl, want)
