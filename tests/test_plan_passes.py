"""The planner's passes, each on its own (no GPU): the body's levels, the avg-pool fold, the tail's
reductions, the box engines' tiling, shared memory, row accesses and occupancy, the engine.
`plan_whole` runs them in that order; what they return is what the templates read."""

from __future__ import annotations

from specgen import plan as planner
from specgen.plan import Constant
from specgen.spec import validate


def _spec(epilogue, size=(16, 16), channels=4, out=8, kernel=3, **conv):
    return validate({"name": "passes", "input": {"channels": channels, "size": list(size)},
                     "conv": {"out_channels": out, "kernel": kernel, **conv}, "epilogue": epilogue})


def _levels(spec):
    consts: list[Constant] = []
    o3 = planner._spatial3(spec.shapes()[0].sizes[1:], 1)
    return planner._body_levels(spec, spec.shapes(), o3, consts), consts


def test_body_levels_stop_at_the_first_reduction():
    spec = _spec(["relu", {"max_pool": {"kernel": 2}}, "sigmoid", {"sum": {"dims": [1]}}, {"mul": 2.0}])
    (levels, tail_start, channel_norm), _ = _levels(spec)
    assert [lvl["kind"] for lvl in levels] == ["conv", "pool"]
    assert [p["op"] for p in levels[0]["pointwise"]] == ["relu"]
    assert [p["op"] for p in levels[1]["pointwise"]] == ["sigmoid"]
    assert levels[1]["kernel"] == (1, 2, 2) and levels[1]["in"] == (1, 14, 14) and levels[1]["out"] == (1, 7, 7)
    assert [lvl["level"] for lvl in levels] == [0, 1]
    assert tail_start == 3 and channel_norm is None


def test_a_global_pool_with_no_windowed_pool_after_it_starts_the_tail():
    spec = _spec(["gelu", "global_avg_pool"])
    (levels, tail_start, _), _ = _levels(spec)
    assert [lvl["kind"] for lvl in levels] == ["conv"] and tail_start == 1


def test_the_avg_pool_fold_grows_the_kernel_and_takes_the_pool_stride():
    spec = _spec([{"avg_pool": {"kernel": 2}}, "tanh"])
    (levels, _, _), _ = _levels(spec)
    assert planner._can_fold_avg_pool(spec, levels)
    fold, note, k3, s3, o3 = planner._fold_avg_pool(levels, (1, 3, 3), 2)
    assert k3 == (1, 4, 4) and s3 == (1, 2, 2) and o3 == (1, 7, 7)
    assert fold == {"orig_kernel": (1, 3, 3), "window": (1, 2, 2), "window_size": 4}
    assert len(levels) == 1 and levels[0]["out"] == (1, 7, 7)
    assert [p["op"] for p in levels[0]["pointwise"]] == ["tanh"]  # the pool's pointwise ops follow the conv's
    assert note.startswith("avg-pool fold: epilogue[0] avg_pool 2x2 folded into the conv (kernel 3x3 -> 4x4, stride 2x2)")
    assert "2.25x fewer multiply-adds" in note  # 4 * 9 / 16


def test_tail_reductions_give_each_axis_its_role():
    spec = _spec(["relu", {"sum": {"dims": [1], "keepdim": True}}, "tanh", {"amax": {"dims": [2, 3]}}])
    consts: list[Constant] = []
    t1 = (8, 1, 14, 14)
    reductions, role, batched, srole = planner._tail_reductions(spec, spec.shapes(), t1, 1, consts)
    assert [(r["op"], r["axes"], r["count"]) for r in reductions] == [("sum", ["c"], 8), ("amax", ["h", "w"], 196)]
    assert [p["op"] for p in reductions[0]["pointwise"]] == ["tanh"]
    assert role == {"c": "R1", "d": "F", "h": "R2", "w": "R2"}
    assert batched and srole == {"c": "R1", "d": "F", "h": "F", "w": "F"}  # one value per sample: the outer a box at a time
    assert [r["channel_reduced"] for r in reductions] == [True, True]


