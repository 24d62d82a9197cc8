"""The example models (examples/models.py): each imports and, fused, computes what it computes.

CPU: every model is examined without error, its fusable chains are the ones its structure has,
and from_module's model (CPU reference path) equals the original in eval mode. GPU (marked
`gpu`): at batch 1 and 8, the fused model (never-slower rule on) matches the float64 original
within rel. L2 1e-5 with TF32 off (fp32 mode)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from specgen.importer import explain, from_module
from specgen.module import FusedLayer


def _load_models():
    path = Path(__file__).resolve().parent.parent / "examples" / "models.py"
    spec = importlib.util.spec_from_file_location("specgen_example_models", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


models = _load_models()

# The chains each model's structure holds: conv (+ batch norm) (+ activation) (+ a pool that
# follows directly); a residual add or a concatenation ends a chain.
CHAINS = {"ResNet18": 20, "ResNet50Stage": 13, "MobileNetV2": 52, "VGG11": 8, "UNet": 15, "Conv3dStack": 5}


def test_every_model_is_listed():
    assert sorted(cls.__name__ for cls in models.MODELS) == sorted(CHAINS)


@pytest.mark.parametrize("cls", models.MODELS, ids=lambda c: c.__name__)
def test_model_imports_and_fused_output_equals_the_original(cls):
    model = cls.make()
    x = cls.example_input(batch=2, small=True)
    report = explain(model, x)
    assert len(report.specs) == CHAINS[cls.__name__], str(report)
    fused = from_module(model, x)
    assert len([m for m in fused.modules() if isinstance(m, FusedLayer)]) == CHAINS[cls.__name__]
    with torch.no_grad():
        want = model(x)
        torch.testing.assert_close(fused(x), want)
        other = cls.example_input(batch=3, small=True, seed=1)  # another batch size, other values
        torch.testing.assert_close(fused(other), model(other))
    assert want.abs().max() > 0


def test_make_gives_eval_models_with_nontrivial_batch_norm():
    model = models.ResNet18.make()
    assert not model.training
    assert model.bn1.running_var.min() >= 0.5 and model.bn1.running_mean.abs().max() > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("cls", models.MODELS, ids=lambda c: c.__name__)
def test_fused_model_matches_float64_on_the_gpu(cls, batch):
    old = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False  # fp32 mode
    try:
        model = cls.make().cuda()
        x = cls.example_input(batch=batch, device="cuda")
        fused = from_module(model, x)
        with torch.no_grad():
            got = fused(x)
            want64 = model.double()(x.double())
        model.float()
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = old
    rel = ((got.double() - want64).norm() / want64.norm()).item()
    print(f"{cls.__name__} batch {batch}: rel L2 {rel:.2e}; {fused.specgen_report}")
    assert rel <= 1e-5, f"{cls.__name__} batch {batch}: rel L2 {rel:.3e}"
