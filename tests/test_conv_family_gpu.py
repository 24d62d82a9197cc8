"""Transposed convolutions and batch norm on the GPU against float64 PyTorch (marker `gpu`).

Every check draws random inputs, weights and batch-norm statistics, poisons the output with NaN
first, and requires rel. L2 error <= 1e-5 against float64 and allclose(1e-4, 1e-4) against
PyTorch fp32 (TF32 off) computed by nn.ConvTranspose itself.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from specgen import reference  # noqa: E402
from specgen.module import FusedLayer  # noqa: E402
from specgen.spec import validate  # noqa: E402

from conv_family_specs import TRANSPOSED  # noqa: E402
from gpu_helpers import compare as compare_to_reference, randomize, rel_l2  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fp32_reference")]


def torch_module(spec, layer: FusedLayer) -> torch.nn.Module:
    """nn.ConvTranspose with the layer's weights: PyTorch's own transposed conv, for the fp32 check."""
    conv = reference.make_conv(spec).cuda()
    with torch.no_grad():
        conv.weight.copy_(layer.conv.weight)
        if spec.conv.bias:
            conv.bias.copy_(layer.conv.bias)
    return conv


def compare(layer: FusedLayer, batch: int, seed: int) -> float:
    """The fp32 bars (the reference's fp32 path is F.conv_transpose), and nn.ConvTranspose itself
    gives the conv's output shape."""
    spec = layer.spec
    assert spec.precision == "fp32"
    rel = compare_to_reference(layer, batch, seed)["rel_l2"]
    x = torch.randn((batch, spec.input.channels, *spec.input.size), device="cuda")
    with torch.no_grad():
        assert tuple(torch_module(spec, layer)(x).shape[1:]) == tuple(spec.shapes()[0].sizes)
    return rel


@pytest.mark.parametrize("name", list(TRANSPOSED))
@pytest.mark.parametrize("batch", [1, 3])
def test_transposed_layers_match_float64(name, batch):
    layer = FusedLayer(validate({"name": name, **TRANSPOSED[name]})).cuda()
    assert layer.specialize().plan["mma"] is None
    compare(layer, batch, seed=batch)


def test_conv_transpose_itself_matches_the_reference():
    """The fp32 reference path is PyTorch's nn.ConvTranspose (a plain layer, no stages)."""
    spec = validate({"name": "plain_t", "input": {"channels": 4, "size": [6, 7]},
                     "conv": {"out_channels": 6, "kernel": 3, "stride": 2, "padding": 1, "output_padding": 1,
                              "groups": 2, "transposed": True}, "epilogue": ["relu"]})
    layer = FusedLayer(spec).cuda()
    gen = torch.Generator(device="cuda").manual_seed(0)
    randomize(layer, gen)
    x = torch.randn((2, 4, 6, 7), generator=gen, device="cuda")
    out = torch.full(spec.output_shape(2), float("nan"), device="cuda")
    layer(x, out=out)
    with torch.no_grad():
        want = torch.relu(torch_module(spec, layer).double()(x.double()))
    rel = rel_l2(out, want)
    assert rel <= 1e-5, rel


def test_imported_transposed_conv_batch_norm_pools_match_the_model():
    """KernelBench level 2 no. 72 at a small size: ConvTranspose3d -> BatchNorm3d -> two AvgPool3d."""
    import torch.nn as nn

    import specgen

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv_transpose = nn.ConvTranspose3d(3, 16, 3, stride=2, padding=1)
            self.batch_norm = nn.BatchNorm3d(16)
            self.avg_pool1 = nn.AvgPool3d(kernel_size=2)
            self.avg_pool2 = nn.AvgPool3d(kernel_size=2)

        def forward(self, x):
            return self.avg_pool2(self.avg_pool1(self.batch_norm(self.conv_transpose(x))))

    torch.manual_seed(0)
    model = Model().cuda().eval()
    with torch.no_grad():
        model.batch_norm.running_mean.normal_()
        model.batch_norm.running_var.uniform_(0.5, 1.5)
        model.batch_norm.weight.normal_()
        model.batch_norm.bias.normal_()
    x = torch.rand(4, 3, 8, 9, 10, device="cuda")
    fused = specgen.from_module(model, x)
    assert len(fused.specgen_report.specs) == 1 and not fused.specgen_report.fallbacks
    with torch.no_grad():
        got = fused(x)
        want = model.double()(x.double())
    rel = ((got.double() - want).norm() / want.norm()).item()
    assert rel <= 1e-5, rel


def _kernelbench_fused():
    import kernelbench_problems as kb

    return [pytest.param(p, id=p.stem) for p in kb.problems() if p.stem in kb.FUSED]


@pytest.mark.parametrize("path", _kernelbench_fused())
def test_kernelbench_problems_fused_whole_match_float64(path):
    """Each public problem that imports into one spec, fused, against the model in float64
    (batch 1 at the problem's own sizes; batch-norm statistics drawn at random). Fused without
    timing: whether the chain wins is the benchmark's question, and timings taken beside other
    tests on the same GPU would decide it at random."""
    import kernelbench_problems as kb

    import specgen

    model, inputs = kb.load(path)
    model = kb.randomize_batch_norms(model).cuda()
    inputs = [t.cuda() if isinstance(t, torch.Tensor) else t for t in inputs]
    fused = specgen.from_module(model, *inputs, keep_slower=True)
    assert len(fused.specgen_report.specs) == 1 and not fused.specgen_report.fallbacks
    with torch.no_grad():
        got = fused(*inputs)
        torch.cuda.synchronize()
        want = model.double()(*[t.double() if isinstance(t, torch.Tensor) else t for t in inputs])
    assert torch.isfinite(got).all()
    rel = rel_l2(got, want)
    assert rel <= 1e-5, f"{path.stem}: rel L2 {rel:.3e}"


# Stride-1 transposed convs run as the plain conv they equal (specgen.plan.forward_equivalent), on
# whichever engine the plain conv gets: the weights reach the kernels swapped and reversed.
STRIDE1 = {
    "tma_tf32": ({"channels": 64, "size": [20, 24]}, {"out_channels": 64, "kernel": 4}, ["tanh"], "tf32", None),
    "tma_bf16": ({"channels": 64, "size": [20, 24]}, {"out_channels": 64, "kernel": 3, "padding": 1}, ["relu"], "bf16", None),
    "tma_fp32": ({"channels": 64, "size": [12, 10]}, {"out_channels": 96, "kernel": 3}, ["gelu"], "fp32", None),
    "igemm_fp32": ({"channels": 32, "size": [9, 11]}, {"out_channels": 48, "kernel": 3, "padding": 1}, ["relu"], "fp32", "igemm"),
    "slab_3d": ({"channels": 8, "size": [5, 6, 7]}, {"out_channels": 32, "kernel": 3, "padding": 1}, ["silu"], "fp32", None),
    "ffma_groups_dil": ({"channels": 8, "size": [10, 12]}, {"out_channels": 6, "kernel": 3, "dilation": 2, "groups": 2}, ["tanh"], "fp32", None),
    "avg_pool_fold": ({"channels": 8, "size": [12, 12]}, {"out_channels": 16, "kernel": 3}, [{"avg_pool": 2}], "fp32", None),
    "then_group_norm": ({"channels": 32, "size": [16, 16]}, {"out_channels": 64, "kernel": 3}, [{"group_norm": 8}, "relu"], "tf32", None),
}


@pytest.mark.parametrize("name", list(STRIDE1))
@pytest.mark.parametrize("batch", [1, 5])
def test_stride_1_transposed_convs_run_as_plain_convs(name, batch):
    inp, conv, epilogue, precision, engine = STRIDE1[name]
    data = {"name": f"s1_{name}", "input": inp, "conv": {**conv, "transposed": True}, "epilogue": epilogue, "precision": precision}
    if engine is not None:
        data["tile"] = {"engine": engine}
    layer = FusedLayer(validate(data)).cuda()
    plan = layer.specialize().plan
    assert plan["weight_transforms"][0]["kind"] == "transposed_to_plain"
    compare_to_reference(layer, batch, seed=batch + 11)


# Strided transposed convs on the implicit-GEMM engine: one GEMM per stride phase (grid y).
PHASES = {
    "k3s2_op1_2d": ({"channels": 32, "size": [9, 11]}, {"out_channels": 48, "kernel": 3, "stride": 2, "padding": 1, "output_padding": 1}, ["relu"]),
    "k4s2_2d": ({"channels": 64, "size": [8, 7]}, {"out_channels": 64, "kernel": 4, "stride": 2, "padding": 1}, ["tanh"]),
    "k2s2_unet": ({"channels": 128, "size": [6, 10]}, {"out_channels": 64, "kernel": 2, "stride": 2}, [{"mul": 0.5}]),
    "k1s2_empty_phases": ({"channels": 16, "size": [5, 6]}, {"out_channels": 24, "kernel": 1, "stride": 2}, ["gelu"]),
    "k5s3_op2_1d": ({"channels": 24, "size": [13]}, {"out_channels": 40, "kernel": 5, "stride": 3, "padding": 2, "output_padding": 2}, ["silu"]),
    "k3s2_3d": ({"channels": 32, "size": [4, 5, 6]}, {"out_channels": 64, "kernel": 3, "stride": 2, "padding": 1, "output_padding": 1},
                [{"add": {"param": "b2"}}, "relu"]),
    "mixed_strides_3d": ({"channels": 16, "size": [3, 4, 5]}, {"out_channels": 20, "kernel": [2, 3, 4], "stride": [1, 2, 3], "padding": [0, 1, 1]},
                         [{"clamp": {"min": -0.5, "max": 0.5}}]),
    "nobias_residual": ({"channels": 32, "size": [7, 7]}, {"out_channels": 32, "kernel": 3, "stride": 2, "padding": 1, "bias": False},
                        [{"add": {"input": "skip"}}, "relu"]),
    # odd output extents (7, 9, 11): W phase 1 has a column less than its pair's grid
    "odd_3d_residual": ({"channels": 32, "size": [3, 4, 5]}, {"out_channels": 40, "kernel": 3, "stride": 2},
                        [{"add": {"input": "skip"}}, "gelu"]),
}


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
@pytest.mark.parametrize("name", list(PHASES))
def test_strided_transposed_convs_on_the_implicit_gemm(name, precision):
    inp, conv, epilogue = PHASES[name]
    data = {"name": f"ph_{name}_{precision}", "input": inp, "conv": {**conv, "transposed": True}, "epilogue": epilogue,
            "precision": precision, "tile": {"engine": "igemm"}}
    layer = FusedLayer(validate(data)).cuda()
    plan = layer.specialize().plan
    assert plan["engine"] == "igemm" and plan["igemm"].phases
    for batch, seed in ((1, 1), (5, 2)):
        compare_to_reference(layer, batch, seed=seed)


@pytest.mark.parametrize("single", [False, True])
@pytest.mark.parametrize("precision", ["fp32", "tf32"])
@pytest.mark.parametrize("name", ["k3s2_op1_2d", "k4s2_2d", "odd_3d_residual", "nobias_residual"])
def test_w_pairs_and_single_phases_compute_the_same_layer(name, precision, single):
    """Each tile config both ways: a block per W pair of phases (stored side by side) and a block per phase."""
    from specgen import pipeline
    from specgen.igemm import IgemmConfig

    inp, conv, epilogue = PHASES[name]
    data = {"name": f"pair_{name}_{precision}", "input": inp, "conv": {**conv, "transposed": True}, "epilogue": epilogue,
            "precision": precision}
    spec = validate(data)
    for cfg in (IgemmConfig(8, 1, 1, 8, 32, 3, 1, True), IgemmConfig(4, 2, 2, 4, 32, 3)):
        cfg = IgemmConfig(**{**cfg.__dict__, "phases_per_block": 1 if single else 2})
        layer = FusedLayer(spec).cuda()
        layer._specialized = pipeline.specialize(spec, igemm_config=cfg)
        layer._bind_op()
        assert layer._specialized.plan["igemm"].w_pairs == (not single)
        compare_to_reference(layer, 3, seed=5)


def test_strided_transposed_conv_then_group_norm_runs_its_body_s_stride_phases():
    data = {"name": "ph_gn", "input": {"channels": 32, "size": [8, 8]},
            "conv": {"out_channels": 64, "kernel": 3, "stride": 2, "padding": 1, "output_padding": 1, "transposed": True},
            "epilogue": ["gelu", {"group_norm": 8}], "precision": "tf32"}
    layer = FusedLayer(validate(data)).cuda()
    plan = layer.specialize().plan
    body = plan["tma"] or plan["igemm"]  # (the TMA engine's phases on Hopper, else the implicit GEMM's)
    assert plan["engine"] == "sequence" and body is not None and body.phases
    compare_to_reference(layer, 3, seed=4)


SPLITS = {
    "max_pool": ["relu", {"max_pool": 2}, "tanh"],
    "mean_lse": [{"mul": 2.0}, "relu", {"mean": {"dims": [2, 3], "keepdim": True}}, {"logsumexp": {"dims": [1]}}],  # (relu: no tap-sum fold)
    # (amax, not amin: GELU of a min over 64 channels is GELU far into its negative tail, values
    # near 0 whose float32 evaluation alone misses float64 by 1e-4 relative in PyTorch itself)
    "amax_gelu": [{"amax": {"dims": [1], "keepdim": True}}, "gelu"],  # (one TMA kernel: the amax on its accumulators)
    "amax_sum": [{"amax": {"dims": [1], "keepdim": True}}, {"sum": {"dims": [2], "keepdim": True}}, "gelu"],  # (T0: one channel)
}


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
@pytest.mark.parametrize("name", list(SPLITS))
def test_a_strided_transposed_conv_split_before_its_pool_or_reduction(name, precision):
    data = {"name": f"tsplit_{name}_{precision}", "input": {"channels": 32, "size": [12, 10]},
            "conv": {"out_channels": 64, "kernel": 3, "stride": 2, "padding": 1, "output_padding": 1, "transposed": True},
            "epilogue": SPLITS[name], "precision": precision}
    layer = FusedLayer(validate(data)).cuda()
    plan = layer.specialize().plan
    if plan["engine"] == "tma":  # a reduction over the channels on the accumulators, nothing after it
        assert name == "amax_gelu" and plan["tma"].channel_reduction and plan["tma"].phases
    else:
        body = plan["parts"][0]["plan"]
        assert plan["engine"] == "sequence" and body["engine"] in ("tma", "igemm") and body[body["engine"]].phases
    compare_to_reference(layer, 1, seed=1)
    compare_to_reference(layer, 3, seed=2)
