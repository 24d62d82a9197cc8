"""The slab engine's staging of whole input rows as one run per channel (`SlabTiling.runs`): which
layers take it, that their kernels build without spills in both renderings, and (marker `gpu`)
that they match float64 PyTorch with poisoned outputs, fresh inputs, batch 1 and an odd batch."""

from __future__ import annotations

import pytest

from specgen import pipeline
from specgen.spec import validate

from test_boxfold import layer as _layer


def layer(*args, **conv):
    """A layer on the slab engine's mma.sync (the planner takes wgmma or FFMA for some of these)."""
    return {**_layer(*args, **conv), "tile": {"engine": "slab", "wgmma": False}}


RUNS = {
    # the folded KernelBench 65's second kernel: a 1x1 conv over 72 box means, sigmoid, the sum of all
    "fold_body": layer(72, [95, 95], 64, ["sigmoid", {"sum": {"dims": [1, 2, 3]}}], kernel=1),
    # padding rows above and below (none along W), a row of 33: the first and last slabs read zeros
    "pad_rows": layer(8, [30, 33], 32, ["relu"], padding=[1, 0]),
    # strided along H and W, taps past the last full stride: rows still whole
    "strided": layer(6, [21, 11], 16, ["gelu"], stride=2),
    # 1-D: the whole sequence is one row
    "conv1d": layer(5, [50], 24, [{"add": 0.5}, "tanh"]),
    # 3-D with one depth tap: each slab one input depth; channels past C_IN_G padded to 4
    "conv3d_depth1": layer(3, [4, 40, 37], 16, ["silu"], kernel=[1, 3, 3]),
    # a per-sample max over positions after the conv (a reduction in the same kernel)
    "row_max": layer(7, [17, 19], 32, [{"amax": {"dims": [2, 3]}}], kernel=[3, 1]),
}

NOT_RUNS = {
    # padding along W: a row of the slab starts before the input's
    "pad_w": layer(8, [30, 33], 32, ["relu"], padding=1),
    # rows of a multiple of 4 floats are staged in 16-byte chunks instead
    "aligned": layer(8, [30, 32], 32, ["relu"]),
}


def _slab(spec):
    plan = pipeline.build_plan(spec)
    body = plan if plan["engine"] == "slab" else plan["parts"][-1]
    assert body["engine"] == "slab" and body["mma"] is not None and not body["mma"].wgmma, spec.name
    return plan, body["mma"]


@pytest.mark.parametrize("name", sorted(RUNS))
def test_whole_row_slabs_are_staged_as_runs(name):
    plan, mma = _slab(validate(RUNS[name]))
    assert mma.runs and mma.stage == "cp4" and mma.xs[0] == 1
    assert "one run of whole rows" in pipeline.render_plan(plan)


@pytest.mark.parametrize("name", sorted(NOT_RUNS))
def test_other_slabs_are_staged_row_by_row(name):
    plan, mma = _slab(validate(NOT_RUNS[name]))
    assert not mma.runs
    assert "const int RUN" not in pipeline.render_plan(plan)


@pytest.mark.parametrize("name", ["fold_body", "pad_rows", "conv3d_depth1"])
@pytest.mark.parametrize("runtime_dims", [False, True])
def test_run_staging_builds_without_spills(name, runtime_dims, tmp_path):
    from specgen.compile import compile_cubin

    plan = pipeline.build_plan(validate(RUNS[name]))
    (tmp_path / "kernel.cu").write_text(pipeline.render_plan(plan, runtime_dims=runtime_dims))
    report = compile_cubin(tmp_path / "kernel.cu", tmp_path / "kernel.cubin", pipeline.build_arch(plan, "sm_90"))
    assert report.registers > 0 and report.spill_bytes == 0, report.log


@pytest.mark.gpu
@pytest.mark.usefixtures("fp32_reference")
@pytest.mark.parametrize("name", sorted(RUNS))
@pytest.mark.parametrize("batch", [1, 3])
def test_run_staged_layers_match_float64(name, batch):
    torch = pytest.importorskip("torch")
    from specgen.module import FusedLayer

    from gpu_helpers import compare

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    spec = validate(RUNS[name])
    layer_ = FusedLayer(spec).cuda()
    assert _slab(spec)[1].runs
    compare(layer_, batch, seed=batch + len(name))
