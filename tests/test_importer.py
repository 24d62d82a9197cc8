"""specgen.explain / specgen.from_module on the suite in import_models.py (CPU reference path)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn

import specgen
from specgen.importer import Fallback, ImportedLayer, ModelImportError, explain, from_module
from specgen.module import FusedLayer
from specgen.spec import load, parse_yaml

import import_models as im
from seed_models import SEEDS

pytestmark = pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel lengths")


def _build(case):
    torch.manual_seed(0)
    model = case.make()
    dtype = next(model.parameters()).dtype
    return model, torch.randn(case.shape, dtype=dtype)


def _ops(report) -> list[list[str]]:
    return [[stage.op for stage in spec.epilogue] for spec in report.specs]


def _fused_layers(module: nn.Module) -> list[FusedLayer]:
    return [m for m in module.modules() if isinstance(m, FusedLayer)]


# -- the suite that must fuse completely ---------------------------------------------------------


@pytest.mark.parametrize("case", im.CASES, ids=lambda c: c.id)
def test_explain_finds_every_chain(case):
    model, x = _build(case)
    report = explain(model, x)
    assert report.fallbacks == []
    assert _ops(report) == case.ops
    names = [spec.name for spec in report.specs]
    assert len(set(names)) == len(names)
    assert all(name.startswith(type(model).__name__.lower() + "_") for name in names)


@pytest.mark.parametrize("case", im.CASES, ids=lambda c: c.id)
def test_from_module_matches_and_shares_parameters(case):
    model, x = _build(case)
    fused = from_module(model, x)
    layers = _fused_layers(fused)
    assert len(layers) == len(case.ops)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), model(x))
        bigger = torch.randn((x.shape[0] + 3, *x.shape[1:]))  # the batch stays free
        torch.testing.assert_close(fused(bigger), model(bigger))
    originals = {id(p) for p in model.parameters()}
    assert {id(p) for p in fused.parameters()} <= originals
    for layer in layers:
        assert id(layer.conv.weight) in originals
        assert layer.conv.bias is None or id(layer.conv.bias) in originals
        for tensor in layer.spec_params().values():  # per-channel tensors: views of the originals' storage
            owners = [t for t in (*model.parameters(), *model.buffers()) if t.data_ptr() == tensor.data_ptr()]
            assert owners


@pytest.mark.parametrize("case", im.CASES, ids=lambda c: c.id)
def test_from_module_matches_in_both_modes(case):
    """Imported in eval mode and in training mode (batch norms, dropout), then switched: the fused
    model computes what the model computes in each."""
    for training in (False, True):
        model, x = _build(case)
        modal = [m for m in model.modules() if isinstance(m, (nn.modules.batchnorm._BatchNorm, nn.Dropout))]
        model.train(training)
        fused = from_module(model, x)
        for mode in (training, not training):
            if mode and any(isinstance(m, nn.Dropout) for m in modal):
                continue  # random
            if modal and not training and mode:
                continue  # imported in eval mode, batch norm and dropout stay so (documented)
            fused.train(mode), model.train(mode)
            with torch.no_grad():
                torch.testing.assert_close(fused(x), model(x))


def test_module_and_functional_forms_share_the_very_parameters():
    torch.manual_seed(0)
    model = im.ParamArith()
    fused = from_module(model, torch.randn(im.IMG))
    (layer,) = _fused_layers(fused)
    assert layer.conv is model.conv
    assert layer.bias_param is model.bias
    assert layer.scale is model.scale
    assert layer.shift is model.shift
    assert layer.denominator is model.denominator  # a buffer stays a buffer

    model = im.FunctionalConv()
    fused = from_module(model, torch.randn(im.IMG))
    first, second = _fused_layers(fused)
    assert first.conv.weight is model.weight and first.conv.bias is model.bias
    assert second.conv.weight is model.weight2 and second.conv.bias is None


@pytest.mark.parametrize("make", [im.ParamArith, im.FunctionalConv, im.FlattenAfterPool, im.ParamExpr, im.ScalarParam,
                                  im.CloneDetachResidual])
def test_training_the_fused_module_trains_the_original(make):
    torch.manual_seed(0)
    model = make()
    x = torch.randn(im.IMG)
    fused = from_module(model, x)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = torch.optim.SGD(fused.parameters(), lr=0.1)
    loss = fused(x).square().sum()
    loss.backward()
    optimizer.step()
    changed = [name for name, p in model.named_parameters() if not torch.equal(p.detach(), before[name])]
    assert sorted(changed) == sorted(before)  # every parameter of the original moved
    with torch.no_grad():
        torch.testing.assert_close(fused(x), model(x))


@pytest.mark.parametrize("make", [im.ParamArith, im.ScalarParam, im.CloneDetachResidual, im.SoftplusInsideExpr])
def test_gradients_match_the_original(make):
    """Including a scalar parameter (its gradient summed over every channel) and a detached copy
    (no gradient through it: treating it as the value itself would double the conv's)."""
    torch.manual_seed(0)
    model = make()
    x = torch.randn(im.IMG)
    fused = from_module(model, x)
    model(x).sin().sum().backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    fused(x).sin().sum().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name])


