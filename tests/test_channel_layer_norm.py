"""`layer_norm_channels`: a LayerNorm over each position's channels (ConvNeXt's channels-first
LayerNorm, timm's LayerNorm2d). The spec and its reference; on Hopper the TMA epilogue takes it over
a block's channels (quad shuffles, like a softmax over them); elsewhere the tail engine's strided
kernel (the channels INNER floats apart) with the mean and the squared deviations; builds without
spills. The kernels against float64 on a GPU: tests/test_channel_layer_norm_gpu.py; the importer's
forms: tests/import_models.py (ChannelsLayerNormForms)."""

from __future__ import annotations

import pytest
import torch

from build_helpers import build_report, spilled
from specgen import reference, tma
from specgen.plan import build_plan, describe
from specgen.render import render_plan
from specgen.spec import SpecError, validate
from specgen.target import BUILTIN

HOPPER = BUILTIN["sm_90"]
C3 = {"kernel": 3, "padding": 1}


def spec_of(cin, size, conv, epilogue, precision="tf32", name="lnc"):
    return validate({"name": name, "input": {"channels": cin, "size": list(size)}, "conv": conv,
                     "epilogue": list(epilogue), "precision": precision})


def test_the_spec_names_per_channel_tensors_and_refuses_what_it_cannot_normalize():
    spec = spec_of(8, [6, 6], {"out_channels": 16, **C3}, [{"layer_norm_channels": {"eps": 1e-6}}])
    assert spec.params() == {"ln_weight": (16, 1, 1), "ln_bias": (16, 1, 1)}
    plain = spec_of(8, [6, 6], {"out_channels": 16, **C3}, [{"layer_norm_channels": {"elementwise_affine": False}}])
    assert plain.params() == {}
    with pytest.raises(SpecError, match="eps"):
        spec_of(8, [6, 6], {"out_channels": 16, **C3}, [{"layer_norm_channels": {"eps": 0}}])
    with pytest.raises(SpecError, match="dim 1 is no longer the channels"):
        spec_of(8, [6, 6], {"out_channels": 16, **C3}, [{"sum": {"dims": [1]}}, {"layer_norm_channels": {}}])


