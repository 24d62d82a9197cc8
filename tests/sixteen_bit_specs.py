"""Layers the FFMA engine runs in bf16 / fp16, reading and writing the layer's own 16-bit type
(plan io_ctype): one per code path of its loads and stores. Shared by test_sixteen_bit_ffma.py
(rendering, nvcc) and test_sixteen_bit_ffma_gpu.py (the numbers)."""
from __future__ import annotations

from specgen.spec import validate

CTYPE = {"bf16": "__nv_bfloat16", "fp16": "__half"}

# name -> (input, conv, epilogue): the comment says which path of the kernel it takes
FFMA_16 = {
    # 4-wide loads from an aligned start before the first tap (padding 1), 4-wide stores
    "depthwise": ({"channels": 48, "size": [10, 20]}, {"out_channels": 48, "kernel": 3, "padding": 1, "groups": 48},
                  [{"hardtanh": {"min_val": 0.0, "max_val": 6.0}}]),
    # 4-wide loads, 2-wide stores
    "grouped_vec": ({"channels": 32, "size": [9, 16]}, {"out_channels": 32, "kernel": 3, "groups": 8}, ["relu"]),
    # a pool level over the conv's level, element stores
    "dw_maxpool": ({"channels": 24, "size": [12, 14]}, {"out_channels": 24, "kernel": 3, "padding": 1, "groups": 24},
                   ["relu", {"max_pool": 2}]),
    # a reduction over the channels: the tail's owners store the results
    "dw_channel_sum": ({"channels": 16, "size": [8, 10]}, {"out_channels": 16, "kernel": 3, "groups": 16},
                       ["gelu", {"sum": {"dims": [1], "keepdim": True}}]),
    # a reduction to one value per (sample, channel)
    "dw_spatial_mean": ({"channels": 16, "size": [8, 10]}, {"out_channels": 16, "kernel": 3, "groups": 16},
                        [{"mean": {"dims": [2, 3]}}]),
    # a transposed conv's gather (few channels: the FFMA engine)
    "transposed_few": ({"channels": 4, "size": [7, 9]},
                       {"out_channels": 6, "kernel": 3, "stride": 2, "padding": 1, "output_padding": 1, "transposed": True},
                       ["tanh"]),
    "depthwise_3d": ({"channels": 24, "size": [5, 6, 7]}, {"out_channels": 24, "kernel": 3, "padding": 1, "groups": 24},
                     ["silu"]),
}

# A pool split: the conv on the TMA engine, its pool in an FFMA kernel that reads the body's 16-bit
# output as one span per window row (plan row_span).
POOL_SPLIT = ({"channels": 64, "size": [20, 22]}, {"out_channels": 64, "kernel": 3, "padding": 1},
              ["relu", {"max_pool": {"kernel": 3, "stride": 2, "padding": 1}}])


def spec(name: str, precision: str, prefix: str = "h16"):
    inp, conv, epilogue = POOL_SPLIT if name == "pool_split" else FFMA_16[name]
    return validate({"name": f"{prefix}_{name}_{precision}", "input": inp, "conv": conv, "epilogue": epilogue,
                     "precision": precision})
