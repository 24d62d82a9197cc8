"""Autotuning (`specgen.tune`): candidates, the choice store, its use by the pipeline, the CLI.

CPU tests: the candidates plan and compile without spills (nvcc), the store round-trips and is
keyed by spec, precision, GPU, driver and batch bucket, the pipeline and `show --plan` use a
stored choice (the GPU identity is faked), `specgen tune` without a GPU exits 2. The GPU test
(marker `gpu`) tunes a small layer and checks the tuned layer against float64.
"""

from __future__ import annotations

import hashlib
import json

import pytest

from specgen import cli, measured, pipeline, tune
from specgen.igemm import IgemmConfig
from specgen.spec import validate
from specgen.tma import TmaConfig

FAKE_GPU = {"gpu": "Fake GPU (7 SMs)", "arch": "sm_90", "driver": 12080}


def layer(channels=64, out=64, precision="fp32", **extra) -> dict:
    return {
        "name": f"tune_{channels}_{out}_{precision}",
        "input": {"channels": channels, "size": [8, 8]},
        "conv": {"out_channels": out, "kernel": 3, "padding": 1, **extra},
        "epilogue": ["relu"],
        "precision": precision,
    }


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(tune.ENV_AUTOTUNE, raising=False)
    yield tmp_path / "cache"


@pytest.fixture
def fake_gpu(monkeypatch, cache_dir):
    monkeypatch.setattr(tune, "current_gpu", lambda: dict(FAKE_GPU))
    yield FAKE_GPU


# ---------------------------------------------------------------------------- candidates


def _engine(cfg) -> str:
    return "tma" if isinstance(cfg, TmaConfig) else "igemm"


def test_candidates_plan_start_with_the_heuristic_and_follow_the_precision():
    fp32 = validate(layer(precision="fp32"))
    tf32 = validate(layer(precision="tf32"))
    c32, ct = tune.candidates(fp32), tune.candidates(tf32)
    for spec, cands in ((fp32, c32), (tf32, ct)):
        plan = tune.heuristic(spec)
        assert cands[0] == plan[plan["engine"]].config
        assert 3 <= len(cands) <= tune.MAX_CANDIDATES and len(set(cands)) == len(cands)
        # on Hopper (the default target) both engines' tiles are offered
        assert {_engine(c) for c in cands} == {"tma", "igemm"}
        for cfg in cands:
            plan = tune.plan_with(spec, cfg)
            assert plan["engine"] == _engine(cfg) and plan[_engine(cfg)].config == cfg
            if isinstance(cfg, IgemmConfig):
                assert cfg.bk <= 32 and 64 % cfg.bk == 0
    ig32 = [c for c in c32 if isinstance(c, IgemmConfig)]
    igt = [c for c in ct if isinstance(c, IgemmConfig)]
    # 64 x 64 warp tiles and two 128 x 128 blocks per SM spill in 3xTF32: tf32 mode only
    assert not any((c.wn == 8 and not c.wgmma) or c.min_blocks == 2 for c in ig32)
    assert any(c.min_blocks == 2 for c in igt)
    offered = [cfg for _, cfg in tune._templates(False, 64, True)]  # (the capped list may end before them)
    assert any(c.wn == 8 and not c.wgmma for c in offered) and any(c.min_blocks == 2 and c.wgmma for c in offered)
    assert not any(c.min_blocks == 2 for _, c in tune._templates(True, 64, True))


def test_few_channels_get_the_narrow_tile_and_a_fitting_k_chunk():
    spec = validate(layer(channels=16, out=32, precision="tf32"))
    cands = tune.candidates(spec)
    assert any(c.bm == 256 and c.bn == 32 for c in cands if isinstance(c, IgemmConfig))
    assert all(c.bk <= 16 for c in cands if isinstance(c, IgemmConfig) and not c.wgmma)  # mma.sync K chunks of at most 16


def test_a_strided_transposed_conv_s_candidates_include_one_phase_per_block():
    spec = validate({**layer(precision="tf32"), "conv": {"out_channels": 64, "kernel": 3, "stride": 2, "padding": 1,
                                                          "transposed": True}})
    cands = tune.candidates(spec)
    assert tune.heuristic(spec)["engine"] == "tma" and tune.heuristic(spec)["tma"].phases  # the TMA engine's phases first
    own = next(c for c in cands if isinstance(c, IgemmConfig))  # then the implicit GEMM's: its planner's W pairs
    assert tune.plan_with(spec, own)["igemm"].w_pairs and own.phases_per_block == 0
    single = [c for c in cands if isinstance(c, IgemmConfig) and c.phases_per_block == 1]
    assert single and not tune.plan_with(spec, single[0])["igemm"].w_pairs
    # a stored choice written before the field existed reads back with its default
    record = {k: v for k, v in tune.config_record(own).items() if k != "phases_per_block"}
    assert tune.config_from(record) == own


def test_layers_off_the_implicit_gemm_engine_have_no_candidates():
    spec = validate({**layer(), "conv": {"out_channels": 64, "kernel": 3, "padding": 1, "groups": 64}})
    assert tune.heuristic(spec)["engine"] not in ("igemm", "tma")
    assert tune.candidates(spec) == []


def slab_layer() -> dict:
    """The seed kb90's layer, smaller: 8 input channels, left to the planner on the slab engine."""
    return {"name": "tune_slab", "input": {"channels": 8, "size": [6, 20, 30]}, "conv": {"out_channels": 64, "kernel": 3},
            "epilogue": ["relu"], "precision": "fp32"}


def test_slab_layers_have_warp_tile_candidates():
    """The slab engine's candidates: mma.sync with the planner's and other warp tiles (each plans
    with its own tile) and the wgmma slab's variants, none the heuristic's (wgmma on sm_90a for this
    layer), kept and read back like the other engines' choices."""
    from specgen.plan import SlabConfig

    spec = validate(slab_layer())
    plan = tune.heuristic(spec)
    assert plan["engine"] == "slab" and plan["mma"].wgmma and tune.tunable(spec)
    cands = tune.candidates(spec)
    assert cands and all(isinstance(c, SlabConfig) for c in cands)
    sync = [c for c in cands if not c.wgmma]
    assert sync[0] == SlabConfig(0) and len(sync) >= 4
    shapes = {tune._slab_shape(plan["mma"])}
    for cfg in cands:
        got = tune.plan_with(spec, cfg)["mma"]
        assert got.wgmma == bool(cfg.wgmma) and tune._slab_shape(got) not in shapes
        assert cfg.wgmma or not cfg.wm or (got.wm, got.wn) == (cfg.wm, cfg.wn)
        shapes.add(tune._slab_shape(got))
        assert tune.config_from(tune.config_record(cfg)) == cfg and tune.label(cfg).startswith("slab ")
    tiled = next(c for c in sync if c.wm)
    source = pipeline.request(spec, "sm_90", igemm_config=tiled)[1]
    assert f"constexpr int WM = {tiled.wm};" in source and f"constexpr int WN = {tiled.wn};" in source


