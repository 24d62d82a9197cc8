"""The FFMA engine's conv rows loaded from an aligned start before the first tap (plan in_lead,
in_vectors: padding that leaves the first tap unaligned), at each mode's bar: the vectors that lie
in the padding are zeros, the ones in the row its values, whatever the lead, stride, dilation,
row length or number of spatial dims."""
from __future__ import annotations

import pytest
from gpu_helpers import compare

from specgen import FusedLayer
from specgen.spec import validate

pytestmark = pytest.mark.gpu

# name -> (input, conv, epilogue, (in_vec, in_lead))
ROWS = {
    "dw3_p1": ({"channels": 16, "size": [9, 32]}, {"out_channels": 16, "kernel": 3, "padding": 1, "groups": 16}, ["relu"], (4, 3)),
    "dw5_p2_s2": ({"channels": 16, "size": [11, 32]}, {"out_channels": 16, "kernel": 5, "padding": 2, "stride": 2, "groups": 16},
                  ["silu"], (4, 2)),
    "dw3_dil2": ({"channels": 8, "size": [10, 24]}, {"out_channels": 8, "kernel": 3, "padding": 2, "dilation": 2, "groups": 8},
                 ["tanh"], (4, 2)),
    # a row of 4: the first and last vectors of every tile lie wholly in the padding
    "narrow_row": ({"channels": 8, "size": [5, 4]}, {"out_channels": 8, "kernel": 3, "padding": 1, "groups": 8}, [{"mul": 0.5}], (4, 3)),
    "row_of_30": ({"channels": 8, "size": [6, 30]}, {"out_channels": 8, "kernel": 3, "padding": 1, "groups": 8}, ["relu"], (2, 1)),
    "grouped_1d": ({"channels": 16, "size": [64]}, {"out_channels": 32, "kernel": 3, "padding": 1, "groups": 4}, ["gelu"], (4, 3)),
    "dw_3d": ({"channels": 8, "size": [4, 6, 8]}, {"out_channels": 8, "kernel": 3, "padding": 1, "groups": 8}, ["relu"], (4, 3)),
    "dw_mean": ({"channels": 16, "size": [12, 16]}, {"out_channels": 16, "kernel": 3, "padding": 1, "groups": 16},
                ["relu", {"mean": {"dims": [2, 3]}}], (4, 3)),
    "grouped_ct": ({"channels": 32, "size": [10, 16]}, {"out_channels": 64, "kernel": 3, "padding": 1, "groups": 2}, ["relu"], (4, 3)),
}


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
@pytest.mark.parametrize("name", list(ROWS))
def test_rows_loaded_from_an_aligned_start_before_the_first_tap(name, precision):
    inp, conv, epilogue, (vec, lead) = ROWS[name]
    layer = FusedLayer(validate({"name": f"rows_{name}_{precision}", "input": inp, "conv": conv, "epilogue": epilogue,
                                 "precision": precision})).cuda()
    plan = layer.specialize().plan
    assert plan["engine"] == "ffma" and (plan["in_vec"], plan["in_lead"]) == (vec, lead) and plan["in_vectors"] > 0
    for batch, seed in ((1, 1), (3, 2)):
        compare(layer, batch, seed)
    compare(layer, 2, 3, channels_last=len(inp["size"]) > 1)
