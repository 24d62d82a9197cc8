"""Reductions over depth that keep the rows, on the GPU (marker `gpu`; skipped without CUDA): the
FFMA box spans depths before rows there (`plan.DEPTH_REDUCTION_DEPTHS_FIRST`, v63: KernelBench 24's
min over depth), so each owner folds several depths of a kept element and a block walks the
depth chunks. Each layer against float64 at its precision's bar, into NaN-poisoned outputs, at
batch 1 and 3 and channels-last."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from specgen import FusedLayer  # noqa: E402
from specgen.spec import validate  # noqa: E402

from gpu_helpers import compare_formats  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fp32_reference")]

# name -> (input channels, size [D, H, W], conv, epilogue)
CASES = {
    # KernelBench 24's shape, smaller: a min over depth, then a softmax over the channels (a sequence)
    "amin_softmax": (3, [12, 14, 18], {"out_channels": 24, "kernel": 3}, [{"amin": {"dims": [2]}}, {"softmax": 1}]),
    # a mean over depth kept as a dim of 1, an odd depth, padding
    "mean_keepdim": (4, [9, 10, 16], {"out_channels": 16, "kernel": 3, "padding": 1},
                     ["relu", {"mean": {"dims": [2], "keepdim": True}}, "tanh"]),
    # depth and width reduced together, the rows kept
    "sum_depth_width": (3, [7, 12, 20], {"out_channels": 8, "kernel": [3, 3, 3]}, [{"sum": {"dims": [2, 4]}}]),
    # a reduction of two accumulators (max and sum) over a long depth
    "logsumexp": (2, [30, 8, 12], {"out_channels": 16, "kernel": 3}, [{"logsumexp": {"dims": [2]}}]),
}


@pytest.mark.parametrize("precision", ["fp32", "tf32"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_a_reduction_over_depth_boxes_depths_first_and_matches_float64(name, precision):
    cin, size, conv, epilogue = CASES[name]
    spec = validate({"name": f"depth_{name}", "input": {"channels": cin, "size": size}, "conv": conv,
                     "epilogue": epilogue, "precision": precision, "tile": {"engine": "ffma"}})
    layer = FusedLayer(spec).cuda().eval()
    plan = layer.specialize().plan
    body = next(p["plan"] for p in plan["parts"] if p["role"] == "body") if plan["engine"] == "sequence" else plan
    assert body["engine"] == "ffma" and body["box"][1] > 1, body["box"]  # several depths a box
    compare_formats(layer)
