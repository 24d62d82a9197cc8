"""Transposed-convolution specs shared by the CPU and GPU tests (name -> spec without its name).

Together they cover 1D/2D/3D, strides 1/2/3, padding, output_padding, dilation, groups, no bias,
weights read through the cache (too many for shared memory), and pointwise, batch-norm, pool and
reduction epilogues."""

TRANSPOSED = {
    "t1d_s3_dil_groups_amax": {
        "input": {"channels": 6, "size": [20]},
        "conv": {"out_channels": 6, "kernel": 4, "stride": 3, "padding": 2, "dilation": 2, "output_padding": 2,
                 "groups": 3, "transposed": True},
        "epilogue": ["gelu", {"amax": {"dims": [2]}}],
    },
    "t2d_s2_op1_maxpool_sum": {
        "input": {"channels": 4, "size": [9, 11]},
        "conv": {"out_channels": 8, "kernel": 3, "stride": 2, "padding": 1, "output_padding": 1, "transposed": True},
        "epilogue": ["relu", {"max_pool": 2}, {"sum": {"dims": [1]}}],
    },
    "t2d_s1_dil2_groups_nobias_mean": {
        "input": {"channels": 4, "size": [10, 12]},
        "conv": {"out_channels": 6, "kernel": 3, "dilation": 2, "groups": 2, "bias": False, "transposed": True},
        "epilogue": ["tanh", {"mean": {"dims": [2, 3], "keepdim": True}}],
    },
    "t2d_s2_gap_lse": {
        "input": {"channels": 8, "size": [7, 9]},
        "conv": {"out_channels": 16, "kernel": 4, "stride": 2, "padding": 1, "transposed": True},
        "epilogue": ["global_avg_pool", {"add": {"param": "extra"}}, {"logsumexp": {"dims": [1], "keepdim": True}},
                     {"sum": {"dims": [2, 3]}}, {"mul": 10.0}],
    },
    "t3d_s2_bn_avgpool_avgpool": {
        "input": {"channels": 3, "size": [5, 6, 7]},
        "conv": {"out_channels": 16, "kernel": 3, "stride": 2, "padding": 1, "transposed": True},
        "epilogue": ["batch_norm", {"avg_pool": 2}, {"avg_pool": 2}],
    },
    "t3d_mixed_strides_affine_bn_lse": {
        "input": {"channels": 4, "size": [4, 5, 6]},
        "conv": {"out_channels": 8, "kernel": [2, 3, 3], "stride": [1, 2, 3], "padding": [0, 1, 2],
                 "output_padding": [0, 1, 2], "transposed": True},
        "epilogue": [{"mul": 2.0}, {"batch_norm": {"name": "norm", "affine": False, "eps": 1e-3}},
                     {"logsumexp": {"dims": [1]}}],
    },
    "t2d_weights_in_global": {
        "input": {"channels": 96, "size": [5, 6]},
        "conv": {"out_channels": 192, "kernel": 3, "stride": 2, "transposed": True},
        "epilogue": ["silu"],
        "tile": {"engine": "ffma"},  # (left to the planner: the implicit GEMM's stride phases)
    },
}


def float64_transposed_case(spec, batch: int = 2):
    """(x, weight, bias, PyTorch's float64 output) for a transposed conv spec: random float64 values
    through nn.ConvTransposeNd, the reference the CPU models of the stride phases are held to."""
    import torch

    from specgen import reference

    x = torch.randn(batch, spec.input.channels, *spec.input.size, dtype=torch.float64)
    w = torch.randn(*spec.weight_shape(), dtype=torch.float64)
    b = torch.randn(spec.conv.out_channels, dtype=torch.float64)
    conv = reference.make_conv(spec).double()
    with torch.no_grad():
        conv.weight.copy_(w)
        conv.bias.copy_(b)
        return x, w, b, conv(x)
