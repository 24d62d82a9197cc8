"""On a GPU, from_module keeps as the model's own code every chain that its timing says is not
faster fused, and still runs the joins and pools no chain takes by their kernels. Which chains
those are is the timing's to decide, so the rewritten graph must be whole and compute the model
whichever chains stay: checked here without a GPU, the choices forced to none, every other one
and all of the chains, on the example models and the public problems (KernelBench 6 pools a
softmax twice; with its chain kept, the second pool read the first one's erased node)."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

import kernelbench_problems as kb  # noqa: E402
from example_models import example_models  # noqa: E402

from random_models import force_choices, outputs  # noqa: E402
from specgen.importer import from_module  # noqa: E402

PATTERNS = {
    "none_fused": lambda i: False,
    "every_other_fused": lambda i: i % 2 == 0,
    "others_fused": lambda i: i % 2 == 1,
}
MODELS = ["ResNet18", "MobileNetV2", "VGG11", "UNet", "Conv3dStack", "ConvNeXtT"]


def _check(model, inputs):
    with torch.no_grad():
        want = model(*inputs)
        fused = from_module(copy.deepcopy(model), *inputs)
        got = fused(*inputs)
    for g, w in zip(outputs(got), outputs(want), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    return fused


@pytest.mark.parametrize("pattern", list(PATTERNS))
@pytest.mark.parametrize("name", MODELS)
def test_an_example_model_computes_itself_whichever_chains_stay(monkeypatch, name, pattern):
    cls = getattr(example_models(), name)
    force_choices(monkeypatch, PATTERNS[pattern])
    fused = _check(cls.make(), [cls.example_input(2, small=True)])
    kept = [c for c in fused.specgen_report.choices if not c.fused]
    assert len(kept) == sum(not PATTERNS[pattern](i) for i in range(len(fused.specgen_report.choices)))


@pytest.mark.parametrize("standalone", list(PATTERNS))
@pytest.mark.parametrize("pattern", ["every_other_fused", "others_fused"])
def test_the_unet_computes_itself_whichever_joins_and_pools_stay(monkeypatch, pattern, standalone):
    """The joins and pools are timed too (`standalone_choice`): kept or not, each beside kept or
    fused chains, the rewritten graph is whole and computes the model."""
    cls = example_models().UNet
    force_choices(monkeypatch, PATTERNS[pattern], PATTERNS[standalone])
    fused = _check(cls.make(), [cls.example_input(2, small=True)])
    report = fused.specgen_report
    decided = report.standalone_choices
    assert [c.fused for c in decided] == [PATTERNS[standalone](i) for i in range(len(decided))], str(report)
    kept = {fb.node for fb in report.fallbacks if "kept as PyTorch" in fb.reason}
    assert kept == {c.layer for c in decided if not c.fused}, str(report)


def _problems():
    return [pytest.param(p, id=p.stem) for p in kb.problems() if p.stem in kb.FUSED or "Pool" in p.stem]


@pytest.mark.skipif(kb.folder() is None, reason="the KernelBench problems are not beside the checkout")
@pytest.mark.parametrize("pattern", ["none_fused", "every_other_fused"])
@pytest.mark.parametrize("path", _problems())
def test_a_public_problem_computes_itself_whichever_chains_stay(monkeypatch, path, pattern):
    model, inputs = kb.load(path)
    force_choices(monkeypatch, PATTERNS[pattern], PATTERNS["others_fused"])  # (its pools: every other kept)
    _check(model, inputs)
