"""Transposed convolutions and the batch_norm stage without a GPU: spec, plan, render, nvcc,
reference, importer, and how many public KernelBench problems import."""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kernelbench_problems as kb
from conv_family_specs import TRANSPOSED, float64_transposed_case
from specgen import reference
from specgen.importer import explain, from_module
from specgen.module import FusedLayer
from specgen.plan import PlanError, build_plan, forward_equivalent
from specgen.render import render, render_plan
from specgen.spec import SpecError, parse_yaml, validate
from specgen.target import BUILTIN
from specgen.torchop import forward_weight

T2 = {"name": "t", "input": {"channels": 4, "size": [5, 7]},
      "conv": {"out_channels": 6, "kernel": 3, "stride": 2, "padding": 1, "output_padding": 1, "transposed": True}}


def spec_of(name: str):
    return validate({"name": name, **TRANSPOSED[name]})


def with_conv(**conv) -> dict:
    return {**T2, "conv": {**T2["conv"], **conv}}


# ---- spec ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "conv, expected",
    [
        ({"output_padding": 2}, "conv.output_padding: must be >= 0 and smaller than the stride or the dilation"),
        ({"output_padding": [1, 1], "stride": [2, 1]}, "spatial dim 1 has output_padding 1, stride 1, dilation 1"),
        ({"output_padding": -1}, "conv.output_padding: must be >= 0"),
        ({"output_padding": 1, "transposed": False}, "conv.output_padding: only a transposed conv"),
        ({"padding": 6}, "with padding 6 has output size 0; it must be at least 1"),
        ({"output_padding": [1, 1, 1]}, "conv.output_padding: expected one value or 2"),
    ],
)
def test_bad_transposed_geometry_names_the_field(conv, expected):
    with pytest.raises(SpecError) as err:
        validate(with_conv(**conv))
    assert expected in str(err.value)


def test_output_padding_below_the_dilation_is_allowed():
    spec = validate(with_conv(stride=1, dilation=3, output_padding=2))  # PyTorch: < stride or < dilation
    assert spec.shapes()[0].sizes[1:] == (5 - 1 + 3 * 2 + 2 + 1 - 2, 7 - 1 + 3 * 2 + 2 + 1 - 2)


CONFIGS = [
    (1, {"in_channels": 6, "out_channels": 6, "kernel_size": 4, "stride": 3, "padding": 2, "output_padding": 2,
         "dilation": 2, "groups": 3}, (20,)),
    (2, {"in_channels": 4, "out_channels": 8, "kernel_size": (3, 2), "stride": (2, 1), "padding": (1, 0),
         "output_padding": (1, 0)}, (9, 11)),
    (2, {"in_channels": 4, "out_channels": 6, "kernel_size": 3, "dilation": 2, "groups": 2, "bias": False}, (4, 3)),
    (3, {"in_channels": 4, "out_channels": 8, "kernel_size": (2, 3, 3), "stride": (1, 2, 3), "padding": (0, 1, 2),
         "output_padding": (0, 1, 2)}, (4, 5, 6)),
    (3, {"in_channels": 2, "out_channels": 2, "kernel_size": 1, "stride": 3, "padding": 0}, (2, 2, 2)),
]


def spec_from_module(nd: int, kw: dict, size: tuple):
    conv = {"out_channels": kw["out_channels"], "kernel": _list(kw["kernel_size"]), "transposed": True}
    for field, key in (("stride", "stride"), ("padding", "padding"), ("output_padding", "output_padding"),
                       ("dilation", "dilation"), ("groups", "groups"), ("bias", "bias")):
        if key in kw:
            conv[field] = _list(kw[key])
    return validate({"name": "m", "input": {"channels": kw["in_channels"], "size": list(size)}, "conv": conv,
                     "epilogue": ["relu"]})


def _list(v):
    return list(v) if isinstance(v, tuple) else v


@pytest.mark.parametrize("nd, kw, size", CONFIGS)
def test_output_and_weight_shapes_match_conv_transpose(nd, kw, size):
    module = getattr(nn, f"ConvTranspose{nd}d")(**kw)
    spec = spec_from_module(nd, kw, size)
    out = module(torch.randn(2, kw["in_channels"], *size))
    assert spec.output_shape(2) == tuple(out.shape)
    assert spec.weight_shape() == tuple(module.weight.shape)


@pytest.mark.parametrize("nd, kw, size", CONFIGS)
def test_reference_is_conv_transpose_in_float64(nd, kw, size):
    torch.manual_seed(0)
    module = getattr(nn, f"ConvTranspose{nd}d")(**kw).double()
    spec = spec_from_module(nd, kw, size)
    ref = reference.Reference(spec).double()
    assert isinstance(ref.conv, getattr(nn, f"ConvTranspose{nd}d"))
    ref.conv.load_state_dict(module.state_dict())
    x = torch.randn(3, kw["in_channels"], *size, dtype=torch.float64)
    torch.testing.assert_close(ref(x), torch.relu(module(x)), rtol=1e-12, atol=1e-12)