# -- recognition details -------------------------------------------------------------------------


def test_module_defaults_and_arguments_are_read():
    torch.manual_seed(0)
    (spec,) = explain(im.LeakyForms(), torch.randn(im.IMG)).specs
    slopes = [stage.args.negative_slope for stage in spec.epilogue if stage.op == "leaky_relu"]
    assert slopes == [0.01, 0.2, 0.3]
    (spec,) = explain(im.ClampForms(), torch.randn(im.IMG)).specs
    bounds = [(s.args.min, s.args.max) for s in spec.epilogue]
    assert bounds == [(-1.0, 1.0), (-0.5, None), (None, 0.8), (-0.4, None), (None, 0.7)]
    (spec,) = explain(im.ConstArith(), torch.randn(im.IMG)).specs
    assert [s.args.value for s in spec.epilogue] == [2.0, 2.5, 0.75, 0.5, 0.25, 1.5, 3.0, 0.1, 0.2, 3.0]
    (spec,) = explain(im.GeluForms(), torch.randn(im.IMG)).specs
    assert [s.args.approximate for s in spec.epilogue] == ["tanh", "none"]


def test_handwritten_hardswish_becomes_one_expression():
    (spec,) = explain(im.HardswishByHand(), torch.randn(im.IMG)).specs
    assert spec.epilogue[0].args.code == "x * clamp((x + 3.0) / 6.0, 0.0, 1.0)"


def test_detached_copies_and_softplus_are_written_into_one_expression():
    (spec,) = explain(im.CloneDetachResidual(), torch.randn(im.IMG)).specs
    assert spec.epilogue[0].args.code == "(x + bias_param + detach(x)) * detach(x) + detach(x)"
    (spec,) = explain(im.SoftplusInsideExpr(), torch.randn(im.IMG)).specs
    assert [s.args.code for s in spec.epilogue] == ["tanh(softplus(x)) * x", "x * (softplus(2.0 * x) / 2.0)"]


@pytest.mark.parametrize("training", [False, True], ids=["eval", "training"])
def test_residual_blocks_fuse_their_shortcut_and_match(training):
    """The shortcut (the block's input, or the projection chain's output, computed after the main
    branch) is an extra input of the main chain's layer; the fused model matches the original,
    gradients and running statistics included."""
    import copy

    torch.manual_seed(0)
    model = im._randomize_bn(im.DownsampleBlock()).train(training)
    x = torch.randn(3, im.C, 8, 8, requires_grad=True)
    plain = copy.deepcopy(model)
    fused = from_module(model, x)
    report = fused.specgen_report
    assert not report.fallbacks and [list(s.inputs()) for s in report.specs] == [[], ["down_1"], []]
    main = next(layer for layer in _fused_layers(fused) if layer.spec.inputs())
    assert main.spec.epilogue[1].args.input == "down_1"
    y, want = fused(x), plain(x)
    torch.testing.assert_close(y, want)
    if training:
        grad = torch.randn_like(y)
        got = torch.autograd.grad(y, [x, *model.parameters()], grad)
        expected = torch.autograd.grad(want, [x, *plain.parameters()], grad)
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b)
        for a, b in zip(model.buffers(), plain.buffers()):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("name", sorted(im.TIME_EMBEDDINGS))
