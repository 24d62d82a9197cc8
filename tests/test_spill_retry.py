"""The spill retry's smaller tiles (`pipeline._without_spills`, `pipeline._smaller_tiles`): a TMA
build that spilled under the planner's 256-position tile is built again with the 128-position tile
and kept if it spills less; the FFMA and slab engines keep the planner's tile (timed slower). The layers below are from a sweep of random layer specs built for sm_90:
each spilled under the planner's tile with nvcc 13.0 (the FFMA engine under a pool, the mma.sync
slab before a global pool in fp16, the TMA engine's 256-position tile with an exact GELU or a
reduction over the channels)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from specgen import pipeline
from specgen.plan import DEFAULT_SETTINGS, Settings, build_plan
from specgen.render import render_plan
from specgen.spec import validate

LAYERS = {
    # 3 -> 16 channels of a 3x3x3 conv, then a 2x2x2 max pool: FFMA (fewer than 32 channels)
    "ffma_pool": {"input": {"channels": 3, "size": [4, 16, 16]},
                  "conv": {"out_channels": 16, "kernel": 3, "padding": 1},
                  "epilogue": [{"max_pool": {"kernel": 2}}], "precision": "tf32"},
    # a grouped 5x5 conv, tanh and silu, a 2x2 average pool: FFMA
    "ffma_grouped": {"input": {"channels": 32, "size": [112, 112]},
                     "conv": {"out_channels": 32, "kernel": 5, "padding": 2, "groups": 4, "bias": False},
                     "epilogue": [{"mul": {"value": 0.5}}, "tanh", "silu", {"avg_pool": {"kernel": 2}}], "precision": "tf32"},
    # 3 -> 128 channels, 7x7, batch norm, a global average: the slab engine on mma.sync
    "slab_global": {"input": {"channels": 3, "size": [32, 32]},
                    "conv": {"out_channels": 128, "kernel": 7, "padding": 3},
                    "epilogue": ["relu", "batch_norm", {"global_avg_pool": {}}], "precision": "fp16"},
    # a strided 1D conv without bias and an exact GELU: the TMA engine's 256 x 128 tile
    "tma_gelu": {"input": {"channels": 128, "size": [799]},
                 "conv": {"out_channels": 128, "kernel": 3, "stride": 2, "bias": False},
                 "epilogue": [{"gelu": {"approximate": "none"}}], "precision": "tf32"},
    # a sum over the channels in the TMA epilogue, bf16
    "tma_channel_sum": {"input": {"channels": 256, "size": [17, 17]},
                        "conv": {"out_channels": 128, "kernel": 5, "padding": 2},
                        "epilogue": ["batch_norm", {"clamp": {"min": -1.0, "max": 1.0}}, {"sum": {"dims": [1], "keepdim": True}}],
                        "precision": "bf16"},
}


def spec_of(name: str, **changes):
    return validate({"name": name, **LAYERS[name], **changes})


class Built:
    def __init__(self, spill_bytes: int):
        self.spill_bytes = spill_bytes


def test_only_the_tma_engine_gets_a_smaller_tile():
    """Timed (benchmarks/spill_retry.py): the TMA engine's smaller tile paid, the FFMA and slab
    engines' mostly did not, so those keep the planner's tile."""
    assert pipeline.SPILL_RETRY_ENGINES == ("tma",)
    ffma = build_plan(spec_of("ffma_pool"))
    assert ffma["engine"] == "ffma" and ffma["ct"] == 8 and pipeline._smaller_tiles(ffma, DEFAULT_SETTINGS) == []
    slab = build_plan(spec_of("slab_global"))
    assert slab["engine"] == "slab" and not slab["mma"].wgmma and pipeline._smaller_tiles(slab, DEFAULT_SETTINGS) == []

    tma = build_plan(spec_of("tma_gelu"))
    assert tma["engine"] == "tma" and tma["tma"].config.bm == 256
    [(settings, config)] = pipeline._smaller_tiles(tma, DEFAULT_SETTINGS)
    assert config == replace(tma["tma"].config, bm=128) and settings == DEFAULT_SETTINGS
    assert build_plan(spec_of("tma_gelu"), tma_config=config)["tma"].config.bm == 128


def test_the_ffma_cap_still_plans_smaller_tiles_for_the_tuner():
    ffma = build_plan(spec_of("ffma_pool"))
    smaller = build_plan(spec_of("ffma_pool"), settings=Settings(ffma_ct=4))
    assert smaller["ct"] == 4 and smaller["threads"] * smaller["tile_iters"] >= ffma["threads"] * ffma["tile_iters"]
    assert "FFMA tiles of at most 4 channels" in Settings(ffma_ct=4).summary()


def test_no_smaller_tile_where_there_is_none():
    # a one-channel FFMA register tile, a wgmma slab (its M tile is the instruction's)
    one = build_plan(validate({"name": "one", "input": {"channels": 8, "size": [16, 16]},
                               "conv": {"out_channels": 8, "kernel": 3, "groups": 8}, "epilogue": ["relu"],
                               "tile": {"channels_per_thread": 1}}))
    assert one["engine"] == "ffma" and pipeline._smaller_tiles(one, DEFAULT_SETTINGS) == []
    kb90 = build_plan(validate({"name": "kb90", "input": {"channels": 8, "size": [16, 64, 64]},
                                "conv": {"out_channels": 64, "kernel": 3}, "epilogue": ["relu"]}))
    assert kb90["engine"] == "slab" and kb90["mma"].wgmma and pipeline._smaller_tiles(kb90, DEFAULT_SETTINGS) == []


def _retry(monkeypatch, spec, spills, smaller):
    """_without_spills on the planner's plan of `spec`, built with `spills` bytes; `smaller` =
    (text, bytes): a rebuild whose source holds the text reports those bytes, any other `spills`.
    Returns (the item kept, the requests rebuilt)."""
    seen = []

    def fake_build(req):
        seen.append(req)
        return Built(smaller[1] if smaller[0] in req.source else spills)

    monkeypatch.setattr(pipeline.cache, "get_or_build", fake_build)
    plan = build_plan(spec)
    return pipeline._without_spills(pipeline.Specialized(spec, plan, render_plan(plan), Built(spills)), "sm_90"), seen


def test_a_spilling_build_is_rebuilt_with_the_smaller_tile_and_kept_when_it_spills_less(monkeypatch):
    spec = spec_of("tma_gelu")
    out, seen = _retry(monkeypatch, spec, 224, ("constexpr int BM = 128,", 0))
    assert "constexpr int BM = 128," in seen[-1].source and out.build.spill_bytes == 0 and out.plan["tma"].config.bm == 128
    assert all(req.canonical_spec == spec.canonical_json() for req in seen)  # the user's spec keys the cache
    assert out.plan["spec_yaml"] == build_plan(spec)["spec_yaml"] and out.spec is spec

    out, seen = _retry(monkeypatch, spec, 224, ("constexpr int BM = 128,", 300))  # it spills more: the first stays
    assert "constexpr int BM = 128," in seen[-1].source
    assert out.build.spill_bytes == 224 and out.plan["tma"].config.bm == 256

    ffma = spec_of("ffma_pool")  # the FFMA engine: no smaller tile tried (only the one-block settings retry)
    out, seen = _retry(monkeypatch, ffma, 176, ("constexpr int CT = 4;", 0))
    assert not any("constexpr int CT = 4;" in req.source for req in seen)
    assert out.build.spill_bytes == 176 and out.plan["ct"] == 8


def test_a_build_that_does_not_spill_and_a_pinned_tile_are_left_alone(monkeypatch):
    out, seen = _retry(monkeypatch, spec_of("tma_gelu"), 0, ("constexpr int BM = 128,", 0))
    assert seen == [] and out.plan["tma"].config.bm == 256
    out, seen = _retry(monkeypatch, spec_of("tma_gelu"), 224, ("constexpr int BM = 128,", 0))  # the planner's: retried
    assert out.plan["tma"].config.bm == 128 and out.build.spill_bytes == 0
    pinned = spec_of("tma_gelu", tile={"engine": "tma"})  # a tile the user wrote: only the settings' retries
    out, seen = _retry(monkeypatch, pinned, 224, ("constexpr int BM = 128,", 0))
    assert not any("constexpr int BM = 128," in req.source for req in seen)
    assert out.plan["tma"].config.bm == 256 and out.build.spill_bytes == 224


@pytest.mark.nvcc
def test_the_sweeps_spilling_tma_layers_build_without_spills(tmp_path, monkeypatch):
    """Built for sm_90 by nvcc: each TMA layer spilled under the planner's tile, and does not with
    the retry's smaller one; the FFMA and slab layers keep the planner's tile."""
    from specgen import cache

    monkeypatch.setenv("SPECGEN_CACHE_DIR", str(tmp_path / "cache"))
    specs = [spec_of(name) for name in LAYERS]
    first = cache.build_many([pipeline.request(spec, "sm_90")[2] for spec in specs])
    if not any(build.spill_bytes for spec, build in zip(specs, first) if spec.name.startswith("tma")):
        pytest.skip("no TMA layer spills under this compiler's planner tiles: nothing for the retry to do")
    for spec, build in zip(specs, first):
        item = pipeline.specialize(spec, "sm_90", tuned=False)
        if spec.name.startswith("tma"):
            assert item.build.spill_bytes == 0, (spec.name, build.spill_bytes, item.build.log)
            if build.spill_bytes:
                assert item.plan["tma"].config.bm == 128, spec.name
        else:
            assert item.plan.get("ct", 0) == build_plan(spec).get("ct", 0), spec.name


def test_settings_with_the_ffma_cap_key_the_request_apart():
    """The cap is a planner setting: a request with it is another request-index key."""
    from specgen import planindex, target

    spec = spec_of("ffma_pool")
    t = target.resolve("sm_90")
    keys = {planindex.request_key(spec.canonical_json(), "sm_90", t, s, None)
            for s in (DEFAULT_SETTINGS, Settings(ffma_ct=4), Settings(ffma_ct=2))}
    assert len(keys) == 3