def test_a_plain_conv_spells_and_hashes_as_before():
    plain = validate({**T2, "conv": {"out_channels": 6, "kernel": 3}})
    assert "transposed" not in plain.canonical()["conv"] and "output_padding" not in plain.canonical()["conv"]
    assert plain.shape_hash == validate({**T2, "conv": {"out_channels": 6, "kernel": 3, "transposed": False}}).shape_hash
    transposed = validate({**T2, "conv": {"out_channels": 6, "kernel": 3, "transposed": True}})
    assert transposed.shape_hash != plain.shape_hash
    assert validate(transposed.canonical()).shape_hash == transposed.shape_hash


def test_transposed_specs_read_from_yaml():
    (spec,) = parse_yaml(
        "name: up\ninput: {channels: 4, size: [5, 7]}\n"
        "conv: {transposed: true, out_channels: 8, kernel: 4, stride: 2, padding: 1, output_padding: 1}\n"
        "epilogue: [batch_norm, relu]\n"
    )
    assert spec.conv.transposed and spec.output_shape(1) == (1, 8, 11, 15)


# ---- plan and render -------------------------------------------------------------------------


def test_strided_transposed_convs_stay_on_ffma_even_when_deep_and_wide():
    deep = {"name": "deep", "input": {"channels": 32, "size": [16, 16]}, "conv": {"out_channels": 64, "kernel": 3}}
    assert build_plan(validate(deep))["mma"] is not None  # K = 32 x 9, 64 channels: tensor cores for a plain conv
    strided = {**deep, "conv": {**deep["conv"], "stride": 2, "transposed": True}}
    with pytest.raises(PlanError, match="the slab engine cannot run this layer: the conv is transposed"):
        build_plan(validate({**strided, "tile": {"engine": "slab"}}))
    boxed = build_plan(validate({**strided, "tile": {"engine": "ffma"}}))
    assert boxed["mma"] is None and boxed["engine"] == "ffma"
    plan = build_plan(spec_of("t2d_weights_in_global"))
    assert plan["mma"] is None and plan["transposed"] and not plan["weights_in_smem"]


@pytest.mark.parametrize("conv, pad", [
    ({"kernel": 3}, [2, 2]),
    ({"kernel": 4, "padding": 1}, [2, 2]),
    ({"kernel": [3, 5], "padding": [0, 2], "dilation": [1, 2]}, [2, 6]),
])
def test_a_stride_1_transposed_conv_is_planned_as_the_plain_conv_it_equals(conv, pad):
    data = {"name": "s1", "input": {"channels": 32, "size": [16, 16]}, "conv": {"out_channels": 64, **conv, "transposed": True},
            "epilogue": ["relu"], "precision": "tf32"}
    spec = validate(data)
    plain = forward_equivalent(spec)
    assert plain is not None and not plain.conv.transposed and list(plain.conv_geometry()["padding"]) == pad
    assert plain.output_shape(3) == spec.output_shape(3)
    plan = build_plan(spec)
    assert plan["engine"] in ("tma", "igemm") and plan["weight_transforms"] == [{"kind": "transposed_to_plain", "groups": 1}]
    assert plan["rewrites"][0].startswith("stride-1 transposed conv run as a plain conv")
    text = render(spec)
    assert "transposed: true" in text and "stride-1 transposed conv run as a plain conv" in text  # the user's spec, and why
    # the rewrite is a rewrite: off with the others, and never for a stride, an output padding, or a crop
    assert not build_plan(validate({**data, "rewrites": False})).get("weight_transforms")  # none: the user's weights as they are
    for other in ({"stride": 2}, {"dilation": 2, "output_padding": 1}, {"padding": 5}):
        assert forward_equivalent(validate({**data, "conv": {**data["conv"], **other}})) is None