def test_a_per_sample_channel_operand_is_an_extra_input_of_its_shape(name):
    """A time embedding ([N, C] viewed as [N, C, 1, ...]) joins the conv's chain as an extra input
    of one value per sample and channel; the embedding's own ops stay PyTorch; gradients reach it."""
    make, shape, ops = im.TIME_EMBEDDINGS[name]
    torch.manual_seed(0)
    model = make()
    x = torch.randn(shape, requires_grad=True)
    report = explain(model, x)
    assert _ops(report) == [ops], str(report)
    (spec,) = report.specs
    ((input_name, input_shape),) = spec.inputs().items()
    assert input_shape == (im.C,) + (1,) * (len(shape) - 2)
    assert spec.epilogue[0].args.input == input_name and spec.epilogue[0].args.shape == list(input_shape)
    assert all(f.node != "conv" for f in report.fallbacks)
    fused = from_module(model, x)
    y, want = fused(x), model(x)
    torch.testing.assert_close(y, want)
    grad = torch.randn_like(y)
    got = torch.autograd.grad(y, [x, *model.parameters()], grad)
    expected = torch.autograd.grad(want, [x, *model.parameters()], grad)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)


def test_a_scalar_parameter_is_shared_and_expanded():
    torch.manual_seed(0)
    model = im.ScalarParam()
    x = torch.randn(im.IMG)
    fused = from_module(model, x)
    (layer,) = _fused_layers(fused)
    assert layer.shift is model.shift and layer.scale is model.scale  # the model's tensors, not copies
    assert layer.spec.params() == {"scale": (im.C, 1, 1), "shift": (im.C, 1, 1)}
    with torch.no_grad():
        model.shift.fill_(-1.25)  # a later change to the parameter is seen
        torch.testing.assert_close(fused(x), model(x))


def test_per_channel_parameters_are_named_after_their_attributes():
    (spec,) = explain(im.ParamArith(), torch.randn(im.IMG)).specs
    assert list(spec.params()) == ["bias_param", "scale", "shift", "denominator"]  # 'bias' is reserved
    (spec,) = explain(im.ParamExpr(), torch.randn(im.IMG)).specs
    assert set(spec.params()) == {"beta", "gate"}


def test_pools_and_reductions_keep_their_geometry():
    (spec,) = explain(im.PoolModules(), torch.randn(im.IMG)).specs
    canonical = spec.canonical()["epilogue"]
    assert canonical[0]["avg_pool"]["kernel"] == [2, 2] and canonical[0]["avg_pool"]["stride"] == [2, 2]
    assert canonical[2]["max_pool"] == {"kernel": [3, 3], "stride": [1, 1], "padding": [1, 1], "dilation": [1, 1]}
    (spec,) = explain(im.MinMaxReductions(), torch.randn(im.IMG)).specs
    assert [(s.args.dims, s.args.keepdim) for s in spec.epilogue] == [([1], True), ([2], False), ([2], False)]


def test_shape_ops_after_a_reduction_are_absorbed_and_restored():
    model = im.ViewAfterMean()
    x = torch.randn(im.IMG)
    (spec,) = explain(model, x).specs
    assert spec.output_shape(2) == (2, 4, 1, 1)
    fused = from_module(model, x)
    assert fused(x).shape == model(x).shape == (2, 4)


