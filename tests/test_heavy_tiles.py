"""Layers of few outputs and a deep K (many input channels and taps into fewer than 32 channels,
before a pool): the FFMA engine parallelizes over the outputs alone, so the planner splits them
before the pool (the conv on the TMA engine, `tail.POOL_SPLIT_FEW_CHANNELS_MIN_K`) where the TMA
engine runs the conv, and otherwise spreads the FFMA register tiles (`plan._spread_heavy_tiles`).
The plans and builds without a GPU; each layer against float64 on one."""

from __future__ import annotations

import math

import pytest

from specgen import tail
from specgen.plan import FFMA_HEAVY_TILE_MACS, FFMA_SPREAD_TILES, _spread_heavy_tiles, build_plan
from specgen.spec import validate

LAYERS = {
    # 384 -> 16 channels of a 7x7 stride-2 conv, then a 2x2 max pool: one block of 32 threads with
    # 2.4 million multiply-adds each, before the split
    "split_fp16": ({"channels": 384, "size": [32, 32]}, {"out_channels": 16, "kernel": 7, "stride": 2, "padding": 3},
                   ["relu", {"max_pool": {"kernel": 2}}], "fp16"),
    "split_tf32_3d": ({"channels": 512, "size": [4, 12, 12]}, {"out_channels": 24, "kernel": 3, "padding": 1},
                      ["silu", {"max_pool": {"kernel": 2}}], "tf32"),
    "split_fp32": ({"channels": 384, "size": [17, 17]}, {"out_channels": 24, "kernel": 5, "padding": 2},
                   [{"add": {"param": "b2"}}, {"max_pool": {"kernel": 2}}], "fp32"),
    # the TMA engine's layout pass does not pay for these convs in fp32 (too few multiply-adds per
    # input byte): split, the body on the implicit GEMM; on FFMA (a tile naming it), spread
    "spread_fp32": ({"channels": 512, "size": [28, 28]}, {"out_channels": 16, "kernel": 3, "padding": 1},
                    [{"mul": {"value": 0.5}}, "tanh", {"avg_pool": {"kernel": 2}}], "fp32"),
    "spread_8ch": ({"channels": 256, "size": [32, 32]}, {"out_channels": 8, "kernel": 3, "padding": 1},
                   ["relu", {"max_pool": {"kernel": 2}}], "fp32"),
}


def spec_of(key: str, **changes):
    inp, conv, epilogue, precision = LAYERS[key]
    return validate({"name": key, "input": inp, "conv": conv, "epilogue": epilogue, "precision": precision, **changes})


def sample_threads(plan) -> int:
    return plan["threads"] * plan["blocks_per_sample"]


@pytest.mark.parametrize("name", [n for n in LAYERS if n.startswith("split")])
def test_few_channels_with_a_deep_k_split_before_the_pool(name):
    spec = spec_of(name)
    assert spec.conv.out_channels < 32 and spec.input.channels * math.prod(spec.conv_geometry()["kernel"]) >= tail.POOL_SPLIT_FEW_CHANNELS_MIN_K
    plan = build_plan(spec)
    assert plan["engine"] == "sequence"
    body = plan["parts"][0].plan
    assert body["engine"] == "tma" and body["tma"].config.bn <= 32


def test_few_channels_with_a_shallow_k_stay_whole():
    """3 -> 16 channels 3x3x3 (K 81) before a pool: measured faster whole (NOTES v24)."""
    spec = validate({"name": "shallow", "input": {"channels": 3, "size": [8, 16, 16]},
                     "conv": {"out_channels": 16, "kernel": 3, "padding": 1}, "epilogue": ["relu", {"max_pool": {"kernel": 2}}],
                     "precision": "tf32"})
    assert build_plan(spec)["engine"] == "ffma"


@pytest.mark.parametrize("name", ["spread_fp32", "spread_8ch"])
def test_few_channels_with_a_deep_k_split_where_the_tma_engine_does_not_pay(name):
    """In fp32 the TMA engine's layout pass does not pay for these convs alone (`tma.worth_it`): the
    split's body runs where the planner puts the conv alone, the implicit GEMM."""
    plan = build_plan(spec_of(name))
    assert plan["engine"] == "sequence"
    assert plan["parts"][0].plan["engine"] == "igemm"


@pytest.mark.parametrize("name", ["spread_fp32", "spread_8ch"])
def test_heavy_ffma_tiles_spread_over_more_threads(name):
    spec = spec_of(name, tile={"engine": "ffma"})
    plan = build_plan(spec)
    assert plan["engine"] == "ffma"
    pinned = build_plan(spec_of(name, tile={"engine": "ffma", "channels_per_thread": 8, "positions_per_thread": 4}))
    assert (pinned["ct"], pinned["pt"]) == (8, 4)
    assert plan["ct"] * plan["pt"] < 32 and sample_threads(plan) >= 4 * sample_threads(pinned)


def test_spreading_halves_channels_then_positions_until_enough_tiles_or_light_ones():
    t1 = (16, 1, 8, 8)
    # 18816 multiply-adds per value: 8 x 4 -> 4 x 4 -> 2 x 4 -> 2 x 2 -> 1 x 2, whose tiles are light
    assert _spread_heavy_tiles(8, 4, t1, 18816, True, True) == (1, 2, False)
    # heavier: down to 1 x 1, still heavy, 1024 tiles: not stacked
    assert _spread_heavy_tiles(8, 4, t1, 4 * 18816, True, True) == (1, 1, True)
    # pinned channels: only the positions shrink
    assert _spread_heavy_tiles(8, 4, t1, 18816, False, True) == (8, 1, True)
    # light tiles stay as they are
    light = FFMA_HEAVY_TILE_MACS / 32
    assert _spread_heavy_tiles(8, 4, t1, light, True, True) == (8, 4, False)
    # plenty of tiles already: kept, and stacked four to a thread from 4 x FFMA_SPREAD_TILES
    big = (64, 1, 64, 64)
    assert _spread_heavy_tiles(8, 4, big, 18816, True, True) == (8, 4, False)
    assert 8 * 64 * 16 >= 4 * FFMA_SPREAD_TILES


@pytest.mark.nvcc
def test_heavy_layers_build_without_spills(tmp_path, monkeypatch):
    from specgen import pipeline

    monkeypatch.setenv("SPECGEN_CACHE_DIR", str(tmp_path / "cache"))
    for item in pipeline.specialize_many([spec_of(n) for n in LAYERS], "sm_90", tuned=False):
        assert item.build.registers > 0 and item.build.spill_bytes == 0, (item.spec.name, item.build.log)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(LAYERS))
def test_heavy_layers_on_the_gpu(name):
    from gpu_helpers import compare

    from specgen import FusedLayer

    layer = FusedLayer(spec_of(name, name=f"heavy_{name}")).cuda()
    for batch, seed in ((1, 1), (3, 2)):
        compare(layer, batch, seed)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["spread_fp32", "spread_8ch"])
def test_spread_ffma_tiles_on_the_gpu(name):
    from gpu_helpers import compare

    from specgen import FusedLayer

    layer = FusedLayer(spec_of(name, name=f"heavy_ffma_{name}", tile={"engine": "ffma"})).cuda()
    for batch, seed in ((1, 3), (3, 4)):
        compare(layer, batch, seed)