def test_wgmma_slab_candidates_follow_their_switch(monkeypatch):
    from specgen.plan import SlabConfig

    spec = validate(slab_layer())
    wgmma = [c for c in tune.candidates(spec) if isinstance(c, SlabConfig) and c.wgmma]
    assert wgmma and all(tune.plan_with(spec, c)["mma"].wgmma for c in wgmma)
    monkeypatch.setattr(tune, "SLAB_WGMMA_CANDIDATES", False)
    assert not any(c.wgmma for c in tune.candidates(spec))


def test_a_bad_slab_config_is_refused():
    from specgen.plan import SlabConfig

    for bad in ({"wgmma": 2}, {"wm": 3}, {"wm": 5, "wn": 1}, {"wgmma": 1, "wm": 2, "wn": 2}, {"slab_h": 2},
                {"prefetch": 1}, {"wgmma": 1, "prefetch": 3}, {"box_fold": 3}):
        with pytest.raises(ValueError):
            SlabConfig(**bad)


@pytest.mark.parametrize("planner_folds", [True, False])
def test_a_box_foldable_layer_is_tuned_with_and_without_its_fold(monkeypatch, planner_folds):
    """A layer the box fold applies to (specgen.boxfold) has candidates both ways, whichever way the
    planner takes (`boxfold.ENABLED`): a folded candidate plans the box means and a 1x1 conv with
    its tile, an unfolded one the layer in one kernel (the avg-pool fold); the record names the
    choice, so a stored choice plans the same way again."""
    from specgen import boxfold
    from specgen.plan import SlabConfig

    monkeypatch.setattr(boxfold, "ENABLED", planner_folds)
    monkeypatch.setattr(tune, "SLAB_WGMMA_CANDIDATES", True)
    spec = validate({"name": "tune_box", "input": {"channels": 8, "size": [26, 23]}, "precision": "fp32",
                     "conv": {"out_channels": 64, "kernel": 3},
                     "epilogue": [{"avg_pool": 4}, "sigmoid", {"sum": {"dims": [1, 2, 3]}}]})
    assert tune._box_folded(tune.heuristic(spec)) == planner_folds and tune.tunable(spec)
    cands = tune.candidates(spec)
    other = [c for c in cands if c.box_fold]
    assert other and len(other) < len(cands) and any(c.wgmma for c in other)
    assert {c.box_fold for c in other} == {2 if planner_folds else 1}
    if not planner_folds:  # the fold with its 1x1 conv on wgmma, prefetching (the planner's since v46)
        assert SlabConfig(1, prefetch=1, box_fold=1) in other
    for cfg in cands:
        got = tune.plan_with(spec, cfg)
        folded = cfg.box_fold == 1 or (planner_folds and cfg.box_fold == 0)
        assert tune._box_folded(got) == folded and got["engine"] == ("sequence" if folded else "slab")
        assert tune.slab_part(got)["mma"].wgmma == bool(cfg.wgmma)
        assert tune.config_from(tune.config_record(cfg)) == cfg
    assert tune.label(other[0]).endswith("no box fold" if planner_folds else " box fold")
    source = pipeline.request(spec, "sm_90", igemm_config=other[0])[1]
    assert ("box means" in source) != planner_folds
    plain = validate({**spec.model_dump(), "conv": {"out_channels": 64, "kernel": 3, "stride": 2}})
    assert not any(c.box_fold for c in tune.candidates(plain))  # (a strided conv: no box fold)


def stem_layer() -> dict:
    """A ResNet stem, smaller: its max pool splits it in two kernels, the conv on the slab engine."""
    return {"name": "tune_stem", "input": {"channels": 3, "size": [40, 48]}, "precision": "fp32",
            "conv": {"out_channels": 64, "kernel": 7, "stride": 2, "padding": 3},
            "epilogue": ["relu", {"max_pool": {"kernel": 3, "stride": 2, "padding": 1}}]}


def test_a_split_layer_tunes_its_slab_body(monkeypatch):
    """A layer split before its pool (the stem) has its body's slab candidates: each plans the body
    with its tile and leaves the pool's kernel as the planner has it."""
    from specgen.plan import SlabConfig

    spec = validate(stem_layer())
    plan = tune.heuristic(spec)
    assert plan["engine"] == "sequence" and tune.slab_part(plan) is not None and tune.tunable(spec)
    rest = next(p["plan"] for p in plan["parts"] if p["role"] == "rest")
    monkeypatch.setattr(tune, "SLAB_WGMMA_CANDIDATES", True)
    cands = tune.candidates(spec)
    assert cands and all(isinstance(c, SlabConfig) for c in cands) and any(c.wgmma for c in cands)
    for cfg in cands:
        got = tune.plan_with(spec, cfg)
        body = tune.slab_part(got)["mma"]
        assert body.wgmma == bool(cfg.wgmma) and (cfg.wgmma or not cfg.wm or (body.wm, body.wn) == (cfg.wm, cfg.wn))
        assert next(p["plan"] for p in got["parts"] if p["role"] == "rest") == rest
    source = pipeline.request(spec, "sm_90", igemm_config=next(c for c in cands if c.wgmma))[1]
    assert "wgmma.mma_async" in source and source.count("__global__") >= 2


@pytest.mark.nvcc
def test_slab_candidates_compile(cache_dir):
    spec = validate(slab_layer())
    (cands,) = tune.build_candidates([spec])
    assert cands[0].config is None and cands[0].item.plan["engine"] == "slab"
    assert len(cands) == len(tune.candidates(spec)) + 1
    assert all(c.item is not None or "spills" in c.error for c in cands), [(c.name, c.error) for c in cands]
    assert len({c.item.key for c in cands if c.item is not None}) == sum(c.item is not None for c in cands)
    (stem,) = tune.build_candidates([validate(stem_layer())])  # (a sequence: the body's candidates)
    assert stem[0].item.plan["engine"] == "sequence" and len(stem) > 1
    assert all(c.item is not None and c.item.build.spill_bytes == 0 for c in stem), [(c.name, c.error) for c in stem]


