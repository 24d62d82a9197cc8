"""The transposed pool fold without a GPU: the plain conv an avg pool after a strided transposed
conv makes, against the float64 reference of the two, where it applies, and what the plan says."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from specgen import poolfold, reference
from specgen.plan import build_plan, describe
from specgen.spec import SpecError, validate
from specgen.torchop import transformed_weight
from test_tapsum import random_tensors


def layer(cin, size, cout, epilogue, **conv):
    return {"name": "pfold", "input": {"channels": cin, "size": size},
            "conv": {"out_channels": cout, "kernel": conv.pop("kernel", 3), "transposed": True, "stride": conv.pop("stride", 2), **conv},
            "epilogue": epilogue}


def tensors(spec, batch=2, seed=0):
    return random_tensors(spec, batch, seed)


def folded(spec, x, w, b, params):
    """The layer as the plan runs it: the plain conv's reference with the launch's weights."""
    fold = poolfold.find(spec)
    assert fold is not None
    for t in build_plan(spec)["weight_transforms"]:
        w = transformed_weight(w, t)
    return reference.forward(fold.spec, x, w, b, params)


@given(size=st.integers(1, 9), kernel=st.integers(1, 5), stride=st.integers(2, 3), padding=st.integers(0, 3),
       dilation=st.integers(1, 2), output_padding=st.integers(0, 2), window=st.integers(1, 4), mult=st.integers(1, 2))
def test_one_dim_matches_conv_transpose_then_avg_pool(size, kernel, stride, padding, dilation, output_padding, window, mult):
    assume(output_padding < max(stride, dilation) and padding <= dilation * (kernel - 1))
    out = (size - 1) * stride - 2 * padding + dilation * (kernel - 1) + output_padding + 1
    pool_stride = stride * mult
    assume(out >= window)
    f = poolfold.dim_fold(size, kernel, stride, padding, dilation, out, window, pool_stride)
    assume(f is not None)
    g = torch.Generator().manual_seed(size * 31 + kernel)
    x = torch.rand(1, 1, size, generator=g, dtype=torch.float64)
    w = torch.randn(1, 1, kernel, generator=g, dtype=torch.float64)
    want = F.avg_pool1d(F.conv_transpose1d(x, w, stride=stride, padding=padding, output_padding=output_padding,
                                           dilation=dilation), window, pool_stride)
    plain = torch.zeros(f.kernel, dtype=torch.float64)
    for j, pairs in enumerate(f.taps):
        for count, k in pairs:
            plain[j] += count * w[0, 0, k] / window
    got = F.conv1d(x, plain.view(1, 1, -1), stride=f.stride, padding=f.padding)
    assert got.shape == want.shape
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)


CASES = {
    "kb72": layer(3, [8, 8, 8], 4, [{"batch_norm": {}}, {"avg_pool": 2}, {"avg_pool": 2}], padding=1),
    "kb50": layer(3, [6, 8, 8], 4, [{"mul": {"param": "s1"}}, {"avg_pool": 2}, {"add": {"param": "b"}}, {"mul": 0.5}], padding=1),
    "window4_2d": layer(2, [9, 7], 3, [{"avg_pool": 4}, "tanh"], kernel=4, padding=1),
    "output_padding": layer(4, [6, 6], 4, [{"avg_pool": {"kernel": 3, "stride": 2}}], padding=1, output_padding=1, groups=2),
    "conv1d_window2": layer(2, [20], 3, [{"div": 2.0}, {"avg_pool": 2}, {"softmax": 1}], kernel=5, padding=2),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_folded_conv_is_the_layer(name):
    spec = validate({**CASES[name], "precision": "fp32"})
    x, w, b, params = tensors(spec)
    want = reference.forward(spec, x, w, b, params)
    got = folded(spec, x, w, b, params)
    assert got.shape == want.shape
    assert ((got - want).norm() / want.norm()).item() < 1e-12


def test_what_does_not_fold():
    base = CASES["window4_2d"]

    def fold(**changes):
        return poolfold.find(validate({**base, **changes}))

    assert fold() is not None
    assert fold(epilogue=["relu", {"avg_pool": 4}]) is None  # not affine before the pool
    assert fold(epilogue=[{"max_pool": 4}]) is None
    assert fold(epilogue=[{"avg_pool": {"kernel": 4, "stride": 3}}]) is None  # the pool's stride no multiple of 2
    assert fold(epilogue=[{"avg_pool": {"kernel": 4, "padding": 1}}]) is None
    assert fold(rewrites=False) is None and fold(tile={"engine": "ffma"}) is None
    assert fold(conv={**base["conv"], "stride": 1}) is None  # stride 1: the plain conv it equals, then the avg-pool fold


def test_the_plan_is_the_plain_convs_with_both_folds():
    spec = validate(CASES["kb72"])
    plan = build_plan(spec)
    assert [t["kind"] for t in plan["weight_transforms"]] == ["transposed_pool_fold"]
    assert plan["rewrites"][0].startswith("transposed pool fold") and plan["rewrites"][1].startswith("avg-pool fold")
    assert "transposed: true" in plan["spec_yaml"]  # the banner shows the user's spec
    assert plan["engine"] != "sequence" and "avg-pool fold" in describe(plan)


@st.composite
def pooled(draw):
    nd = draw(st.integers(1, 3))
    groups = draw(st.sampled_from([1, 1, 2]))
    cin, cout = groups * draw(st.integers(1, 2)), groups * draw(st.integers(1, 2))
    size, kernel, stride, padding, out_pad, window, pstride = [], [], [], [], [], [], []
    for _ in range(nd):
        k, s = draw(st.integers(1, 4)), draw(st.integers(2, 3))
        size.append(draw(st.integers(1, {1: 16, 2: 7, 3: 4}[nd])))
        kernel.append(k), stride.append(s)
        padding.append(draw(st.integers(0, k - 1)))
        out_pad.append(draw(st.integers(0, s - 1)))
        window.append(draw(st.integers(1, 4)))
        pstride.append(s * draw(st.integers(1, 2)))
    pre = draw(st.lists(st.sampled_from([{"mul": 1.5}, {"add": {"param": "shift"}}, {"batch_norm": {}}]), max_size=2))
    post = draw(st.lists(st.sampled_from(["tanh", {"avg_pool": 2}, {"mean": {"dims": [1]}}]), max_size=1))
    return {"name": "rnd", "input": {"channels": cin, "size": size},
            "conv": {"out_channels": cout, "kernel": kernel, "stride": stride, "padding": padding, "output_padding": out_pad,
                     "groups": groups, "transposed": True},
            "epilogue": [*pre, {"avg_pool": {"kernel": window, "stride": pstride}}, *post]}


checked = {"cases": 0}


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(data=pooled())
def test_random_pool_folds_match_the_reference(data):
    try:
        spec = validate(data)
    except SpecError:
        assume(False)
    assume(poolfold.find(spec) is not None)
    x, w, b, params = tensors(spec, seed=3)
    want = reference.forward(spec, x, w, b, params)
    got = folded(spec, x, w, b, params)
    assert got.shape == want.shape
    assert (got - want).norm().item() / (want.norm().item() or 1.0) < 1e-11
    checked["cases"] += 1


def test_the_random_pool_folds_ran():
    if checked["cases"] == 0:
        test_random_pool_folds_match_the_reference()
    assert checked["cases"] >= 20, checked
