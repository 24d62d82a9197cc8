"""Autograd with the fused kernel in the forward (marker `gpu`; skipped without CUDA): gradients
and a short training run against the plain PyTorch model."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

from specgen import reference  # noqa: E402
from specgen.module import FusedLayer  # noqa: E402
from specgen.spec import validate  # noqa: E402

from gpu_helpers import rel_l2  # noqa: E402
from test_autograd import GRAD_SPECS, SaveCounter  # noqa: E402
from test_torchop import example_specs  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fp32_reference")]


@pytest.fixture(autouse=True)
def _deterministic_backward():
    # Deterministic backward algorithms (fp32 comes from the fp32_reference fixture): both sides'
    # backward runs cuDNN, whose nondeterministic (atomic) algorithms differ by more than 1e-5
    # where gradients cancel.
    torch.backends.cudnn.deterministic = True
    yield
    torch.backends.cudnn.deterministic = False


def all_specs():
    return [pytest.param(validate(d), id=d["name"]) for d in GRAD_SPECS] + example_specs(start=16)


def pair(spec, seed: int):
    """A FusedLayer and the plain PyTorch model with the same random parameters, on the GPU."""
    gen = torch.Generator().manual_seed(seed)
    fused = FusedLayer(spec)
    with torch.no_grad():
        for name, p in fused.named_parameters():
            value = torch.randn(p.shape, generator=gen)
            if p.dim() > 1 and not name.startswith("conv."):
                value = value.sign() * (0.5 + value.abs())  # some parameters divide
            p.copy_(value * (0.3 if name == "conv.weight" else 1.0))
    plain = reference.Reference(spec)
    plain.load_state_dict(fused.state_dict())
    return fused.cuda(), plain.cuda()


def cuda_input(spec, batch: int, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn((batch, spec.input.channels, *spec.input.size), generator=gen, device="cuda")


rel = rel_l2


@pytest.mark.parametrize("spec", all_specs())
def test_gradients_match_the_reference(spec):
    fused, plain = pair(spec, seed=3)
    x1 = cuda_input(spec, 3, seed=4).requires_grad_()
    x2 = x1.detach().clone().requires_grad_()
    g = torch.randn(spec.output_shape(3), generator=torch.Generator(device="cuda").manual_seed(5), device="cuda")
    # a loss that depends non-linearly on the forward: the kernel's output feeds the backward
    (torch.tanh(fused(x1)) * g).sum().backward()
    (torch.tanh(plain(x2)) * g).sum().backward()
    # The float64 gradients are the truth. tanh' turns forward rounding differences of two fp32
    # implementations into gradient differences (seen: 1.3e-4 between specgen and PyTorch on
    # conv2d_lse_channels_relu), so specgen must be within 1e-5 of PyTorch fp32, or at least as
    # close to float64 as PyTorch fp32 is (with a factor 2 of slack).
    plain64 = copy.deepcopy(plain).double()
    x3 = x1.detach().double().requires_grad_()
    (torch.tanh(plain64(x3)) * g.double()).sum().backward()
    grads = [("input", x1.grad, x2.grad, x3.grad)]
    fused_params, params64 = dict(fused.named_parameters()), dict(plain64.named_parameters())
    for name, p in plain.named_parameters():
        assert fused_params[name].grad is not None, f"no gradient for {name}"
        grads.append((name, fused_params[name].grad, p.grad, params64[name].grad))
    for name, got, fp32, exact in grads:
        bar = max(1e-5, 2 * rel(fp32, exact))
        assert rel(got, fp32) <= 1e-5 or rel(got, exact) <= bar, (
            f"gradient of {name}: rel {rel(got, fp32):.2e} to PyTorch fp32, {rel(got, exact):.2e} to float64 "
            f"(PyTorch fp32: {rel(fp32, exact):.2e})"
        )


@pytest.mark.parametrize("spec", all_specs()[:8])
def test_training_matches_the_plain_model(spec):
    fused, plain = pair(spec, seed=7)
    x = cuda_input(spec, 4, seed=8)
    target = torch.randn(spec.output_shape(4), generator=torch.Generator(device="cuda").manual_seed(9), device="cuda")
    losses = {}
    for label, model in (("fused", fused), ("plain", plain)):
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        losses[label] = []
        for _ in range(5):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), target)
            loss.backward()
            opt.step()
            losses[label].append(loss.item())
    assert losses["fused"] == pytest.approx(losses["plain"], rel=1e-4, abs=1e-6)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_nothing_saved_for_backward_in_inference(mode):
    spec = validate(GRAD_SPECS[0])
    fused, _ = pair(spec, seed=1)
    x = cuda_input(spec, 2, seed=2).requires_grad_()
    context = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
    with SaveCounter() as saved, context:
        y = fused(x)
    assert saved.count == 0 and y.grad_fn is None


@pytest.mark.parametrize("spec", all_specs()[:6])
def test_eager_calls_record_the_ops_own_formula(spec):
    """An eager forward with autograd on skips the custom op's dispatch (specgen.torchop._Eager):
    its output and gradients are bit for bit those of a call of the op itself."""
    fused, _ = pair(spec, seed=11)
    x = cuda_input(spec, 2, seed=12)
    g = torch.randn(spec.output_shape(2), generator=torch.Generator(device="cuda").manual_seed(13), device="cuda")
    results = []
    for call in ("layer", "op"):
        xi = x.clone().requires_grad_()
        fused.zero_grad()
        y = fused(xi) if call == "layer" else fused._op(xi, *fused._op_tensors())
        assert ("_Eager" in type(y.grad_fn).__name__) == (call == "layer"), type(y.grad_fn).__name__
        (y * g).sum().backward()
        results.append([y.detach(), xi.grad, *(p.grad for p in fused.parameters())])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_eval_twin_records_gradients_eagerly():
    """A layer with a training-mode batch norm, in eval mode with autograd on: its eval twin's kernel,
    differentiable, against the plain model in eval mode."""
    spec = validate({"name": "bn_twin", "input": {"channels": 3, "size": [10, 12]}, "conv": {"out_channels": 8, "kernel": 3},
                     "epilogue": [{"batch_norm": {"training": True}}, "relu"]})
    fused, plain = pair(spec, seed=21)
    fused.eval(), plain.eval()
    x1 = cuda_input(spec, 3, seed=22).requires_grad_()
    x2 = x1.detach().clone().requires_grad_()
    y1, y2 = fused(x1), plain(x2)
    assert y1.grad_fn is not None and "_Eager" in type(y1.grad_fn).__name__
    assert rel(y1, y2) <= 1e-5
    y1.sum().backward(), y2.sum().backward()
    assert rel(x1.grad, x2.grad) <= 1e-5
    assert rel(fused.conv.weight.grad, plain.conv.weight.grad) <= 1e-5


def test_imported_batch_norm_gradients_reach_the_models_own_tensors():
    """An imported conv + batch norm + ReLU in eval mode with autograd on: the kernel reads the
    model's 1-D batch-norm tensors as they are and the backward views them in the spec's shapes,
    so each gradient lands on the model's parameter in its own shape, equal to PyTorch's."""
    from specgen.importer import from_module

    torch.manual_seed(31)
    model = torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU())
    with torch.no_grad():
        model[1].running_mean.uniform_(-0.5, 0.5)
        model[1].running_var.uniform_(0.5, 2.0)
        model[1].weight.uniform_(0.5, 1.5)
        model[1].bias.uniform_(-0.5, 0.5)
    model = model.cuda().eval()
    plain = copy.deepcopy(model)
    x = torch.randn(2, 4, 12, 12, device="cuda")
    fused = from_module(model, x, keep_slower=True)
    assert len(fused.specgen_report.specs) == 1
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    g = torch.randn(2, 8, 12, 12, device="cuda")
    (fused(x1) * g).sum().backward()
    (plain(x2) * g).sum().backward()
    assert rel(x1.grad, x2.grad) <= 1e-5
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert p.grad is not None and p.grad.shape == q.grad.shape, name
        assert rel(p.grad, q.grad) <= 1e-5, name