@pytest.mark.nvcc
def test_candidates_compile_in_one_batch_without_spills(cache_dir):
    specs = [validate(layer(precision="fp32")), validate(layer(channels=128, out=128, precision="tf32"))]
    built = tune.build_candidates(specs)
    for spec, cands in zip(specs, built):
        assert cands[0].config is None and cands[0].item.plan["engine"] in ("igemm", "tma")
        assert len(cands) == len(tune.candidates(spec))  # the heuristic's own tile is not repeated
        for cand in cands:
            assert cand.item is not None, f"{spec.name} {cand.name}: {cand.error}"
            assert cand.item.build.spill_bytes == 0, f"{spec.name} {cand.name} spills"
        assert len({c.item.key for c in cands}) == len(cands)


# ---------------------------------------------------------------------------- the store


def test_the_store_round_trips_and_is_keyed_by_everything_the_choice_depends_on(cache_dir):
    spec = validate(layer())
    cfg = tune.candidates(spec)[1]
    assert tune.store_choice(spec, FAKE_GPU, 64, cfg, [{"label": "x", "ms": 1.0}], batch=50)
    key = tune.choice_key(spec, FAKE_GPU["gpu"], FAKE_GPU["driver"], 64)
    path = cache_dir / "tuned" / f"{key}.json"
    record = json.loads(path.read_text())
    assert record["config"] == tune.config_record(cfg) and record["config"]["engine"] == _engine(cfg)
    assert record["bucket"] == 64 and record["batch"] == 50 and record["gpu"] == FAKE_GPU["gpu"]
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left
    got = tune.load_choice(spec, FAKE_GPU["gpu"], FAKE_GPU["driver"], 64)
    assert got["config"] == cfg
    # every part of the key matters
    other = validate(layer(precision="tf32"))
    assert tune.load_choice(other, FAKE_GPU["gpu"], FAKE_GPU["driver"], 64) is None
    assert tune.load_choice(validate({**layer(), "epilogue": ["gelu"]}), FAKE_GPU["gpu"], FAKE_GPU["driver"], 64) is None
    assert tune.load_choice(spec, "Other GPU (7 SMs)", FAKE_GPU["driver"], 64) is None
    assert tune.load_choice(spec, "Fake GPU (8 SMs)", FAKE_GPU["driver"], 64) is None
    assert tune.load_choice(spec, FAKE_GPU["gpu"], 12090, 64) is None
    assert tune.load_choice(spec, FAKE_GPU["gpu"], FAKE_GPU["driver"], 32) is None
    assert measured.batch_bucket(50) == 64  # a batch of 50 is looked up in bucket 64


def test_a_damaged_or_unplannable_record_counts_as_none(cache_dir):
    spec = validate(layer())
    key = tune.choice_key(spec, FAKE_GPU["gpu"], FAKE_GPU["driver"], 8)
    folder = cache_dir / "tuned"
    tune.store_choice(spec, FAKE_GPU, 8, tune.candidates(spec)[1], [], batch=8)
    (folder / f"{key}.json").write_text("{not json")
    assert tune.load_choice(spec, FAKE_GPU["gpu"], FAKE_GPU["driver"], 8) is None
    bad = {"key": key, "config": {"warps_m": 3, "warps_n": 1, "wm": 1, "wn": 1, "bk": 32, "stages": 40, "min_blocks": 0}}
    (folder / f"{key}.json").write_text(json.dumps(bad))  # 40 stages exceed shared memory
    assert tune.load_choice(spec, FAKE_GPU["gpu"], FAKE_GPU["driver"], 8) is None


def test_without_a_batch_the_largest_bucket_tuned_is_used(fake_gpu):
    spec = validate(layer())
    small, large = tune.candidates(spec)[1:3]
    tune.store_choice(spec, fake_gpu, 8, small, [], batch=8)
    tune.store_choice(spec, fake_gpu, 128, large, [], batch=100)
    assert tune.stored_choice(spec)["config"] == large
    assert tune.stored_choice(spec, bucket=8)["config"] == small
    assert tune.stored_choice(spec, bucket=64) is None
    assert tune.stored_choice(spec, arch="sm_80") is None  # built for another GPU: not this one's choice
    tune.store_choice(spec, fake_gpu, 256, None, [], batch=256)  # the heuristic won at 256
    assert tune.stored_choice(spec)["config"] is None



def _named(name: str, scale: str, shortcut: str, **extra) -> dict:
    """A layer with a per-channel parameter and an extra input, its names given."""
    return {**layer(**extra), "name": name, "epilogue": [{"mul": {"param": scale}}, {"add": {"input": shortcut}}, "relu"]}


def test_layers_that_differ_only_in_names_share_a_tuned_choice(fake_gpu):
    """A model's repeated blocks, or a layer tuned from a YAML file and the same layer imported
    from a model, differ only in their names: one choice serves them all."""
    tuned = validate(_named("block_1", "block_1_scale", "block_1_x"))
    cfg = tune.candidates(tuned)[1]
    tune.store_choice(tuned, fake_gpu, 64, cfg, [], batch=64)
    twin = validate(_named("stage_3_conv", "gamma", "residual"))
    assert tune.signature(twin) == tune.signature(tuned) and tune.stored_choice(twin)["config"] == cfg
    # the structure still counts: a constant for the parameter, one tensor read twice, another shape
    others = [
        {**_named("a", "s", "r"), "epilogue": [{"mul": {"value": 2.0}}, {"add": {"input": "r"}}, "relu"]},
        {**_named("b", "s", "r"), "epilogue": [{"mul": {"param": "s"}}, {"add": {"param": "s"}}, "relu"]},
        _named("c", "s", "r", stride=2),
        _named("d", "s", "r", precision="tf32"),
    ]
    for data in others:
        spec = validate(data)
        assert tune.signature(spec) != tune.signature(tuned) and tune.stored_choice(spec) is None, data["name"]


def test_a_saved_value_is_renamed_like_a_tensor():
    def spec(saved: str, gamma: str):
        return validate({**layer(), "name": f"n_{saved}", "epilogue": [
            {"save": {"name": saved}}, {"group_norm": {"num_groups": 8, "weight": gamma, "bias": f"{gamma}_b"}},
            {"add": {"saved": saved}}]})

    assert tune.signature(spec("conv_out", "g")) == tune.signature(spec("h", "norm_weight"))
    data = json.loads(tune.signature(spec("h", "g")))
    assert "name" not in data and data["epilogue"][0] == {"save": {"name": "t0"}}  # (the layer's own name is gone)


