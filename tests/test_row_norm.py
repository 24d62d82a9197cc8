"""A statistic stage over trailing spatial dims (a LayerNorm over W or over H and W, a softmax over
W) taken in the TMA engine's epilogue (`tma.row_norm`): which layers plan it, which refuse it and
why, what the kernel says, and that it builds without spills. The kernels against float64 on a
GPU: tests/test_row_norm_gpu.py."""

from __future__ import annotations

import pytest

from build_helpers import build_report, spilled
from specgen import tma
from specgen.plan import build_plan, describe
from specgen.render import render_plan
from specgen.spec import validate
from specgen.target import BUILTIN

HOPPER = BUILTIN["sm_90"]
C3 = {"kernel": 3, "padding": 1}
KB34_CONV = {"kernel": 4, "stride": 2, "padding": 1, "transposed": True}


def spec_of(cin, size, conv, epilogue, precision="tf32", name="rn"):
    return validate({"name": name, "input": {"channels": cin, "size": list(size)}, "conv": conv,
                     "epilogue": list(epilogue), "precision": precision})


def test_which_stages_are_over_trailing_positions():
    ln_w = spec_of(64, [16, 32], {"out_channels": 64, **C3}, ["relu", {"layer_norm": 32}, "gelu"])
    assert tma.row_norm(ln_w) == 1 and tma.row_norm_group(ln_w) == 32 and tma.row_norm_rows(ln_w, False) == 32
    ln_hw = spec_of(32, [8, 8, 8], {"out_channels": 64, **C3}, [{"layer_norm": [8, 8]}])
    assert tma.row_norm_group(ln_hw) == 64 and tma.row_norm_rows(ln_hw, False) == 64
    softmax_w = spec_of(64, [16, 32], {"out_channels": 64, **C3}, [{"softmax": -1}])
    assert tma.row_norm(softmax_w) == 0 and tma.row_norm_rows(softmax_w, False) == 32
    # 48 positions: whole 16-row chunks, but no tile of 128 or 256 rows holds whole groups
    assert tma.row_norm_rows(spec_of(64, [16, 48], {"out_channels": 64, **C3}, [{"softmax": -1}]), False) is None
    # an instance norm's group is every position of a channel: a small map's is a tile's rows
    inorm = spec_of(64, [16, 16], {"out_channels": 64, **C3}, [{"instance_norm": {"affine": True}}])
    assert tma.row_norm(inorm) == 0 and tma.row_norm_rows(inorm, False) == 256
    assert tma.row_norm_rows(spec_of(64, [16, 32], {"out_channels": 64, **C3}, [{"instance_norm": {}}]), False) is None
    # over the channels, a channel group, the channels and positions, the batch: not this
    for epilogue in ([{"softmax": 1}], [{"group_norm": 8}], [{"layer_norm": [64, 16, 32]}],
                     [{"batch_norm": {"training": True}}], ["relu"], [{"max_pool": 2}, {"layer_norm": 16}]):
        assert tma.row_norm(spec_of(64, [16, 32], {"out_channels": 64, **C3}, epilogue)) is None, epilogue
    # groups that are not whole 16-row chunks, or too long for a tile
    assert tma.row_norm_rows(spec_of(64, [16, 24], {"out_channels": 64, **C3}, [{"layer_norm": 24}]), False) is None
    assert tma.row_norm_rows(spec_of(64, [16, 32], {"out_channels": 64, **C3}, [{"layer_norm": [16, 32]}]), False) is None
    # a transposed conv: a group over W alone, both W phases of a pair, an even width
    kb34 = spec_of(32, [4, 8, 32], {"out_channels": 64, **KB34_CONV}, [{"layer_norm": 64}])
    assert tma.row_norm_rows(kb34, True) == 32 and tma.row_norm_rows(kb34, False) is None
    over_hw = spec_of(32, [4, 8, 8], {"out_channels": 64, **KB34_CONV}, [{"layer_norm": [16, 16]}])
    assert tma.row_norm_rows(over_hw, True) is None


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
def test_a_layer_norm_over_w_is_one_kernel(precision):
    spec = spec_of(64, [16, 64], {"out_channels": 96, **C3}, ["relu", {"layer_norm": 64}, "gelu", {"mul": 2.0}], precision)
    plan = build_plan(spec, target=HOPPER)
    assert plan["engine"] == "tma", describe(plan)
    tp = plan["tma"]
    assert tp.row_norm and tp.norm_rows == 64 and tp.norm_group == 64 and tp.bm % 64 == 0
    assert tp.split_k == 1 and tp.blocks_per_sm == 1 and not tp.store_quads
    assert tp.smem_bytes == tp.stages * tp.stage_bytes + tma.SMEM_ALIGN + tma.row_norm_smem(tp.bm, tp.bn)
    assert [p["op"] for p in plan["pointwise"]] == ["relu"]
    assert plan["channel_norm"]["axis"] == "rows" and [p["op"] for p in plan["channel_norm"]["pointwise"]] == ["gelu", "mul"]
    assert "statistic stage over positions taken on the accumulators (groups of 64 positions" in describe(plan)
    source = render_plan(plan)
    assert "constexpr int NORM_ROWS = 64;" in source and source.count("bar.sync 1, %0;") == 2
    assert "p_ln_weight + e_el" in source and "1.0f / sqrtf(sb + S1_EPS)" in source


