"""A conv over a nearest-upsampled input on the GPU (marker `gpu`; skipped without CUDA): each
engine the equivalent transposed conv plans for, against float64 at the mode's bar, outputs
poisoned, fresh inputs per check, odd batches and channels-last inputs; a decoder imported whole."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402

from specgen import FusedLayer, from_module  # noqa: E402

from gpu_helpers import assert_model_bar, pinned_layer, precision_params, skip_unless_engine_runs  # noqa: E402
from gpu_helpers import compare_formats  # noqa: E402
from gpu_helpers import tf32_allowed  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fp32_reference")]

# name -> (input channels, size, conv, epilogue, engine, precisions)
CASES = {
    "tma_3x3": (64, [12, 12], {"out_channels": 64, "kernel": 3, "padding": 1, "upsample": 2}, ["batch_norm", "relu"], "tma",
                ["fp32", "tf32", "bf16", "fp16"]),
    "tma_1x1": (96, [10, 7], {"out_channels": 48, "kernel": 1, "upsample": 2}, ["silu"], "tma", ["tf32", "bf16"]),
    "igemm_1d": (32, [40], {"out_channels": 24, "kernel": 5, "padding": 2, "upsample": 2}, ["gelu"], "igemm", ["fp32", "tf32"]),
    "ffma_groups": (16, [6, 9], {"out_channels": 24, "kernel": [3, 5], "padding": [1, 2], "upsample": [2, 3], "groups": 4},
                    ["relu"], "ffma", ["fp32"]),
    "ffma_3d": (8, [3, 4, 5], {"out_channels": 16, "kernel": 3, "padding": 1, "upsample": [1, 2, 2]}, ["tanh"], None, ["fp32"]),
}


def _layer(name: str, precision: str) -> FusedLayer:
    cin, size, conv, epilogue, engine, _ = CASES[name]
    layer = pinned_layer(f"up_{name}_{precision}", cin, size, conv, epilogue, engine, precision)
    assert layer.specialize().plan["rewrites"][0].startswith("upsample fold")
    return layer


PARAMS = precision_params(CASES)


@pytest.mark.parametrize("name, precision", PARAMS)
def test_upsampled_convs_match_float64(name, precision):
    skip_unless_engine_runs(CASES[name][4])
    layer = _layer(name, precision)
    compare_formats(layer)


class Decoder(nn.Module):
    """Upsample, conv, batch norm, ReLU, twice (a U-Net decoder without its skips)."""

    def __init__(self, c: int = 64):
        super().__init__()
        self.up = nn.Upsample(scale_factor=2)
        self.b1 = nn.Sequential(nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU())
        self.b2 = nn.Sequential(nn.Conv2d(c, c // 2, 3, padding=1, bias=False), nn.BatchNorm2d(c // 2), nn.ReLU())

    def forward(self, x):
        return self.b2(self.up(self.b1(self.up(x))))


@pytest.mark.parametrize("precision", ["fp32", "tf32"])
def test_a_decoder_fuses_its_upsamples_and_matches(precision):
    torch.manual_seed(0)
    model = Decoder().cuda().eval()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 1.5)
    x = torch.randn(3, 64, 14, 14, device="cuda")
    fused = from_module(copy.deepcopy(model), x, keep_slower=True, precision=precision)
    assert [s.upsampled() for s in fused.specgen_report.specs] == [True, True], str(fused.specgen_report)
    with torch.no_grad():
        got = fused(x)
        ref64 = copy.deepcopy(model).double()(x.double())
        with tf32_allowed(precision == "tf32"):
            ref = model(x)
    assert_model_bar(got, ref64, ref, precision)