def test_a_choice_stored_for_one_layer_reaches_its_twins_already_specialized(fake_gpu, monkeypatch):
    """Storing a choice drops the memoized kernels of every layer of its signature, not only its own."""
    tuned, twin = validate(_named("block_1", "s1", "x1")), validate(_named("block_2", "s2", "x2"))
    plan = tune.heuristic(twin)
    heuristic = plan[plan["engine"]].config
    chosen = next(c for c in tune.candidates(tuned) if c != heuristic)
    monkeypatch.setattr(pipeline.cache, "get_or_build", lambda req: _FakeBuild(req))
    pipeline.forget(twin)
    assert _config(pipeline.specialize(twin)) == heuristic
    tune.store_choice(tuned, fake_gpu, 64, chosen, [], batch=64)
    assert _config(pipeline.specialize(twin)) == chosen
    pipeline.forget(twin)
    pipeline.forget(tuned)


def test_layers_of_one_signature_are_tuned_once(fake_gpu, monkeypatch):
    """`tune` times the first of each signature and says which others its choice serves."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    built, timed = [], []

    def fake_build(specs, arch=None):
        built.append([s.name for s in specs])
        return [[tune.Candidate(cfg) for cfg in tune.candidates(s)[:2]] for s in specs]

    def fake_measure(spec, cands, batch, reps=tune.REPS):
        timed.append(spec.name)
        for i, c in enumerate(cands):
            c.ms, c.rel_l2, c.ok = 2.0 - i, 0.0, True  # the second candidate wins

    monkeypatch.setattr(tune, "build_candidates", fake_build)
    monkeypatch.setattr(tune, "measure", fake_measure)
    specs = [validate(_named(f"block_{i}", f"s{i}", f"x{i}")) for i in range(3)] + [validate(layer(channels=32))]
    results = tune.tune(specs, batch=8)
    assert built == [["block_0", layer(channels=32)["name"]]] and timed == built[0]
    assert [r.alike for r in results] == [["block_1", "block_2"], []]
    assert "its choice also serves block_1, block_2" in results[0].table().splitlines()[0]
    for spec in specs[:3]:
        assert tune.stored_choice(spec, bucket=8)["config"] == tune.candidates(specs[0])[1]

# ---------------------------------------------------------------------------- users of the choice


def _config(item):
    plan = item.plan
    return plan[plan["engine"]].config


@pytest.mark.parametrize("engine", ["tma", "igemm"])
def test_the_pipeline_uses_a_stored_choice_for_this_gpu(fake_gpu, monkeypatch, engine):
    """A stored choice of either engine replaces the heuristic tile (on Hopper, the other engine too)."""
    spec = validate(layer())
    plan = tune.heuristic(spec)
    heuristic = plan[plan["engine"]].config
    chosen = next(c for c in tune.candidates(spec) if c != heuristic and _engine(c) == engine)
    built = []
    monkeypatch.setattr(pipeline.cache, "get_or_build", lambda req: built.append(req) or _FakeBuild(req))
    pipeline.forget(spec)
    first = pipeline.specialize(spec)
    assert _config(first) == heuristic  # nothing stored yet
    tune.store_choice(spec, fake_gpu, 64, chosen, [], batch=64)  # forgets the memoized kernel
    second = pipeline.specialize(spec)
    assert _config(second) == chosen and second.plan["engine"] == engine
    assert _config(pipeline.specialize(spec, tuned=False)) == heuristic
    assert _config(pipeline.specialize_many([spec])[0]) == chosen
    monkeypatch.setattr(tune, "current_gpu", lambda: None)  # no GPU: the heuristic
    pipeline.forget(spec)
    assert _config(pipeline.specialize(spec)) == heuristic
    pipeline.forget(spec)


def test_the_pipeline_uses_a_stored_slab_choice(fake_gpu, monkeypatch):
    """A stored slab candidate (a warp tile) replaces the planner's, and reads back from its record."""
    spec = validate(slab_layer())
    heuristic = tune.heuristic(spec)["mma"]
    chosen = next(c for c in tune.candidates(spec) if c.wm)  # an mma.sync warp tile (the heuristic: wgmma)
    monkeypatch.setattr(pipeline.cache, "get_or_build", lambda req: _FakeBuild(req))
    pipeline.forget(spec)
    assert tune._slab_shape(pipeline.specialize(spec).plan["mma"]) == tune._slab_shape(heuristic)
    tune.store_choice(spec, fake_gpu, 64, chosen, [], batch=64)
    assert tune.stored_choice(spec)["config"] == chosen
    got = pipeline.specialize(spec).plan
    assert not got["mma"].wgmma and (got["mma"].wm, got["mma"].wn) == (chosen.wm, chosen.wn) and got["settings"].slab == chosen
    pipeline.forget(spec)



@pytest.mark.small_batch
def test_a_batch_whose_bucket_was_tuned_apart_takes_that_buckets_tile(fake_gpu, monkeypatch):
    """The layer's kernel follows the largest bucket tuned; a call at another tuned bucket runs
    that bucket's tile (kept per layer and bucket); untuned buckets, and kernels that do not
    follow the tuned choices, stay as they are."""
    spec = validate(layer())

    monkeypatch.setattr(pipeline.cache, "get_or_build", _SourceKeyedBuild)
    plan = tune.heuristic(spec)
    heuristic = plan[plan["engine"]].config
    small, large, other = [c for c in tune.candidates(spec) if c != heuristic][:3]
    tune.store_choice(spec, fake_gpu, 1, small, [], batch=1)
    tune.store_choice(spec, fake_gpu, 64, large, [], batch=64)
    sp = pipeline.specialize(spec)
    assert sp.follows_tuning and _config(sp) == large
    at_one = pipeline.batch_variant(sp, 1)
    assert _config(at_one) == small and not at_one.follows_tuning
    assert pipeline.batch_variant(sp, 1) is at_one  # kept
    assert pipeline.batch_variant(sp, 50) is sp  # bucket 64
    # bucket 8, untuned: 8 x 64 positions is a small batch, which the TMA plan leaves to the implicit GEMM
    assert plan["engine"] == "tma" and _config(pipeline.batch_variant(sp, 8)) == pipeline.small_batch_config(spec, sp.plan, sp.arch, 8) != large
    assert pipeline.batch_variant(at_one, 64) is at_one
    pinned = pipeline.specialize(spec, igemm_config=other, tuned=False)
    assert not pinned.follows_tuning and pipeline.batch_variant(pinned, 1) is pinned
    tune.store_choice(spec, fake_gpu, 1, None, [], batch=1)  # the heuristic won at batch 1 after all
    sp = pipeline.specialize(spec)
    assert _config(pipeline.batch_variant(sp, 1)) == heuristic
    pipeline.forget(spec)
    assert not pipeline._batch_variants


