"""A pool over a per-channel 1x1 conv (the second kernel of every pool split: a pool over an identity
conv) reads each window row of its input once, as one span (`plan._row_span`), instead of calling
the conv once per window column. Where the plan takes it, what it renders, where it does not, and
on the GPU (marker `gpu`) the results against float64 at the fp32 bar."""

from __future__ import annotations

import pytest

from specgen.plan import build_plan
from specgen.render import render_plan
from specgen.spec import validate


def dw(channels, size, epilogue, out=None, **conv):
    """A 1x1 conv of one input channel per output channel (depthwise, `out` a multiple of it)."""
    return {"name": "rs", "input": {"channels": channels, "size": size},
            "conv": {"out_channels": out or channels, "kernel": 1, "groups": channels, **conv}, "epilogue": epilogue}


TAKEN = {
    # the ResNet stem at a small size: the conv on tensor cores, the max pool in a second kernel
    "stem_split": {"name": "rs", "input": {"channels": 3, "size": [64, 64]}, "precision": "tf32",
                   "conv": {"out_channels": 64, "kernel": 7, "stride": 2, "padding": 3},
                   "epilogue": ["relu", {"max_pool": {"kernel": 3, "stride": 2, "padding": 1}}]},
    # pointwise ops and a bias under an avg pool that counts only the unpadded values
    "avg_exclusive": dw(8, [28, 28], ["relu", {"avg_pool": {"kernel": 3, "stride": 2, "padding": 1, "count_include_pad": False}},
                                      {"mul": {"value": 2.0}}]),
    # two output channels per input channel; an odd row (scalar loads)
    "multiplier_odd": dw(8, [17, 17], [{"max_pool": {"kernel": 2, "stride": 2}}], out=16, bias=False),
    # stride 1 under a wider window; rows of an even length (pairs)
    "stride_one": dw(4, [12, 66], [{"max_pool": {"kernel": 3, "stride": 1, "padding": 1}}]),
    # 3-D, padding along H and W only
    "three_d": dw(4, [6, 10, 20], [{"max_pool": {"kernel": [2, 3, 3], "stride": 2, "padding": [0, 1, 1]}}]),
}

NOT_TAKEN = {
    "gaps": dw(4, [12, 30], [{"max_pool": {"kernel": 2, "stride": 3}}]),  # windows that leave gaps
    "dilated": dw(4, [12, 30], [{"max_pool": {"kernel": 2, "stride": 1, "dilation": 2}}]),
    "mixing_conv": {"name": "rs", "input": {"channels": 4, "size": [12, 32]},  # a 1x1 conv over 4 channels
                    "conv": {"out_channels": 4, "kernel": 1}, "tile": {"engine": "ffma"},
                    "epilogue": [{"max_pool": {"kernel": 2, "stride": 2}}]},
}


for _table in (TAKEN, NOT_TAKEN):
    for _name, _data in _table.items():
        _data["name"] = f"rs_{_name}"


def pool_plans(plan):
    """The kernel plans of a plan (its parts' where it is a sequence) with a pool over the conv."""
    plans = [p["plan"] for p in plan["parts"]] if plan.get("parts") else [plan]
    return [p for p in plans if p.get("levels") and len(p["levels"]) == 2 and p["levels"][1]["kind"] == "pool"]


def spans(data):
    return [p["levels"][1].get("row_span") for p in pool_plans(build_plan(validate(data)))]


@pytest.mark.parametrize("name", sorted(TAKEN))
def test_the_pool_reads_each_window_row_once(name):
    plans = [p for p in pool_plans(build_plan(validate(TAKEN[name]))) if p["levels"][1].get("row_span")]
    assert len(plans) == 1
    plan = plans[0]
    rs, pool, pt = plan["levels"][1]["row_span"], plan["levels"][1], plan["pt"]
    assert rs["span"] == (pt - 1) * pool["stride"][2] + pool["kernel"][2]
    assert (rs["lead"] + pool["padding"][2]) % rs["vec"] == 0 and rs["vectors"] * rs["vec"] >= rs["lead"] + rs["span"]
    assert plan["in"][2] % rs["vec"] == 0 and (pt * pool["stride"][2]) % rs["vec"] == 0
    text = render_plan(plan)
    level1 = text[text.index("void level1("):]
    level1 = level1[: level1.index("\n}\n")]
    assert "level0(" not in level1  # the conv is not called per window column any more
    assert f"float xin[{rs['vectors'] * rs['vec']}];" in level1


def test_the_spans_vector_width_follows_the_rows():
    widths = {name: spans(TAKEN[name])[-1]["vec"] for name in ("stem_split", "multiplier_odd", "stride_one")}
    assert widths == {"stem_split": 4, "multiplier_odd": 1, "stride_one": 2}


@pytest.mark.parametrize("name", sorted(NOT_TAKEN))
def test_other_pools_keep_the_general_path(name):
    found = spans(NOT_TAKEN[name])
    assert found and not any(found)


@pytest.mark.nvcc
def test_row_span_kernels_build_without_spills(tmp_path, monkeypatch):
    from specgen import pipeline

    monkeypatch.setenv("SPECGEN_CACHE_DIR", str(tmp_path / "cache"))
    built = pipeline.specialize_many([validate(d) for d in TAKEN.values()], "sm_90", tuned=False)
    assert len(built) == len(TAKEN)
    for item in built:
        assert item.build.spill_bytes == 0, (item.spec.name, item.build.log)


# ---- on the GPU -----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(TAKEN))
@pytest.mark.parametrize("batch", [1, 3])
def test_row_spans_match_float64(name, batch, fp32_reference):
    from specgen.module import FusedLayer

    from gpu_helpers import compare

    compare(FusedLayer(validate(TAKEN[name])).cuda(), batch, seed=batch)
