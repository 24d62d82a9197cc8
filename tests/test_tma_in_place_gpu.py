"""A 1x1 conv on the TMA engine reading its NC(D)HW input where it lies (no layout pass;
`TmaPlan.a_in_place`; in tf32 and fp32 mode through the staging buffer the producer's warps
transpose, `TmaPlan.a_staged`) against PyTorch on the GPU (marker `gpu`; skipped without an sm_90 GPU): at
the mode's bar (within 2x of PyTorch's own error in that dtype against float64), outputs poisoned,
fresh inputs per check; batches 1 and odd ones (a last M tile past the batch), channels not a
multiple of the K-block, positions that are not whole m64 tiles (M padded per sample), strided
convs (their input subsampled first), every epilogue kind the engine takes, the split kernel, and the inputs the
tensor map cannot read as they are (channels-last for the contiguous kernel, a misaligned view),
which are copied first and must give the same bits."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from specgen import tmarun  # noqa: E402
from specgen.module import FusedLayer  # noqa: E402
from specgen.spec import validate  # noqa: E402

from gpu_helpers import as_channels_last, compare, randomize  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fp32_reference")]

DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16, "tf32": torch.float32, "fp32": torch.float32}
PRECISIONS = ["bf16", "fp16", "tf32", "fp32"]


@pytest.fixture(autouse=True)
def _staged(monkeypatch):
    """tf32 and fp32 through the staging buffer (`tma.STAGED_NCHW`, on by default: kept on whatever the default)."""
    from specgen import tma

    monkeypatch.setattr(tma, "STAGED_NCHW", True)


@pytest.fixture(autouse=True)
def _hopper():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the TMA engine needs an sm_90 GPU")


CASES = {
    # name: (input channels, size, conv, epilogue)
    "c256_to_64": (256, [16, 16], {"out_channels": 64}, ["relu"]),
    "c24_to_40_padded_k": (24, [8, 16], {"out_channels": 40}, ["sigmoid"]),
    "c8_conv1d": (8, [192], {"out_channels": 96}, [{"gelu": {"approximate": "none"}}]),
    "c16_conv3d": (16, [4, 4, 8], {"out_channels": 48}, ["relu", {"mul": 0.5}]),
    "c64_to_300_no_bias": (64, [8, 8], {"out_channels": 300, "bias": False}, [{"add": {"param": "shift"}}, "tanh"]),
    "c64_residual": (64, [16, 8], {"out_channels": 64}, [{"add": {"input": "shortcut"}}, "relu"]),
    "c40_amax_channels": (40, [8, 8], {"out_channels": 100}, [{"amax": {"dims": [1]}}]),
    "c32_softmax_channels": (32, [8, 16], {"out_channels": 64}, [{"softmax": 1}]),
    # positions that are not whole m64 tiles: M padded per sample, the padding rows not stored
    "c256_28_padded": (256, [28, 28], {"out_channels": 64}, ["relu"]),
    "c64_residual_padded": (64, [12, 10], {"out_channels": 72}, [{"add": {"input": "shortcut"}}, "relu"]),
    "c40_amax_padded": (40, [12, 10], {"out_channels": 100}, [{"amax": {"dims": [1]}}, {"sub": 0.5}]),
    "c32_softmax_padded_1d": (32, [200], {"out_channels": 64}, [{"softmax": 1}]),
    # strided: the launch copies out every stride-th position, the kernel is the stride-1 conv of the copy
    "c256_stride2_padded": (256, [56, 56], {"out_channels": 128, "stride": 2}, ["relu"]),  # 28^2 out
    "c64_stride2_residual_odd": (64, [31, 33], {"out_channels": 72, "stride": 2}, [{"add": {"input": "shortcut"}}, "relu"]),
    "c16_stride_1x2x2_3d": (16, [3, 8, 16], {"out_channels": 40, "stride": [1, 2, 2]}, ["relu"]),
    "c32_stride3_1d": (32, [383], {"out_channels": 48, "stride": 3}, [{"amax": {"dims": [1]}}]),
}


def _layer(name: str, precision: str) -> FusedLayer:
    cin, size, conv, epilogue = CASES[name]
    spec = validate({"name": f"nchw_{name}_{precision}", "input": {"channels": cin, "size": size},
                     "conv": {"kernel": 1, **conv}, "epilogue": epilogue, "precision": precision,
                     "tile": {"engine": "tma"}})
    layer = FusedLayer(spec).cuda()
    tp = layer.specialize().plan["tma"]
    # (32-bit: staged, but not where padding M to whole m64 tiles adds many rows: the layout pass then)
    assert tp.a_in_place or precision in ("tf32", "fp32")
    assert tp.a_staged == (tp.a_in_place and precision in ("tf32", "fp32"))
    return layer


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_a_1x1_conv_reading_its_input_in_place_meets_the_modes_bar(name, precision):
    layer = _layer(name, precision)
    compare(layer, 1, seed=1)
    compare(layer, 3, seed=2)
    compare(layer, 5, seed=3)
    compare(layer, 2, seed=4, channels_last=True)  # (the layer's channels-last kernel)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_the_split_kernel_reads_the_input_in_place_too(precision):
    spec = validate({"name": f"nchw_split_{precision}", "input": {"channels": 1024, "size": [8, 8]},
                     "conv": {"out_channels": 256, "kernel": 1}, "epilogue": [{"add": {"input": "shortcut"}}, "relu"],
                     "precision": precision, "tile": {"engine": "tma"}})
    layer = FusedLayer(spec).cuda()
    tp = layer.specialize().plan["tma"]
    assert tp.a_in_place and tp.split_k > 1
    sms = tmarun.sm_count(torch.cuda.current_device())
    for batch, seed in ((1, 1), (3, 2)):
        assert tmarun.uses_split(tp, batch, sms)
        compare(layer, batch, seed=seed)
    big = next(b for b in range(8, 4096) if not tmarun.uses_split(tp, b, sms))
    compare(layer, big, seed=5)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_inputs_the_map_cannot_read_in_place_are_copied_first(precision):
    """A channels-last input run by the contiguous kernel (the caller's output is contiguous) and a
    contiguous view that is not 16-byte aligned: both copied to a contiguous tensor first, the
    outputs bit for bit those of the contiguous input."""
    layer = _layer("c24_to_40_padded_k", precision)
    gen = torch.Generator(device="cuda").manual_seed(11)
    randomize(layer, gen)
    shape = (3, 24, 8, 16)
    flat = torch.randn(3 * 24 * 8 * 16 + 1, generator=gen, device="cuda").to(DTYPE[precision])
    sliced = flat[1:].view(shape)
    assert sliced.is_contiguous() and sliced.data_ptr() % 16
    x = sliced.clone()
    with torch.no_grad():
        want = layer(x)
        assert bool(torch.isfinite(want).all())
        assert torch.equal(layer(sliced), want)
        out = torch.full_like(want, float("nan"))
        layer(as_channels_last(x), out=out)
        assert torch.equal(out, want)


# Convs of several taps read in place through shifted boxes (`TmaPlan.a_shifted`, `tma.STAGED_TAPS`):
# stride 1, the output keeping the input's extents; the consumers read their A registers there. (Over
# 64 output channels: a tf32 plan of two blocks per SM keeps the pass.)
TAP_CASES = {
    # name: (input channels, size, conv, epilogue)
    "k3_c64_32x32": (64, [32, 32], {"out_channels": 64, "kernel": 3, "padding": 1}, ["relu"]),
    "k3_c16_16x20": (16, [16, 20], {"out_channels": 72, "kernel": 3, "padding": 1}, ["sigmoid"]),
    "k5_c32_16x16_residual": (32, [16, 16], {"out_channels": 64, "kernel": 5, "padding": 2},
                              [{"add": {"input": "shortcut"}}, "relu"]),
    "k3_dilated_c40": (40, [16, 12], {"out_channels": 96, "kernel": 3, "padding": 2, "dilation": 2}, ["relu"]),
    "k3_3d_c16": (16, [4, 8, 8], {"out_channels": 80, "kernel": 3, "padding": 1}, [{"mul": 0.5}]),
    "k7_1d_c24": (24, [192], {"out_channels": 96, "kernel": 7, "padding": 3}, [{"softmax": 1}]),
}


@pytest.mark.parametrize("precision", ["tf32", "fp32"])
@pytest.mark.parametrize("name", sorted(TAP_CASES))
def test_a_conv_of_several_taps_reading_its_input_through_shifted_boxes_meets_the_modes_bar(monkeypatch, name, precision):
    from specgen import tma

    monkeypatch.setattr(tma, "STAGED_TAPS", True)
    monkeypatch.setattr(tma, "STAGED_TAPS_MAX_TAPS", 27)  # (the 5x5 and 3-D cases: off by default)
    cin, size, conv, epilogue = TAP_CASES[name]
    spec = validate({"name": f"shifted_{name}_{precision}", "input": {"channels": cin, "size": size},
                     "conv": conv, "epilogue": epilogue, "precision": precision, "tile": {"engine": "tma"}})
    layer = FusedLayer(spec).cuda()
    assert layer.specialize().plan["tma"].a_shifted
    compare(layer, 1, seed=1)
    compare(layer, 3, seed=2)
    compare(layer, 5, seed=3)
