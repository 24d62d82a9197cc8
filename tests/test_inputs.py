"""Extra inputs (`add: {input: shortcut}`): a tensor of the layer's output shape that the caller
passes at run time, read by the epilogue at each output element (a residual's shortcut); or, with
`shape: [C, 1, ...]`, one value per sample and channel read at every position (a time embedding).

CPU: the spec (validation, shape, hash), the reference and the op (shapes, autograd), which
engines read one and which refuse, and the rendered kernels compiled with ptxas (no spills)."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from specgen import FusedLayer, reference  # noqa: E402
from build_helpers import build_report, spilled  # noqa: E402
from specgen.plan import PlanError, build_plan  # noqa: E402
from specgen.render import render_plan  # noqa: E402
from specgen.spec import SpecError, validate  # noqa: E402


def spec_of(name, epilogue, cin=8, size=(10, 10), cout=16, precision="fp32", **extra):
    return validate({"name": name, "input": {"channels": cin, "size": list(size)},
                     "conv": {"out_channels": cout, "kernel": 3, "padding": 1, "bias": False},
                     "epilogue": epilogue, "precision": precision, **extra})


RESIDUAL = ["batch_norm", {"add": {"input": "shortcut"}}, "relu"]

# One per engine that reads extra inputs: TMA (in each precision), the implicit GEMM, the tail
# engine after a statistic stage.
ENGINE_CASES = {
    "tma_tf32": (dict(cin=64, size=(20, 20), cout=64, precision="tf32"), RESIDUAL, "tma"),
    "tma_bf16": (dict(cin=64, size=(20, 20), cout=64, precision="bf16"), RESIDUAL, "tma"),
    "igemm": (dict(tile={"engine": "igemm"}), ["batch_norm", {"add": {"input": "shortcut"}}, {"mul": {"input": "gate"}}, "relu"], "igemm"),
    "tail": (dict(), [{"batch_norm": {"training": True}}, {"sub": {"input": "shortcut"}}, "relu"], "sequence"),
}


# One value per sample and channel, on each engine that reads extra inputs (the TMA engine beside a
# shortcut of the output's shape; the tail engine's apply kernel after a statistic stage).
TEMB = {"add": {"input": "temb", "shape": [16, 1, 1]}}
CHANNEL_CASES = {
    "tma_tf32": (dict(cin=64, size=(20, 20), cout=64, precision="tf32"),
                 [{"add": {"input": "temb", "shape": [64, 1, 1]}}, "silu"], "tma"),
    "tma_bf16_and_shortcut": (dict(cin=64, size=(20, 20), cout=64, precision="bf16"),
                              [{"mul": {"input": "temb", "shape": [64, 1, 1]}}, {"add": {"input": "shortcut"}}], "tma"),
    "igemm": (dict(tile={"engine": "igemm"}), ["batch_norm", TEMB, "relu"], "igemm"),
    "tail": (dict(), [{"group_norm": 4}, TEMB, "relu"], "sequence"),
    # before a statistic stage: the body kernel reads it (on the TMA engine), the tail normalizes
    "body_before_group_norm": (dict(cin=64, size=(20, 20), cout=64, precision="tf32"),
                               [{"add": {"input": "temb", "shape": [64, 1, 1]}}, {"group_norm": 8}, "silu"], "sequence"),
}


def test_the_spec_names_its_inputs_in_order_and_they_change_the_hash():
    spec = spec_of("r", ["batch_norm", {"add": {"input": "shortcut"}}, {"mul": {"input": "gate"}}, {"sub": {"input": "shortcut"}}])
    assert spec.inputs() == {"shortcut": (16, 10, 10), "gate": (16, 10, 10)}
    assert "shortcut" not in spec.params() and spec.output_shape(2) == (2, 16, 10, 10)
    plain = spec_of("r", ["batch_norm", {"add": {"param": "shortcut"}}, {"mul": {"param": "gate"}}, {"sub": {"param": "shortcut"}}])
    assert plain.shape_hash != spec.shape_hash


def test_an_input_of_one_value_per_sample_and_channel_says_its_shape():
    spec = spec_of("t", [TEMB, {"add": {"input": "shortcut"}}, {"mul": {"input": "temb", "shape": [16, 1, 1]}}])
    assert spec.inputs() == {"temb": (16, 1, 1), "shortcut": (16, 10, 10)}
    full = spec_of("t", [{"add": {"input": "temb"}}, {"add": {"input": "shortcut"}}, {"mul": {"input": "temb"}}])
    assert full.inputs()["temb"] == (16, 10, 10) and full.shape_hash != spec.shape_hash
    # the output's shape written out is the default's, and hashes as it
    written = spec_of("t", [{"add": {"input": "s", "shape": [16, 10, 10]}}])
    assert written.inputs() == {"s": (16, 10, 10)}
    assert written.shape_hash == spec_of("t", [{"add": {"input": "s"}}]).shape_hash
    # 1-D and 3-D layers
    assert spec_of("t", [{"add": {"input": "e", "shape": [16, 1]}}], size=(12,)).inputs() == {"e": (16, 1)}
    assert spec_of("t", [{"sub": {"input": "e", "shape": [16, 1, 1, 1]}}], size=(4, 5, 6)).inputs() == {"e": (16, 1, 1, 1)}


@pytest.mark.parametrize(
    "epilogue, expected",
    [
        ([{"add": {"input": "e", "shape": [16, 10, 1]}}], "epilogue[0].add.shape: an extra input's shape per sample is the "
                                                           "layer's output's [16, 10, 10] or one value per channel [16, 1, 1], "
                                                           "got [16, 10, 1]"),
        ([{"add": {"input": "e", "shape": [8, 1, 1]}}], "or one value per channel [16, 1, 1], got [8, 1, 1]"),
        ([{"add": {"param": "e", "shape": [16, 1, 1]}}], "shape is an extra input's shape per sample: give it with input, not with param"),
        ([{"add": {"input": "e", "shape": [16, 1, 1]}}, {"mul": {"input": "e"}}],
         "epilogue[1].mul: extra input 'e' has shape [16, 10, 10] here and [16, 1, 1] at epilogue[0]"),
        ([{"add": {"input": "e", "shape": [16, 0, 1]}}], "epilogue[0].add.shape[1]: Input should be greater than 0"),
        ([{"add": {"input": "e", "shape": [16, 1, 1]}}, {"max_pool": 2}], "only pointwise and statistic stages"),
        ([{"add": {"input": "s"}}, {"max_pool": 2}], "epilogue[0] (add): an extra input is read at the layer's output shape, "
                                                      "so only pointwise and statistic stages (which keep the shape) may "
                                                      "follow it; epilogue[1] is max_pool (pool)"),
        ([{"add": {"input": "s"}}, {"sum": {"dims": [1]}}], "epilogue[1] is sum (reduce)"),
        ([{"add": {"input": "s"}}, {"group_norm": 2}, {"avg_pool": 2}], "epilogue[2] is avg_pool (pool)"),
        ([{"add": {"input": "s", "value": 1.0}}], "epilogue[0].add: give exactly one of value"),
        ([{"mul": {"input": "2x"}}], "epilogue[0].mul.input: String should match pattern"),
        ([{"add": {"param": "s"}}, {"sub": {"input": "s"}}], "'s' names an extra input and a tensor of the layer"),
        ([{"add": {"input": "spec"}}], "parameter name 'spec' is reserved"),
    ],
)
def test_bad_inputs_name_the_field(epilogue, expected):
    with pytest.raises(SpecError) as err:
        spec_of("bad", epilogue)
    assert expected in str(err.value), str(err.value)


def test_the_reference_and_the_layer_read_the_inputs():
    torch.manual_seed(0)
    spec = spec_of("r", ["batch_norm", {"add": {"input": "shortcut"}}, {"mul": {"input": "gate"}}, "relu"])
    layer = FusedLayer(spec).eval()
    x, s, g = torch.randn(3, 8, 10, 10), torch.randn(3, 16, 10, 10), torch.randn(3, 16, 10, 10)
    with torch.no_grad():
        bn = (layer.conv(x) - layer.bn_running_mean) / torch.sqrt(layer.bn_running_var + 1e-5) * layer.bn_weight + layer.bn_bias
        want = torch.relu((bn + s) * g)
        torch.testing.assert_close(layer(x, s, g), want)
        plain = reference.Reference(spec).eval()
        plain.load_state_dict(layer.state_dict())
        torch.testing.assert_close(plain(x, s, g), want)
        out = torch.empty(3, 16, 10, 10)
        assert layer(x, s, g, out=out) is out
        torch.testing.assert_close(out, want)


def test_an_input_per_sample_and_channel_is_broadcast_and_its_gradient_summed():
    torch.manual_seed(0)
    spec = spec_of("t", ["batch_norm", TEMB, "relu", {"mul": {"input": "gate"}}])
    layer = FusedLayer(spec).eval()
    x, t, g = torch.randn(3, 8, 10, 10), torch.randn(3, 16, 1, 1, requires_grad=True), torch.randn(3, 16, 10, 10)
    y = layer(x, t, g)
    with torch.no_grad():
        bn = (layer.conv(x) - layer.bn_running_mean) / torch.sqrt(layer.bn_running_var + 1e-5) * layer.bn_weight + layer.bn_bias
        torch.testing.assert_close(y.detach(), torch.relu(bn + t) * g)
        out = torch.empty(3, 16, 10, 10)
        assert layer(x, t, g, out=out) is out
        torch.testing.assert_close(out, y)
    (grad,) = torch.autograd.grad(y, [t], torch.ones_like(y))
    assert grad.shape == t.shape
    torch.testing.assert_close(grad, ((bn + t.detach() > 0) * g).sum((2, 3), keepdim=True))
    with pytest.raises(ValueError, match=r"extra input temb: expected a torch.float32 tensor of shape \[3, 16, 1, 1\] "
                                         r"\(one value per sample and channel\)"):
        layer(x, torch.randn(3, 16, 10, 10), g)
    with pytest.raises(ValueError, match=r"expected the extra input temb of shape \[3, 16, 1, 1\] \(one value per sample "
                                         r"and channel\), got \[3, 16\]"):
        layer.op.overload(x, layer.conv.weight, *layer._op_tensors()[1:], torch.randn(3, 16), g)


def test_wrong_inputs_are_refused_before_anything_runs():
    layer = FusedLayer(spec_of("r", RESIDUAL))
    x = torch.randn(2, 8, 10, 10)
    with pytest.raises(TypeError, match=r"takes x and the extra inputs shortcut \(spec.inputs\(\)\), got 0"):
        layer(x)
    with pytest.raises(ValueError, match=r"extra input shortcut: expected a torch.float32 tensor of shape \[2, 16, 10, 10\]"):
        layer(x, torch.randn(2, 16, 10, 9))
    with pytest.raises(ValueError, match="extra input shortcut"):
        layer(x, torch.randn(2, 16, 10, 10, dtype=torch.float64))
    with pytest.raises(TypeError, match="takes x and no extra inputs"):
        FusedLayer(spec_of("p", ["relu"]))(x, torch.randn(2, 16, 10, 10))
    op = layer.op  # the op checks the same, on real and on fake tensors
    with pytest.raises(ValueError, match=r"expected the extra input shortcut of shape \[2, 16, 10, 10\]"):
        op.overload(x, layer.conv.weight, *layer._op_tensors()[1:], torch.randn(2, 16, 5, 5))


def test_gradients_reach_the_inputs_and_compile_sees_no_graph_break():
    torch.manual_seed(0)
    layer = FusedLayer(spec_of("r", RESIDUAL)).train()
    x, s = torch.randn(2, 8, 10, 10, requires_grad=True), torch.randn(2, 16, 10, 10, requires_grad=True)
    y = layer(x, s)
    plain = reference.Reference(layer.spec).train()
    plain.load_state_dict(layer.state_dict())
    x2, s2 = x.detach().clone().requires_grad_(), s.detach().clone().requires_grad_()
    y2 = plain(x2, s2)
    torch.testing.assert_close(y, y2)
    grad = torch.randn_like(y)
    y.backward(grad)
    y2.backward(grad)
    torch.testing.assert_close(s.grad, s2.grad)
    torch.testing.assert_close(x.grad, x2.grad)
    assert s.grad.abs().sum() > 0
    compiled = torch.compile(layer, fullgraph=True, backend="eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, s), layer(x, s))


def _planned(cases: dict, name: str):
    """(the spec of case `name`, its plan, its rendered source), the plan checked to take the case's engine."""
    kw, epilogue, engine = cases[name]
    spec = spec_of(name, epilogue, **kw)
    plan = build_plan(spec)
    assert plan["engine"] == engine
    return spec, plan, render_plan(plan)