def test_conv_geometry_is_read_from_modules_and_functions():
    (spec,) = explain(im.ConvGeometry(), torch.randn(2, 4, 9, 8)).specs
    conv = spec.canonical()["conv"]
    assert conv == {
        "out_channels": 8,
        "kernel": [3, 2],
        "stride": [2, 1],
        "padding": [1, 2],
        "dilation": [1, 2],
        "groups": 2,
        "bias": False,
    }
    (spec,) = explain(im.ConvSamePadding(), torch.randn(im.IMG)).specs
    assert spec.canonical()["conv"]["padding"] == [1, 1]


def test_padding_the_conv_cannot_say_is_written_out_and_a_zero_pad_is_taken_in():
    """A conv padded otherwise than the same zeros on both sides runs unpadded after an F.pad that
    stays PyTorch (as PyTorch runs it); a zero F.pad, even per dim, joins the conv's own padding."""
    model = im.ZeroPadIntoConv()
    report = explain(model, torch.randn(im.IMG))
    assert [s.canonical()["conv"]["padding"] for s in report.specs] == [[2, 3], [0, 1]]
    assert [s.name for s in report.specs] == ["zeropadintoconv_conv", "zeropadintoconv_w"]
    fused = from_module(model, torch.randn(im.IMG))
    assert not [n for n in fused.graph.nodes if n.target is torch.nn.functional.pad]
    for make, kernel in ((im.ReflectPadding, [3, 3]), (im.EvenKernelSame, [2, 2])):
        model = make().eval()
        (spec,) = explain(model, torch.randn(im.IMG)).specs
        assert spec.name.endswith("_conv") and spec.canonical()["conv"]["kernel"] == kernel
        assert spec.canonical()["conv"]["padding"] == [0, 0]
        fused, x = from_module(model, torch.randn(im.IMG)), torch.randn(3, *im.IMG[1:])
        assert [n.kwargs.get("mode") for n in fused.graph.nodes if n.target is torch.nn.functional.pad] == \
            ["reflect" if make is im.ReflectPadding else "constant"]
        with torch.no_grad():
            torch.testing.assert_close(fused(x), model(x))


def test_the_report_round_trips_through_yaml():
    torch.manual_seed(0)
    report = explain(im.TwoChains(), torch.randn(im.IMG))
    again = parse_yaml(report.yaml())
    assert [s.canonical() for s in again] == [s.canonical() for s in report.specs]
    assert "twochains_conv1" in str(report)


# -- the seed models -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(SEEDS))
def test_seed_models_become_their_example_specs(name):
    cls, shape = SEEDS[name]
    torch.manual_seed(0)
    model, x = cls(), torch.randn(shape)
    report = explain(model, x, precision="fp32")  # the examples are fp32 specs
    assert report.fallbacks == []
    (spec,) = report.specs
    want = load(f"examples/{name}.yaml").canonical()
    got = spec.canonical()
    want.pop("name"), got.pop("name")
    assert got == want
    fused = from_module(model, x)
    assert len(_fused_layers(fused)) == 1
    with torch.no_grad():
        torch.testing.assert_close(fused(x), model(x))


# -- fallbacks -----------------------------------------------------------------------------------


@pytest.mark.parametrize("case", im.FALLBACKS, ids=lambda c: c.id)
def test_fallbacks_say_why(case):
    model, x = _build(case)
    report = explain(model, x)
    assert _ops(report) == case.ops
    assert all(isinstance(fb, Fallback) for fb in report.fallbacks)
    for node, phrase in case.expect:
        reasons = [fb.reason for fb in report.fallbacks if fb.node == node]
        assert reasons, f"no fallback for {node}: {report.fallbacks}"
        assert phrase in reasons[0]
    fused = from_module(model, x)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), model(x))


