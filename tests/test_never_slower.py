"""Never slower than what it replaces (GPU): each example model, fused by from_module with the
never-slower rule on, runs at most 5% slower than the eager model, at batch 1 and 8, with TF32
off (fp32 mode) and on (PyTorch's default for convolutions)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from specgen import measured  # noqa: E402
from specgen.importer import from_module  # noqa: E402
from test_models import models  # noqa: E402

pytestmark = [pytest.mark.gpu]

SLACK = 1.05


@pytest.mark.parametrize("tf32", [False, True], ids=["fp32", "tf32"])
@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("cls", models.MODELS, ids=lambda c: c.__name__)
def test_fused_model_is_not_slower_than_eager(cls, batch, tf32):
    old = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = tf32
    try:
        model = cls.make().cuda()
        x = cls.example_input(batch=batch, device="cuda")
        fused = from_module(model, x)
        inputs = [x, cls.example_input(batch=batch, device="cuda", seed=1)]
        fused_ms, eager_ms = measured.compare(fused, model, inputs, reps=15)
    finally:
        torch.backends.cudnn.allow_tf32 = old
    report = fused.specgen_report
    kept = sum(not c.fused for c in report.choices)
    print(
        f"{cls.__name__} batch {batch} tf32={tf32}: eager {eager_ms:.3f} ms, specgen {fused_ms:.3f} ms "
        f"({eager_ms / fused_ms:.2f}x); {len(report.choices) - kept} chains fused, {kept} kept as PyTorch"
    )
    assert fused_ms <= eager_ms * SLACK, f"{cls.__name__} batch {batch}: {fused_ms:.3f} ms vs eager {eager_ms:.3f} ms"
