"""tf32 layers of few input channels compute to fp32 accuracy (`plan.exact_tf32`), as cuDNN
computes such convs in TF32 mode: on the GPU their error against float64 stays at the fp32 bar
(rel. L2 <= 1e-5, allclose to PyTorch fp32), where TF32 operands would give about 3e-4. Marker
`gpu`; skipped without CUDA. Outputs poisoned with NaN, inputs fresh per check."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from specgen import reference  # noqa: E402
from specgen.module import FusedLayer  # noqa: E402
from specgen.plan import exact_tf32  # noqa: E402
from specgen.spec import validate  # noqa: E402

from gpu_helpers import assert_fp32, rel_l2, run, tf32_allowed  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fp32_reference")]

CASES = {
    # name: (input channels, size, conv, epilogue, tile)
    "kb90_like_3d": (8, [6, 10, 12], {"out_channels": 64, "kernel": 3},
                     [{"leaky_relu": {"negative_slope": 0.2}}, {"add": {"param": "b"}}, {"clamp": {"min": -1.0, "max": 1.0}}, "gelu"], None),
    "cin3_2d": (3, [34, 30], {"out_channels": 16, "kernel": 3, "padding": 1}, ["relu"], None),
    "cin8_2d_wide": (8, [20, 24], {"out_channels": 64, "kernel": 3}, [{"mul": 0.5}, "tanh"], None),
    "cin3_softmax_3d": (3, [6, 8, 8], {"out_channels": 16, "kernel": 3}, [{"softmax": 1}, {"amax": {"dims": [1]}}], None),
    "cin3_k4_3d_cout16": (3, [7, 9, 9], {"out_channels": 16, "kernel": 4}, ["relu"], None),
    "cin8_on_tma": (8, [18, 18], {"out_channels": 64, "kernel": 3, "padding": 1}, ["relu"], {"engine": "tma"}),
    "kb90_like_3d_wgmma": (8, [6, 10, 12], {"out_channels": 64, "kernel": 3}, ["relu"], {"wgmma": True}),
    "cin3_stride2_wgmma": (3, [33, 35], {"out_channels": 64, "kernel": 3, "stride": 2, "padding": 1}, ["relu"], {"wgmma": True}),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("batch", [1, 3])
def test_tf32_layers_of_few_channels_meet_the_fp32_bar(name, batch):
    if torch.cuda.get_device_capability() != (9, 0) and CASES[name][4]:
        pytest.skip("the TMA engine and wgmma need an sm_90 GPU")
    cin, size, conv, epilogue, tile = CASES[name]
    data = {"name": f"exact_{name}", "input": {"channels": cin, "size": size}, "conv": conv,
            "epilogue": epilogue, "precision": "tf32", **({"tile": tile} if tile else {})}
    spec = validate(data)
    assert exact_tf32(spec)
    layer = FusedLayer(spec).cuda()
    assert layer.specialize().plan["precision"] == "fp32"
    x, out = run(layer, batch, seed=100 + batch)
    params = layer.spec_params()
    with torch.no_grad():
        ref64 = reference.forward64(spec, x, layer.conv.weight, layer.conv.bias, params)
        with tf32_allowed(False):
            ref32 = reference.forward(spec, x, layer.conv.weight, layer.conv.bias, params)
    assert_fp32(f"{name} (tf32) at batch {batch}", out, ref64, ref32)


@pytest.mark.parametrize("wgmma", [False, True])
def test_exact_sums_are_as_accurate_as_pytorchs_fp32_conv(wgmma):
    """Each k-step's products summed apart (on mma.sync, or on wgmma into two register sets) keeps a
    tf32 layer of few channels within 2x of PyTorch's own fp32 error, where one running sum of 3xTF32
    products, truncated at each add, lands several times above it (kb90: 7.9e-7 against 9.1e-8)."""
    if wgmma and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("wgmma runs on sm_90a (H100 / H200) only")
    data = {"name": "exact_sums", "input": {"channels": 8, "size": [8, 20, 24]}, "precision": "tf32",
            "conv": {"out_channels": 64, "kernel": 3}, "epilogue": [], "tile": {"wgmma": wgmma}}
    spec = validate(data)
    layer = FusedLayer(spec).cuda()
    plan = layer.specialize().plan
    assert plan["settings"].exact_sums and plan["mma"].wgmma == wgmma
    x, out = run(layer, 2, seed=7)
    with torch.no_grad():
        ref64 = reference.forward64(spec, x, layer.conv.weight, layer.conv.bias, {})
        with tf32_allowed(False):
            ref32 = reference.forward(spec, x, layer.conv.weight, layer.conv.bias, {})
    rel, torch_rel = rel_l2(out, ref64), rel_l2(ref32, ref64)
    assert rel <= 2 * torch_rel, f"rel L2 {rel:.2e} against float64, PyTorch fp32's {torch_rel:.2e}"
