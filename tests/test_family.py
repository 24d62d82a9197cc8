"""The conv family beyond the public problems (examples/family/): layers written in KernelBench's
file format with the op mixes, geometries and stages the public set lacks. On the CPU: every one
imports into one spec with no fallback in eval and in training mode, the fused model computes what
the model does (its layers run their PyTorch reference here), and every kernel, at the problem's
own sizes, compiles for sm_90 without spilling registers."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import kernelbench_problems as kb  # noqa: E402
from specgen.importer import explain, from_module  # noqa: E402

PROBLEMS = [pytest.param(p, id=p.stem) for p in kb.family()]
MODES = {False: "eval", True: "train"}


def test_the_family_is_there():
    assert len(PROBLEMS) >= 26


@pytest.mark.parametrize("training", [False, True], ids=MODES.get)
@pytest.mark.parametrize("path", PROBLEMS)
def test_each_problem_imports_whole_and_computes_what_the_model_does(path, training):
    model, inputs = kb.load(path, training=training, batch=2)
    model = kb.randomize_batch_norms(model)
    with torch.no_grad():
        want = model(*inputs)
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    fused = from_module(model, *inputs)
    report = fused.specgen_report
    assert len(report.specs) == 1 and not report.fallbacks, str(report)
    # importing and timing leave the model's running statistics alone
    for name, value in model.named_buffers():
        assert torch.equal(value, buffers[name]), name
    with torch.no_grad():
        got = fused(*inputs)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.nvcc
def test_every_problem_compiles_at_its_own_size_without_spills(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECGEN_CACHE_DIR", str(tmp_path / "cache"))
    from specgen.pipeline import specialize_many

    specs = []
    for path in kb.family():
        model, inputs = kb.load(path)
        specs.append(explain(model, *inputs).specs[0].model_copy(update={"precision": "tf32"}))
    specs += [s.model_copy(update={"precision": "fp32"}) for s in specs]
    for item in specialize_many(specs, arch="sm_90"):
        build = item.build
        assert build.cubin.stat().st_size > 0, item.spec.name
        assert build.spill_bytes == 0, f"{item.spec.name} ({item.spec.precision}): {build.spill_bytes} spill bytes"
