"""Memory formats on the GPU (marker `gpu`; skipped without CUDA, the TMA cases without an sm_90
GPU): a channels-last input gives a channels-last output where the layer has a kernel that keeps
the format (as PyTorch's conv does), the values at the mode's bar against float64 whichever
kernel runs; a caller's `out` in either format is filled; torch.compile sees the strides the
kernel writes; a channels-last model imported whole keeps its format."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from specgen import FusedLayer, from_module  # noqa: E402
from specgen.spec import validate  # noqa: E402

from gpu_helpers import as_channels_last, poisoned, random_input, randomize, rel_l2  # noqa: E402
from gpu_helpers import compare as check  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fp32_reference")]

CL = {4: torch.channels_last, 5: torch.channels_last_3d}


def _hopper():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the TMA engine needs an sm_90 GPU")


def _layer(name, cin, size, conv, epilogue, precision, engine=None) -> FusedLayer:
    data = {"name": f"mf_{name}_{precision}", "input": {"channels": cin, "size": size}, "conv": conv,
            "epilogue": epilogue, "precision": precision}
    if engine:
        data["tile"] = {"engine": engine}
    return FusedLayer(validate(data)).cuda()


# name -> (input channels, size, conv, epilogue): layers whose channels-last kernel is the TMA engine's
KEEPS_FORMAT = {
    "3x3": (64, [14, 15], {"out_channels": 64, "kernel": 3, "padding": 1}, ["relu"]),
    "s2_256": (128, [15, 17], {"out_channels": 256, "kernel": 3, "stride": 2, "padding": 1}, ["relu"]),
    "1x1_thin": (256, [9, 11], {"out_channels": 64, "kernel": 1}, ["relu"]),  # contiguous plan: the implicit GEMM
    "deep_7x7": (512, [7, 7], {"out_channels": 512, "kernel": 3, "padding": 1}, ["relu"]),  # split K at small batches
    "conv3d": (16, [6, 9, 10], {"out_channels": 32, "kernel": 3, "padding": 1}, ["relu", {"mul": 0.5}]),
    "transposed_pairs": (32, [7, 9], {"out_channels": 24, "kernel": 4, "stride": 2, "padding": 1, "transposed": True},
                         ["relu"]),
    "softmax": (32, [9, 10], {"out_channels": 64, "kernel": 3, "padding": 1}, [{"softmax": 1}, "tanh"]),
    "residual": (64, [10, 12], {"out_channels": 64, "kernel": 3, "padding": 1, "bias": False},
                 ["batch_norm", {"add": {"input": "shortcut"}}, "relu"]),
}
# (fp32 mode's 1x1_thin stays on the implicit GEMM: `test_a_layer_without_a_channels_last_kernel_...`)
PARAMS = [pytest.param(n, p, id=f"{n}-{p}") for n in sorted(KEEPS_FORMAT) for p in ("fp32", "tf32", "bf16")
          if (n, p) != ("1x1_thin", "fp32")]


@pytest.mark.parametrize("name, precision", PARAMS)
def test_a_channels_last_input_gives_a_channels_last_output(name, precision):
    _hopper()
    layer = _layer(name, *KEEPS_FORMAT[name], precision)
    check(layer, 3, seed=1, channels_last=True)  # into a poisoned channels-last out=, against float64
    check(layer, 1, seed=2, channels_last=True)
    gen = torch.Generator(device="cuda").manual_seed(5)
    randomize(layer, gen)
    x = random_input(layer.spec, 2, gen)
    extras = [torch.randn(layer.spec.output_shape(2), generator=gen, device="cuda").to(x.dtype) for _ in layer.spec.inputs()]
    with torch.no_grad():
        y = layer(as_channels_last(x), *map(as_channels_last, extras))
        y_contiguous = layer(x, *extras)
        # extra inputs in the other format: copied into the output's, the same values
        y_mixed = layer(as_channels_last(x), *extras)
    fmt = CL[y.dim()]
    assert y.is_contiguous(memory_format=fmt) and not y.is_contiguous()
    assert y_contiguous.is_contiguous()
    assert layer.specialize().plan["engine"] in ("tma", "igemm")
    torch.testing.assert_close(y_mixed, y, rtol=0, atol=0)
    # the two kernels differ in where they read and write (and in tf32 mode, where the operands are
    # rounded): the same sums otherwise, compared at a bound below every mode's bar
    assert rel_l2(y, y_contiguous) <= (1e-6 if precision == "fp32" else 1e-3)


def test_a_contiguous_out_takes_the_contiguous_kernel_and_a_channels_last_one_the_other():
    _hopper()
    layer = _layer("outs", *KEEPS_FORMAT["3x3"], "tf32")
    x = as_channels_last(torch.randn((2, 64, 14, 15), device="cuda"))
    with torch.no_grad():
        want = layer(x)
        into_contiguous = poisoned(want.shape)
        into_cl = as_channels_last(poisoned(want.shape))
        layer(x, out=into_contiguous)
        layer(x, out=into_cl)
    torch.testing.assert_close(into_cl, want, rtol=0, atol=0)
    assert rel_l2(into_contiguous, want) <= 1e-6


def test_a_layer_without_a_channels_last_kernel_fills_a_channels_last_out():
    """fp32 mode's 1x1 conv of 64 -> 32 channels runs on the implicit GEMM for either format (the TMA
    engine would copy its operands into two planes anyway): its output is NC(D)HW, and a
    channels-last `out` is filled by a copy."""
    layer = _layer("igemm_only", 64, [9, 11], {"out_channels": 32, "kernel": 1}, ["relu"], "fp32")
    check(layer, 3, seed=1, channels_last=True)
    with torch.no_grad():
        y = layer(as_channels_last(torch.randn((2, 64, 9, 11), device="cuda")))
    assert y.is_contiguous()


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16", "fp16"])
@pytest.mark.parametrize("name, cin, size, conv", [
    ("depthwise", 144, [14, 15], {"out_channels": 144, "kernel": 3, "padding": 1, "groups": 144}),  # FFMA
    ("few_channels", 8, [12, 13], {"out_channels": 16, "kernel": 3}),  # FFMA (16-bit: the TMA engine)
    ("depthwise_3d", 24, [5, 6, 7], {"out_channels": 24, "kernel": 3, "padding": 1, "groups": 24}),
    ("odd_1d", 37, [70], {"out_channels": 40, "kernel": 3, "padding": 1}),  # implicit GEMM; a [N][L][C] input, 37 channels
])
def test_engines_that_read_nchw_lay_a_channels_last_input_out_themselves(name, cin, size, conv, precision):
    """`<kernel>_from_cl`: the module's own tiled layout pass (widening a 16-bit input), then the
    NC(D)HW kernel; the output NC(D)HW. Checked at the mode's bar, batch 1 and odd."""
    layer = _layer(name, cin, size, conv, [{"hardtanh": {"min_val": 0.0, "max_val": 6.0}}], precision)
    assert precision != "fp32" or layer.specialize().plan["engine"] in ("ffma", "igemm")
    check(layer, 1, seed=1, channels_last=True)
    check(layer, 3, seed=2, channels_last=True)