def test_an_instance_norm_of_a_small_map_takes_its_weight_per_channel():
    spec = spec_of(64, [8, 8], {"out_channels": 128, **C3}, [{"instance_norm": {"affine": True}}, "relu"])
    plan = build_plan(spec, target=HOPPER)
    assert plan["tma"].row_norm and plan["tma"].norm_group == 64
    assert "p_inorm_weight + cj" in render_plan(plan)


def test_a_softmax_over_w_folds_max_then_exponentials():
    spec = spec_of(64, [16, 32], {"out_channels": 40, **C3}, [{"log_softmax": -1}])
    plan = build_plan(spec, target=HOPPER)
    assert plan["tma"].row_norm and plan["tma"].norm_rows == 32
    source = render_plan(plan)
    assert "fmaxf(s, s2)" in source and "expf(acc[i][k] - sa)" in source and "logf(sb)" in source


def test_deep_small_batch_layers_take_no_split_k():
    spec = spec_of(512, [4, 16], {"out_channels": 128, **C3}, [{"layer_norm": 16}])
    tp = build_plan(spec, target=HOPPER)["tma"]
    assert tp.row_norm and tp.split_k == 1


def test_the_transposed_kernelbench_34_layer_is_one_kernel_of_w_pairs():
    spec = spec_of(32, [16, 32, 32], {"out_channels": 64, **KB34_CONV}, [{"layer_norm": 64}, "gelu", {"mul": 1.0}])
    plan = build_plan(spec, target=HOPPER)
    assert "parts" not in plan and plan["engine"] == "tma", describe(plan)
    tp = plan["tma"]
    assert tp.w_pairs and tp.row_norm and tp.norm_rows == 32 and tp.norm_group == 64
    source = render_plan(plan)
    assert "(p + 1) % NORM_GROUP" in source and "acc2[i][k + 2]" in source


def test_the_transposed_layer_takes_two_blocks_of_a_narrow_tile():
    """Its blocks hold one tile each (no walk): two per SM, the tile narrow enough (BN 32) that the
    statistics fit the registers two blocks leave."""
    spec = spec_of(32, [16, 32, 32], {"out_channels": 64, **KB34_CONV}, [{"layer_norm": 64}, "gelu"])
    tp = build_plan(spec, target=HOPPER)["tma"]
    assert (tp.bm, tp.bn, tp.blocks_per_sm) == (128, 32, 2) and not tp.persistent
    assert 2 * (tp.smem_bytes + 1024) <= HOPPER.smem_per_sm


def test_a_statistic_the_epilogue_takes_pays_for_the_layout_pass():
    """The family's 25: 54 multiply-adds per input byte, below the TMA engine's bar, but the fused
    LayerNorm saves the conv's output's round trip (1.72x on an H100)."""
    spec = spec_of(16, [32, 64, 64], {"out_channels": 32, "kernel": 3, "stride": 2, "padding": 1}, [{"layer_norm": 32}, "gelu"])
    assert not tma.worth_it(spec) and tma.row_norm_fits(spec)
    plan = build_plan(spec, target=HOPPER)
    assert plan["engine"] == "tma" and plan["tma"].row_norm
    tma.ROW_NORM = False
    try:
        assert [p.role for p in build_plan(spec, target=HOPPER)["parts"]] == ["body", "tail"]
    finally:
        tma.ROW_NORM = True