def test_a_mean_names_its_count_for_the_finalize():
    spec = _spec([{"mean": {"dims": [2, 3]}}])
    consts: list[Constant] = []
    reductions, role, batched, _ = planner._tail_reductions(spec, spec.shapes(), (8, 1, 14, 14), 0, consts)
    assert [r["op"] for r in reductions] == ["mean"] and role["c"] == "F" and not batched
    assert [c.name for c in consts] == ["R1_COUNT"]


def _box_inputs(spec):
    """What plan_whole hands passes 5 and 6: the levels, T1, the axes' roles and the reductions."""
    (levels, tail_start, _), consts = _levels(spec)
    t1 = (spec.conv.out_channels, *levels[-1]["out"])
    reductions, role, batched, srole = planner._tail_reductions(spec, spec.shapes(), t1, tail_start, consts)
    geo = spec.conv_geometry()
    k3, s3 = planner._spatial3(geo["kernel"], 1), planner._spatial3(geo["stride"], 1)
    p3, d3 = planner._spatial3(geo["padding"], 0), planner._spatial3(geo["dilation"], 1)
    in3 = planner._spatial3(tuple(spec.input.size), 1)
    return levels, t1, role, srole, reductions, batched, in3, k3, s3, p3, d3, k3[0] * k3[1] * k3[2]


