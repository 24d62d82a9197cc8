"""Extra inputs (`add: {input: shortcut}`): a tensor of the layer's output shape that the caller
passes at run time, read by the epilogue at each output element (a residual's shortcut).

CPU: the spec (validation, shape, hash), the reference and the op (shapes, autograd), which
engines read one and which refuse, and the rendered kernels compiled with ptxas (no spills)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from specgen import FusedLayer, reference  # noqa: E402
from specgen import compile as nvcc  # noqa: E402
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


def test_the_spec_names_its_inputs_in_order_and_they_change_the_hash():
    spec = spec_of("r", ["batch_norm", {"add": {"input": "shortcut"}}, {"mul": {"input": "gate"}}, {"sub": {"input": "shortcut"}}])
    assert spec.inputs() == {"shortcut": (16, 10, 10), "gate": (16, 10, 10)}
    assert "shortcut" not in spec.params() and spec.output_shape(2) == (2, 16, 10, 10)
    plain = spec_of("r", ["batch_norm", {"add": {"param": "shortcut"}}, {"mul": {"param": "gate"}}, {"sub": {"param": "shortcut"}}])
    assert plain.shape_hash != spec.shape_hash


@pytest.mark.parametrize(
    "epilogue, expected",
    [
        ([{"add": {"input": "s"}}, {"max_pool": 2}], "epilogue[0] (add): an extra input is read at the layer's output shape, "
                                                      "so only pointwise stages may follow it; epilogue[1] is max_pool (pool)"),
        ([{"add": {"input": "s"}}, {"sum": {"dims": [1]}}], "epilogue[1] is sum (reduce)"),
        ([{"add": {"input": "s"}}, {"group_norm": 2}], "epilogue[1] is group_norm (norm)"),
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


@pytest.mark.parametrize("name", sorted(ENGINE_CASES))
def test_the_engines_that_read_inputs_plan_them(name):
    kw, epilogue, engine = ENGINE_CASES[name]
    spec = spec_of(name, epilogue, **kw)
    plan = build_plan(spec)
    assert plan["engine"] == engine
    source = render_plan(plan)
    for n in spec.inputs():
        assert f"i_{n}" in source and f"input_value(i_{n}, e_out)" in source


def test_engines_without_inputs_refuse_with_the_reason():
    with pytest.raises(PlanError, match=r"an extra input \(shortcut\) is read by the tma and igemm engines .* this layer plans for the ffma engine"):
        build_plan(spec_of("f", [{"add": {"input": "shortcut"}}], tile={"engine": "ffma"}))
    # after a pool that runs as a layer of its own behind a statistic stage
    with pytest.raises(SpecError, match="extra input"):
        build_plan(spec_of("t", [{"group_norm": 4}, {"max_pool": 2}, {"add": {"input": "s"}}]))


@pytest.mark.nvcc
@pytest.mark.parametrize("name", sorted(ENGINE_CASES))
def test_input_kernels_compile_without_spills(name, tmp_path):
    kw, epilogue, _ = ENGINE_CASES[name]
    spec = spec_of(name, epilogue, **kw)
    from specgen import pipeline

    _, source, request = pipeline.request(spec, "sm_90")
    cu = tmp_path / f"{name}.cu"
    cu.write_text(source)
    report = nvcc.compile_cubin(cu, tmp_path / f"{name}.cubin", request.arch, compiler="nvcc")
    assert report.kernels
    spills = {k: r.spill_bytes for k, r in report.kernels.items() if r.spill_bytes}
    assert not spills, spills