def test_the_plain_weights_of_a_transposed_conv_give_its_output():
    """forward_weight against PyTorch's own transposed conv (float64, CPU): groups, dilation, 1-3D."""
    torch.manual_seed(0)
    for nd, cin, cout, groups, kernel, padding, dilation in [(2, 8, 12, 4, 3, 1, 1), (1, 6, 4, 2, 5, 3, 2),
                                                             (3, 4, 6, 1, 3, 0, 1), (2, 16, 32, 1, 4, 2, 1)]:
        x = torch.randn(2, cin, *[7] * nd, dtype=torch.float64)
        w = torch.randn(cin, cout // groups, *[kernel] * nd, dtype=torch.float64)
        want = getattr(F, f"conv_transpose{nd}d")(x, w, padding=padding, dilation=dilation, groups=groups)
        got = getattr(F, f"conv{nd}d")(x, forward_weight(w, groups), padding=dilation * (kernel - 1) - padding,
                                       dilation=dilation, groups=groups)
        assert got.shape == want.shape and torch.allclose(got, want, atol=1e-12, rtol=0), (nd, groups)


def test_tensor_cores_are_refused_for_a_transposed_conv():
    with pytest.raises(PlanError) as err:
        build_plan(validate({**T2, "epilogue": ["relu"], "tile": {"tensor_cores": True}}))
    assert "tile.tensor_cores" in str(err.value) and "transposed" in str(err.value)


def test_an_avg_pool_after_a_strided_transposed_conv_folds_into_a_plain_conv():
    spec = validate({**with_conv(stride=2, output_padding=0, padding=0), "epilogue": [{"avg_pool": 2}]})
    plan = build_plan(spec)  # specgen.poolfold: the two are one plain conv
    assert plan["rewrites"][0].startswith("transposed pool fold") and not plan["transposed"]
    # without rewrites the FFMA gather pulls each window through the transposed conv
    unfolded = build_plan(validate({**spec.model_dump(), "rewrites": False}))
    assert unfolded["fold"] is None and len(unfolded["levels"]) == 2 and unfolded["transposed"]
    # at stride 1 the conv is planned as a plain one, and the pool folds into that
    assert build_plan(validate({**with_conv(stride=1, output_padding=0, padding=0), "epilogue": [{"avg_pool": 2}]}))["fold"] is not None
    assert build_plan(validate({**spec.model_dump(), "conv": {"out_channels": 6, "kernel": 3}}))["fold"] is not None


def test_two_nested_pools_get_a_register_tile_that_does_not_spill():
    plan = build_plan(validate({**spec_of("t3d_s2_bn_avgpool_avgpool").model_dump(), "rewrites": False}))  # (else: one plain conv)
    assert plan["transposed"] and plan["ct"] * plan["pt"] <= 16


@pytest.mark.parametrize("name", [n for n in TRANSPOSED if build_plan(spec_of(n))["engine"] == "ffma" and build_plan(spec_of(n))["transposed"]])
def test_transposed_rendering_gathers(name):
    spec = spec_of(name)
    text = render(spec)
    assert "nw % S_W == 0" in text and "(K_W - 1 - kw) * DIL_W" in text
    assert "const float* __restrict__ weight,  // [C_IN, C_OUT_G, K_D, K_H, K_W]" in text
    assert "((group * C_IN_G + ci) * C_OUT_G + c % C_OUT_G) * TAPS + tap" in text
    assert "atomicAdd" not in text and "atom." not in text
    for var, start, bound in re.findall(r"for \(int (\w+) = ([^;]+); \1 (?:<|<=|>|>=) ([^;]+);", text):
        assert re.fullmatch(r"[A-Z0-9_ ()*/+\-]+", bound), (var, bound)
    assert "nw % S_W" not in render(validate({**T2, "conv": {"out_channels": 6, "kernel": 3}}))


@pytest.mark.nvcc
def test_transposed_specs_build_without_spills(tmp_path, monkeypatch):
    """Real nvcc (-Xptxas -v), through the pipeline and the cache, all at once."""
    from specgen import pipeline

    monkeypatch.setenv("SPECGEN_CACHE_DIR", str(tmp_path / "cache"))
    specs = [spec_of(name) for name in TRANSPOSED]
    for spec, item in zip(specs, pipeline.specialize_many(specs)):
        assert item.build.registers > 0 and item.build.spill_bytes == 0, (spec.name, item.build.log)


@pytest.mark.nvcc
def test_transposed_runtime_dims_rendering_compiles(tmp_path):
    from specgen.compile import compile_cubin

    src = tmp_path / "kernel.cu"
    src.write_text(render_plan(build_plan(spec_of("t3d_mixed_strides_affine_bn_lse")), runtime_dims=True))
    assert compile_cubin(src, tmp_path / "kernel.cubin", "sm_90").registers > 0


# ---- batch_norm ------------------------------------------------------------------------------


BN = {"name": "b", "input": {"channels": 3, "size": [6, 6]}, "conv": {"out_channels": 4, "kernel": 3}}


def test_batch_norm_names_its_tensors_after_pytorch():
    spec = validate({**BN, "epilogue": ["batch_norm", {"batch_norm": "bn2"}, {"batch_norm": {"affine": False, "name": "n"}}]})
    assert list(spec.params()) == ["bn_running_mean", "bn_running_var", "bn_weight", "bn_bias",
                                   "bn2_running_mean", "bn2_running_var", "bn2_weight", "bn2_bias",
                                   "n_running_mean", "n_running_var"]
    assert validate(spec.canonical()).shape_hash == spec.shape_hash
    explicit = validate({**BN, "epilogue": [{"batch_norm": {"running_mean": "m", "running_var": "v", "weight": "g",
                                                             "bias": "b", "eps": 1e-3}}]})
    assert list(explicit.params()) == ["m", "v", "g", "b"]


@pytest.mark.parametrize(
    "stage, expected",
    [
        ({"batch_norm": {"affine": False, "weight": "g"}}, "affine: false has no weight"),
        ({"batch_norm": {"eps": 0.0}}, "eps"),
        ({"batch_norm": {"name": "1bn"}}, "name must be an identifier"),
        ({"batch_norm": {"running_mean": "eps"}}, "'eps' is the op's constant"),
        ({"batch_norm": {"running_var": "x y"}}, "running_var"),
    ],
)
def test_bad_batch_norm_arguments_are_refused(stage, expected):
    with pytest.raises(SpecError) as err:
        validate({**BN, "epilogue": [stage]})
    assert expected in str(err.value)


def test_a_running_statistic_cannot_also_be_a_learnable_parameter():
    with pytest.raises(SpecError) as err:
        validate({**BN, "epilogue": ["batch_norm", {"mul": {"param": "bn_running_var"}}]})
    assert "'bn_running_var' is a running statistic (a buffer)" in str(err.value)


def test_layers_create_batch_norm_tensors_as_batch_norm_does():
    spec = validate({**BN, "epilogue": ["batch_norm", {"add": {"param": "shift"}}]})
    for layer in (FusedLayer(spec), reference.Reference(spec)):
        buffers = dict(layer.named_buffers())
        params = dict(layer.named_parameters())
        assert set(buffers) == {"bn_running_mean", "bn_running_var"}
        assert {"bn_weight", "bn_bias", "shift", "conv.weight"} <= set(params)
        assert torch.equal(buffers["bn_running_var"], torch.ones(4, 1, 1))
        assert torch.equal(buffers["bn_running_mean"], torch.zeros(4, 1, 1))
        assert torch.equal(params["bn_weight"], torch.ones(4, 1, 1)) and torch.equal(params["bn_bias"], torch.zeros(4, 1, 1))
    fused, plain = FusedLayer(spec), reference.Reference(spec)
    with torch.no_grad():
        plain.bn_running_var.uniform_(0.5, 2.0)
    fused.load_state_dict(plain.state_dict())
    assert torch.equal(fused.bn_running_var, plain.bn_running_var)


def test_batch_norm_reference_is_nn_batch_norm_in_eval_mode():
    torch.manual_seed(0)
    spec = validate({**T2, "epilogue": [{"batch_norm": {"eps": 1e-3}}]})
    ref = reference.Reference(spec).double()
    bn = nn.BatchNorm2d(6, eps=1e-3).double().eval()
    with torch.no_grad():
        bn.running_mean.normal_()
        bn.running_var.uniform_(0.5, 2.0)
        bn.weight.normal_()
        bn.bias.normal_()
        for name in ("running_mean", "running_var", "weight", "bias"):
            getattr(ref, f"bn_{name}").copy_(getattr(bn, name).view(6, 1, 1))
    x = torch.randn(2, 4, 5, 7, dtype=torch.float64)
    torch.testing.assert_close(ref(x), bn(ref.conv(x)), rtol=1e-12, atol=1e-12)


def test_batch_norm_renders_one_expression_per_channel():
    text = render(validate({**BN, "epilogue": [{"batch_norm": {"eps": 1e-3, "affine": False}}]}))
    assert "__frsqrt_rn(__ldg(p_bn_running_var + cj) + S0_EPS)" in text
    assert "p_bn_weight" not in text


# ---- importer --------------------------------------------------------------------------------


class UpBlock(nn.Module):
    def __init__(self, nd: int = 2, groups: int = 2):
        super().__init__()
        self.up = getattr(nn, f"ConvTranspose{nd}d")(4, 6, 3, stride=2, padding=1, output_padding=1, groups=groups,
                                                     dilation=1)
        self.bn = getattr(nn, f"BatchNorm{nd}d")(6)

    def forward(self, x):
        return torch.relu(self.bn(self.up(x)))


class FunctionalUp(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 3, 2, 3) * 0.3)
        self.bias = nn.Parameter(torch.randn(6))

    def forward(self, x):
        x = F.conv_transpose2d(x, self.weight, self.bias, stride=(2, 1), padding=(0, 1), output_padding=(1, 0),
                               groups=2, dilation=(1, 2))
        return torch.sigmoid(x).amax(dim=1)


