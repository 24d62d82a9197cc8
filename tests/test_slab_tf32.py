"""A tf32 conv of few input channels that cuDNN runs in TF32 too (large kernels, many output
channels: the ResNet stem) runs on the slab engine with one TF32 product per k-step
(`plan.slab_in_tf32`); every other layer the slab engine takes keeps 3xTF32. The plans, the source,
and on the GPU (marker `gpu`) the results against the tf32 bar (2x PyTorch's own TF32 error)."""

from __future__ import annotations

import re

import pytest

from specgen.plan import build_plan, describe
from specgen.render import render_plan
from specgen.spec import validate


def layer(name, channels, size, out, kernel, precision="tf32", epilogue=("relu",), tile=None, **conv):
    data = {"name": name, "input": {"channels": channels, "size": size}, "precision": precision,
            "conv": {"out_channels": out, "kernel": kernel, **conv}, "epilogue": list(epilogue)}
    return {**data, "tile": tile} if tile else data


TF32 = [
    layer("stem", 3, [64, 64], 64, 7, stride=2, padding=3),
    layer("stem_pool", 3, [64, 64], 64, 7, stride=2, padding=3,
          epilogue=["relu", {"max_pool": {"kernel": 3, "stride": 2, "padding": 1}}]),
    layer("stem_bn_pool", 3, [64, 64], 64, 7, stride=2, padding=3, bias=False,
          epilogue=[{"batch_norm": {}}, "relu", {"max_pool": {"kernel": 3, "stride": 2, "padding": 1}}]),
    layer("four_in", 4, [20, 36], 40, 7, padding=2),
    layer("cube", 4, [6, 10, 12], 48, 4, padding=1),
    layer("line", 3, [300], 64, 31, padding=15),
]
THREE = [
    layer("stem_fp32", 3, [64, 64], 64, 7, precision="fp32", stride=2, padding=3),
    # split before its pool: the body on the slab engine in fp32 too (`tail.split_engine`)
    layer("stem_pool_fp32", 3, [64, 64], 64, 7, precision="fp32", stride=2, padding=3,
          epilogue=["relu", {"max_pool": {"kernel": 3, "stride": 2, "padding": 1}}]),
    layer("small_kernel", 3, [32, 32], 64, 5, padding=2),  # computed exactly (`exact_tf32`): fp32
    layer("sixteen_in", 16, [20, 20], 64, 3, padding=1, tile={"engine": "slab"}),
    layer("eight_in", 8, [20, 36], 40, 7, padding=2, tile={"engine": "slab"}),  # (not timed: left to the planner, TMA)
]


def slab_plans(data):
    plan = build_plan(validate(data))
    plans = [p["plan"] for p in plan["parts"]] if plan.get("parts") else [plan]
    return [p for p in plans if p["engine"] == "slab"]


@pytest.mark.parametrize("data", TF32, ids=[d["name"] for d in TF32])
def test_a_tf32_stem_runs_its_slab_products_in_tf32(data):
    (plan,) = slab_plans(data)
    assert plan["mma"]["products"] == 1
    text = render_plan(plan)
    assert "tf32_round(" in text and "split_tf32(" not in text
    assert re.search(r"TF32 (mma\.sync|wgmma)", describe(build_plan(validate(data))))  # (the slab on either instruction)


@pytest.mark.parametrize("data", THREE, ids=[d["name"] for d in THREE])
def test_other_slab_layers_keep_3xtf32(data):
    plans = slab_plans(data)
    assert plans and all(p["mma"]["products"] == 3 for p in plans)
    assert all("split_tf32(" in render_plan(p) and "tf32_round(" not in render_plan(p) for p in plans)


def test_an_fp32_stems_pool_split_runs_its_body_on_the_slab_engine():
    plan = build_plan(validate(THREE[1]))
    assert [(p.role, p.plan.engine) for p in plan.parts] == [("body", "slab"), ("rest", "ffma")]
    assert "the conv runs on the slab engine" in plan.why[0]
    # 16 input channels and more: the TMA engine, as left to the planner
    wide = build_plan(validate({**THREE[1], "input": {"channels": 16, "size": [64, 64]}}))
    assert wide.parts[0].plan.engine == "tma"


@pytest.mark.parametrize("precision", ["tf32", "fp32"])
def test_a_split_body_whose_slab_staging_does_not_fit_takes_the_tma_engine(precision):
    """A 15x15 kernel of 3 channels: the slab engine's staged weights do not fit. Left to the
    planner the body alone runs on the TMA engine in tf32 and on FFMA in fp32 (which keeps fewer
    than 16 channels off the GEMM engines), which is what the split avoids."""
    data = layer("wide_kernel", 3, [64, 64], 64, 15, precision=precision, padding=7,
                 epilogue=["relu", {"max_pool": {"kernel": 3, "stride": 2, "padding": 1}}])
    cut = {**data, "epilogue": ["relu"]}
    assert build_plan(validate(cut))["engine"] == ("tma" if precision == "tf32" else "ffma")  # the body alone
    plan = build_plan(validate(data))
    assert [p.plan.engine for p in plan.parts] == ["tma", "ffma"]


