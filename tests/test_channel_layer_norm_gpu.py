"""`layer_norm_channels` against float64 on the GPU (marker `gpu`; skipped without CUDA): on the TMA
epilogue (an sm_90 GPU) over a block's channels, and on the tail engine's strided kernel after a
depthwise conv (groups in registers, and groups read twice). At each precision's bar (see
gpu_helpers.compare), outputs poisoned first, fresh inputs and parameters per check, odd batches,
both input memory formats."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from specgen.module import FusedLayer  # noqa: E402
from specgen.spec import validate  # noqa: E402

from gpu_helpers import compare as check, compare_formats  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fp32_reference")]

C3 = {"kernel": 3, "padding": 1}


def _layer(name, cin, size, conv, epilogue, precision, tile=None):
    data = {"name": name, "input": {"channels": cin, "size": size}, "conv": conv, "epilogue": epilogue, "precision": precision}
    if tile:
        data["tile"] = tile
    return FusedLayer(validate(data)).cuda()


TMA_CASES = {
    "c96_gelu": (64, [9, 14], {"out_channels": 96, **C3}, ["relu", {"layer_norm_channels": {}}, "gelu"]),
    "c40_odd": (32, [7, 9], {"out_channels": 40, **C3}, [{"layer_norm_channels": {"eps": 1e-6}}, {"mul": {"param": "s"}}]),
    "c256_plain": (48, [6, 6], {"out_channels": 256, **C3}, [{"layer_norm_channels": {"elementwise_affine": False}}]),
    "c64_3d": (16, [4, 5, 6], {"out_channels": 64, **C3}, [{"layer_norm_channels": {}}, {"sum": {"dims": [1], "keepdim": True}}]),
}


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
@pytest.mark.parametrize("name", sorted(TMA_CASES))
def test_the_tma_epilogue_normalizes_over_the_channels(name, precision):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the TMA engine needs an sm_90 GPU")
    cin, size, conv, epilogue = TMA_CASES[name]
    if precision == "fp32" and conv["out_channels"] > 128:
        pytest.skip("(fp32's two planes: a block holds at most 128 channels)")
    layer = _layer(f"lnc_{name}_{precision}", cin, size, conv, epilogue, precision, {"engine": "tma"})
    tp = layer.specialize().plan["tma"]
    assert tp.channel_norm and tp.channel_norm_op == "layer_norm_channels"
    compare_formats(layer)


@pytest.mark.parametrize("precision", ["fp32", "tf32"])
@pytest.mark.parametrize("channels, size", [(32, [28, 28]), (96, [14, 14]), (768, [7, 7])])
def test_after_a_depthwise_conv_the_tail_engine_normalizes_strided_groups(channels, size, precision):
    layer = _layer(f"lnc_dw{channels}_{precision}", channels, size,
                   {"out_channels": channels, "kernel": 7, "padding": 3, "groups": channels},
                   [{"layer_norm_channels": {"eps": 1e-6}}, {"add": 0.5}], precision)
    plan = layer.specialize().plan
    assert plan["parts"][-1].plan.mode == "strided"
    check(layer, 1, seed=1)
    check(layer, 5, seed=2)


@pytest.mark.parametrize("teams", [True, False], ids=["teams", "thread_per_group"])
@pytest.mark.parametrize("channels, size, epilogue", [
    (768, [7, 7], [{"layer_norm_channels": {"eps": 1e-6}}, {"add": 0.5}]),
    (500, [5, 3], [{"softmax": 1}, {"mul": {"param": "s"}}]),
    (100, [6, 6], [{"log_softmax": 1}]),
    (20, [3, 5], [{"layer_norm_channels": {}}]),
])
def test_strided_groups_on_teams_and_on_a_thread_each(channels, size, epilogue, teams, monkeypatch):
    """`tail.STRIDED_TEAMS` (on by default) and off: a block of neighbouring groups, their values
    sliced across its threads and joined through shared memory, against a thread per group."""
    from specgen import tail

    monkeypatch.setattr(tail, "STRIDED_TEAMS", teams)
    layer = _layer(f"strided_{channels}_{len(epilogue)}_{teams}", channels, size,
                   {"out_channels": channels, "kernel": 3, "padding": 1, "groups": channels}, epilogue, "fp32")
    assert bool(layer.specialize().plan["parts"][-1].plan.team_pos) == teams
    check(layer, 1, seed=1)
    check(layer, 7, seed=2)