@pytest.mark.small_batch
def test_a_small_batch_leaves_the_tma_plan_for_the_implicit_gemms_tile(monkeypatch):
    """Untuned, a call whose batch has at most SMALL_BATCH_MAX_POSITIONS output positions on a
    layer planned for the TMA engine runs the implicit GEMM's 128 x 64 mma.sync tile, the K chunk
    capped by the channels; larger batches, 16-bit layers, transposed convs, a reduction after the conv,
    a tile in the spec, layers on another engine and SPECGEN_SMALL_BATCH=0 keep the planner's kernel."""
    from types import SimpleNamespace

    from specgen.igemm import IgemmConfig

    def sp(data, arch="sm_90"):
        spec = validate(data)
        return SimpleNamespace(spec=spec, plan=tune.heuristic(spec), arch=arch)

    def small_batch_config(layer_, bucket):
        return pipeline.small_batch_config(layer_.spec, layer_.plan, layer_.arch, bucket)

    deep = sp({**layer(channels=256, out=256, precision="tf32"), "input": {"channels": 256, "size": [14, 14]}})
    assert deep.plan["engine"] == "tma"
    want = IgemmConfig(4, 2, 2, 4, 32, 3)
    assert want.bm == 128 and want.bn == 64
    limit = pipeline.SMALL_BATCH_MAX_POSITIONS // (14 * 14)  # 16 samples of 14^2
    assert [small_batch_config(deep, b) for b in (1, 2, limit)] == [want] * 3
    assert small_batch_config(deep, 2 * limit) is None
    assert pipeline.small_batch_largest(deep.spec, deep.plan, deep.arch) == limit
    assert small_batch_config(sp({**layer(channels=256, out=256, precision="bf16"),
                                  "input": {"channels": 256, "size": [14, 14]}}), 1) is None
    tiled = sp({**layer(channels=256, out=256, precision="tf32"), "input": {"channels": 256, "size": [14, 14]},
                "tile": {"engine": "tma"}})
    assert tiled.plan["engine"] == "tma" and small_batch_config(tiled, 1) is None
    up = sp({"name": "up", "input": {"channels": 256, "size": [7, 7]},
             "conv": {"out_channels": 128, "kernel": 2, "stride": 2, "transposed": True}, "precision": "tf32"})
    assert small_batch_config(up, 1) is None
    reduced = sp({**layer(channels=256, out=256, precision="tf32"), "input": {"channels": 256, "size": [14, 14]},
                 "epilogue": ["relu", {"sum": {"dims": [1]}}]})
    assert reduced.plan["engine"] == "tma" and small_batch_config(reduced, 1) is None  # (not measured)
    few = sp(layer(channels=3, out=16))  # the seeds' kind: not on the TMA engine
    assert few.plan["engine"] != "tma" and small_batch_config(few, 1) is None
    assert pipeline.small_batch_largest(few.spec, few.plan, few.arch) == 0
    monkeypatch.setenv("SPECGEN_SMALL_BATCH", "0")
    assert small_batch_config(deep, 1) is None


@pytest.mark.small_batch
def test_a_small_batch_kernel_is_built_once_and_a_tuned_choice_wins(fake_gpu, monkeypatch):
    """batch_variant builds the small-batch kernel on a bucket's first call and keeps it; a choice
    stored for the bucket replaces the rule (the heuristic stored: the layer's own TMA kernel);
    turning the rule off reaches a layer already called."""
    spec = validate({**layer(channels=256, out=256, precision="tf32"), "input": {"channels": 256, "size": [14, 14]}})

    monkeypatch.setattr(pipeline.cache, "get_or_build", _SourceKeyedBuild)
    pipeline.forget(spec)
    sp = pipeline.specialize(spec)
    assert sp.plan["engine"] == "tma" and sp.follows_tuning
    small = pipeline.batch_variant(sp, 1)
    assert small.plan["engine"] == "igemm" and _config(small) == pipeline.small_batch_config(spec, sp.plan, sp.arch, 1)
    assert pipeline.batch_variant(sp, 1) is small and pipeline.batch_variant(sp, 64) is sp
    monkeypatch.setenv("SPECGEN_SMALL_BATCH", "0")
    assert pipeline.batch_variant(sp, 1) is sp
    monkeypatch.setenv("SPECGEN_SMALL_BATCH", "1")
    tune.store_choice(spec, fake_gpu, 1, None, [], batch=1)  # the TMA plan measured fastest at batch 1
    assert pipeline.batch_variant(pipeline.specialize(spec), 1).plan["engine"] == "tma"
    pipeline.forget(spec)


@pytest.mark.small_batch
def test_small_batch_kernels_are_prebuilt_in_one_build(fake_gpu, monkeypatch):
    """`build_batch_variants` (from_module at its example's batch) builds the small-batch kernels
    of the TMA layers in one parallel build, the others' not at all; the first calls then find
    them; a batch past the rule builds nothing."""
    specs = [validate({**layer(channels=c, out=c, precision="tf32"), "name": f"pre_{c}", "input": {"channels": c, "size": [14, 14]}})
             for c in (128, 256)] + [validate(layer(channels=3, out=16))]
    items, batches = _prebuilt_in_one_build(monkeypatch, specs, 2)  # the two TMA layers, one build
    for sp in items[:2]:
        assert pipeline.batch_variant(sp, 2).plan["engine"] == "igemm"
    assert pipeline.batch_variant(items[2], 2) is items[2]
    pipeline.build_batch_variants(items, 2)
    assert batches == [2]  # nothing left to build
    for spec in specs:
        pipeline.forget(spec)


def _depthwise(channels: int, size: int, stride: int = 1, kernel: int = 3, **extra) -> dict:
    """MobileNetV2's kind: a depthwise conv, batch norm and ReLU6, tf32 as a model runs it."""
    return {"name": f"dw_{channels}_{size}_s{stride}_k{kernel}", "input": {"channels": channels, "size": [size, size]},
            "conv": {"out_channels": channels, "kernel": kernel, "stride": stride, "padding": kernel // 2,
                     "groups": channels, "bias": False},
            "epilogue": [{"batch_norm": {}}, {"hardtanh": {"min_val": 0.0, "max_val": 6.0}}], "precision": "tf32", **extra}