def test_torch_compile_sees_the_strides_the_kernel_writes():
    """The op's fake kernel gives the output's memory format from the same choice as the launch, so
    a compiled graph that reads the output (here: an add and a permute) reads it where it lies."""
    _hopper()
    layer = _layer("compiled", *KEEPS_FORMAT["3x3"], "tf32")
    x = as_channels_last(torch.randn((2, 64, 14, 15), device="cuda"))

    def f(t):
        y = layer(t)
        return (y + 1.0).permute(0, 2, 3, 1).reshape(-1)[:4000], y

    with torch.no_grad():
        want, y_eager = f(x)
        got, y_compiled = torch.compile(f, fullgraph=True)(x)
    assert y_compiled.stride() == y_eager.stride()
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_channels_last_model_imported_whole_keeps_its_format():
    _hopper()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(32, 64, 3, padding=1, bias=False), torch.nn.BatchNorm2d(64), torch.nn.ReLU(),
        torch.nn.Conv2d(64, 64, 3, padding=1, bias=False), torch.nn.BatchNorm2d(64), torch.nn.ReLU(),
    ).cuda().eval().to(memory_format=torch.channels_last)
    x = torch.randn((4, 32, 20, 20), device="cuda").to(memory_format=torch.channels_last)
    fused = from_module(model, x, precision="tf32", keep_slower=True)
    with torch.no_grad():
        want = model(x)  # (TF32 off: PyTorch fp32)
        got = fused(x)
        want64 = model.double()(x.double())
    assert want.is_contiguous(memory_format=torch.channels_last)
    assert got.is_contiguous(memory_format=torch.channels_last)
    assert rel_l2(got, want64) <= 2 * max(rel_l2(want, want64), 2.0**-11)  # the tf32 bar, at least one TF32 rounding
