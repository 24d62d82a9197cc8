"""from_module on the GPU: every module of the import suite runs its fused parts as specgen kernels
and matches the original PyTorch model (rel. L2 <= 1e-5 against float64, allclose against fp32)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import import_models as im  # noqa: E402
from specgen.importer import from_module  # noqa: E402
from specgen.module import FusedLayer  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel lengths"),
]


@pytest.mark.parametrize("case", im.CASES, ids=lambda c: c.id)
def test_from_module_on_cuda_matches_the_original(case):
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    model = case.make().cuda().eval()
    x = torch.randn(case.shape, device="cuda")
    fused = from_module(model, x, keep_slower=True)  # every chain as its kernel: this checks the kernels
    layers = [m for m in fused.modules() if isinstance(m, FusedLayer)]
    assert layers and all(layer.key for layer in layers), "the fused parts were not specialized"
    with torch.no_grad():
        got = fused(x)
        want32 = model(x)
        want64 = model.double()(x.double())
        model.float()
    rel = ((got.double() - want64).norm() / want64.norm().clamp_min(1e-30)).item()
    assert rel <= 1e-5, f"{case.id}: rel L2 {rel:.3e}"
    torch.testing.assert_close(got, want32, atol=1e-4, rtol=1e-4)