def test_box_tiling_on_ffma_keeps_the_register_tile_in_the_box():
    spec = _spec(["relu"], size=(30, 30), channels=4, out=24)
    levels, t1, role, srole, reductions, batched, in3, k3, s3, p3, d3, taps = _box_inputs(spec)
    bt = planner._box_tiling(spec, levels, t1, role, srole, reductions, in3, k3, s3, p3, d3, taps, planner.targets.DEFAULT)
    assert bt.mma is None  # K = 36: FFMA (tensor cores do not pay)
    assert bt.box[0] % bt.ct == 0 and 24 % bt.ct == 0 and bt.threads % 32 == 0
    assert bt.thread_tiles == (bt.box[0] // bt.ct) * bt.box[1] * bt.box[2] * -(-bt.box[3] // bt.pt)
    assert bt.f_tiles == bt.blocks_per_sample and bt.cluster == 1 and not reductions  # no reduction: no cluster
    assert bt.tiles == {a: -(-e // b) for a, e, b in zip("cdhw", t1, bt.box)}


def test_box_tiling_takes_a_cluster_for_a_full_reduction_and_memory_sizes_its_buffers():
    spec = _spec(["relu", {"sum": {"dims": [1, 2, 3]}}], size=(64, 64), channels=16, out=32)
    levels, t1, role, srole, reductions, batched, in3, k3, s3, p3, d3, taps = _box_inputs(spec)
    target = planner.targets.DEFAULT
    bt = planner._box_tiling(spec, levels, t1, role, srole, reductions, in3, k3, s3, p3, d3, taps, target)
    assert bt.f_tiles == 1 and bt.cluster > 1 and bt.blocks_per_sample == bt.cluster  # one kept value per sample
    mem = planner._box_memory(spec, bt, role, reductions, batched, None, taps, target)
    assert mem.smem_bytes <= target.smem_per_block and mem.red_floats > 0
    # the same layer with clusters of one block on a target without clusters
    ampere = planner.targets.BUILTIN["sm_80"]
    assert planner._box_tiling(spec, levels, t1, role, srole, reductions, in3, k3, s3, p3, d3, taps, ampere).cluster == 1


def test_a_reduction_over_depth_that_keeps_the_rows_boxes_depths_first(monkeypatch):
    """KernelBench 24's shape (3 -> 24 channels, 3x3x3, a min over depth): rows first gave a box of
    one depth and every thread 29 kept elements' accumulators; depths first, a few each."""
    spec = validate({"name": "passes", "input": {"channels": 3, "size": [24, 32, 32]},
                     "conv": {"out_channels": 24, "kernel": 3}, "epilogue": [{"amin": {"dims": [2]}}]})
    levels, t1, role, srole, reductions, batched, in3, k3, s3, p3, d3, taps = _box_inputs(spec)
    assert srole["d"] == "R1" and srole["h"] == "F"
    target = planner.targets.DEFAULT
    bt = planner._box_tiling(spec, levels, t1, role, srole, reductions, in3, k3, s3, p3, d3, taps, target)
    assert bt.box[1] > 1 and bt.box[2] == 1 and bt.nr == bt.box[1]  # several depths, one row
    assert bt.owner_iters <= 4 and bt.nf == 24 * 30
    monkeypatch.setattr(planner, "DEPTH_REDUCTION_DEPTHS_FIRST", False)
    rows = planner._box_tiling(spec, levels, t1, role, srole, reductions, in3, k3, s3, p3, d3, taps, target)
    assert rows.box[1] == 1 and rows.box[2] > 1 and rows.owner_iters >= 16
    # a reduction over the rows keeps its order: rows first, then depths
    over_rows = validate({"name": "passes", "input": {"channels": 3, "size": [24, 32, 32]},
                          "conv": {"out_channels": 24, "kernel": 3}, "epilogue": [{"amin": {"dims": [3]}}]})
    args = _box_inputs(over_rows)
    monkeypatch.setattr(planner, "DEPTH_REDUCTION_DEPTHS_FIRST", True)
    on = planner._box_tiling(over_rows, *args[:5], *args[6:], target)
    monkeypatch.setattr(planner, "DEPTH_REDUCTION_DEPTHS_FIRST", False)
    assert on == planner._box_tiling(over_rows, *args[:5], *args[6:], target)


def test_box_access_reads_aligned_rows_in_vectors_and_a_transposed_conv_one_at_a_time():
    spec = _spec(["relu"], size=(32, 32), channels=4, out=24, padding=0)
    levels, t1, role, srole, reductions, batched, in3, k3, s3, p3, d3, taps = _box_inputs(spec)
    bt = planner._box_tiling(spec, levels, t1, role, srole, reductions, in3, k3, s3, p3, d3, taps, planner.targets.DEFAULT)
    access = planner._box_access(levels, bt, t1, in3, k3, s3, p3, d3, 4, taps, False, reductions)
    assert levels[0]["step"] == 1
    assert access.conv_span == bt.pt + 2  # a register tile of PT outputs reads PT + 2 inputs of a 3-wide row
    assert access.in_vec in (2, 4) and access.in_vec <= access.conv_span and access.unroll_cin
    assert access.out_vec == planner._widest((4, 2, 1), t1[3], bt.pt, bt.box[3] if bt.tiles["w"] > 1 else 0)
    gather = planner._box_access(levels, bt, t1, in3, k3, s3, p3, d3, 4, taps, True, reductions)
    assert gather.in_vec == 1 and gather.conv_span == bt.pt + 2
    # under a pool each level's step along W is the product of the pool strides after it
    pooled = _spec(["relu", {"max_pool": {"kernel": 2}}], size=(32, 32), channels=4, out=24, padding=0)
    levels, t1, role, srole, reductions, batched, in3, k3, s3, p3, d3, taps = _box_inputs(pooled)
    bt = planner._box_tiling(pooled, levels, t1, role, srole, reductions, in3, k3, s3, p3, d3, taps, planner.targets.DEFAULT)
    access = planner._box_access(levels, bt, t1, in3, k3, s3, p3, d3, 4, taps, False, reductions)
    assert [lvl["step"] for lvl in levels] == [2, 1] and access.in_vec == 1 and "row_span" in levels[1]


def _access(spec):
    levels, t1, role, srole, reductions, batched, in3, k3, s3, p3, d3, taps = _box_inputs(spec)
    bt = planner._box_tiling(spec, levels, t1, role, srole, reductions, in3, k3, s3, p3, d3, taps, planner.targets.DEFAULT)
    return bt, planner._box_access(levels, bt, t1, in3, k3, s3, p3, d3, spec.input.channels // spec.conv.groups, taps,
                                   spec.conv.transposed, reductions)


def test_padding_that_leaves_the_first_tap_unaligned_loads_whole_vectors_from_an_aligned_start():
    # a 3x3 depthwise conv, padding 1: each tile's first tap is one before an aligned position
    bt, access = _access(_spec(["relu"], size=(32, 32), channels=16, out=16, groups=16, padding=1))
    assert access.in_vec == 4 and access.in_lead == 3  # (-1) mod 4
    assert access.in_vectors == -(-(3 + access.conv_span) // 4)
    # the start is aligned for every tile: PT and the box's width (where several boxes share a row)
    # are multiples of the vector, and so is the row
    assert bt.pt % 4 == 0 and (bt.tiles["w"] == 1 or bt.box[3] % 4 == 0)
    # padding 2 and stride 2: lead (-2) mod 4
    _, strided = _access(_spec(["relu"], size=(32, 32), channels=16, out=16, groups=16, kernel=5, padding=2, stride=2))
    assert strided.in_vec == 4 and strided.in_lead == 2
    # aligned padding keeps the loads at the first tap; an odd row length keeps single elements
    _, aligned = _access(_spec(["relu"], size=(32, 32), channels=16, out=16, groups=16, padding=0))
    assert aligned.in_lead == 0 and aligned.in_vectors == 0 and aligned.in_vec > 1
    _, odd = _access(_spec(["relu"], size=(31, 31), channels=16, out=16, groups=16, padding=1))
    assert odd.in_vec == 1 and odd.in_vectors == 0
    # a transposed conv gathers one value at a time, and a pool above the conv shifts its starts
    _, gather = _access(_spec(["relu"], size=(32, 32), channels=4, out=4, padding=1, transposed=True))
    assert gather.in_vec == 1 and gather.in_vectors == 0
    _, pooled = _access(_spec(["relu", {"max_pool": {"kernel": 2}}], size=(32, 32), channels=16, out=16, groups=16, padding=1))
    assert pooled.in_vec == 1 and pooled.in_vectors == 0


def test_box_occupancy_asks_for_more_blocks_without_a_tail_and_yields_to_a_tile_or_the_settings():
    from dataclasses import replace

    spec = _spec(["relu"], size=(30, 30), channels=4, out=24)
    levels, t1, role, srole, reductions, batched, in3, k3, s3, p3, d3, taps = _box_inputs(spec)
    target = planner.targets.DEFAULT
    bt = planner._box_tiling(spec, levels, t1, role, srole, reductions, in3, k3, s3, p3, d3, taps, target)
    blocks = planner._box_occupancy(bt, 4096, reductions, levels, None, planner.DEFAULT_SETTINGS, target)
    assert blocks in (2, 3) and target.regs_per_sm // (blocks * bt.threads) >= 96
    assert planner._box_occupancy(bt, 4096, [{"op": "sum"}], levels, None, planner.DEFAULT_SETTINGS, target) == 1
    assert planner._box_occupancy(bt, 4096, reductions, levels, None, replace(planner.DEFAULT_SETTINGS, min_blocks=1), target) == 1
    tile = validate({**spec.model_dump(mode="json"), "tile": {"min_blocks": 4}}).tile
    assert planner._box_occupancy(bt, 4096, reductions, levels, tile, planner.DEFAULT_SETTINGS, target) == 4


def test_the_engine_pass_names_the_engine_and_refuses_what_it_cannot_read():
    import pytest

    from specgen.plan import PlanError

    spec = validate({"name": "e", "input": {"channels": 64, "size": [14, 14]},
                     "conv": {"out_channels": 128, "kernel": 3, "padding": 1}, "epilogue": ["relu"], "precision": "tf32"})
    levels, t1, role, srole, reductions, batched, in3, k3, s3, p3, d3, taps = _box_inputs(spec)
    o3 = planner._spatial3(spec.shapes()[0].sizes[1:], 1)
    args = (spec, levels, reductions, None, o3, taps, None, None, None, None)
    engine, tp, ig = planner._choose_engine(*args, planner.targets.DEFAULT, planner.DEFAULT_SETTINGS)
    assert engine == "tma" and tp is not None and ig is None
    engine, tp, ig = planner._choose_engine(*args, planner.targets.BUILTIN["sm_80"], planner.DEFAULT_SETTINGS)
    assert engine == "igemm" and tp is None and ig is not None
    grouped = validate({**spec.model_dump(mode="json"), "conv": {**spec.model_dump(mode="json")["conv"], "groups": 64},
                        "epilogue": [{"add": {"input": "skip"}}]})
    levels, t1, role, srole, reductions, batched, in3, k3, s3, p3, d3, taps = _box_inputs(grouped)
    with pytest.raises(PlanError, match="an extra input"):
        planner._choose_engine(grouped, levels, reductions, None, o3, taps, None, None, None, None,
                               planner.targets.DEFAULT, planner.DEFAULT_SETTINGS)