@pytest.mark.small_batch
def test_a_depthwise_box_keeps_one_tile_a_thread_where_a_small_batch_leaves_sms_idle(monkeypatch):
    """`small_batch_settings`: a depthwise conv on the FFMA engine whose stacked box gives a call at
    most half as many blocks as SMs plans one register tile a thread (`Settings.stacked_tiles`
    false): four times the blocks, a box of one output row; larger batches, dense and grouped convs,
    a pool after the conv, a tile in the spec and SMALL_BATCH_SPREAD false keep the plan."""
    from types import SimpleNamespace

    from specgen.plan import Settings, build_plan

    def sp(data, arch="sm_90"):
        spec = validate(data)
        return SimpleNamespace(spec=spec, plan=tune.heuristic(spec), arch=arch)

    def settings(layer_, bucket):
        return pipeline.small_batch_settings(layer_.spec, layer_.plan, layer_.arch, bucket)

    dw = sp(_depthwise(144, 56))  # 42 stacked blocks a sample on 132 SMs
    assert dw.plan["engine"] == "ffma" and dw.plan["blocks_per_sample"] == 42 and dw.plan["box"][2] == 4
    assert settings(dw, 1) == Settings(stacked_tiles=False) and settings(dw, 2) is None
    spread = build_plan(dw.spec, settings=Settings(stacked_tiles=False))
    assert spread["blocks_per_sample"] == 4 * 42 and spread["box"][2] == 1 and spread["threads"] == dw.plan["threads"]
    assert "one FFMA tile a thread" in Settings(stacked_tiles=False).summary()
    deep = sp(_depthwise(576, 14, stride=2))  # 9 blocks a sample
    assert [settings(deep, b) is not None for b in (1, 2, 4, 8)] == [True, True, True, False]
    assert pipeline.small_batch_spread_largest(deep.spec, deep.plan, deep.arch) == 4
    assert pipeline.small_batch_spread_largest(dw.spec, dw.plan, dw.arch) == 1
    dense = sp({**_depthwise(32, 28), "conv": {"out_channels": 32, "kernel": 3, "padding": 1}})
    grouped = sp({**_depthwise(64, 28), "conv": {"out_channels": 64, "kernel": 3, "padding": 1, "groups": 16}})
    pooled = sp({**_depthwise(144, 56), "epilogue": ["relu", {"max_pool": 2}]})
    tiled = sp({**_depthwise(144, 56), "tile": {"engine": "ffma"}})
    for other in (dense, grouped, pooled, tiled):
        assert settings(other, 1) is None, other.spec.name
    monkeypatch.setattr(pipeline, "SMALL_BATCH_SPREAD", False)
    assert settings(dw, 1) is None and pipeline.small_batch_spread_largest(dw.spec, dw.plan, dw.arch) == 0


@pytest.mark.small_batch
def test_a_small_batch_depthwise_call_takes_the_spread_box_and_a_tuned_choice_wins(fake_gpu, monkeypatch):
    """batch_variant: a depthwise layer's call at batch 1 runs its box of one tile a thread (built
    once, kept), batch 64 its own kernel; turning SMALL_BATCH_SPREAD off reaches a layer already
    called; a choice stored for the bucket replaces the rule; `build_batch_variants` prebuilds
    the spread kernels in one build."""
    spec = validate(_depthwise(144, 56))
    monkeypatch.setattr(pipeline.cache, "get_or_build", _SourceKeyedBuild)
    pipeline.forget(spec)
    sp = pipeline.specialize(spec)
    assert sp.plan["engine"] == "ffma" and sp.follows_tuning
    one = pipeline.batch_variant(sp, 1)
    assert one.key != sp.key and one.plan["blocks_per_sample"] == 4 * sp.plan["blocks_per_sample"]
    assert pipeline.batch_variant(sp, 1) is one and pipeline.batch_variant(sp, 64) is sp
    monkeypatch.setattr(pipeline, "SMALL_BATCH_SPREAD", False)
    assert pipeline.batch_variant(sp, 1) is sp
    monkeypatch.setattr(pipeline, "SMALL_BATCH_SPREAD", True)
    tune.store_choice(spec, fake_gpu, 1, None, [], batch=1)  # the stacked box measured fastest at batch 1
    assert pipeline.batch_variant(pipeline.specialize(spec), 1).plan["blocks_per_sample"] == sp.plan["blocks_per_sample"]
    pipeline.forget(spec)

    specs = [validate(_depthwise(c, 14, stride=2)) for c in (576, 960)] + [validate(layer(channels=3, out=16))]
    items, batches = _prebuilt_in_one_build(monkeypatch, specs, 2)  # the two depthwise layers, one build
    for item in items[:2]:
        assert pipeline.batch_variant(item, 2).plan["blocks_per_sample"] == 4 * item.plan["blocks_per_sample"]
    assert pipeline.batch_variant(items[2], 2) is items[2]
    pipeline.build_batch_variants(items, 2)
    assert batches == [2]  # nothing left to build
    for s in specs:
        pipeline.forget(s)


@pytest.mark.nvcc
@pytest.mark.small_batch
@pytest.mark.parametrize("data", [_depthwise(144, 56), _depthwise(576, 14, stride=2), _depthwise(240, 28, kernel=5),
                                  _depthwise(40, 33, stride=2)], ids=lambda d: d["name"])
def test_the_spread_depthwise_box_builds_without_spills(data, tmp_path):
    from specgen.plan import Settings

    from build_helpers import build_report, spilled

    spec, spread = validate(data), Settings(stacked_tiles=False)
    assert pipeline.request(spec, "sm_90", settings=spread)[1] != pipeline.request(spec, "sm_90")[1]  # (a kernel of its own)
    kernels = build_report(spec, tmp_path, settings=spread)
    assert f"specgen_{spec.name}" in kernels and not spilled(kernels), spilled(kernels)


class _FakeBuild:
    spill_bytes = 0

    def __init__(self, req):
        self.key = req.source[:16]


class _SourceKeyedBuild(_FakeBuild):
    """A stub build keyed by its whole source: a small-batch variant is told apart from the layer's
    kernel by it."""

    def __init__(self, req):
        self.key = hashlib.sha256(req.source.encode()).hexdigest()[:16]


def _prebuilt_in_one_build(monkeypatch, specs: list, wanted: int) -> list:
    """Specialize `specs` (builds stubbed), then `build_batch_variants`: nothing at batch 64, the
    `wanted` small-batch kernels at batch 2 in one parallel build; a build after it fails the test
    (the first calls must find them). The layers' kernels and the list of builds, for the caller's
    checks."""
    monkeypatch.setattr(pipeline.cache, "get_or_build", _SourceKeyedBuild)
    for spec in specs:
        pipeline.forget(spec)
    items = [pipeline.specialize(spec) for spec in specs]
    batches = []
    monkeypatch.setattr(pipeline.cache, "build_many",
                        lambda reqs: batches.append(len(reqs)) or [_SourceKeyedBuild(r) for r in reqs])
    pipeline.build_batch_variants(items, 64)
    assert batches == []
    pipeline.build_batch_variants(items, 2)
    assert batches == [wanted]
    monkeypatch.setattr(pipeline.cache, "get_or_build", lambda req: pytest.fail("built again on the first call"))
    return items, batches


