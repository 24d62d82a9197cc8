"""Random small conv nets (`random_models`) imported on the GPU (marker `gpu`; skipped without
CUDA): every chain fused and run by its compiled kernel in fp32 mode, the joins and pools by
theirs, on output memory poisoned first; the fp32 bars against the model in float64 and against
PyTorch fp32 (TF32 off for PyTorch's own ops). Each of the four parts draws its own nets afresh
(hypothesis prints the failing draw, with the blob that reproduces it)."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
from hypothesis import HealthCheck, given, settings  # noqa: E402

from gpu_helpers import assert_fp32, tf32_allowed  # noqa: E402
from random_models import random_nets  # noqa: E402
from specgen.importer import from_module  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
GPU_FUZZ = settings(max_examples=12, deadline=None, database=None, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.mark.parametrize("part", range(4))
@GPU_FUZZ
@given(net=random_nets(max_steps=8, max_channels=40))
def test_a_random_net_runs_fused_at_the_fp32_bars(part, net):
    model, x = net
    model, x = model.cuda(), x.cuda()
    with tf32_allowed(False), torch.no_grad():
        want32 = model(x)
        want64 = copy.deepcopy(model).double()(x.double())
        fused = from_module(copy.deepcopy(model), x, keep_slower=True, precision="fp32")
        torch.full((1 << 22,), float("nan"), device="cuda")  # (freed at once: the outputs' blocks hold NaN)
        got = fused(x)
        torch.cuda.synchronize()
    outs = zip(*(v if isinstance(v, tuple) else (v,) for v in (got, want64, want32)))
    for i, (g, w64, w32) in enumerate(outs):
        assert_fp32(f"output {i} of {model.describe()}", g, w64, w32)