def _randomize_bn(model):
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.running_mean.normal_()
                m.running_var.uniform_(0.5, 2.0)
                if m.weight is not None:
                    m.weight.normal_()
                    m.bias.normal_()


@pytest.mark.parametrize("nd", [1, 2, 3])
def test_conv_transpose_and_batch_norm_modules_import_as_one_layer(nd):
    torch.manual_seed(0)
    model = UpBlock(nd).eval()
    _randomize_bn(model)
    x = torch.randn((2, 4) + (5, 6, 7)[:nd])
    report = explain(model, x)
    assert report.fallbacks == []
    (spec,) = report.specs
    assert spec.conv.transposed and spec.conv_geometry()["output_padding"] == (1,) * nd and spec.conv.groups == 2
    assert [stage.op for stage in spec.epilogue] == ["batch_norm", "relu"]
    bn = spec.epilogue[0].args
    assert (bn.running_mean, bn.running_var, bn.weight, bn.bias) == ("bn_running_mean", "bn_running_var", "bn_weight", "bn_bias")
    fused = from_module(model, x)
    layer = next(m for m in fused.modules() if isinstance(m, FusedLayer))
    assert layer.conv is model.up and layer.bn_running_var is model.bn.running_var
    assert "bn_running_var" in dict(layer.named_buffers())
    with torch.no_grad():
        torch.testing.assert_close(fused(x), model(x))
    assert validate(parse_yaml(report.yaml())[0]).shape_hash == spec.shape_hash


