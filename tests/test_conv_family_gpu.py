"""Transposed convolutions and batch norm on the GPU against float64 PyTorch (marker `gpu`).

Every check draws random inputs, weights and batch-norm statistics, poisons the output with NaN
first, and requires rel. L2 error <= 1e-5 against float64 and allclose(1e-4, 1e-4) against
PyTorch fp32 (TF32 off) computed by nn.ConvTranspose itself.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from specgen import reference  # noqa: E402
from specgen.module import FusedLayer  # noqa: E402
from specgen.spec import validate  # noqa: E402

from conv_family_specs import TRANSPOSED  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(autouse=True)
def _fp32_reference():
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    yield


def randomize(layer: torch.nn.Module, gen: torch.Generator) -> None:
    inits = layer.spec.param_inits()
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen, device=p.device) * (0.3 if p.dim() > 1 else 1.0))
        for name, b in layer.named_buffers():
            if name in inits and "var" in name:
                b.copy_(torch.rand(b.shape, generator=gen, device=b.device) + 0.5)
            elif name in inits:
                b.copy_(torch.randn(b.shape, generator=gen, device=b.device))


def torch_module(spec, layer: FusedLayer) -> torch.nn.Module:
    """nn.ConvTranspose with the layer's weights: PyTorch's own transposed conv, for the fp32 check."""
    conv = reference.make_conv(spec).cuda()
    with torch.no_grad():
        conv.weight.copy_(layer.conv.weight)
        if spec.conv.bias:
            conv.bias.copy_(layer.conv.bias)
    return conv


def compare(layer: FusedLayer, batch: int, seed: int) -> float:
    spec = layer.spec
    gen = torch.Generator(device="cuda").manual_seed(seed)
    randomize(layer, gen)
    x = torch.randn((batch, spec.input.channels, *spec.input.size), generator=gen, device="cuda")
    out = torch.full(spec.output_shape(batch), float("nan"), device="cuda")
    layer(x, out=out)
    torch.cuda.synchronize()
    params = layer.spec_params()
    ref64 = reference.forward64(spec, x, layer.conv.weight, layer.conv.bias, params)
    with torch.no_grad():  # nn.ConvTranspose itself gives the conv's output shape
        assert tuple(torch_module(spec, layer)(x).shape[1:]) == tuple(spec.shapes()[0].sizes)
    ref32 = reference.forward(spec, x, layer.conv.weight, layer.conv.bias, params).detach()  # F.conv_transpose
    assert torch.isfinite(out).all(), f"{spec.name}: unwritten (NaN) or non-finite outputs"
    rel = ((out.double() - ref64).norm() / ref64.norm().clamp_min(1e-30)).item()
    assert rel <= 1e-5, f"{spec.name}: rel L2 {rel:.3e} > 1e-5 at batch {batch}"
    assert torch.allclose(out, ref32, atol=1e-4, rtol=1e-4), f"{spec.name}: not allclose to PyTorch fp32"
    return rel


@pytest.mark.parametrize("name", list(TRANSPOSED))
@pytest.mark.parametrize("batch", [1, 3])
def test_transposed_layers_match_float64(name, batch):
    layer = FusedLayer(validate({"name": name, **TRANSPOSED[name]})).cuda()
    assert layer.specialize().plan["mma"] is None
    compare(layer, batch, seed=batch)


def test_conv_transpose_itself_matches_the_reference():
    """The fp32 reference path is PyTorch's nn.ConvTranspose (a plain layer, no stages)."""
    spec = validate({"name": "plain_t", "input": {"channels": 4, "size": [6, 7]},
                     "conv": {"out_channels": 6, "kernel": 3, "stride": 2, "padding": 1, "output_padding": 1,
                              "groups": 2, "transposed": True}, "epilogue": ["relu"]})
    layer = FusedLayer(spec).cuda()
    gen = torch.Generator(device="cuda").manual_seed(0)
    randomize(layer, gen)
    x = torch.randn((2, 4, 6, 7), generator=gen, device="cuda")
    out = torch.full(spec.output_shape(2), float("nan"), device="cuda")
    layer(x, out=out)
    with torch.no_grad():
        want = torch.relu(torch_module(spec, layer).double()(x.double()))
    rel = ((out.double() - want).norm() / want.norm()).item()
    assert rel <= 1e-5, rel


def test_imported_transposed_conv_batch_norm_pools_match_the_model():
    """KernelBench level 2 no. 72 at a small size: ConvTranspose3d -> BatchNorm3d -> two AvgPool3d."""
    import torch.nn as nn

    import specgen

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv_transpose = nn.ConvTranspose3d(3, 16, 3, stride=2, padding=1)
            self.batch_norm = nn.BatchNorm3d(16)
            self.avg_pool1 = nn.AvgPool3d(kernel_size=2)
            self.avg_pool2 = nn.AvgPool3d(kernel_size=2)

        def forward(self, x):
            return self.avg_pool2(self.avg_pool1(self.batch_norm(self.conv_transpose(x))))

    torch.manual_seed(0)
    model = Model().cuda().eval()
    with torch.no_grad():
        model.batch_norm.running_mean.normal_()
        model.batch_norm.running_var.uniform_(0.5, 1.5)
        model.batch_norm.weight.normal_()
        model.batch_norm.bias.normal_()
    x = torch.rand(4, 3, 8, 9, 10, device="cuda")
    fused = specgen.from_module(model, x)
    assert len(fused.specgen_report.specs) == 1 and not fused.specgen_report.fallbacks
    with torch.no_grad():
        got = fused(x)
        want = model.double()(x.double())
    rel = ((got.double() - want).norm() / want.norm()).item()
    assert rel <= 1e-5, rel


def _kernelbench_fused():
    import kernelbench_problems as kb

    return [pytest.param(p, id=p.stem) for p in kb.problems() if p.stem in kb.FUSED]


@pytest.mark.parametrize("path", _kernelbench_fused())
def test_kernelbench_problems_fused_whole_match_float64(path):
    """Each public problem that imports into one spec, fused, against the model in float64
    (batch 1 at the problem's own sizes; batch-norm statistics drawn at random)."""
    import kernelbench_problems as kb

    import specgen

    model, inputs = kb.load(path)
    model = model.cuda()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                m.running_mean.normal_()
                m.running_var.uniform_(0.5, 1.5)
                m.weight.normal_()
                m.bias.normal_()
    inputs = [t.cuda() if isinstance(t, torch.Tensor) else t for t in inputs]
    fused = specgen.from_module(model, *inputs)
    assert len(fused.specgen_report.specs) == 1 and not fused.specgen_report.fallbacks
    with torch.no_grad():
        got = fused(*inputs)
        torch.cuda.synchronize()
        want = model.double()(*[t.double() if isinstance(t, torch.Tensor) else t for t in inputs])
    assert torch.isfinite(got).all()
    rel = ((got.double() - want).norm() / want.norm().clamp_min(1e-30)).item()
    assert rel <= 1e-5, f"{path.stem}: rel L2 {rel:.3e}"
