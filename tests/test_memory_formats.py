"""A layer's kernel for channels-last inputs: planned apart where the contiguous plan's engine reads
NC(D)HW only and the TMA engine can read the channels-last input where it lies."""

from __future__ import annotations

import pytest

from specgen import pipeline
from specgen.plan import Settings, build_plan
from specgen.tma import describe as tma_describe
from specgen.spec import validate

CL = Settings(channels_last=True)


def _spec(precision="tf32", channels=64, out=32, size=(9, 11), epilogue=("relu",), **conv):
    return validate({"name": f"cl_{precision}_{channels}_{out}", "input": {"channels": channels, "size": list(size)},
                     "conv": {"out_channels": out, "kernel": 1, **conv}, "epilogue": list(epilogue), "precision": precision})


def test_a_channels_last_input_pays_no_layout_pass_so_a_thin_1x1_conv_takes_the_tma_engine():
    spec = _spec()
    assert build_plan(spec)["engine"] == "igemm"  # too few multiply-adds per byte to pay a layout pass
    plan = build_plan(spec, settings=CL)
    assert plan["engine"] == "tma"
    assert plan["settings"].channels_last and "channels-last input and output" in plan["settings"].summary()


@pytest.mark.parametrize("spec, why", [
    (_spec("fp32"), "fp32 mode splits every operand into two planes: a layout pass either way"),
    (_spec(channels=20), "20 channels are padded to 24: a layout pass either way"),
    (_spec(channels=48, groups=2), "grouped convs do not run on the TMA engine"),
])
def test_the_channels_last_setting_changes_nothing_where_the_tma_engine_would_still_copy(spec, why):
    assert build_plan(spec, settings=CL)["engine"] == build_plan(spec)["engine"], why


def test_the_setting_is_part_of_the_request_key():
    spec = _spec()
    assert pipeline._request_key(spec, "sm_90", None) != pipeline._request_key(spec, "sm_90", None, settings=CL)


@pytest.mark.nvcc
def test_the_channels_last_variant_is_built_once_and_only_where_it_differs():
    thin = pipeline.specialize(_spec(), "sm_90")
    variant = pipeline.channels_last_variant(thin)
    assert thin.plan["engine"] == "igemm" and variant is not None
    assert variant.plan["engine"] == "tma" and variant.key != thin.key and variant.arch == "sm_90"
    assert pipeline.channels_last_variant(thin) is variant  # kept per process
    assert pipeline.channels_last_variant(variant) is None  # (it is its own channels-last kernel)
    fp32 = pipeline.specialize(_spec("fp32"), "sm_90")
    assert pipeline.channels_last_variant(fp32) is None


def test_a_variant_that_fails_to_build_leaves_the_contiguous_kernel(monkeypatch, caplog):
    import types

    thin = pipeline.Specialized(_spec(out=16), build_plan(_spec(out=16)), "", types.SimpleNamespace(key="f" * 64), "sm_90")

    def broken(*args, **kwargs):
        raise RuntimeError("nvcc failed")

    monkeypatch.setattr(pipeline, "specialize", broken)
    assert pipeline.channels_last_variant(thin) is None
    assert "no channels-last kernel (RuntimeError: nvcc failed)" in caplog.text


# ---- the channels-last kernel's output ---------------------------------------------------------------

CL_OUT_INDEX = "out + (static_cast<size_t>(sample) * POSITIONS + p) * C_OUT + c0;"  # a channel pair's store
NCHW_OUT_INDEX = "out[static_cast<size_t>(sample) * (C_OUT * POSITIONS) + static_cast<size_t>(cj) * POSITIONS + p]"


@pytest.mark.parametrize("size", [[9, 11], [5, 6, 7]])
def test_the_channels_last_plan_writes_its_output_channels_last(size):
    from specgen.render import render_plan

    spec = _spec(channels=64, out=48, size=size)
    contiguous, cl = build_plan(spec), build_plan(spec, settings=CL)
    assert cl["tma"].channels_last_out and "the output channels-last" in tma_describe(cl["tma"])
    cl_text = render_plan(cl)
    assert CL_OUT_INDEX in cl_text and NCHW_OUT_INDEX not in cl_text
    assert "[batch][d][h][w][C_OUT] output" in cl_text
    if contiguous["engine"] == "tma":
        assert not contiguous["tma"].channels_last_out
        assert NCHW_OUT_INDEX in render_plan(contiguous)
    # every store and every extra input goes through the one index function
    assert "* POSITIONS + p]" not in cl_text