def test_show_plan_names_the_tuned_choice(fake_gpu, tmp_path, capsys):
    data = layer()
    path = tmp_path / "l.yaml"
    path.write_text(json.dumps([data]))
    spec = validate(data)
    chosen = tune.candidates(spec)[2]
    assert cli.main(["show", str(path), "--plan"]) == 0
    assert "tuned:" not in capsys.readouterr().out
    tune.store_choice(spec, fake_gpu, 32, chosen, [], batch=32)
    assert cli.main(["show", str(path), "--plan"]) == 0
    out = capsys.readouterr().out
    assert f"tuned: {tune.label(chosen)} for {fake_gpu['gpu']}, batch bucket 32" in out
    assert f"block tile {chosen.bm} positions x {chosen.bn} channels" in out


def test_cache_ls_lists_tuned_choices(fake_gpu, capsys):
    spec = validate(layer())
    chosen = tune.candidates(spec)[1]
    tune.store_choice(spec, fake_gpu, 16, chosen, [], batch=10)
    assert cli.main(["cache", "ls"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith(spec.name))
    assert fake_gpu["gpu"] in row and " 16 " in row and tune.label(chosen) in row


def test_cli_tune_without_a_gpu_exits_2_with_a_clear_message(cache_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(tune, "current_gpu", lambda: None)
    path = tmp_path / "l.yaml"
    path.write_text(json.dumps([layer()]))
    assert cli.main(["tune", str(path)]) == 2
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err and "1 layer(s) left untuned" in err
    assert not (cache_dir / "tuned").exists()


def test_cli_tune_with_nothing_to_tune_exits_0(cache_dir, tmp_path, capsys):
    path = tmp_path / "l.yaml"
    path.write_text(json.dumps([{**layer(), "conv": {"out_channels": 64, "kernel": 3, "padding": 1, "groups": 64}}]))
    assert cli.main(["tune", str(path)]) == 0
    assert "nothing to tune" in capsys.readouterr().out


def test_cli_tune_refuses_a_bad_batch(cache_dir, tmp_path, capsys):
    path = tmp_path / "l.yaml"
    path.write_text(json.dumps([layer()]))
    assert cli.main(["tune", str(path), "--batch", "0"]) == 2
    assert "--batch: expected a positive int, got 0" in capsys.readouterr().err


def test_fused_layer_refuses_a_bad_tune_batch():
    from specgen.module import FusedLayer

    with pytest.raises(ValueError, match="tune_batch: expected a positive int, got 0"):
        FusedLayer(validate(layer()), tune_batch=0)


# ---------------------------------------------------------------------------- on the GPU


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "tf32"])
def test_tune_picks_a_candidate_that_matches_float64_and_is_reused(cache_dir, tmp_path, capsys, precision):
    import torch

    from specgen import reference
    from specgen.module import FusedLayer

    data = {**layer(channels=64, out=128, precision=precision), "input": {"channels": 64, "size": [28, 28]}}
    path = tmp_path / "l.yaml"
    path.write_text(json.dumps([data]))
    spec = validate(data)
    assert cli.main(["tune", str(path), "--batch", "8", "--reps", "5"]) == 0
    out = capsys.readouterr().out
    assert "chosen:" in out and "kept" in out
    record = tune.stored_choice(spec, bucket=8)
    assert record is not None and record["batch"] == 8
    assert all(row["ok"] for row in record["candidates"] if row["ms"] is not None and row["label"] == record["label"]) \
        or record["config"] is None
    # a new layer of the same spec runs the stored tile
    pipeline.forget(spec)
    layer_ = FusedLayer(spec).cuda()
    def tile(plan):  # the engine's tile config (the tuner tries both tensor-core engines)
        return plan[plan["engine"]].config

    want = record["config"] or tile(tune.heuristic(spec))
    assert tile(layer_.specialize().plan) == want
    gen = torch.Generator(device="cuda").manual_seed(1)
    with torch.no_grad():
        layer_.conv.weight.copy_(torch.randn(layer_.conv.weight.shape, generator=gen, device="cuda") * 0.05)
        x = torch.randn((8, 64, 28, 28), generator=gen, device="cuda")
        y = layer_(x)
    ref = reference.forward64(spec, x, layer_.conv.weight, layer_.conv.bias, layer_.spec_params())
    rel = ((y.double() - ref).norm() / ref.norm()).item()
    if precision == "fp32":
        assert rel <= 1e-5
    else:
        untuned = pipeline.specialize(spec, tuned=False)
        from specgen import torchop

        y0 = torchop.launch(untuned, x, layer_.conv.weight, layer_.conv.bias, layer_.spec_params(), None)
        rel0 = ((y0.double() - ref).norm() / ref.norm()).item()
        assert rel <= 2 * rel0 + 1e-7
    # tune=True with a stored choice for its bucket measures nothing again
    calls = []
    real = tune.tune
    tune.tune = lambda *a, **k: calls.append(a) or real(*a, **k)
    try:
        FusedLayer(spec, tune=True, tune_batch=7)  # bucket 8: stored
    finally:
        tune.tune = real
    assert calls == []



@pytest.mark.gpu
def test_a_layer_runs_the_kernel_tuned_for_its_calls_batch_bucket(cache_dir):
    """Choices stored for buckets 1 and 64 (a TMA tile at 64, the implicit GEMM's mma.sync tile at
    1, as v55 measured on small-M GEMMs): a FusedLayer runs each at its bucket, both to the fp32
    bar, into a NaN-filled output's place, and a repeat at batch 1 stays on its bucket's kernel."""
    from specgen.module import FusedLayer

    gpu = tune.current_gpu()
    spec = validate({**layer(channels=128, out=256), "input": {"channels": 128, "size": [14, 14]}})
    cands = tune.candidates(spec)
    tma = next(c for c in cands if isinstance(c, TmaConfig))
    mma = next(c for c in cands if isinstance(c, IgemmConfig) and not c.wgmma)
    tune.store_choice(spec, gpu, 64, tma, [], batch=64)
    tune.store_choice(spec, gpu, 1, mma, [], batch=1)
    _runs_each_batch_on(FusedLayer(spec).cuda().eval(), ((64, "tma"), (1, "igemm"), (1, "igemm"), (33, "tma")), seed=5)
    pipeline.forget(spec)