@pytest.mark.parametrize("nd", [1, 2, 3])
def test_the_reference_is_pytorchs_layer_norm_with_the_channels_moved_last(nd):
    torch.manual_seed(nd)
    spec = spec_of(3, [5] * nd, {"out_channels": 6, "kernel": 3}, [{"layer_norm_channels": {"eps": 1e-6}}])
    x = torch.randn(2, 3, *[5] * nd, dtype=torch.float64)
    w, b = torch.randn(6, 3, *[3] * nd, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
    p = {"ln_weight": torch.randn(6, *[1] * nd, dtype=torch.float64), "ln_bias": torch.randn(6, *[1] * nd, dtype=torch.float64)}
    got = reference.forward64(spec, x, w, b, p)
    conv = getattr(torch.nn.functional, f"conv{nd}d")(x, w, b)
    want = torch.nn.functional.layer_norm(conv.movedim(1, -1), (6,), p["ln_weight"].reshape(-1), p["ln_bias"].reshape(-1),
                                          1e-6).movedim(-1, 1)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
def test_on_hopper_the_epilogue_takes_it_over_a_blocks_channels(precision):
    spec = spec_of(64, [14, 14], {"out_channels": 96, **C3}, ["relu", {"layer_norm_channels": {}}, "gelu"], precision)
    assert tma.channel_norm(spec) == 1
    plan = build_plan(spec, target=HOPPER)
    assert plan["engine"] == "tma", describe(plan)
    tp = plan["tma"]
    assert tp.channel_norm and tp.channel_norm_op == "layer_norm_channels" and tp.n_tiles == 1
    assert "layer_norm_channels over the channels taken on the accumulators" in describe(plan)
    source = render_plan(plan)
    assert "mx *= 1.0f / C_OUT;  // the row's mean" in source
    assert "1.0f / sqrtf(sum * (1.0f / C_OUT) + S1_EPS)" in source and "p_ln_weight + cj" in source
    assert "expf(" not in source.split("---- epilogue")[1].split("gelu")[0]


def test_a_depthwise_conv_runs_it_on_the_tail_engine_over_strided_groups():
    spec = spec_of(32, [28, 28], {"out_channels": 32, "kernel": 7, "padding": 3, "groups": 32},
                   [{"layer_norm_channels": {"eps": 1e-6}}])
    plan = build_plan(spec, target=HOPPER)
    assert [p.role for p in plan["parts"]] == ["body", "tail"]
    tail = plan["parts"][1].plan
    assert tail.mode == "strided" and tail.statistic == "moments" and tail.elems == 32 and tail.registers
    assert tail.kernels[0].name.endswith("_norm")
    wide = spec_of(768, [7, 7], {"out_channels": 768, "kernel": 7, "padding": 3, "groups": 768}, [{"layer_norm_channels": {}}])
    assert build_plan(wide, target=HOPPER)["parts"][1].plan.team_pos  # (a team per group: see below)


@pytest.mark.nvcc
@pytest.mark.parametrize("name, cin, size, conv, epilogue, precision", [
    ("lnc_tma", 64, [14, 14], {"out_channels": 96, **C3}, [{"layer_norm_channels": {}}, "gelu"], "tf32"),
    ("lnc_tma_fp32", 64, [14, 14], {"out_channels": 128, **C3}, ["relu", {"layer_norm_channels": {"eps": 1e-6}}], "fp32"),
    ("lnc_dw", 32, [28, 28], {"out_channels": 32, "kernel": 7, "padding": 3, "groups": 32}, [{"layer_norm_channels": {}}], "tf32"),
    ("lnc_dw_wide", 768, [7, 7], {"out_channels": 768, "kernel": 7, "padding": 3, "groups": 768},
     [{"layer_norm_channels": {}}], "fp32"),
])
def test_channel_layer_norm_kernels_build_without_spills(name, cin, size, conv, epilogue, precision, tmp_path):
    kernels = build_report(spec_of(cin, size, conv, epilogue, precision, name), tmp_path)
    assert f"specgen_{name}" in kernels or f"specgen_{name}_body" in kernels
    assert not spilled(kernels), spilled(kernels)


def test_strided_groups_of_many_values_or_few_positions_take_a_team(monkeypatch, tmp_path):
    """`tail.STRIDED_TEAMS`: a group of more than STRIDED_REGISTERS values (768 channels), or of any
    length on a small map, is a team's: a block of TEAM_POS groups x THREADS / TEAM_POS slices, each
    thread its slice's values in registers, the statistics joined in slice order."""
    from specgen import tail

    spec = spec_of(768, [7, 7], {"out_channels": 768, "kernel": 3, "padding": 1, "groups": 768},
                   [{"layer_norm_channels": {}}, {"add": 0.5}], "fp32", name="lnc_team")
    plan = build_plan(spec, target=HOPPER)
    tp = plan["parts"][1].plan
    # 49 groups a sample: 8 a block (a sector of neighbouring positions), 32 threads each, 24 values a thread
    assert (tp.team_pos, tp.lane_items, tp.kernels[0].grid_x) == (8, 24, 7)
    assert "a block per 8 group(s), 32 threads a group, 24 value(s) a thread" in describe(plan)
    source = render_plan(plan)
    assert "constexpr int TEAM_POS = 8;" in source and "constexpr int LANE_ITEMS = 24;" in source
    assert "m2 = group_join(m2, red, slice, pos, false);" in source
    # a large map: 32 neighbouring groups a block; few values on a large map keep a thread each
    big = build_plan(spec_of(96, [56, 56], {"out_channels": 96, "kernel": 7, "padding": 3, "groups": 96},
                             [{"layer_norm_channels": {}}]), target=HOPPER)["parts"][1].plan
    assert (big.team_pos, big.lane_items) == (32, 12)
    few = spec_of(32, [64, 64], {"out_channels": 32, "kernel": 3, "padding": 1, "groups": 32}, [{"layer_norm_channels": {}}])
    assert build_plan(few, target=HOPPER)["parts"][1].plan.team_pos == 0
    # off: a thread per group, reading the 768 values twice (Welford, then the normalization)
    monkeypatch.setattr(tail, "STRIDED_TEAMS", False)
    off = build_plan(spec, target=HOPPER)["parts"][1].plan
    assert off.team_pos == 0 and not off.registers
    monkeypatch.undo()
    kernels = build_report(spec, tmp_path)
    assert "specgen_lnc_team_e0_norm" in kernels and not spilled(kernels), spilled(kernels)
