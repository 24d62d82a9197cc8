"""The conv family beyond the public problems (examples/family/) on the GPU (marker `gpu`): each
problem fused whole through from_module (every chain its kernel), against a float64 copy of the
model. In fp32 (TF32 off, so chains fuse as fp32) at batch 1 and 3, in eval and in training mode
(then the batch norms' running statistics too); in tf32 (PyTorch's default flags, what a user's
model runs) at batch 2 in eval mode, within 2x PyTorch TF32's own error. Inputs are fresh random
draws, batch-norm statistics and norms' affine parameters random."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

import kernelbench_problems as kb  # noqa: E402
from specgen.importer import from_module  # noqa: E402
from specgen.module import FusedLayer  # noqa: E402

from gpu_helpers import FP32_ATOL, FP32_RTOL, assert_fp32, assert_tf32, tf32_allowed  # noqa: E402

pytestmark = pytest.mark.gpu

MODES = {False: "eval", True: "train"}


def _cuda(values):
    return [v.cuda() if isinstance(v, torch.Tensor) else v for v in values]


def _double(values):
    return [v.double() if isinstance(v, torch.Tensor) else v for v in values]


def _fused_whole(model, inputs):
    fused = from_module(model, *inputs, keep_slower=True)
    report = fused.specgen_report
    assert len(report.specs) == 1 and not report.fallbacks, str(report)
    (layer,) = [m for m in fused.modules() if isinstance(m, FusedLayer)]
    return fused, layer


def _fresh(path, training, batch, seed):
    model, inputs = kb.load(path, training=training, batch=batch)
    torch.manual_seed(seed)
    inputs = [torch.rand_like(t) if isinstance(t, torch.Tensor) else t for t in inputs]
    return kb.randomize_batch_norms(model).cuda(), _cuda(inputs)


@pytest.mark.usefixtures("fp32_reference")
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("training", [False, True], ids=MODES.get)
@pytest.mark.parametrize("path", [pytest.param(p, id=p.stem) for p in kb.family()])
def test_family_fused_matches_float64_in_fp32(path, training, batch):
    model, inputs = _fresh(path, training, batch, seed=batch)
    ref64, ref32 = copy.deepcopy(model).double(), copy.deepcopy(model)
    fused, layer = _fused_whole(model, inputs)
    assert layer.spec.precision == "fp32"
    what = f"{path.stem} at batch {batch} ({MODES[training]})"
    with torch.no_grad():
        got = fused(*inputs)
        torch.cuda.synchronize()
        want64, want32 = ref64(*_double(inputs)), ref32(*inputs)
    assert_fp32(what, got, want64, want32)
    if training:
        for name, want in ref64.named_buffers():
            mine = dict(model.named_buffers())[name]
            torch.testing.assert_close(mine.double(), want.double(), rtol=FP32_RTOL, atol=FP32_ATOL, msg=f"{what}: {name}")


@pytest.mark.parametrize("path", [pytest.param(p, id=p.stem) for p in kb.family()])
def test_family_fused_matches_float64_in_tf32(path):
    with tf32_allowed(True):
        model, inputs = _fresh(path, False, 2, seed=7)
        ref64, ref_tf32 = copy.deepcopy(model).double(), copy.deepcopy(model)
        fused, layer = _fused_whole(model, inputs)
        assert layer.spec.precision == "tf32"
        with torch.no_grad():
            got = fused(*inputs)
            torch.cuda.synchronize()
            want64, want_tf32 = ref64(*_double(inputs)), ref_tf32(*inputs)
        assert_tf32(f"{path.stem} (tf32)", got, want64, want_tf32)