def test_asking_for_the_slab_engine_where_it_cannot_run_is_an_error():
    """It used to fall back to the FFMA engine without a word."""
    from specgen.plan import PlanError

    pooled = {**THREE[1], "tile": {"engine": "slab"}}  # a tile keeps the layer whole: a pool over tensor cores
    with pytest.raises(PlanError, match="tile.engine: the slab engine cannot run this layer: a pool sits between"):
        build_plan(validate(pooled))
    with pytest.raises(PlanError, match="tile.engine: slab runs on tensor cores, but tile.tensor_cores is false"):
        build_plan(validate({**THREE[0], "tile": {"engine": "slab", "tensor_cores": False}}))
    grouped = layer("grouped", 16, [20, 20], 32, 3, groups=2, tile={"engine": "slab"})
    with pytest.raises(PlanError, match="the conv has groups"):
        build_plan(validate(grouped))


def test_eight_input_channels_keep_the_tma_engine():
    data = {**THREE[-1], "tile": None}
    assert build_plan(validate(data))["engine"] == "tma"


@pytest.mark.parametrize("stage", [{"add": {"input": "skip"}}, {"softmax": {"dim": 1}}], ids=["extra_input", "channel_softmax"])
def test_a_stem_that_only_the_tma_engine_runs_keeps_it(stage):
    """An extra input or a softmax over the channels: the slab engine cannot run them, so the
    stem stays on the TMA engine (whose epilogue takes both)."""
    plan = build_plan(validate(layer("stem_tma_only", 3, [64, 64], 64, 7, stride=2, padding=3, epilogue=["relu", stage])))
    assert plan["engine"] == "tma"


def test_the_slab_epilogue_reads_a_channels_parameters_once():
    """A channel's bias, batch-norm statistics and 1 / sqrt(var + eps) are read and computed once,
    before the loop over its positions, not per value."""
    (plan,) = slab_plans(TF32[2])
    text = render_plan(plan)
    epilogue = text[text.index("A channel at a time"):]
    epilogue = epilogue[: epilogue.index("\n}\n")]
    positions = "for (int j = 0; j < NB / 8; ++j)" if plan["mma"].wgmma else "for (int i = 0; i < WM; ++i)"
    before, loop = epilogue.split(positions, 1)
    assert "const float pc0_invstd = __frsqrt_rn(pc_bn_running_var + S0_EPS);" in before
    assert "__ldg(" not in loop and "__frsqrt_rn" not in loop
    assert "pc0_invstd" in loop


@pytest.mark.nvcc
def test_tf32_slab_kernels_build_without_spills(tmp_path, monkeypatch):
    from specgen import pipeline

    monkeypatch.setenv("SPECGEN_CACHE_DIR", str(tmp_path / "cache"))
    built = pipeline.specialize_many([validate(d) for d in TF32], "sm_90", tuned=False)
    assert len(built) == len(TF32)
    for item in built:
        assert item.build.spill_bytes == 0, (item.spec.name, item.build.log)


@pytest.mark.gpu
@pytest.mark.parametrize("data", TF32 + THREE[:2], ids=[d["name"] for d in TF32 + THREE[:2]])
@pytest.mark.parametrize("batch", [1, 3])
def test_tf32_slab_layers_meet_the_bar(data, batch, fp32_reference):
    from specgen.module import FusedLayer

    from gpu_helpers import compare

    compare(FusedLayer(validate(data)).cuda(), batch, seed=batch)


@pytest.mark.nvcc
def test_fp32_splits_truncate_and_exact_sums_round():
    """fp32 mode splits each 3xTF32 operand with an AND and a subtraction (hi truncated); a tf32
    layer computed exactly (exact sums, held to PyTorch's fp32-level error) rounds hi first, an add
    of half a TF32 unit more. Read from the PTX: the rounding add is the immediate 4096."""
    from specgen import compile as compile_mod

    from specgen.pipeline import build_arch

    def ptx(data):
        (plan,) = slab_plans(data)
        return plan, compile_mod.compile_ptx(render_plan(plan), build_arch(plan, "sm_90"))

    def rounding_adds(text):
        return sum(1 for line in text.splitlines() if line.strip().startswith("add.s32") and line.rstrip().endswith(", 4096;"))

    def masks(text):
        return sum(1 for line in text.splitlines() if line.strip().startswith("and.b32") and line.rstrip().endswith(", -8192;"))

    fp32_plan, fp32 = ptx(THREE[0])
    exact_plan, exact = ptx(THREE[2])
    assert not fp32_plan["settings"].exact_sums and exact_plan["settings"].exact_sums
    assert masks(fp32) > 0 and rounding_adds(fp32) == 0
    assert masks(exact) > 0 and rounding_adds(exact) >= masks(exact) // 2
