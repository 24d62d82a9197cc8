"""The tap-sum fold without a GPU: where it applies, the taps' index sets against the conv's own
definition, the folded layer against the float64 reference (through a model of every thread of the
tap-sum kernel and the reference of the folded conv), rendering and nvcc."""

from __future__ import annotations


import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import tail_model
from specgen import reference, tapsum
from specgen.plan import build_plan, describe, forward_equivalent
from specgen.render import render_plan
from specgen.spec import validate


def layer(cin, size, cout, epilogue, **conv):
    return {"name": "fold", "input": {"channels": cin, "size": size},
            "conv": {"out_channels": cout, "kernel": conv.pop("kernel", 3), **conv}, "epilogue": epilogue}


def random_tensors(spec, batch, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(batch, spec.input.channels, *spec.input.size, generator=g, dtype=torch.float64)
    w = torch.randn(spec.weight_shape(), generator=g, dtype=torch.float64)
    b = torch.randn(spec.conv.out_channels, generator=g, dtype=torch.float64) if spec.conv.bias else None
    params = {n: torch.rand(s, generator=g, dtype=torch.float64) + 0.5 for n, s in spec.params().items()}
    return x, w, b, params


def folded_by_model(spec, x, w, b, params):
    """The layer as its plan runs it: the tap-sum kernel's model, the folded conv's reference."""
    plan = build_plan(spec)
    assert plan["engine"] == "sequence" and plan["parts"][0]["role"] == "tapsum", plan.get("why")
    return tail_model.run_sequence(spec, plan, x, w, b, params)


# ---- the index sets -----------------------------------------------------------------------------


@given(size=st.integers(1, 12), kernel=st.integers(1, 5), stride=st.integers(1, 3), padding=st.integers(0, 3),
       dilation=st.integers(1, 3), transposed=st.booleans(), output_padding=st.integers(0, 2))
def test_each_taps_set_is_what_the_conv_reads_through_it(size, kernel, stride, padding, dilation, transposed, output_padding):
    """Enumerate the conv by its definition: the input indices tap k meets over all output positions."""
    if transposed:
        assume(output_padding < max(stride, dilation))
        out = (size - 1) * stride - 2 * padding + dilation * (kernel - 1) + output_padding + 1
    else:
        out = (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1
    assume(out >= 1)
    taps = tapsum.dim_taps(size, out, kernel, stride, padding, dilation, transposed)
    for k in range(kernel):
        if transposed:
            want = [i for i in range(size) if 0 <= i * stride - padding + k * dilation < out]
        else:
            want = [o * stride - padding + k * dilation for o in range(out)]
            want = [i for i in want if 0 <= i < size]
        j = taps.of_tap[k]
        got = [] if j < 0 else list(range(taps.first[j], taps.first[j] + taps.count[j] * taps.step, taps.step))
        assert got == want, (k, taps)
    assert len(set(zip(taps.first, taps.count))) == taps.sets  # each set once


# ---- where it applies -----------------------------------------------------------------------------


FOLDS = {
    "global_mean_2d": layer(3, [12, 12], 5, [{"mean": {"dims": [2, 3], "keepdim": True}}, "gelu"]),
    "mean_depth_3d": layer(2, [16, 6, 7], 4, [{"mean": {"dims": [2], "keepdim": True}}, {"softmax": 1}], padding=1),
    "mean_w_drop": layer(2, [6, 40], 3, [{"mul": 0.5}, {"mean": {"dims": [-1]}}, "tanh"], stride=2, padding=1),
    "sum_hw_3d": layer(2, [5, 12, 14], 3, [{"add": {"param": "shift"}}, {"sum": {"dims": [3, 4]}}], dilation=2),
    "gap_bn": layer(3, [10, 11], 4, [{"mul": 2.0}, {"batch_norm": {}}, "global_avg_pool", {"logsumexp": {"dims": [1]}}],
                    kernel=[3, 2], stride=[1, 2]),
    "gap_transposed_s2": layer(3, [6, 7], 4, ["global_avg_pool"], transposed=True, stride=2, padding=1, output_padding=1),
    "gap_transposed_s1": layer(2, [5, 5, 5], 3, [{"div": {"param": "scale"}}, "global_avg_pool"], transposed=True, kernel=2),
    "grouped_mean": layer(4, [14, 14], 6, [{"mean": {"dims": [2, 3], "keepdim": True}}], groups=2, padding=2),
    "mean_h_keep_w": layer(3, [64, 5], 2, [{"mean": {"dims": [2], "keepdim": True}}, "sigmoid"], kernel=[4, 3], stride=[3, 1]),
    "conv1d_sum": layer(2, [40], 3, [{"sum": {"dims": [2], "keepdim": True}}], kernel=5, padding=2),
    # a reduction that drops its dim, then a stage that numbers dims: the single positions are reduced away
    "mean_drop_softmax": layer(3, [30, 9], 4, [{"mean": {"dims": [2]}}, {"softmax": 1}], padding=1),
}


@pytest.mark.parametrize("name", sorted(FOLDS))
@pytest.mark.parametrize("batch", [1, 2])
def test_the_folded_layer_is_the_layer(name, batch):
    spec = validate({**FOLDS[name], "precision": "fp32"})
    x, w, b, params = random_tensors(spec, batch, hash(name) % 1000 + batch)
    want = reference.forward(spec, x, w, b, params)
    got = folded_by_model(spec, x, w, b, params)
    assert got.shape == want.shape
    assert ((got - want).norm() / want.norm()).item() < 1e-12


def test_a_dropped_dim_is_a_view_unless_a_later_stage_numbers_dims():
    view = tapsum.find(validate(FOLDS["mean_w_drop"]))
    assert not any(st.op == "mean" for st in view.spec.epilogue)  # only tanh after: the output is a view
    kept = tapsum.find(validate(FOLDS["mean_drop_softmax"]))
    assert [st.op for st in kept.spec.epilogue] == ["mean", "softmax"]  # the mean over the single positions


def test_what_does_not_fold():
    base = layer(3, [12, 12], 5, [{"mean": {"dims": [2, 3], "keepdim": True}}])

    def fold(**changes):
        data = {**base, **changes}
        return tapsum.find(validate(data))

    assert fold() is not None
    assert fold(epilogue=["relu", {"mean": {"dims": [2, 3]}}]) is None  # not affine: does not commute with the mean
    assert fold(epilogue=[{"amax": {"dims": [2, 3]}}]) is None  # a max is not linear
    assert fold(epilogue=[{"mean": {"dims": [1]}}]) is None  # over channels: the conv's own sum
    assert fold(epilogue=[{"mean": {"dims": [1, 2, 3]}}]) is None
    assert fold(epilogue=[{"avg_pool": 2}]) is None  # windows, not whole dims
    assert fold(rewrites=False) is None and fold(precision="bf16") is None
    assert fold(tile={"engine": "ffma"}) is None  # a tile keeps the layer as the user planned it
    assert fold(input={"channels": 3, "size": [4, 4]}) is None  # 4 positions for 9 taps: nothing saved
    transposed = {**base, "conv": {**base["conv"], "transposed": True, "stride": 2}}
    assert tapsum.find(validate(transposed)) is not None
    part = {**transposed, "epilogue": [{"mean": {"dims": [2]}}]}
    assert tapsum.find(validate(part)) is None  # a strided transposed conv folds only over all its dims
    relu_after = validate({**base, "epilogue": [{"mean": {"dims": [2, 3]}}, "relu"]})
    assert tapsum.find(relu_after) is not None  # what follows the mean is the folded layer's


# ---- the plan, the source, nvcc ----------------------------------------------------------------------


def test_the_plan_says_what_it_does():
    spec = validate({**FOLDS["gap_transposed_s1"], "precision": "tf32"})
    plan = build_plan(spec)
    kinds = [t["kind"] for t in plan["weight_transforms"]]
    assert kinds == ["transposed_to_plain", "tap_fold"]  # stride 1: the plain conv, then folded
    assert plan["rewrites"][0].startswith("stride-1 transposed conv") and any("tap-sum fold" in r for r in plan["rewrites"][1:])
    text = describe(plan)
    assert "tap sums: the input summed over DxHxW" in text and "averages whole spatial dims" in text
    body = next(p for p in plan["parts"] if p["role"] == "body")
    assert body["spec"].precision == "fp32"  # the sums are not what TF32 would round
    # taps that read the same input (all of them here: stride 1, no padding) share one sum
    assert plan["parts"][0]["plan"]["tap_count"] == 1 and body["spec"].input.channels == 2


def test_the_source_names_each_taps_set():
    spec = validate(FOLDS["gap_transposed_s2"])
    plan = build_plan(spec)
    text = render_plan(plan)
    assert "specgen_fold_tapsum" in text and "set 0 = " in text and "tap -> set:" in text
    assert "for (int o = 16; o > 0; o >>= 1)" in text  # the block's fixed-order sum


def test_a_fold_over_a_sequence_makes_new_steps_that_read_the_sums(monkeypatch):
    """The folded conv's own plan is a sequence here (a softmax after the mean): the fold puts the
    tap-sum kernel first and takes its parts as they are, its steps one part later and reading S
    where they read x, as new steps; the folded conv's plan is left as it was built."""
    from specgen import plan as planner
    from specgen.kernelplan import KernelStep, LayerStep, SequencePlan

    built = []
    real = planner.build_plan

    def recorded(*args, **kwargs):
        built.append(real(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(planner, "build_plan", recorded)
    spec = validate({**FOLDS["mean_depth_3d"], "precision": "fp32"})
    fold = tapsum.find(spec)
    plan = tapsum.plan_fold(spec, fold)
    inner = built[-1]  # the folded conv's plan (the last to finish)
    assert isinstance(inner, SequencePlan) and inner.name == spec.name
    assert plan.parts[0].role == "tapsum" and plan.parts[0].folded_spec is fold.spec
    assert plan.parts[1:] == inner.parts  # the same parts
    assert [type(s) for s in plan.steps] == [KernelStep, LayerStep, KernelStep]
    assert (plan.steps[0].name, plan.steps[0].args) == ("specgen_fold_tapsum", ["x", "s"])
    for step, was in zip(plan.steps[1:], inner.steps):
        assert step is not was and step.part == was.part + 1
    assert (inner.steps[0].in_, plan.steps[1].in_) == ("x", "s")
    assert inner.steps[0].part == 0 and plan.steps[2].args == inner.steps[1].args
    assert plan.buffers == {"s": plan.parts[0].plan.s_per_sample, **inner.buffers}


@pytest.mark.nvcc
def test_fold_variants_compile_without_spills(tmp_path, monkeypatch):
    from specgen import pipeline

    monkeypatch.setenv("SPECGEN_CACHE_DIR", str(tmp_path / "cache"))
    specs = [validate({**FOLDS[n], "name": n}) for n in ("global_mean_2d", "mean_depth_3d", "gap_transposed_s2", "mean_h_keep_w")]
    built = pipeline.specialize_many(specs, "sm_90", tuned=False)
    for item in built:
        assert item.build.spill_bytes == 0, (item.spec.name, item.build.log)
        assert f"specgen_{item.spec.name}_tapsum" in item.build.log


# ---- random foldable layers ---------------------------------------------------------------------


@st.composite
def foldable(draw):
    nd = draw(st.integers(1, 3))
    transposed = draw(st.booleans())
    groups = 1 if transposed else draw(st.sampled_from([1, 1, 2]))
    cin, cout = groups * draw(st.integers(1, 2)), groups * draw(st.integers(1, 3))
    size, kernel, stride, padding, dilation, out_pad = [], [], [], [], [], []
    for _ in range(nd):
        k, s, d = draw(st.integers(1, 3)), draw(st.integers(1, 2)), draw(st.integers(1, 2))
        p = draw(st.integers(0, d * (k - 1)))
        n = draw(st.integers(max(1, d * (k - 1) + 1 - 2 * p), {1: 30, 2: 10, 3: 5}[nd]))
        op = draw(st.integers(0, max(s, d) - 1)) if transposed else 0
        size.append(n), kernel.append(k), stride.append(s), padding.append(p), dilation.append(d), out_pad.append(op)
    dims = list(range(2, 2 + nd))
    if not transposed:
        dims = sorted(draw(st.sets(st.sampled_from(dims), min_size=1)))
    pre = draw(st.lists(st.sampled_from([{"mul": 1.5}, {"add": {"param": "shift"}}, {"div": {"param": "scale"}},
                                         {"sub": 0.25}, {"batch_norm": {}}]), max_size=2))
    op = draw(st.sampled_from(["mean", "sum", "global_avg_pool"]))
    if op == "global_avg_pool":
        red = "global_avg_pool"
    else:
        red = {op: {"dims": dims, "keepdim": draw(st.booleans())}}
    post = draw(st.lists(st.sampled_from(["tanh", {"mul": 2.0}, "gelu"]), max_size=1))
    conv = {"out_channels": cout, "kernel": kernel, "stride": stride, "padding": padding, "dilation": dilation, "groups": groups}
    if transposed:
        conv.update(transposed=True, output_padding=out_pad)
    return {"name": "rnd", "input": {"channels": cin, "size": size}, "conv": conv, "epilogue": [*pre, red, *post]}


ran = {"cases": 0}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(data=foldable(), batch=st.integers(1, 2))
def test_random_folds_match_the_reference(data, batch):
    from specgen.spec import SpecError

    try:
        spec = validate(data)
    except SpecError:
        assume(False)
    plain = forward_equivalent(spec) or spec
    assume(tapsum.find(plain) is not None)
    x, w, b, params = random_tensors(spec, batch, 7)
    want = reference.forward(spec, x, w, b, params)
    got = folded_by_model(spec, x, w, b, params)
    assert got.shape == want.shape
    scale = want.norm().item() or 1.0
    assert (got - want).norm().item() / scale < 1e-11
    ran["cases"] += 1


def test_the_random_folds_ran():
    """The property test above checked real cases (assume() skips specs that do not fold)."""
    if ran["cases"] == 0:
        test_random_folds_match_the_reference()
    assert ran["cases"] >= 20, ran
