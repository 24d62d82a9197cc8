"""from_module on the GPU: every module of the import suite runs its fused parts as specgen kernels
and matches the original PyTorch model (rel. L2 <= 1e-5 against float64, allclose against fp32)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import import_models as im  # noqa: E402
from specgen.importer import from_module  # noqa: E402
from specgen.module import FusedLayer  # noqa: E402

from gpu_helpers import assert_fp32  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.usefixtures("fp32_reference"),
    pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel lengths"),
]


@pytest.mark.parametrize("case", im.CASES, ids=lambda c: c.id)
def test_from_module_on_cuda_matches_the_original(case):
    torch.manual_seed(0)
    model = case.make().cuda().eval()
    x = torch.randn(case.shape, device="cuda")
    fused = from_module(model, x, keep_slower=True)  # every chain as its kernel: this checks the kernels
    layers = [m for m in fused.modules() if isinstance(m, FusedLayer)]
    assert layers and all(layer.key for layer in layers), "the fused parts were not specialized"
    _matches(case.id, fused, model, x)


def _matches(name: str, fused, model, x) -> None:
    """The fused model's output against the original's in fp32 and float64 (the fp32 bar)."""
    with torch.no_grad():
        got = fused(x)
        want32 = model(x)
        want64 = model.double()(x.double())
        model.float()
    assert_fp32(name, got, want64, want32)


def test_an_untraceable_models_children_run_their_kernels():
    torch.manual_seed(0)
    model = im._bn(im.ControlFlowOnValues)().cuda().eval()
    x = torch.randn(im.IMG, device="cuda")
    fused = from_module(model, x, keep_slower=True)
    layers = [m for m in fused.modules() if isinstance(m, FusedLayer)]
    assert len(layers) == 3 and all(layer.key for layer in layers)
    _matches("ControlFlowOnValues", fused, model, x)


def test_a_convnext_blocks_fused_output_is_read_channels_last():
    """The depthwise conv and the LayerNorm over the channels run as one fused layer whose output the
    Linear layers read permuted channels-last (`_Chain.out_perm`)."""
    torch.manual_seed(0)
    model = im.ConvNeXtBlock().cuda().eval()
    x = torch.randn(im.IMG, device="cuda")
    fused = from_module(model, x, keep_slower=True)
    layers = [m for m in fused.modules() if isinstance(m, FusedLayer)]
    assert len(layers) == 1 and layers[0].key
    _matches("ConvNeXtBlock", fused, model, x)


@pytest.mark.parametrize("make, shape, linears", [(im.ConvNeXtMLP, (2, 32, 8, 8), ("_pw1", "_pw2")),
                                                  (im.TransformerMLP, im.TOKENS, ("_fc1", "_fc2"))],
                         ids=["channels-last", "tokens"])
def test_linear_chains_train_on_cuda_as_the_original(make, shape, linears):
    """ConvNeXt's MLP and a transformer's over tokens as 1x1 conv chains (fp32 mode) in training
    mode: the gradients reach each Linear's own [C_out, C_in] weight through the op's view of it
    (`FusedLayer._flat_weight`), the layer scale's along the channels and the residual's through
    its permuted read, as PyTorch's."""
    torch.manual_seed(0)
    model = make().cuda().train()
    x = torch.randn(shape, device="cuda", requires_grad=True)
    fused = from_module(model, x.detach(), keep_slower=True)
    names = [m.spec.name for m in fused.modules() if isinstance(m, FusedLayer)]
    assert sum(n.endswith(linears) for n in names) == 2, names
    model(x).sin().sum().backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    expected["input"], x.grad = x.grad.clone(), None
    model.zero_grad()
    fused(x).sin().sum().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-4, atol=1e-4, msg=name)
    torch.testing.assert_close(x.grad, expected["input"], rtol=1e-4, atol=1e-4, msg="input")


def test_an_input_of_other_sizes_runs_kernels_specialized_for_them():
    """A model fused at one image size, called at another: each fused layer specializes a sibling
    kernel for the new sizes (sharing the layer's parameters) and matches the original to the fp32 bar."""
    torch.manual_seed(0)
    model = im._bn(im.ReluForms)().cuda().eval()
    x = torch.randn(im.IMG, device="cuda")
    fused = from_module(model, x, keep_slower=True)
    layers = [m for m in fused.modules() if isinstance(m, FusedLayer)]
    bigger = torch.randn(x.shape[0], x.shape[1], x.shape[2] + 8, x.shape[3] + 4, device="cuda")
    _matches("ReluForms at other sizes", fused, model, bigger)
    siblings = [s for layer in layers for s in layer._at_sizes.values()]
    assert siblings and all(s.key and s.key != layer.key for layer in layers for s in layer._at_sizes.values())
    _matches("ReluForms at its own size", fused, model, x)  # (the original layers still run their own kernels)
