"""The tap-sum and transposed pool folds on the GPU against float64 PyTorch (marker `gpu`): the
layers of test_tapsum.py and test_poolfold.py, wide rows and long sums, random foldable layers, in
fp32 and tf32. Outputs are poisoned with NaN, inputs and parameters fresh per check
(gpu_helpers.compare)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hypothesis import HealthCheck, assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from specgen import boxfold, poolfold, tapsum  # noqa: E402
from specgen.module import FusedLayer  # noqa: E402
from specgen.plan import forward_equivalent  # noqa: E402
from specgen.spec import SpecError, validate  # noqa: E402

from gpu_helpers import captured, compare  # noqa: E402
from test_boxfold import FOLDS as BOX_FOLDS, foldable as box_foldable, layer as box_layer  # noqa: E402
from test_poolfold import CASES as POOL_FOLDS, pooled  # noqa: E402
from test_tapsum import FOLDS, foldable, layer  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fp32_reference")]

LARGE = {
    # a block of 512 threads per (channel), one row of W at a time (KernelBench 42's shape, smaller)
    "wide_rows": layer(8, [96, 512], 16, [{"mean": {"dims": [2, 3], "keepdim": True}}, {"add": {"param": "b"}},
                                          {"logsumexp": {"dims": [1], "keepdim": True}}], transposed=True),
    # a thread per (channel, h, w) summing 40 depths (KernelBench 13's shape, smaller)
    "long_depth": layer(4, [40, 32, 64], 16, [{"mean": {"dims": [2], "keepdim": True}}, {"softmax": 1}, "tanh"],
                        padding=1, transposed=True),
    # summed D and H with W kept, 96 * 20 positions per thread: the loop is not unrolled whole
    "dh_keep_w": layer(3, [96, 20, 33], 5, [{"sum": {"dims": [2, 3]}}, "gelu"], kernel=[3, 2, 3], stride=[2, 1, 1]),
    # strided transposed conv, 5^3 taps, global pool after a batch norm (KernelBench 77's kind)
    "gap_t3d": layer(6, [6, 10, 12], 8, [{"mul": 2.0}, {"batch_norm": {}}, "global_avg_pool"], kernel=5, stride=2,
                     transposed=True),
}


def fused(data, precision):
    spec = validate({**data, "precision": precision})
    plain = forward_equivalent(spec) or spec
    assert tapsum.find(plain) is not None, spec.name
    return FusedLayer(spec).cuda()


@pytest.mark.parametrize("name", sorted(FOLDS) + sorted(LARGE))
@pytest.mark.parametrize("precision", ["fp32", "tf32"])
@pytest.mark.parametrize("batch", [1, 3])
def test_folded_layers_match_float64(name, precision, batch):
    data = {**FOLDS, **LARGE}[name]
    layer = fused(data, precision)
    assert layer.specialize().plan["parts"][0]["role"] == "tapsum"
    compare(layer, batch, seed=batch + len(name))


ran = {"cases": 0}
pool_ran = {"cases": 0}


def check_random(data, batch, precision, folds, counter):
    """A random layer that `folds` (its spec -> whether it folds), on the GPU against float64."""
    try:
        spec = validate({**data, "precision": precision})
    except SpecError:
        assume(False)
    assume(folds(spec))
    compare(FusedLayer(spec).cuda(), batch, seed=batch)
    counter["cases"] += 1


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(data=foldable(), batch=st.integers(1, 3), precision=st.sampled_from(["fp32", "tf32"]))
def test_random_folds_on_the_gpu(data, batch, precision):
    check_random(data, batch, precision, lambda spec: tapsum.find(forward_equivalent(spec) or spec) is not None, ran)


def test_the_random_gpu_folds_ran():
    if ran["cases"] == 0:
        test_random_folds_on_the_gpu()
    assert ran["cases"] >= 30, ran


@pytest.mark.parametrize("name", sorted(POOL_FOLDS))
@pytest.mark.parametrize("precision", ["fp32", "tf32"])
@pytest.mark.parametrize("batch", [1, 3])
def test_pool_folded_layers_match_float64(name, precision, batch):
    spec = validate({**POOL_FOLDS[name], "precision": precision})
    assert poolfold.find(spec) is not None
    layer = FusedLayer(spec).cuda()
    assert layer.specialize().plan["weight_transforms"][0]["kind"] == "transposed_pool_fold"
    compare(layer, batch, seed=batch + len(name))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(data=pooled(), batch=st.integers(1, 3), precision=st.sampled_from(["fp32", "tf32"]))
def test_random_pool_folds_on_the_gpu(data, batch, precision):
    check_random(data, batch, precision, lambda spec: poolfold.find(spec) is not None, pool_ran)


def test_the_random_gpu_pool_folds_ran():
    if pool_ran["cases"] == 0:
        test_random_pool_folds_on_the_gpu()
    assert pool_ran["cases"] >= 25, pool_ran


BOX_LARGE = {
    # KernelBench 65 at a quarter of its area, and padded with two groups and a batch norm after the pool
    "kb65_quarter": box_layer(8, [192, 192], 64, [{"avg_pool": 4}, "sigmoid", {"sum": {"dims": [1, 2, 3]}}]),
    "padded_bn": box_layer(12, [61, 70], 128, [{"avg_pool": 4}, {"batch_norm": {}}, "silu"], padding=1, groups=2),
}


def box_fold_on():
    """The box fold taken where it applies, whatever the planner's default (`boxfold.ENABLED`)."""
    from unittest import mock

    return mock.patch.object(boxfold, "ENABLED", True)