def test_functional_conv_transpose_reads_every_argument():
    torch.manual_seed(0)
    model = FunctionalUp()
    x = torch.randn(2, 4, 5, 6)
    report = explain(model, x)
    assert report.fallbacks == []
    (spec,) = report.specs
    g = spec.conv_geometry()
    assert (g["stride"], g["padding"], g["output_padding"], g["dilation"]) == ((2, 1), (0, 1), (1, 0), (1, 2))
    assert spec.conv.out_channels == 6 and spec.weight_shape() == (4, 3, 2, 3)
    with torch.no_grad():
        torch.testing.assert_close(from_module(model, x)(x), model(x))


def test_affine_free_functional_batch_norm_round_trips():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)
            self.bn = nn.BatchNorm2d(4, affine=False, eps=1e-3)

        def forward(self, x):
            return F.batch_norm(self.conv(x), self.bn.running_mean, self.bn.running_var, training=False, eps=1e-3)

    model = M().eval()
    _randomize_bn(model)
    report = explain(model, torch.randn(1, 3, 6, 6))
    (spec,) = report.specs
    assert spec.epilogue[0].op == "batch_norm" and spec.epilogue[0].args.weight is None
    assert parse_yaml(report.yaml())[0].shape_hash == spec.shape_hash


def test_batch_norm_in_training_mode_imports_as_its_statistic_stage():
    """After a transposed conv too: the batch's statistics, the model's running ones updated."""
    torch.manual_seed(0)
    model = UpBlock().train()
    x = torch.randn(2, 4, 5, 6)
    report = explain(model, x)
    assert report.fallbacks == []
    (spec,) = report.specs
    assert [stage.op for stage in spec.epilogue] == ["batch_norm", "relu"] and spec.epilogue[0].args.training
    plain = copy.deepcopy(model)
    fused = from_module(model, x)
    layer = next(m for m in fused.modules() if isinstance(m, FusedLayer))
    assert layer.bn_running_mean is model.bn.running_mean and layer.bn_num_batches_tracked is model.bn.num_batches_tracked
    with torch.no_grad():
        torch.testing.assert_close(fused(x), plain(x))
    for name, buf in plain.bn.named_buffers():
        torch.testing.assert_close(getattr(model.bn, name), buf)


# ---- the public KernelBench problems -----------------------------------------------------------


def _imported_whole(training: bool) -> tuple[set, dict]:
    """The problems that import into one spec with no fallback, and why each other one does not."""
    fused, reasons = set(), {}
    for path in kb.problems():
        model, inputs = kb.load(path, training=training)
        report = explain(model, *inputs)
        if len(report.specs) == 1 and not report.fallbacks:
            fused.add(path.stem)
        else:
            reasons[path.stem] = [fb.reason for fb in report.fallbacks]
    return fused, reasons


@pytest.mark.skipif(kb.folder() is None, reason="the KernelBench problems are not beside the checkout")
def test_kernelbench_problems_that_import_whole():
    """Counts the problems that import into one spec with no fallback (eval mode): no regression,
    and every problem listed as fused is."""
    fused, reasons = _imported_whole(training=False)
    assert len(kb.problems()) == 46
    assert kb.FUSED <= fused, {name: reasons.get(name) for name in kb.FUSED - fused}
    assert len(fused) >= len(kb.FUSED) > kb.FUSED_BEFORE_NORMS > len(kb.FUSED_BEFORE) and kb.FUSED_BEFORE <= fused
    transposed = {name for name in fused if "ConvTranspose" in name}
    assert len(transposed) >= 13
    norms = {name for name in fused if any(op in name for op in ("Norm", "Softmax"))}
    assert len(norms) >= 20


@pytest.mark.skipif(kb.folder() is None, reason="the KernelBench problems are not beside the checkout")
def test_kernelbench_problems_that_import_whole_in_training_mode():
    """The same in training mode, as KernelBench runs the problems: every batch norm among them is
    its training-mode stage."""
    fused, reasons = _imported_whole(training=True)
    assert kb.FUSED_TRAIN <= fused, {name: reasons.get(name) for name in kb.FUSED_TRAIN - fused}
    assert len(fused) >= len(kb.FUSED_TRAIN) > len(kb.FUSED_TRAIN_BEFORE_NORMS) and kb.FUSED_TRAIN_BEFORE_NORMS <= fused
    assert {name for name in fused if "BatchNorm" in name} >= {
        "11_ConvTranspose2d_BatchNorm_Tanh_MaxPool_GroupNorm", "72_ConvTranspose3d_BatchNorm_AvgPool_AvgPool",
        "73_Conv2d_BatchNorm_Scaling", "77_ConvTranspose3d_Scale_BatchNorm_GlobalAvgPool",
    }


