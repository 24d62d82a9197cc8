"""The specgen op on the GPU (marker `gpu`; skipped without CUDA): opcheck with the kernel,
torch.compile with inductor, CUDA graph capture and replay, mode="reduce-overhead"."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import torch.nn as nn  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

from specgen import reference, runtime  # noqa: E402
from specgen.ops import NORMS  # noqa: E402
from specgen.module import FusedLayer  # noqa: E402
from specgen.spec import load_specs  # noqa: E402

from gpu_helpers import allocated_by, captured  # noqa: E402
from test_torchop import EXAMPLES, example_specs as _example_specs, first_output, shrink  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fp32_reference")]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def cuda_layer(spec, seed: int = 0) -> FusedLayer:
    torch.manual_seed(seed)
    layer = FusedLayer(spec).cuda()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, device="cuda") * (0.3 if p.dim() > 1 else 1.0))
    return layer


def cuda_input(spec, batch: int, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn((batch, spec.input.channels, *spec.input.size), generator=gen, device="cuda")


def ref(layer: FusedLayer, x: torch.Tensor) -> torch.Tensor:
    return reference.forward(layer.spec, x, layer.conv.weight, layer.conv.bias, layer.spec_params()).detach()


def kb(name: str):
    return shrink(load_specs(EXAMPLES / f"{name}.yaml")[0], start=16)


def example_specs():
    return _example_specs(start=16)


@pytest.mark.parametrize("spec", example_specs())
def test_opcheck_with_the_kernel(spec):
    layer = cuda_layer(spec)
    assert layer.key is not None and layer.op.name == f"{spec.name}_{layer.key[:12]}"
    x = cuda_input(spec, 2).requires_grad_()
    args = layer.op.arguments(x, layer.conv.weight, layer.conv.bias, layer.spec_params())
    # Gradients through statistics sum over many values: eager's kernels (cuDNN's batch norm, the
    # norms') and the decompositions AOTAutograd traces round differently (measured 1.05e-4 on one
    # element of 64 through batch statistics; 1.2e-4 on a conv bias ahead of a layer norm over W,
    # whose exact gradient is 0, so that only rounding is left)
    stats = any((st.op == "batch_norm" and getattr(st.args, "training", False)) or st.op in NORMS for st in spec.epilogue)
    tol = 1e-3 if stats else 1e-4
    torch.library.opcheck(layer.op.opdef, args, atol=tol, rtol=tol)


@pytest.mark.parametrize("spec", example_specs())
def test_kernel_through_the_op_matches_reference(spec):
    layer = cuda_layer(spec)
    x = cuda_input(spec, 3)
    y = layer(x)
    assert y.is_cuda and y.dtype == torch.float32 and y.is_contiguous() and tuple(y.shape) == spec.output_shape(3)
    torch.testing.assert_close(y.detach(), ref(layer, x), atol=1e-4, rtol=1e-4)
    with FakeTensorMode() as mode:
        fake = first_output(layer, layer.op.overload(
            *[mode.from_tensor(t) for t in layer.op.arguments(x, layer.conv.weight, layer.conv.bias, layer.spec_params())]
        ))
    assert fake.device == x.device and fake.dtype == torch.float32 and tuple(fake.shape) == spec.output_shape(3)


class Wrapped(nn.Module):
    def __init__(self, spec):
        super().__init__()
        self.fused = FusedLayer(spec)

    def forward(self, x):
        return torch.sigmoid(self.fused(x * 0.5)) * 2.0


@pytest.mark.parametrize("spec", example_specs())
def test_inductor_fullgraph_matches_eager(spec):
    torch.manual_seed(0)
    model = Wrapped(spec).cuda()
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        for batch in (2, 3):
            x = cuda_input(spec, batch, seed=batch)
            torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["kb90", "kb65"])
def test_inductor_training_step_matches_eager(name):
    spec = kb(name)
    torch.manual_seed(0)
    model = Wrapped(spec).cuda()
    compiled = torch.compile(model, fullgraph=True)
    x = cuda_input(spec, 2)
    model(x).square().sum().backward()
    eager = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    compiled(x).square().sum().backward()
    for (pname, p), g in zip(model.named_parameters(), eager):
        torch.testing.assert_close(p.grad, g, atol=1e-4, rtol=1e-4, msg=f"gradient of {pname}")


def test_compiled_at_construction_loaded_at_cuda_then_first_call_captured():
    """No nvcc and no module load inside a capture: a fresh layer's very first forward is captured."""
    spec = kb("kb90")
    layer = FusedLayer(spec)
    assert layer.key is not None, "the kernel must be compiled when the layer is built"
    layer = layer.cuda()
    assert (layer.key, torch.cuda.current_device()) in runtime._loaded, "the kernel must be loaded at .cuda()"
    static_x = cuda_input(spec, 4)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        static_out = layer(static_x)
    for seed in range(3):
        static_x.copy_(cuda_input(spec, 4, seed=10 + seed))
        static_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(static_out, ref(layer, static_x), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["kb90", "kb65"])
def test_capture_and_replay_through_the_op_with_autograd_enabled(name):
    spec = kb(name)
    layer = cuda_layer(spec)
    static_x = cuda_input(spec, 3)
    graph, static_out = captured(layer, static_x)  # parameters require grad: the layer records its autograd node
    for seed in range(3):
        static_x.copy_(cuda_input(spec, 3, seed=20 + seed))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(static_out.detach(), ref(layer, static_x), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["kb90", "kb65"])
def test_reduce_overhead_mode(name):
    spec = kb(name)
    torch.manual_seed(0)
    model = Wrapped(spec).cuda()
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        for step in range(5):  # warm-up runs, then recording, then replays
            x = cuda_input(spec, 4, seed=30 + step)
            out = compiled(x).clone()
            torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-5)


def test_reduce_overhead_training():
    spec = kb("kb90")
    torch.manual_seed(0)
    model = Wrapped(spec).cuda()
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    for step in range(4):
        x = cuda_input(spec, 2, seed=40 + step)
        torch.compiler.cudagraph_mark_step_begin()
        model.zero_grad()
        compiled(x).square().sum().backward()
        got = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        model(x).square().sum().backward()
        for p, g in zip(model.parameters(), got):
            torch.testing.assert_close(g, p.grad, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["kb65", "kb90"])
def test_lower_precision_conversion_on_cuda_runs_in_that_dtype(name):
    """A 16-bit conversion makes a layer of that precision: on engines without a 16-bit path its
    arithmetic stays fp32 and the output is rounded once; the bar is PyTorch's own error in that dtype."""
    from gpu_helpers import compare

    spec = kb(name)
    for convert, dtype, precision in ((lambda m: m.half(), torch.float16, "fp16"), (lambda m: m.bfloat16(), torch.bfloat16, "bf16"),
                                      (lambda m: nn.Sequential(m).to(torch.float16), torch.float16, "fp16")):
        layer = cuda_layer(spec)
        convert(layer)
        assert layer.spec.precision == precision and layer.conv.weight.dtype == dtype
        compare(layer, 2, seed=1)
        with pytest.raises(ValueError, match="expected a"):
            layer(cuda_input(spec, 1))  # a float32 input to a 16-bit layer


def test_inference_forward_allocates_only_the_output():
    spec = kb("kb90")
    layer = cuda_layer(spec)
    x = cuda_input(spec, 16)
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            layer(x)
            out, extra = allocated_by(lambda: layer(x))
        assert out.grad_fn is None
        assert extra <= out.numel() * 4 + 512, f"{mode.__name__}: forward allocated {extra} bytes"
