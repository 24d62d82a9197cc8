"""The planner's passes, each on its own (no GPU): the body's levels, the avg-pool fold, the tail's
reductions. `plan_whole` runs them in that order; what they return is what the templates read."""

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
    assert planner._can_fold_avg_pool(spec, levels, (1, 1, 1), (1, 1, 1))
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