def _runs_each_batch_on(layer_, cases, seed: int) -> None:
    """For each (batch, engine): a call of `batch` samples runs that engine's kernel, fills a
    NaN-poisoned output to the fp32 bar against float64, and equals the call without `out`."""
    import torch

    from specgen import reference, torchop

    spec = layer_.spec
    gen = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        weight = layer_.conv.weight
        weight.copy_(torch.randn(weight.shape, generator=gen, device="cuda") * (weight[0].numel() ** -0.5))
        for batch, engine in cases:
            x = torch.randn((batch, spec.input.channels, *spec.input.size), generator=gen, device="cuda")
            assert torchop.kernel_for(layer_.specialize(), x).plan["engine"] == engine, f"batch {batch}"
            out = torch.full(spec.output_shape(batch), float("nan"), device="cuda")
            layer_(x, out=out)
            ref = reference.forward64(spec, x, weight, layer_.conv.bias, layer_.spec_params())
            rel = ((out.double() - ref).norm() / ref.norm()).item()
            assert rel <= 1e-5, f"batch {batch}: rel L2 {rel:.2e}"
            assert torch.equal(layer_(x), out), f"batch {batch}: the call without out differs"


@pytest.mark.gpu
@pytest.mark.small_batch
def test_a_small_batch_runs_the_implicit_gemm_to_the_fp32_bar(cache_dir):
    """Untuned, a FusedLayer planned for the TMA engine runs batches 1 and 3 on the implicit GEMM's
    small-batch tile and batch 64 on its TMA kernel, each to the fp32 bar against float64."""
    from specgen.module import FusedLayer

    spec = validate({**layer(channels=256, out=256), "input": {"channels": 256, "size": [14, 14]}})
    layer_ = FusedLayer(spec).cuda().eval()
    assert layer_.specialize().plan["engine"] == "tma"
    _runs_each_batch_on(layer_, ((1, "igemm"), (3, "igemm"), (64, "tma"), (1, "igemm")), seed=7)
    pipeline.forget(spec)


def test_an_ffma_layer_is_tuned_against_the_slab_engine():
    """A layer the planner puts on FFMA register tiles because its GEMM looked small (24 output
    channels, KernelBench 24's conv -> min over depth -> softmax) is tunable: the slab engine's
    planner tile first, then its other tiles, each planning the body on the slab engine, against
    the FFMA kernel (the heuristic, named so); a stored choice builds the slab engine. A grouped
    conv, which the slab engine cannot run, stays untunable."""
    from types import SimpleNamespace

    from specgen.plan import SlabConfig

    data = {"name": "few_out", "input": {"channels": 3, "size": [12, 16, 16]}, "conv": {"out_channels": 24, "kernel": 3},
            "epilogue": [{"amin": {"dims": [2]}}, {"softmax": {"dim": [1]}}], "precision": "tf32"}
    spec = validate(data)
    plan = tune.heuristic(spec)
    body = next(p["plan"] for p in plan["parts"] if p["role"] == "body")
    assert body["engine"] == "ffma" and tune.slab_part(plan) is None
    assert tune.tunable(spec)
    cands = tune.candidates(spec)
    assert cands[0] == SlabConfig(0) and len(cands) >= 3 and any(c.wgmma for c in cands)
    for cfg in cands:
        assert tune.slab_part(tune.plan_with(spec, cfg)) is not None, tune.label(cfg)
    built, _source, _req = pipeline.request(spec, "sm_90", igemm_config=cands[0])
    assert tune.slab_part(built) is not None
    assert tune.Candidate(None, item=SimpleNamespace(plan=plan)).name == "heuristic (fp32 FFMA)"
    grouped = validate({**data, "input": {"channels": 24, "size": [12, 16, 16]},
                        "conv": {"out_channels": 24, "kernel": 3, "groups": 24}})
    assert not tune.tunable(grouped) and tune.candidates(grouped) == []


def test_a_sequences_gemm_body_is_tuned():
    """A layer split before a norm's statistics whose conv (the sequence's body) runs on a GEMM
    engine is tunable: its candidates are the body's tiles, each planning the sequence with its body
    on a GEMM engine, the body's own tile first; the heuristic is named by the body's tile. A
    tap-sum-folded layer whose tile configs would make it one kernel that no GEMM engine runs is
    not (nothing to time its body's tile against)."""
    from types import SimpleNamespace

    import specgen

    norms = {s.name: s for s in specgen.load_specs("examples/norms.yaml")}
    spec = norms["kb17"]
    plan = tune.heuristic(spec)
    assert plan["engine"] == "sequence" and tune.gemm_engine(plan) in ("tma", "igemm")
    assert tune.tunable(spec)
    cands = tune.candidates(spec)
    body = next(p["plan"] for p in plan["parts"] if p["role"] == "body")
    assert len(cands) > 1 and cands[0] == body[tune.gemm_engine(plan)].config
    for cfg in cands:
        got = tune.plan_with(spec, cfg)
        assert got["engine"] == "sequence" and tune.gemm_engine(got) is not None, tune.label(cfg)
    assert tune.Candidate(None, item=SimpleNamespace(plan=plan)).name == f"heuristic ({tune.label(cands[0])})"
    folded = next(s for s in specgen.load_specs("examples/folds.yaml") if s.name == "head_3x3_256_512_14_bn_gap")
    assert tune.gemm_engine(tune.heuristic(folded)) is not None
    assert not tune.tunable(folded) and tune.candidates(folded) == []


def test_the_tile_rules_figures_in_notes_come_from_the_committed_tune_records():
    """benchmarks/tune_regret.py reads `specgen tune`'s output: NOTES v64's figures (the planner's
    tile 1.065x the fastest before the tile rules, 1.019x after, the 22 changed layers 1.105x faster
    in the second run) are what it computes from the two committed records."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("tune_regret", root / "benchmarks" / "tune_regret.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    before, after = (mod.parse((root / "benchmarks" / f"2026-12-07-h100-v64-tune-{w}.txt").read_text()) for w in ("before", "after"))
    assert len(before) == len(after) == 47
    assert round(mod.geomean(list(mod.regrets(before).values())), 3) == 1.065
    assert round(mod.geomean(list(mod.regrets(after).values())), 3) == 1.019
    moved = mod.changes(before, after)
    assert len(moved) == 22 and round(mod.geomean([m[2] for m in moved.values()]), 3) == 1.105
    assert moved["unet_up3_0_tf32"][:2] == ("tma 256x128 s4 kb1", "tma 128x128 s4 kb1")