def test_batchnorm_in_training_mode_is_its_statistic_stage():
    """A batch norm in training mode (how a model is built) fuses as the batch-statistics stage that
    updates the model's running statistics (tests/test_importer_norms.py checks the updates)."""
    report = explain(im.BatchNormTraining(), torch.randn(im.IMG))
    assert report.fallbacks == []
    (spec,) = report.specs
    bn = spec.epilogue[0]
    assert bn.kind == "norm" and bn.args.training and bn.args.momentum == 0.1
    assert bn.args.buffer_names() == ("bn_running_mean", "bn_running_var", "bn_num_batches_tracked")


def test_explain_leaves_running_statistics_alone():
    model = im.BatchNormTraining()
    before = [b.clone() for b in model.buffers()]
    explain(model, torch.randn(im.IMG))
    assert all(torch.equal(a, b) for a, b in zip(before, model.buffers()))


def test_a_value_read_before_an_in_place_op_keeps_its_value():
    model = im.InplaceAfterARead()
    x = torch.randn(im.IMG)
    report = explain(model, x)
    assert report.specs == [] or all(spec.epilogue[0].op != "mul" for spec in report.specs)
    fused = from_module(model, x)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), model(x))


def test_an_untraceable_model_has_its_children_imported_one_by_one():
    torch.manual_seed(0)
    model = im._bn(im.ControlFlowOnValues)()
    x = torch.randn(im.IMG)
    report = explain(model, x)
    assert [spec.name for spec in report.specs] == ["controlflowonvalues_stem_0", "controlflowonvalues_block1_conv",
                                                     "controlflowonvalues_block2_conv"]
    assert _ops(report) == [["relu"], ["batch_norm", "relu", "add"], ["batch_norm", "relu", "add"]]
    assert "torch.fx cannot trace ControlFlowOnValues" in report.fallbacks[0].reason
    assert any(fb.node.startswith("head.") for fb in report.fallbacks)  # a child's own fallbacks, named under it
    fused = from_module(model, x)
    assert fused is not model and isinstance(fused, im.ControlFlowOnValues)
    assert [type(m).__name__ for m in model.children()] == ["Sequential", "_ResidualBlock", "_ResidualBlock", "ReLU", "Conv2d"]
    assert isinstance(fused.act, nn.ReLU) and fused.head is model.head  # called twice / nothing to fuse: as they were
    assert len(_fused_layers(fused)) == 3
    assert {id(p) for p in fused.parameters()} == {id(p) for p in model.parameters()}
    with torch.no_grad():
        torch.testing.assert_close(fused(x), model(x))
        bigger = torch.randn((x.shape[0] + 3, *x.shape[1:]))
        torch.testing.assert_close(fused(bigger), model(bigger))


def test_an_untraceable_model_without_fusable_children_is_returned_as_it_is():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.act = nn.ReLU()

        def forward(self, x):
            return self.act(x) if x.sum() > 0 else x

    model = Branchy()
    assert from_module(model, torch.randn(2, 3, 4, 4)) is model


def test_a_conv_feeding_two_branches_is_not_fused():
    report = explain(im.TwoBranches(), torch.randn(im.IMG))
    assert report.specs == []
    reasons = dict(report.fallbacks)
    assert "is used by 2 nodes (relu, sigmoid)" in reasons["conv"]
    assert "used more than once" in reasons["relu"]


