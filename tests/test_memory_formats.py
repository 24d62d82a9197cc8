"""A layer's kernel for channels-last inputs: planned apart where the contiguous plan's engine reads
NC(D)HW only and the TMA engine can read the channels-last input where it lies."""

from __future__ import annotations

import pytest

from specgen import pipeline
from specgen.plan import Settings, build_plan
from specgen.spec import validate

CL = Settings(channels_last=True)


def _spec(precision="tf32", channels=64, out=32, **conv):
    return validate({"name": f"cl_{precision}_{channels}_{out}", "input": {"channels": channels, "size": [9, 11]},
                     "conv": {"out_channels": out, "kernel": 1, **conv}, "epilogue": ["relu"], "precision": precision})


def test_a_channels_last_input_pays_no_layout_pass_so_a_thin_1x1_conv_takes_the_tma_engine():
    spec = _spec()
    assert build_plan(spec)["engine"] == "igemm"  # too few multiply-adds per byte to pay a layout pass
    plan = build_plan(spec, settings=CL)
    assert plan["engine"] == "tma"
    assert plan["settings"].channels_last and "channels-last input" in plan["settings"].summary()


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
    assert pipeline.channels_last_variant(variant) is None  # (a TMA plan reads both formats)
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