# ---- transposed convs on the implicit-GEMM engine: one GEMM per stride phase ------------------


def _emulate_phases(plan: dict, x: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
    """What the implicit-GEMM kernel computes for a transposed conv, in float64 on the CPU, read from
    its plan: each stride phase's GEMM over its own taps, with the weights as the launch permutes them."""
    from specgen.torchop import gemm_layout, gemm_weight

    ig = plan["igemm"]
    nd, cin, cout, cip = plan["ndim"], plan["cin"], plan["cout"], ig.cip
    x3 = x.reshape(x.shape[0], cin, *plan["in"])
    wp = gemm_weight(weight, gemm_layout(plan))
    last = ig.phases[-1]
    assert wp.numel() == last.w_offset + cout * last.taps_pad * cip == sum(cout * ph.taps_pad * cip for ph in ig.phases)
    out = torch.full((x.shape[0], cout, *plan["conv_out"]), float("nan"), dtype=x.dtype)
    stride = plan["stride"]
    for ph in ig.phases:
        w = wp[ph.w_offset:ph.w_offset + cout * ph.taps_pad * cip].reshape(cout, ph.taps_pad, cip)[:, :ph.taps, :cin]
        acc = torch.zeros((x.shape[0], cout, *ph.op), dtype=x.dtype)
        for t in range(ph.taps):
            td, th, tw = t // (ph.kp[1] * ph.kp[2]), t // ph.kp[2] % ph.kp[1], t % ph.kp[2]
            idx = [torch.arange(ph.op[a]) + ph.in_off[a] - (td, th, tw)[a] for a in range(3)]
            ok = [(i >= 0) & (i < plan["in"][a]) for a, i in enumerate(idx)]
            xs = x3[:, :, idx[0].clamp(0, plan["in"][0] - 1)][:, :, :, idx[1].clamp(0, plan["in"][1] - 1)][..., idx[2].clamp(0, plan["in"][2] - 1)]
            mask = ok[0][:, None, None] & ok[1][None, :, None] & ok[2][None, None, :]
            acc += torch.einsum("ncdhw,oc->nodhw", xs * mask, w[:, t, :])
        if bias is not None:
            acc += bias.view(1, cout, 1, 1, 1)
        out[:, :, ph.out_off[0]::stride[0], ph.out_off[1]::stride[1], ph.out_off[2]::stride[2]] = acc
    return out.reshape(x.shape[0], cout, *out.shape[5 - nd:])


@pytest.mark.parametrize("conv, size", [
    ({"kernel": 3, "stride": 2, "padding": 1, "output_padding": 1}, [5, 7]),
    ({"kernel": 4, "stride": 2, "padding": 1}, [6, 5]),
    ({"kernel": 1, "stride": 2}, [4, 4]),  # phases no tap reaches: bias only
    ({"kernel": 5, "stride": 3, "padding": 2, "output_padding": 2}, [7, 4]),
    ({"kernel": [2, 3], "stride": [2, 1], "padding": [0, 1]}, [5, 6]),
    ({"kernel": 3, "stride": 2, "padding": 1, "output_padding": 1}, [3, 4, 5]),
    ({"kernel": 4, "stride": 3, "padding": 1}, [9]),
])
def test_stride_phases_compute_the_transposed_conv(conv, size):
    torch.manual_seed(len(size) * 7 + conv["stride"] if isinstance(conv["stride"], int) else 3)
    cin, cout = 20, 24
    spec = validate({"name": "ph", "input": {"channels": cin, "size": size},
                     "conv": {"out_channels": cout, **conv, "transposed": True}, "tile": {"engine": "igemm"}})
    plan = build_plan(spec)
    assert plan["engine"] == "igemm" and plan["igemm"].phases
    geo = spec.conv_geometry()
    import math

    assert len(plan["igemm"].phases) == math.prod(min(s, o) for s, o in zip(geo["stride"], spec.shapes()[0].sizes[1:]))
    covered = sorted(t for ph in plan["igemm"].phases for t in ph.tap_index)
    assert covered == list(range(math.prod(geo["kernel"])))  # every tap in exactly one phase
    x, w, b, ref = float64_transposed_case(spec)
    got = _emulate_phases(plan, x, w, b)
    assert got.shape == ref.shape and torch.allclose(got, ref, atol=1e-12, rtol=0)


def test_transposed_convs_of_enough_channels_take_the_stride_phases():
    data = {"name": "up", "input": {"channels": 64, "size": [32, 32]},
            "conv": {"out_channels": 64, "kernel": 3, "stride": 2, "padding": 1, "output_padding": 1, "transposed": True},
            "epilogue": ["relu"], "precision": "tf32"}
    # Hopper: the TMA engine's phases; without wgmma/TMA (sm_80): the implicit GEMM's
    hopper = build_plan(validate(data))
    assert hopper["engine"] == "tma" and len(hopper["tma"].phases) == 4
    assert build_plan(validate(data), target=BUILTIN["sm_80"])["engine"] == "igemm"
    data = {**data, "tile": {"engine": "igemm"}}
    plan = build_plan(validate(data))
    assert plan["engine"] == "igemm" and len(plan["igemm"].phases) == 4 and plan["igemm"].w_pairs
    assert plan["igemm"].grid_gemms == 2
    text = render(validate(data))
    assert "case 1: conv_pair<Phase2, Phase3>" in text and "stride phases" in text and "atomicAdd" not in text and "atom." not in text
    assert "make_float2(v0, v1)" in text
    # few input channels (KernelBench's 3-channel upsamplers), a dilation, groups: the FFMA gather
    del data["tile"]
    for other in ({"input": {"channels": 3, "size": [32, 32]}}, {"conv": {**data["conv"], "dilation": 2}},
                  {"conv": {**data["conv"], "groups": 2}}):
        assert build_plan(validate({**data, **other}))["engine"] == "ffma", other
    with pytest.raises(PlanError, match="dilation"):
        build_plan(validate({**data, "conv": {**data["conv"], "dilation": 2}, "tile": {"engine": "igemm"}}))


@pytest.mark.nvcc
def test_transposed_implicit_gemm_kernels_build_without_spills(tmp_path, monkeypatch):
    from specgen import pipeline

    monkeypatch.setenv("SPECGEN_CACHE_DIR", str(tmp_path / "cache"))
    specs = [validate({"name": f"tig{i}", "input": {"channels": cin, "size": size},
                       "conv": {"out_channels": cout, **conv, "transposed": True}, "epilogue": ["relu", {"mul": 0.5}],
                       "precision": precision, "tile": {"engine": "igemm"}})
             for i, (cin, cout, size, conv, precision) in enumerate([
                 (64, 64, [16, 16], {"kernel": 3, "stride": 2, "padding": 1, "output_padding": 1}, "tf32"),
                 (32, 64, [6, 8, 8], {"kernel": 3, "stride": 2, "padding": 1, "output_padding": 1}, "fp32"),
                 (64, 128, [16, 16], {"kernel": 4, "stride": 2, "padding": 1}, "fp32"),
                 (128, 64, [8, 8], {"kernel": 2, "stride": 2}, "tf32"),
             ])]
    for spec, item in zip(specs, pipeline.specialize_many(specs)):
        assert item.build.registers > 0 and item.build.spill_bytes == 0, (spec.name, item.build.log)


@pytest.mark.parametrize("epilogue, why", [
    (["relu", {"max_pool": 2}, "tanh"], "a pool between the conv and the output"),
    # (a relu first: a mean right after the conv folds before it instead, specgen.tapsum)
    ([{"mul": 2.0}, "relu", {"mean": {"dims": [2, 3], "keepdim": True}}, {"logsumexp": {"dims": [1]}}], "a fused reduction"),
    ([{"amax": {"dims": [1]}}, {"mean": {"dims": [1, 2]}}, "gelu"], "a fused reduction"),  # (no keepdim: split before it)
])
def test_a_strided_transposed_conv_splits_before_a_pool_or_reduction(epilogue, why):
    """The stride phases run on a GEMM engine (Hopper's TMA engine; the implicit GEMM on sm_80) into
    T0; the pool or reduction reads it."""
    data = {"name": "tsplit", "input": {"channels": 32, "size": [12, 12]},
            "conv": {"out_channels": 64, "kernel": 3, "stride": 2, "padding": 1, "output_padding": 1, "transposed": True},
            "epilogue": epilogue, "precision": "tf32"}
    plan = build_plan(validate(data))
    assert plan["engine"] == "sequence" and [p["plan"]["engine"] for p in plan["parts"]] == ["tma", "ffma"]
    assert plan["parts"][0]["plan"]["tma"].phases and why in plan["why"][0]
    assert plan["out_shape"] == list(validate(data).shapes()[-1].sizes)
    ampere = build_plan(validate(data), target=BUILTIN["sm_80"])
    assert [p["plan"]["engine"] for p in ampere["parts"]] == ["igemm", "ffma"] and ampere["parts"][0]["plan"]["igemm"].phases
    # 3 input channels (KernelBench's small upsamplers, fused well on FFMA): whole
    assert build_plan(validate({**data, "input": {"channels": 3, "size": [12, 12]}}))["engine"] == "ffma"


def test_a_reduction_over_the_channels_after_a_strided_transposed_conv_stays_on_the_accumulators():
    """The TMA epilogue reduces over the channels: the whole layer in one kernel, or, with a pool or
    reduction after it, a body writing one channel (KernelBench 36's shape of layer)."""
    data = {"name": "tred", "input": {"channels": 32, "size": [12, 12]},
            "conv": {"out_channels": 64, "kernel": 3, "stride": 2, "padding": 1, "output_padding": 1, "transposed": True},
            "epilogue": [{"amin": {"dims": [1], "keepdim": True}}, "gelu"], "precision": "tf32"}
    whole = build_plan(validate(data))
    assert whole["engine"] == "tma" and whole["tma"].channel_reduction and whole["tma"].phases
    data["epilogue"] = [{"amin": {"dims": [1], "keepdim": True}}, {"sum": {"dims": [2], "keepdim": True}}, "gelu"]
    plan = build_plan(validate(data))
    body, rest = (p["plan"] for p in plan["parts"])
    assert plan["engine"] == "sequence" and body["engine"] == "tma" and body["tma"].channel_reduction
    assert plan["steps"][0]["out_shape"] == [1, 24, 24] and "the conv and the stages before it run on the tma engine" in plan["why"][0]
    assert plan["out_shape"] == list(validate(data).shapes()[-1].sizes)
    # too many channels for one block: the conv alone before it
    wide = build_plan(validate({**data, "conv": {**data["conv"], "out_channels": 320}}))
    assert wide["steps"][0]["out_shape"][0] == 320


@pytest.mark.parametrize("stride, size, pairs", [
    (2, [5, 7], True),  # W outputs 14 and 13 (odd): phase 1's grid column past its last output is computed, not stored
    ([2, 3], [5, 7], False),  # stride 3 along W: one phase per block
    ([1, 2], [4, 2], True),  # 3 outputs along W (2 and 1 per phase)
])
def test_w_pairs_share_one_grid_and_keep_every_phase_s_taps(stride, size, pairs):
    from specgen.igemm import IgemmConfig

    spec = validate({"name": "wp", "input": {"channels": 32, "size": size},
                     "conv": {"out_channels": 64, "kernel": 3, "stride": stride, "padding": 1, "transposed": True},
                     "precision": "tf32", "tile": {"engine": "igemm"}})
    ig = build_plan(spec)["igemm"]
    assert ig.w_pairs == pairs
    out_w = spec.shapes()[0].sizes[-1]
    if pairs:
        for a, b in zip(ig.phases[0::2], ig.phases[1::2]):
            assert (a.out_off[2], b.out_off[2]) == (0, 1) and a.out_off[:2] == b.out_off[:2]
            assert a.grid_positions == b.grid_positions and a.grid_w == b.grid_w == -(-out_w // 2)
            assert (a.op[2], b.op[2]) == (-(-out_w // 2), out_w // 2)  # the true extents (what each phase stores)
        assert ig.grid_gemms == len(ig.phases) // 2
        assert ig.positions == max(ph.grid_positions for ph in ig.phases)
    else:
        assert ig.grid_gemms == len(ig.phases)
    # the layer's weights, phase after phase in the plan's order, are every tap once
    assert sorted(t for ph in ig.phases for t in ph.tap_index) == list(range(9))
    offsets = [ph.w_offset for ph in ig.phases]
    assert offsets == sorted(offsets) and offsets[0] == 0
    # asking for one phase per block turns the pairs off
    single = build_plan(spec, IgemmConfig(4, 2, 2, 4, 32, 3, phases_per_block=1))["igemm"]
    assert not single.w_pairs and single.grid_gemms == len(single.phases)


def test_w_pairs_stash_the_first_gemm_s_sums_where_shared_memory_allows():
    from specgen import target as targets
    from specgen.igemm import IgemmConfig

    spec = validate({"name": "wp", "input": {"channels": 64, "size": [8, 8]},
                     "conv": {"out_channels": 64, "kernel": 4, "stride": 2, "padding": 1, "transposed": True},
                     "precision": "tf32"})
    cfg = IgemmConfig(4, 2, 2, 4, 32, 3)  # 128 x 64: 78 KB of pipeline, 32 KB of stash
    paired = build_plan(spec, cfg)["igemm"]
    single = build_plan(spec, IgemmConfig(4, 2, 2, 4, 32, 3, phases_per_block=1))["igemm"]
    assert paired.w_pairs and not single.w_pairs and paired.smem_bytes == single.smem_bytes + 4 * 128 * 64
    # sm_86 has 99 KB per block: the planner's pairs give way to one phase per block
    assert not build_plan(spec, cfg, targets.get("sm_86"))["igemm"].w_pairs
    # nor do 16 warps (128 registers a thread)
    assert not build_plan(spec, IgemmConfig(4, 4, 2, 4, 32, 3))["igemm"].w_pairs
    assert build_plan(spec, IgemmConfig(4, 4, 2, 4, 32, 3, phases_per_block=2))["igemm"].w_pairs
    # asked for, pairs are kept even where they do not fit (the plan then refuses the tile)
    with pytest.raises(ValueError, match="shared memory"):
        build_plan(spec, IgemmConfig(4, 2, 2, 4, 32, 3, phases_per_block=2), targets.get("sm_86"))
