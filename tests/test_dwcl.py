"""specgen/dwcl.py: a depthwise conv and `layer_norm_channels` on channels-last tensors in one
kernel (ConvNeXt's block, channels-last), the channels-last plan of such a layer. CPU: which layers
get it and why the others do not, the contiguous plan left as it was, the rendered source, nvcc
builds without spills. On a GPU: tests/test_dwcl_gpu.py."""

from __future__ import annotations

import pytest
import torch

from build_helpers import spilled
from specgen import compile as nvcc
from specgen import dwcl, pipeline, torchop
from specgen.kernelplan import SequencePlan
from specgen.plan import Settings, build_plan
from specgen.render import render_plan
from specgen.spec import validate
from specgen.tail import describe
from specgen.target import BUILTIN

HOPPER = BUILTIN["sm_90"]
CL = Settings(channels_last=True)


def spec_of(channels, size, conv=None, epilogue=None, precision="tf32", name="dwcl"):
    conv = conv or {"kernel": 7, "padding": 3}
    return validate({"name": name, "input": {"channels": channels, "size": list(size)},
                     "conv": {"out_channels": channels, "groups": channels, **conv},
                     "epilogue": epilogue or [{"layer_norm_channels": {"eps": 1e-6}}], "precision": precision})


def test_the_channels_last_plan_is_one_kernel_and_the_contiguous_one_is_unchanged():
    spec = spec_of(96, [56, 56], epilogue=[{"layer_norm_channels": {"eps": 1e-6}}, "gelu"])
    contiguous = build_plan(spec, None, HOPPER)
    assert [p.role for p in contiguous.parts] == ["body", "tail"] and not contiguous.channels_last_io
    plan = build_plan(spec, None, HOPPER, None, CL)
    assert isinstance(plan, SequencePlan) and plan.channels_last_io and plan.buffers == {}
    (part,), (step,) = plan.parts, plan.steps
    tp = part.plan
    assert (tp.c, tp.cv, tp.lane_vecs, tp.pt, tp.span, tp.segs_w) == (96, 24, 1, 8, 14, 7)
    assert step.args == ["x", "weight", "bias", "p_ln_weight", "p_ln_bias", "out"]
    assert step.grid_x == -(-56 * 7 // dwcl.WARPS) and step.threads == 32 * dwcl.WARPS
    assert plan.out_shape == contiguous.out_shape and plan.flops_per_sample > 0
    # the weights reach the kernel tap-major, through the plan's weight transform
    (transform,) = plan.weight_transforms
    weight = torch.randn(96, 1, 7, 7)
    taps = torchop.transformed_weight(weight, transform)
    assert taps.shape == (49, 96) and taps.is_contiguous() and torch.equal(taps[10], weight[:, 0, 1, 3])
    assert "a warp per 8 neighbouring position(s) of a row" in describe(plan)
    source = render_plan(plan)
    assert "constexpr int C = 96;" in source and "constexpr int SPAN = 14;" in source
    assert "fma4(acc[i][j], xv[j], wr[kw][j]);" in source and "erff(" in source
    assert "p_ln_weight + c_el" in source and "o4[cv] = make_float4" in source


def test_wide_layers_read_their_weights_from_the_cache_and_take_fewer_positions_a_warp():
    tp = build_plan(spec_of(768, [7, 7]), None, HOPPER, None, CL).parts[0].plan
    assert (tp.lane_vecs, tp.pt, tp.weights_in_registers) == (6, 2, False)
    source = render_plan(build_plan(spec_of(768, [7, 7]), None, HOPPER, None, CL))
    assert "wr[" not in source and "__ldg(w4 + (kh * K_W + kw) * CV + cv)" in source


@pytest.mark.parametrize("spec, reason", [
    (spec_of(96, [8, 8], precision="bf16"), "precision bf16"),
    (spec_of(30, [8, 8]), "30 channels"),
    (spec_of(8, [4, 8, 8]), "not a 2-D conv"),
    (validate({"name": "x", "input": {"channels": 16, "size": [8, 8]}, "conv": {"out_channels": 32, "kernel": 3, "groups": 16},
               "epilogue": [{"layer_norm_channels": {}}]}), "not a depthwise conv"),
    (spec_of(16, [8, 8], epilogue=["relu", {"layer_norm_channels": {}}]), "not followed by layer_norm_channels"),
    (spec_of(16, [8, 8], epilogue=[{"softmax": 1}]), "not followed by layer_norm_channels"),
    (spec_of(16, [8, 8], epilogue=[{"layer_norm_channels": {}}, {"max_pool": 2}]), "more than the LayerNorm"),
])
def test_other_layers_keep_their_sequence_and_say_why(spec, reason):
    assert reason in dwcl.why_not(spec)
    if spec.precision != "bf16":
        plan = build_plan(spec, None, HOPPER, None, CL)
        assert not getattr(plan, "channels_last_io", False)


@pytest.mark.parametrize("channels, size, conv, epilogue", [
    (96, [56, 56], None, [{"layer_norm_channels": {"eps": 1e-6}}]),
    (768, [7, 7], None, [{"layer_norm_channels": {"eps": 1e-6}}, "gelu"]),
    (64, [15, 17], {"kernel": 3, "padding": 2, "stride": 2, "dilation": 2, "bias": False},
     [{"layer_norm_channels": {"elementwise_affine": False}}, {"mul": {"param": "s"}}]),
])
def test_the_kernel_builds_without_spills(channels, size, conv, epilogue, tmp_path):
    spec = spec_of(channels, size, conv, epilogue, name=f"dwcl{channels}")
    _, source, request = pipeline.request(spec, "sm_90", settings=CL)
    assert "_dwcl(" in source
    cu = tmp_path / "k.cu"
    cu.write_text(source)
    kernels = nvcc.compile_cubin(cu, tmp_path / "k.cubin", request.arch, compiler="nvcc").kernels
    assert f"specgen_dwcl{channels}_dwcl" in kernels and not spilled(kernels), spilled(kernels)


def test_the_pipeline_finds_a_sequences_channels_last_plan():
    spec = spec_of(96, [14, 14])
    sp = pipeline.Specialized(spec, build_plan(spec, None, HOPPER), "", None, "sm_90")
    variant = pipeline._variant_plan(sp)
    assert variant is not None and variant.channels_last_io and variant.parts[0].plan.family == "dwcl"
    assert pipeline._variant_plan(pipeline.Specialized(spec, variant, "", None, "sm_90")) is None  # (it is one)
    other = spec_of(16, [8, 8], epilogue=[{"softmax": 1}])
    assert pipeline._variant_plan(pipeline.Specialized(other, build_plan(other, None, HOPPER), "", None, "sm_90")) is None
