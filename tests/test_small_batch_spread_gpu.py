"""A depthwise conv's FFMA box of one register tile a thread, the kernel a call takes where its batch
leaves most SMs idle with the stacked box (`pipeline.small_batch_settings`), against the reference
on the GPU (marker `gpu`; skipped without CUDA): at the mode's bar, outputs poisoned, fresh inputs
and parameters per check, at batch 1, 2 and 3, strided, 5x5, dilated, an odd map, channels not a
multiple of the box's; and the same layer's stacked kernel at a batch past the rule."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from specgen import pipeline  # noqa: E402
from specgen.module import FusedLayer  # noqa: E402
from specgen.spec import validate  # noqa: E402

from gpu_helpers import compare  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.small_batch, pytest.mark.usefixtures("fp32_reference")]

BN_RELU6 = [{"batch_norm": {}}, {"hardtanh": {"min_val": 0.0, "max_val": 6.0}}]
CASES = {
    # name: (channels, size, conv, epilogue, precision)
    "c144_56": (144, [56, 56], {"kernel": 3, "padding": 1}, BN_RELU6, "tf32"),
    "c576_14_s2": (576, [14, 14], {"kernel": 3, "padding": 1, "stride": 2}, BN_RELU6, "tf32"),
    "c240_28_k5": (240, [28, 28], {"kernel": 5, "padding": 2}, BN_RELU6, "fp32"),
    "c40_33_s2_odd": (40, [33, 31], {"kernel": 3, "padding": 1, "stride": 2}, ["relu"], "fp32"),
    "c96_dilated": (96, [30, 30], {"kernel": 3, "padding": 2, "dilation": 2}, [{"mul": 0.5}, "silu"], "tf32"),
    "c32_112_hardswish": (32, [112, 112], {"kernel": 3, "padding": 1}, ["hardswish"], "tf32"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_small_batch_depthwise_call_runs_the_spread_box_to_the_modes_bar(name):
    channels, size, conv, epilogue, precision = CASES[name]
    spec = validate({"name": f"spread_{name}", "input": {"channels": channels, "size": size},
                     "conv": {"out_channels": channels, "groups": channels, **conv}, "epilogue": epilogue,
                     "precision": precision})
    pipeline.forget(spec)
    layer = FusedLayer(spec).cuda()
    sp = layer.specialize()
    one = pipeline.batch_variant(sp, 1)
    assert sp.plan["engine"] == "ffma" and one.plan["blocks_per_sample"] > sp.plan["blocks_per_sample"]
    largest = pipeline.small_batch_spread_largest(spec, sp.plan, sp.arch)
    compare(layer, 1, seed=1)
    for batch in (2, 3):
        if batch <= largest:
            assert pipeline.batch_variant(sp, batch) is not sp
        compare(layer, batch, seed=batch)
    past = 2 * largest + 1  # (the next bucket's first batch: the stacked kernel)
    assert pipeline.batch_variant(sp, past) is sp
    compare(layer, past, seed=11)