def test_an_unsupported_op_ends_the_chain_there():
    class CumsumAfterRelu(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = im.conv2d()

        def forward(self, x):
            return torch.cumsum(torch.relu(self.conv(x)) * 2, 1)

    report = explain(CumsumAfterRelu(), torch.randn(im.IMG))
    assert _ops(report) == [["relu", "mul"]]
    assert report.fallbacks == [Fallback("cumsum", "torch.cumsum is not a supported op")]


def test_each_fallback_is_logged_once(caplog):
    with caplog.at_level(logging.INFO, logger="specgen"):
        from_module(im.CumsumAfterConv(), torch.randn(im.IMG))
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len([line for line in lines if "cumsum runs as PyTorch" in line]) == 1
    assert any("torch.cumsum is not a supported op" in line for line in lines)


def test_untraceable_models_run_unchanged(caplog):
    model = im.ControlFlow()
    with caplog.at_level(logging.WARNING, logger="specgen"):
        assert from_module(model, torch.randn(im.IMG)) is model
    assert any("torch.fx cannot trace" in r.getMessage() for r in caplog.records)


# -- bad input -----------------------------------------------------------------------------------


def test_bad_arguments_raise_a_clear_error():
    with pytest.raises(ModelImportError, match="expected an nn.Module"):
        explain(lambda x: x, torch.randn(im.IMG))
    with pytest.raises(ModelImportError, match="at least one example input"):
        explain(im.ReluForms())
    with pytest.raises(ModelImportError, match="fails on the example inputs"):
        explain(im.ReluForms(), torch.randn(2, 5, 8, 8))


def test_the_table_lists_every_spelling():
    from specgen.importer import supported_names

    names = supported_names()
    assert {"F.relu", "torch.relu", "torch.clamp_min", "F.adaptive_avg_pool2d", "torch.logsumexp"} <= set(names["functions"])
    assert {"relu", "clamp", "sum", "view"} <= set(names["methods"])
    assert {"nn.ReLU", "nn.LeakyReLU", "nn.Conv3d", "nn.AdaptiveMaxPool2d", "nn.BatchNorm2d"} <= set(names["modules"])


def test_lazy_names_on_the_package():
    assert specgen.explain is explain and specgen.from_module is from_module
    assert issubclass(ImportedLayer, FusedLayer)


def test_precision_follows_the_model():
    """float32 chains run as PyTorch would: tf32 while cuDNN may use TF32, else fp32 (or as asked);
    a bfloat16 / float16 model's chains run in its dtype."""
    cls, shape = SEEDS["kb90"]
    torch.manual_seed(0)
    model, x = cls(), torch.randn(shape)
    saved = torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cudnn.allow_tf32 = True
        assert explain(model, x).specs[0].precision == "tf32"
        torch.backends.cudnn.allow_tf32 = False
        assert explain(model, x).specs[0].precision == "fp32"
        assert explain(model, x, precision="tf32").specs[0].precision == "tf32"
    finally:
        torch.backends.cudnn.allow_tf32 = saved
    for dtype, precision in ((torch.bfloat16, "bf16"), (torch.float16, "fp16")):
        report = explain(cls().to(dtype), x.to(dtype))
        assert report.fallbacks == [] and report.specs[0].precision == precision
    with pytest.raises(ValueError, match="precision: a bf16 layer needs the model in that dtype"):
        explain(model, x, precision="bf16")
    with pytest.raises(ValueError, match="precision: expected None, 'fp32' or 'tf32'"):
        explain(model, x, precision="int8")


class _ConstantsInForward(nn.Module):
    """A conv chain that takes a constant made in forward, and PyTorch code after the chain that
    makes two more (a float and an int)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)

    def forward(self, x):
        y = torch.min(torch.relu(self.conv(x)), torch.tensor(0.5, device=x.device))
        z = torch.flatten(y, 1) * torch.tensor(2.0, device=x.device)
        return z + torch.tensor(3, device=x.device)


def test_constants_made_in_forward_are_filled_on_the_device():
    """torch.tensor(<number>) copies from the host on every call, which a CUDA graph cannot capture;
    the fused graph and the chains' originals make the same tensors with torch.full."""
    import torch.fx as fx

    from specgen.importer import rewrite

    traced = fx.symbolic_trace(_ConstantsInForward())
    x = torch.randn(2, 3, 9, 9)
    want = traced(x)
    assert rewrite.capturable(traced.graph) == 3
    traced.recompile()
    assert not any(n.target is torch.tensor for n in traced.graph.nodes)
    got = traced(x)
    assert got.dtype == want.dtype and torch.equal(got, want)
    assert torch.full((), 3).dtype == torch.tensor(3).dtype  # (an int stays an int64, as torch.tensor made it)

    model = _ConstantsInForward().eval()
    fused = from_module(model, x)
    assert not any(n.target is torch.tensor for n in fused.graph.nodes)
    torch.testing.assert_close(fused(x), model(x))


def test_a_convolution_alone_is_fused_in_fp32_mode_on_a_tensor_core_engine():
    """With nothing after it, a convolution is fused only where PyTorch would run it on the FFMA
    units (fp32 mode: cuDNN with TF32 off) and its plan is 3xTF32 on the tensor cores."""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Conv2d(64, 64, 3, padding=1)), torch.randn(2, 64, 28, 28)
    (spec,) = explain(model, x, precision="fp32").specs
    assert spec.epilogue == [] and spec.precision == "fp32"
    report = explain(model, x, precision="tf32")
    assert report.specs == []
    assert "nothing to fuse after this convolution" in report.fallbacks[0].reason
    small = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1))  # planned on the FFMA engine: PyTorch's
    assert explain(small, torch.randn(2, 3, 16, 16), precision="fp32").specs == []