@pytest.mark.parametrize("spec, why", [
    (_spec(size=[300]), "a 1-D conv: PyTorch has no channels-last format for it"),
    (_spec(channels=64, out=64, epilogue=[{"amax": {"dims": [1], "keepdim": True}}]), "one channel out: either layout"),
])
def test_the_output_stays_contiguous_where_the_format_means_nothing(spec, why):
    plan = build_plan(spec, settings=CL)
    assert plan["engine"] == "tma" and not plan["tma"].channels_last_out, why


def test_the_split_kernel_lays_its_parts_out_as_the_output():
    from specgen.render import render_plan

    spec = _spec(channels=512, out=512, size=[7, 7], kernel=3, padding=1, epilogue=[{"add": {"input": "shortcut"}}, "relu"])
    plan = build_plan(spec, settings=CL)
    assert plan["tma"].split_k > 1 and plan["tma"].channels_last_out
    text = render_plan(plan)
    assert "partial + (static_cast<size_t>(blockIdx.y) * m_total + m) * C_OUT + c0;" in text
    reduce = text[text.index("_reduce(\n"):]
    assert "const int cj = static_cast<int>(i % C_OUT);" in reduce  # channels fastest, as the output lies
    assert "input_value(i_shortcut, e_out)" in reduce


@pytest.mark.nvcc
@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
@pytest.mark.parametrize("data", [
    {"channels": 512, "out": 512, "size": [7, 7], "kernel": 3, "padding": 1, "epilogue": [{"add": {"input": "shortcut"}}, "relu"]},
    {"channels": 32, "out": 24, "size": [7, 9], "kernel": 4, "stride": 2, "padding": 1, "transposed": True},
    {"channels": 32, "out": 64, "size": [9, 10], "kernel": 3, "padding": 1, "epilogue": [{"softmax": 1}, "tanh"]},
    {"channels": 16, "out": 32, "size": [6, 9, 10], "kernel": 3, "padding": 1},
], ids=["split_residual", "transposed_pairs", "softmax", "conv3d"])
def test_channels_last_kernels_compile_without_spills(precision, data):
    spec = _spec(precision, **data)
    sp = pipeline.specialize(spec, "sm_90", tuned=False, settings=CL)
    assert sp.plan["tma"].channels_last_out and sp.build.arch == "sm_90a"
    assert sp.build.spill_bytes == 0, f"{sp.build.spill_bytes} bytes spilled"
    assert "(static_cast<size_t>(sample) * POSITIONS + p" in sp.source  # (W pairs store channel by channel)


# ---- the other engines' own layout pass --------------------------------------------------------------

@pytest.mark.parametrize("precision, ctype", [("fp32", "float"), ("bf16", "__nv_bfloat16"), ("fp16", "__half")])
def test_engines_that_read_nchw_carry_a_layout_pass_for_channels_last_inputs(precision, ctype):
    from specgen.render import render_plan

    depthwise = _spec(precision, channels=48, out=48, size=[10, 12], kernel=3, padding=1, groups=48)
    plan = build_plan(depthwise)
    assert plan["engine"] == "ffma"
    text = render_plan(plan)
    assert f"specgen_{depthwise.name}_from_cl(\n    const {ctype}* __restrict__ in," in text
    assert "constexpr int CL_C = 48, CL_P = 120;" in text  # literals: the layer's channels and positions
    igemm = build_plan(_spec("fp32"))
    assert igemm["engine"] == "igemm" and "_from_cl(" in render_plan(igemm)


@pytest.mark.nvcc
def test_the_layout_pass_compiles_in_a_16_bit_ffma_module():
    spec = _spec("bf16", channels=48, out=48, size=[10, 12], kernel=3, padding=1, groups=48)
    sp = pipeline.specialize(spec, "sm_90")
    assert sp.plan["engine"] == "ffma" and "_from_cl(" in sp.source and sp.build.spill_bytes == 0
