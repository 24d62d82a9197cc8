"""Random small conv nets (`random_models`) imported on the GPU (marker `gpu`; skipped without
CUDA): every chain fused and run by its compiled kernel, the joins and pools by theirs, on output
memory poisoned first. In fp32 mode at the fp32 bars against the model in float64 and against
PyTorch fp32 (TF32 off for PyTorch's own ops); converted with `.bfloat16()`, within 2x PyTorch's
own bf16 error, or 2x the error the bf16 weights and inputs carry alone where that is larger (an
output that cancels: PyTorch's roundings can happen to land nearer). Each part draws its own nets afresh (hypothesis prints the failing draw, with the
blob that reproduces it)."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
from hypothesis import HealthCheck, given, settings  # noqa: E402

from gpu_helpers import assert_fp32, rel_l2, tf32_allowed  # noqa: E402
from random_models import outputs, random_nets  # noqa: E402
from specgen.importer import from_module  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
GPU_FUZZ = settings(max_examples=8, deadline=None, database=None, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _fused_run(model, x, **options):
    """`from_module(model, x, keep_slower=True, **options)` (on a copy) run on `x`, its outputs
    allocated over freed NaNs (the blocks of an output the kernels leave unwritten hold NaN)."""
    fused = from_module(copy.deepcopy(model), x, keep_slower=True, **options)
    torch.full((1 << 22,), float("nan"), device="cuda")
    got = fused(x)
    torch.cuda.synchronize()
    return got


@pytest.mark.parametrize("part", range(4))
@GPU_FUZZ
@given(net=random_nets(max_steps=8, max_channels=40))
def test_a_random_net_runs_fused_at_the_fp32_bars(part, net):
    model, x = net
    model, x = model.cuda(), x.cuda()
    with tf32_allowed(False), torch.no_grad():
        want32 = model(x)
        want64 = copy.deepcopy(model).double()(x.double())
        got = _fused_run(model, x, precision="fp32")
    for i, (g, w64, w32) in enumerate(zip(outputs(got), outputs(want64), outputs(want32), strict=True)):
        assert_fp32(f"output {i} of {model.describe()}", g, w64, w32)


@pytest.mark.parametrize("part", range(2))
@GPU_FUZZ
@given(net=random_nets(max_steps=8, max_channels=40))
def test_a_random_bf16_net_runs_fused_within_twice_pytorch_s_error(part, net):
    model, x = net
    model, x = model.cuda(), x.cuda()
    with torch.no_grad():
        want64 = copy.deepcopy(model).double()(x.double())
        half, x16 = copy.deepcopy(model).bfloat16(), x.bfloat16()
        want16 = half(x16)
        # the error bf16 weights and inputs carry before any rounding of the compute: the model
        # in float64 on them (where the output cancels, this alone exceeds PyTorch's error)
        carried = copy.deepcopy(half).double()(x16.double())
        got = _fused_run(half, x16)
    for i, (g, w64, w16, c) in enumerate(zip(outputs(got), outputs(want64), outputs(want16), outputs(carried), strict=True)):
        assert g.dtype == torch.bfloat16 and g.shape == w64.shape and bool(torch.isfinite(g).all())
        rel, torch_rel, carried_rel = rel_l2(g, w64), rel_l2(w16, w64), rel_l2(c, w64)
        assert rel <= 2 * max(torch_rel, carried_rel, 2.0**-8), \
            f"output {i}: rel L2 {rel:.3e}, PyTorch bf16 {torch_rel:.3e}, carried {carried_rel:.3e}: {model.describe()}"