def test_a_pool_after_it_reads_its_output():
    spec = spec_of(64, [16, 32], {"out_channels": 64, **C3}, [{"layer_norm": 32}, {"avg_pool": 2}, "gelu"])
    plan = build_plan(spec, target=HOPPER)
    assert [p.role for p in plan["parts"]] == ["body", "rest"]
    assert plan["parts"][0].plan["tma"].row_norm
    assert "is taken in the TMA engine's epilogue (a tile holds whole groups)" in plan["why"][0]


@pytest.mark.parametrize("size, epilogue", [
    ([16, 24], [{"layer_norm": 24}]),  # not whole 16-row chunks
    ([16, 32], [{"add": {"input": "skip"}}, {"layer_norm": 32}]),  # an extra input
    ([16, 32], [{"layer_norm": 32}, {"group_norm": 4}]),  # a further statistic stage
])
def test_layers_it_cannot_take_run_as_a_sequence_of_the_tail_engine(size, epilogue):
    plan = build_plan(spec_of(64, size, {"out_channels": 64, **C3}, epilogue), target=HOPPER)
    assert "tail" in [p.role for p in plan["parts"]]
    assert not getattr(plan["parts"][0].plan.get("tma"), "row_norm", False)


def test_groups_no_tile_holds_leave_the_norm_to_the_tail_engine():
    """A tile asking for the TMA engine gets it for the body; the statistics run as before."""
    spec = validate({"name": "rn", "input": {"channels": 64, "size": [16, 24]}, "conv": {"out_channels": 64, **C3},
                     "epilogue": [{"layer_norm": 24}], "precision": "tf32", "tile": {"engine": "tma"}})
    assert not tma.row_norm_fits(spec)
    reasons = tma.why_not(spec, [{}], [], HOPPER)
    assert any("group of 24 positions is not 16 to 256 rows" in r for r in reasons), reasons
    plan = build_plan(spec, target=HOPPER)
    assert [p.role for p in plan["parts"]] == ["body", "tail"] and plan["parts"][0].plan["engine"] == "tma"
    with pytest.raises(ValueError, match="does not hold whole groups of 256 rows"):
        tma.plan_tma(spec_of(64, [4, 64], {"out_channels": 64, **C3}, [{"layer_norm": [4, 64]}]), HOPPER,
                     tma.TmaConfig(128, 64, 3, 1))


def test_tuning_candidates_hold_whole_groups():
    spec = spec_of(64, [16, 128], {"out_channels": 128, **C3}, [{"layer_norm": 128}])
    configs = tma.configs(spec, HOPPER)
    assert configs and all(c.bm % 128 == 0 for c in configs)
    for cfg in configs:
        tp = tma.plan_tma(spec, HOPPER, cfg)
        assert tp.acc_regs <= tma.ROW_NORM_MAX_ACC
        # two blocks per SM only where the accumulators and the statistics fit their registers
        assert cfg.blocks_per_sm == 1 or tp.acc_regs + 2 * tp.wm * tp.bn // 4 <= tma.REGS_TWO_BLOCKS["max_acc"]
    assert any(c.blocks_per_sm == 2 for c in configs)


@pytest.mark.nvcc
@pytest.mark.parametrize("name, cin, size, conv, epilogue, precision", [
    ("ln_w64", 64, [32, 64], {"out_channels": 64, **C3}, [{"layer_norm": 64}, "gelu"], "tf32"),
    ("ln_hw_3d", 32, [8, 8, 8], {"out_channels": 128, **C3}, ["relu", {"layer_norm": [8, 8]}], "tf32"),
    ("softmax_w32", 64, [16, 32], {"out_channels": 96, **C3}, [{"softmax": -1}, {"mul": 2.0}], "tf32"),
    ("ln_w32_fp32", 64, [16, 32], {"out_channels": 64, **C3}, [{"layer_norm": 32}], "fp32"),
    ("ln_w64_bf16", 64, [32, 64], {"out_channels": 64, **C3}, [{"layer_norm": 64}, "gelu"], "bf16"),
    ("kb34_like", 32, [4, 8, 32], {"out_channels": 64, **KB34_CONV}, [{"layer_norm": 64}, "gelu"], "tf32"),
])
def test_row_norm_kernels_build_without_spills(name, cin, size, conv, epilogue, precision, tmp_path):
    spec = spec_of(cin, size, conv, epilogue, precision, name)
    assert build_plan(spec, target=HOPPER)["tma"].row_norm
    kernels = build_report(spec, tmp_path)
    assert f"specgen_{name}" in kernels
    assert not spilled(kernels), spilled(kernels)