@pytest.mark.parametrize("name", sorted(ENGINE_CASES))
def test_the_engines_that_read_inputs_plan_them(name):
    spec, _, source = _planned(ENGINE_CASES, name)
    for n in spec.inputs():
        assert f"i_{n}" in source and f"input_value(i_{n}, e_out)" in source


@pytest.mark.parametrize("name", sorted(CHANNEL_CASES))
def test_an_input_per_sample_and_channel_is_read_at_its_sample_and_channel(name):
    spec, plan, source = _planned(CHANNEL_CASES, name)
    engine = plan["engine"]
    per_sample = spec.output_shape(1)[1:]
    in_tail = engine == "sequence" and spec.epilogue[0].kind == "norm"  # (else the body kernel reads it)
    channel, sample = ("c_el", "n") if in_tail else ("cj", "sample")
    at = f"{sample} * {per_sample[0]} + {channel}"
    assert f"input_value(i_temb, {at})" in source
    assert ("input_value(i_shortcut, e_out)" in source) == ("shortcut" in spec.inputs())
    if engine != "sequence":
        assert [(i["name"], i["per_sample"]) for i in plan["inputs"]] == [(n, math.prod(s)) for n, s in spec.inputs().items()]


def test_engines_without_inputs_refuse_with_the_reason():
    with pytest.raises(PlanError, match=r"an extra input \(shortcut\) is read by the tma and igemm engines .* this layer plans for the ffma engine"):
        build_plan(spec_of("f", [{"add": {"input": "shortcut"}}], tile={"engine": "ffma"}))
    # after a pool that runs as a layer of its own behind a statistic stage
    with pytest.raises(SpecError, match="extra input"):
        build_plan(spec_of("t", [{"group_norm": 4}, {"max_pool": 2}, {"add": {"input": "s"}}]))


@pytest.mark.nvcc
@pytest.mark.parametrize("name", sorted(ENGINE_CASES) + [f"channel_{n}" for n in sorted(CHANNEL_CASES)])
def test_input_kernels_compile_without_spills(name, tmp_path):
    kw, epilogue, _ = CHANNEL_CASES[name[8:]] if name.startswith("channel_") else ENGINE_CASES[name]
    kernels = build_report(spec_of(name, epilogue, **kw), tmp_path)
    assert kernels
    assert not spilled(kernels), spilled(kernels)