@pytest.mark.parametrize("name", sorted(BOX_FOLDS) + sorted(BOX_LARGE))
@pytest.mark.parametrize("precision", ["fp32", "tf32"])
@pytest.mark.parametrize("batch", [1, 3])
def test_box_folded_layers_match_float64(name, precision, batch):
    spec = validate({**{**BOX_FOLDS, **BOX_LARGE}[name], "precision": precision})
    with box_fold_on():
        layer = FusedLayer(spec).cuda()
        plan = layer.specialize().plan
        if precision == "fp32":
            assert boxfold.find(spec) is not None and plan["parts"][0]["role"] == "boxmean"
        compare(layer, batch, seed=batch + len(name))


@pytest.mark.parametrize("kind", ["box_fold", "tap_sum"])
def test_folds_take_a_channels_last_input(kind):
    """A fold's first kernel reads x by address as NC(D)HW: a channels-last input (as a
    channels-last model hands it on) is laid out for it first, not read as if it were NCHW (a
    summed output hides that: KernelBench 65's sum was off by 2e-4 only)."""
    data = {"box_fold": BOX_FOLDS["padded_groups"], "tap_sum": FOLDS["mean_h_keep_w"]}[kind]  # (outputs not summed whole)
    spec = validate({**data, "precision": "fp32"})
    with box_fold_on():
        layer = FusedLayer(spec).cuda()
        role = layer.specialize().plan["parts"][0]["role"]
        assert role == {"box_fold": "boxmean", "tap_sum": "tapsum"}[kind]
        compare(layer, 2, seed=5, channels_last=True)


box_ran = {"cases": 0}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(data=box_foldable(), batch=st.integers(1, 3))
def test_random_box_folds_on_the_gpu(data, batch):
    with box_fold_on():
        check_random(data, batch, "fp32", lambda spec: boxfold.find(spec) is not None, box_ran)


def test_the_random_gpu_box_folds_ran():
    if box_ran["cases"] == 0:
        test_random_box_folds_on_the_gpu()
    assert box_ran["cases"] >= 15, box_ran


@pytest.mark.parametrize("kind", ["tap_fold", "transposed_pool_fold", "box_fold"])
def test_folded_layers_replay_in_a_cuda_graph_with_new_weights(kind, monkeypatch):
    """The folds' weight transforms run inside the capture (no host-to-device copy there), so each
    replay folds the weights as they are then: an in-place update between replays shows."""
    from specgen import reference

    data = {"tap_fold": FOLDS["global_mean_2d"], "transposed_pool_fold": POOL_FOLDS["window4_2d"],
            "box_fold": BOX_FOLDS["kb65_like"]}[kind]
    monkeypatch.setattr(boxfold, "ENABLED", True)
    layer = FusedLayer(validate({**data, "precision": "fp32"})).cuda()
    assert layer.specialize().plan["weight_transforms"][0]["kind"] == kind
    gen = torch.Generator(device="cuda").manual_seed(11)
    x = torch.randn(2, layer.spec.input.channels, *layer.spec.input.size, device="cuda", generator=gen)
    graph, out = captured(layer, x, grad=False)
    for _ in range(2):
        with torch.no_grad():
            layer.conv.weight.copy_(torch.randn(layer.conv.weight.shape, device="cuda", generator=gen))
        x.copy_(torch.randn(x.shape, device="cuda", generator=gen))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want = reference.forward(layer.spec, x, layer.conv.weight, layer.conv.bias, layer.spec_params())
        torch.testing.assert_close(out, want.detach(), atol=1e-4, rtol=1e-4)
