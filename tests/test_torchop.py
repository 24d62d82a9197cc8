"""FusedLayer as a custom op, on the CPU: registration, opcheck, fake tensors, torch.compile,
precision errors. (The CPU implementation of the op is the PyTorch reference; the CUDA one is the
kernel, exercised by test_torchop_gpu.py.)"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import torch.nn as nn  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

from specgen import reference, torchop  # noqa: E402
from specgen.module import FusedLayer  # noqa: E402
from specgen.spec import SpecError, load_specs, validate  # noqa: E402

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def shrink(spec, start: int = 6):
    """The spec at small spatial sizes (same ops and geometry): each size capped at the smallest
    cap (from `start` up) that still validates."""
    for cap in (6, 8, 10, 12, 16, 20, 24, 32, 48, 64):
        if cap < start:
            continue
        data = spec.model_dump()
        data["input"]["size"] = [min(s, cap) for s in spec.input.size]
        try:
            return validate(data)
        except SpecError:
            continue
    return spec


def example_specs(start: int = 6):
    """Every spec of examples/*.yaml (the seeds and the zoo), shrunk."""
    out = []
    for path in sorted(EXAMPLES.glob("*.yaml")):
        out += [pytest.param(shrink(s, start), id=f"{path.stem}:{s.name}") for s in load_specs(path)]
    return out


def make_layer(spec, seed: int = 0, dtype=torch.float32) -> FusedLayer:
    torch.manual_seed(seed)
    layer = FusedLayer(spec)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape) * (0.3 if p.dim() > 1 else 1.0))
    return layer.to(dtype)


def make_input(spec, batch: int, dtype=torch.float32, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((batch, spec.input.channels, *spec.input.size), generator=gen, dtype=dtype)


def op_args(layer: FusedLayer, x: torch.Tensor) -> tuple:
    return layer.op.arguments(x, layer.conv.weight, layer.conv.bias, layer.spec_params())


def first_output(layer: FusedLayer, result):
    """The layer's output from its op's result (a layer with running statistics also returns them)."""
    return result[0] if layer.op.stats_size else result


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------
# Registration and schema
# ---------------------------------------------------------------------------------------------


def test_one_op_per_spec_registered_once():
    spec = shrink(load_specs(EXAMPLES / "kb90.yaml")[0])
    a, b = FusedLayer(spec), FusedLayer(spec)
    assert a.op is b.op is torchop.register(spec, a._specialized, a.arch)
    assert re.fullmatch(r"kb90_[0-9a-f]{12}", a.op.name)
    assert a.op.qualname == f"specgen::{a.op.name}"
    assert getattr(torch.ops.specgen, a.op.name).default is a.op.overload
    if a.key is not None:  # specialized (a GPU machine): the op is named after the cache key
        assert a.op.name == f"kb90_{a.key[:12]}"
    other = shrink(load_specs(EXAMPLES / "kb65.yaml")[0])
    assert FusedLayer(other).op.name != a.op.name
    assert a.op.name in torchop.registered()


def test_schema_lists_the_layer_tensors_and_mutates_nothing():
    spec = validate(
        {
            "name": "schema_probe",
            "input": {"channels": 2, "size": [6]},
            "conv": {"out_channels": 3, "kernel": 3, "bias": False},
            "epilogue": [{"mul": {"param": "scale"}}, {"add": {"param": "shift"}}, {"expr": "x * scale + gain"}],
        }
    )
    op = FusedLayer(spec).op
    schema = op.overload._schema
    assert [a.name for a in schema.arguments] == ["x", "weight", "p_scale", "p_shift", "p_gain"]
    assert not schema.is_mutable
    assert [str(r.type) for r in schema.returns] == ["Tensor"]
    assert op.param_names == ("scale", "shift", "gain")


@pytest.mark.parametrize("spec", example_specs())
def test_opcheck_every_example(spec):
    layer = make_layer(spec)
    x = make_input(spec, 2).requires_grad_()
    torch.library.opcheck(layer.op.opdef, op_args(layer, x))


@pytest.mark.parametrize("spec", example_specs())
def test_op_matches_reference_and_returns_contiguous_fresh_tensor(spec):
    layer = make_layer(spec)
    x = make_input(spec, 3)
    y = layer.op(x, layer.conv.weight, layer.conv.bias, layer.spec_params())
    ref = reference.forward(spec, x, layer.conv.weight, layer.conv.bias, layer.spec_params())
    torch.testing.assert_close(y, ref, rtol=0, atol=0)
    assert y.is_contiguous() and y.shape == spec.output_shape(3)
    # a channels-last input still gives the contiguous output the fake kernel promises
    if x.dim() in (4, 5):
        fmt = torch.channels_last if x.dim() == 4 else torch.channels_last_3d
        y2 = first_output(layer, layer.op.overload(*op_args(layer, x.contiguous(memory_format=fmt))))
        assert y2.is_contiguous()
        # PyTorch picks another conv algorithm for channels-last input: the project's fp32 bar
        # (deep layers such as 512 channels x 9 taps reorder sums past 1e-5)
        torch.testing.assert_close(y2, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("spec", example_specs())
def test_fake_output_shape_from_the_spec(spec):
    layer = make_layer(spec)
    with FakeTensorMode() as mode:
        x = mode.from_tensor(make_input(spec, 5))
        args = [mode.from_tensor(t) if i else x for i, t in enumerate(op_args(layer, make_input(spec, 5)))]
        y = first_output(layer, layer.op.overload(*args))
    assert tuple(y.shape) == spec.output_shape(5)
    assert y.dtype == torch.float32 and y.device == x.device
    meta = first_output(layer, layer.op.overload(*[t.to("meta") for t in op_args(layer, make_input(spec, 4))]))
    assert meta.device.type == "meta" and tuple(meta.shape) == spec.output_shape(4)


def test_op_checks_its_arguments():
    spec = shrink(load_specs(EXAMPLES / "kb90.yaml")[0])
    layer = make_layer(spec)
    x = make_input(spec, 2)
    with pytest.raises(ValueError, match=r"\[batch, 8, 6, 6, 6\].*\[2, 8, 6, 6\]"):
        layer.op.overload(*op_args(layer, x[:, :, 0]))
    with pytest.raises(ValueError, match="float32"):
        layer.op.overload(*op_args(layer, x.half()))
    with pytest.raises(ValueError, match="bias"):
        layer.op.arguments(x, layer.conv.weight, None, layer.spec_params())
    with pytest.raises(ValueError, match=r"sum_tensor of shape \[64, 1, 1, 1\], got \[64\]"):
        layer.op(x, layer.conv.weight, layer.conv.bias, {"sum_tensor": layer.sum_tensor.flatten()})
    with pytest.raises(ValueError, match=r"weight of shape \[64, 8, 3, 3, 3\]"):
        layer.op(x, layer.conv.weight[:, :4], layer.conv.bias, layer.spec_params())


# ---------------------------------------------------------------------------------------------
# The module through the op
# ---------------------------------------------------------------------------------------------


def test_forward_goes_through_the_op():
    spec = shrink(load_specs(EXAMPLES / "kb65.yaml")[0])
    layer = make_layer(spec)
    x = make_input(spec, 2)
    y = layer(x)
    assert type(y.grad_fn).__name__.startswith(f"GeneratedBackwardFor_specgen_{layer.op.name}")
    out = torch.full(spec.output_shape(2), float("nan"))
    assert layer(x, out=out) is out
    torch.testing.assert_close(out, y.detach(), rtol=0, atol=0)
    with pytest.raises(ValueError, match="out must be"):
        layer(x, out=torch.empty(3))
    with pytest.raises(TypeError, match="torch.Tensor"):
        layer(x.numpy())
    with pytest.raises(ValueError, match=r"expected an input of shape \[batch, 8"):
        layer(x[:, :4])


def test_deepcopy_keeps_the_op():
    spec = shrink(load_specs(EXAMPLES / "kb90.yaml")[0])
    layer = make_layer(spec)
    x = make_input(spec, 2)
    clone = copy.deepcopy(layer)
    assert clone.op is layer.op and clone._op is layer._op
    torch.testing.assert_close(clone(x), layer(x))


# ---------------------------------------------------------------------------------------------
# torch.compile (CPU backends in CI; inductor and CUDA graphs in test_torchop_gpu.py)
# ---------------------------------------------------------------------------------------------


class Wrapped(nn.Module):
    """A model that uses a FusedLayer between ordinary torch ops."""

    def __init__(self, spec):
        super().__init__()
        self.pre = nn.Conv2d(spec.input.channels, spec.input.channels, 1) if len(spec.input.size) == 2 else nn.Identity()
        self.fused = FusedLayer(spec)

    def forward(self, x):
        y = self.fused(self.pre(x) * 0.5)
        return torch.tanh(y) + 1.0


def compile_cases():
    """aot_eager (traces forward and backward, like inductor) for every example; eager for the seeds."""
    cases = [pytest.param(p.values[0], "aot_eager", id=f"aot_eager-{p.id}") for p in example_specs()]
    cases += [pytest.param(p.values[0], "eager", id=f"eager-{p.id}") for p in example_specs() if p.id.startswith("kb")]
    return cases


@pytest.mark.parametrize("spec,backend", compile_cases())
def test_compile_fullgraph_matches_eager(spec, backend):
    torch.manual_seed(0)
    model = Wrapped(spec)
    x = make_input(spec, 2)
    expect = model(x)
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    torch.testing.assert_close(compiled(x), expect, rtol=1e-6, atol=1e-6)
    # training through the compiled graph: the same gradients as eager
    x1 = x.clone().requires_grad_()
    x2 = x.clone().requires_grad_()
    model(x1).square().sum().backward()
    eager_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    compiled(x2).square().sum().backward()
    torch.testing.assert_close(x2.grad, x1.grad, rtol=1e-5, atol=1e-6)
    for p, g in zip(model.parameters(), eager_grads):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-6)


def test_compile_has_no_graph_break_and_handles_new_batch_sizes():
    spec = shrink(load_specs(EXAMPLES / "kb90.yaml")[0])
    model = Wrapped(spec)
    explanation = torch._dynamo.explain(model)(make_input(spec, 2))
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager", dynamic=True)
    for batch in (1, 3, 4):
        x = make_input(spec, batch, seed=batch)
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-6, atol=1e-6)


def test_compiled_graph_holds_the_op_as_one_node():
    spec = shrink(load_specs(EXAMPLES / "kb65.yaml")[0])
    layer = make_layer(spec)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(layer, fullgraph=True, backend=backend)(make_input(spec, 2))
    (gm,) = graphs
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(layer.op.overload) == 1
    assert all(t is layer.op.overload or "conv" not in str(t) for t in targets)


# ---------------------------------------------------------------------------------------------
# Precision
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "convert,dtype,precision",
    [
        (lambda m: m.half(), torch.float16, "fp16"),
        (lambda m: m.bfloat16(), torch.bfloat16, "bf16"),
        (lambda m: m.to(torch.float16), torch.float16, "fp16"),
        (lambda m: m.to(dtype=torch.bfloat16), torch.bfloat16, "bf16"),
        (lambda m: m.to("cpu", torch.half), torch.float16, "fp16"),
        (lambda m: m.type(torch.float16), torch.float16, "fp16"),
        (lambda m: nn.Sequential(m).half(), torch.float16, "fp16"),  # a parent's .half() reaches the layer through _apply
        (lambda m: nn.Sequential(nn.Identity(), m).to(torch.bfloat16), torch.bfloat16, "bf16"),
    ],
    ids=["half", "bfloat16", "to-fp16", "to-dtype-bf16", "to-cpu-half", "type-fp16", "parent-half", "parent-to-bf16"],
)
def test_lower_precision_conversion_changes_the_precision(convert, dtype, precision):
    """Converting a layer to a 16-bit dtype makes it a layer of that precision (a new specialization,
    its op takes that dtype); .float() brings the 32-bit precision back."""
    spec = shrink(load_specs(EXAMPLES / "kb90.yaml")[0])
    layer = make_layer(spec)
    convert(layer)
    assert layer.spec.precision == precision
    assert all(p.dtype == dtype for p in layer.parameters())
    x = make_input(spec, 1)
    want = make_layer(spec).to(dtype)(x.to(dtype))
    got = layer(x.to(dtype))
    assert got.dtype == dtype
    torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match="takes"):
        layer(x)  # a float32 input to a 16-bit layer
    layer.float()
    assert layer.spec.precision == spec.precision and layer.conv.weight.dtype == torch.float32
    ref = make_layer(spec)
    ref.load_state_dict(layer.state_dict())  # the weights kept their 16-bit rounding
    torch.testing.assert_close(layer(x), ref(x))


def test_a_16_bit_spec_makes_a_16_bit_layer():
    spec = shrink(load_specs(EXAMPLES / "kb65.yaml")[0]).model_copy(update={"precision": "bf16"})
    layer = FusedLayer(spec)
    assert all(p.dtype == torch.bfloat16 for p in layer.parameters())
    x = make_input(spec, 2).bfloat16()
    assert layer(x).dtype == torch.bfloat16
    layer.float()  # back to the accurate 32-bit precision
    assert layer.spec.precision == "fp32"


def test_lower_precision_input_is_a_clear_error():
    spec = shrink(load_specs(EXAMPLES / "kb65.yaml")[0])
    layer = make_layer(spec)
    for dtype in (torch.float16, torch.bfloat16):
        with pytest.raises(ValueError, match="float32"):
            layer(make_input(spec, 1).to(dtype))


def test_float32_and_float64_conversions_still_work():
    spec = shrink(load_specs(EXAMPLES / "kb65.yaml")[0])
    layer = make_layer(spec)
    x = make_input(spec, 2)
    y32 = layer(x)
    y64 = layer.double()(x.double())
    assert y64.dtype == torch.float64
    torch.testing.assert_close(y64.float(), y32, rtol=1e-4, atol=1e-4)
    assert layer.float().conv.weight.dtype == torch.float32
    assert layer.to("cpu").conv.weight.dtype == torch.float32


def test_a_spec_without_a_precision_runs_as_pytorch_would():
    """FusedLayer follows cuDNN's TF32 flag (read at construction) unless the spec or the caller says."""
    data = {"name": "p", "input": {"channels": 2, "size": [6, 6]}, "conv": {"out_channels": 4, "kernel": 3}}
    saved = torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cudnn.allow_tf32 = True
        assert FusedLayer(validate(data)).spec.precision == "tf32"
        assert FusedLayer(validate({**data, "precision": "fp32"})).spec.precision == "fp32"
        assert FusedLayer(validate(data), precision="fp32").spec.precision == "fp32"
        torch.backends.cudnn.allow_tf32 = False
        assert FusedLayer(validate(data)).spec.precision == "fp32"
        with pytest.raises(ValueError, match="precision: expected one of"):
            FusedLayer(validate(data), precision="fp64")
    finally:
        torch.backends.cudnn.allow_tf32 = saved
