"""A bf16 / fp16 1-D or 2-D conv of several taps on the TMA engine reading its NC(H)W input where it lies
(`tma.TAPS_IN_PLACE` on: `TmaPlan.taps_in_place`, each m64 tile's A a 4-D tiled load of 64
positions of one input row per tap, the padding from the map's zero fill) against PyTorch on the
GPU (marker `gpu`; skipped without an sm_90 GPU): at the mode's bar (within 2x of PyTorch's own
error in that dtype against float64), outputs poisoned, fresh inputs per check; batch 1 and odd
batches, channels not a multiple of the K-block, dilation, padding on one side only and none,
a reduction and a softmax over the channels, an extra input, the split kernel, output rows padded to
whole m64 tiles (112 -> 128, 56 -> 64, 120 -> 128); and next to the same layer through
the layout pass (the switch off), on the same input."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from specgen import pipeline, tma, tmarun  # noqa: E402
from specgen.module import FusedLayer  # noqa: E402
from specgen.spec import validate  # noqa: E402

from gpu_helpers import compare, extra_inputs, random_input, randomize, skip_unless_engine_runs  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fp32_reference")]


@pytest.fixture(autouse=True)
def _hopper():
    skip_unless_engine_runs("tma")


CASES = {
    # name: (input channels, size, conv, epilogue); every output row a whole number of m64 tiles
    "c64_3x3": (64, [64, 64], {"out_channels": 64, "kernel": 3, "padding": 1}, ["relu"]),
    "c128_3x3_residual": (128, [12, 128], {"out_channels": 128, "kernel": 3, "padding": 1},
                          [{"add": {"input": "shortcut"}}, "relu"]),
    "c24_5x5_dilated": (24, [16, 64], {"out_channels": 40, "kernel": 5, "padding": 4, "dilation": 2}, ["sigmoid"]),
    "c32_3x1_no_padding": (32, [10, 64], {"out_channels": 48, "kernel": [3, 1], "padding": 0}, ["relu"]),
    "c64_3x5_padding_hw": (64, [9, 64], {"out_channels": 72, "kernel": [3, 5], "padding": [1, 2]}, ["tanh"]),
    "c40_amax_channels": (40, [8, 64], {"out_channels": 100, "kernel": 3, "padding": 1}, [{"amax": {"dims": [1]}}]),
    "c512_split": (512, [4, 64], {"out_channels": 256, "kernel": 3, "padding": 1}, ["relu"]),  # split K at batch 1
    # output rows padded to whole m64 tiles (OUT_H rows of W_PAD per sample; the rows past OUT_W not stored)
    "c128_3x3_rows_112": (128, [112, 112], {"out_channels": 128, "kernel": 3, "padding": 1}, ["relu"]),
    "c64_residual_rows_56": (64, [7, 56], {"out_channels": 72, "kernel": 3, "padding": 1},
                             [{"add": {"input": "shortcut"}}, "relu"]),
    "c40_amax_rows_56": (40, [5, 56], {"out_channels": 100, "kernel": 3, "padding": 1}, [{"amax": {"dims": [1]}}]),
    "c32_softmax_rows_120": (32, [3, 120], {"out_channels": 64, "kernel": [1, 3], "padding": [0, 1]}, [{"softmax": 1}]),
    # 1-D convs: one row per sample
    "c64_conv1d_1024": (64, [1024], {"out_channels": 96, "kernel": 3, "padding": 1}, [{"gelu": {"approximate": "none"}}]),
    "c48_conv1d_rows_120": (48, [120], {"out_channels": 64, "kernel": 5, "padding": 2},
                            [{"add": {"input": "shortcut"}}, "relu"]),
}


def _spec(name: str, precision: str, suffix: str):
    cin, size, conv, epilogue = CASES[name]
    return validate({"name": f"taps_{name}_{precision}_{suffix}", "input": {"channels": cin, "size": size},
                     "conv": conv, "epilogue": epilogue, "precision": precision, "tile": {"engine": "tma"}})


def _layer(name: str, precision: str, on: bool) -> FusedLayer:
    """The case's layer, planned with the switch `on` (a name of its own, so that it specializes apart)."""
    saved = tma.TAPS_IN_PLACE
    tma.TAPS_IN_PLACE = on
    try:
        spec = _spec(name, precision, "on" if on else "off")
        pipeline.forget(spec)
        layer = FusedLayer(spec).cuda()
        assert layer.specialize().plan["tma"].taps_in_place == on
    finally:
        tma.TAPS_IN_PLACE = saved
    return layer


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_a_conv_of_several_taps_reading_its_input_in_place_meets_the_modes_bar(name, precision):
    layer = _layer(name, precision, True)
    compare(layer, 1, seed=1)
    compare(layer, 3, seed=2)
    compare(layer, 5, seed=3)
    compare(layer, 2, seed=4, channels_last=True)  # (the layer's channels-last kernel: the layout pass's)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("name", ["c64_3x3", "c24_5x5_dilated", "c512_split", "c64_residual_rows_56"])
def test_it_agrees_with_the_layout_pass_on_the_same_input(name, precision):
    """Both walk K in the same order (tap-major, the same K-blocks) on the same wgmma shape: their
    outputs differ by no more than a few roundings of the output dtype."""
    on, off = _layer(name, precision, True), _layer(name, precision, False)
    gen = torch.Generator(device="cuda").manual_seed(5)
    randomize(off, gen)
    on.load_state_dict(off.state_dict())
    for batch in (1, 3):
        x = random_input(off.spec, batch, gen)
        extras = extra_inputs(off.spec, batch, gen)
        with torch.no_grad():
            got, want = on(x, *extras.values()), off(x, *extras.values())
        assert bool(torch.isfinite(got).all())
        scale = want.float().abs().max().item()
        assert (got.float() - want.float()).abs().max().item() <= 1e-2 * scale, f"{name} batch {batch}"


def test_the_split_case_takes_the_split_kernel_at_batch_1():
    layer = _layer("c512_split", "bf16", True)
    tp = layer.specialize().plan["tma"]
    assert tp.split_k > 1 and tmarun.uses_split(tp, 1, tmarun.sm_count(torch.cuda.current_device()))