class _BnPoolThenConv(nn.Module):
    """conv + training-mode batch norm + ReLU + max-pool, then a conv and a mean: two fused layers
    whose sizes past the channels come from the example."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.pool = nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(8, 4, 3)

    def forward(self, x):
        return self.conv2(self.pool(torch.relu(self.bn(self.conv(x))))).mean((2, 3))


def test_an_input_of_other_sizes_runs_a_sibling_layer_for_them(caplog):
    """A model fused at 16x16 called at 24x24: each fused layer makes a sibling for the new sizes
    (said once in the log), sharing its parameters and buffers: in training mode the model's
    running statistics move as the original's do, in eval mode the sibling's eval twin runs; a
    size the layer cannot take is refused, saying which layer and why."""
    import copy

    def close(got, want):  # (the project's fp32 bar: the running statistics sum in another order)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)

    torch.manual_seed(0)
    model = _BnPoolThenConv().train()
    plain = copy.deepcopy(model)
    fused = from_module(model, torch.randn(2, 3, 16, 16))
    layers = [m for m in fused.modules() if isinstance(m, ImportedLayer)]
    assert len(layers) == 2
    x = torch.randn(4, 3, 24, 24)
    with caplog.at_level(logging.WARNING, logger="specgen"):
        close(fused(x), plain(x))
        close(fused(x - 1), plain(x - 1))
    said = [r.getMessage() for r in caplog.records if "specializing a kernel" in r.getMessage()]
    assert len(said) == 2 and "[24, 24]" in said[0] and "[12, 12]" in said[1], said
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        close(getattr(model.bn, name), getattr(plain.bn, name))
    assert [list(layer._at_sizes) for layer in layers] == [[(24, 24)], [(12, 12)]]
    assert all(s.conv is layer.conv for layer in layers for s in layer._at_sizes.values())
    fused.eval(), plain.eval()
    with torch.no_grad():
        close(fused(x), plain(x))
        calls = []
        layers[0].register_forward_hook(lambda *_: calls.append(1))
        fused(x)
        assert calls == [1]  # a hook on the layer runs once per call, not again for its sibling
        twin = copy.deepcopy(fused)  # a copy starts without siblings (they hold the original's dicts)
        assert all(not m._at_sizes for m in twin.modules() if isinstance(m, ImportedLayer))
        close(twin(x), plain(x))
        close(fused(x[:, :, :16, :16]), plain(x[:, :, :16, :16]))  # its own size, as before
        with pytest.raises(ValueError, match=r"bnpoolthenconv_conv2: fused for inputs of shape \[batch, 8, 8, 8\]; an input of "
                                             r"shape \[1, 8, 2, 2\] does not fit the layer: conv \(spatial dim 0\): the kernel spans 3"):
            fused(torch.randn(1, 3, 5, 5))
        with pytest.raises(ValueError, match=r"expected an input of shape \[batch, 3, 16, 16\]"):
            fused(torch.randn(1, 4, 16, 16))
