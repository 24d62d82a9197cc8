"""The statistic stages through the importer, on the CPU (the layers' reference path): every spelling
of the op table's NORMS rows and of training-mode batch norm imports as its stage, the arguments
are read, the refusals say why, a training-mode batch norm updates the model's own running
statistics as PyTorch does, and the public KernelBench problems that import whole compute what the
models compute, in eval and in training mode (tests/test_importer.py runs the models of
import_models.py, norms among them)."""

from __future__ import annotations

import copy
import re

import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import kernelbench_problems as kb  # noqa: E402
import import_models as im  # noqa: E402
from specgen import ops  # noqa: E402
from specgen.importer import explain, from_module, rewrite  # noqa: E402
from specgen.module import FusedLayer  # noqa: E402
from specgen.spec import parse_yaml, validate  # noqa: E402

C = im.C
NAMESPACES = {"torch": torch, "F": F, "torch.special": torch.special}
# How each row's spellings are called on a [N, C, 6, 6] tensor (after the tensor): a module's
# constructor arguments, a function's or method's arguments.
MODULE_ARGS = {"group_norm": (2, C), "instance_norm": (C,), "layer_norm": (6,), "softmax": (), "log_softmax": ()}
MODULE_KWARGS = {"softmax": {"dim": 1}, "log_softmax": {"dim": 1}}
CALL_ARGS = {"group_norm": (2,), "instance_norm": (), "layer_norm": ((6,),), "softmax": (1,), "log_softmax": (1,)}


def _layers(module: nn.Module) -> list[FusedLayer]:
    return [m for m in module.modules() if isinstance(m, FusedLayer)]


class Spelled(nn.Module):
    """A convolution (nd spatial dims) followed by one statistic stage written as `kind` `name`."""

    def __init__(self, row: str, kind: str, name: str, nd: int = 2):
        super().__init__()
        self.conv = getattr(nn, f"Conv{nd}d")(3, C, 3)
        self.kind, self.name, self.args = kind, name, CALL_ARGS[row]
        if kind == "modules":
            cls = getattr(nn, name)
            self.op = cls() if name == "Softmax2d" else cls(*MODULE_ARGS[row], **MODULE_KWARGS.get(row, {}))

    def forward(self, x):
        x = self.conv(x) * 2
        if self.kind == "modules":
            return self.op(x)
        if self.kind == "methods":
            return getattr(x, self.name)(*self.args)
        space, _, attr = self.name.rpartition(".")
        return getattr(NAMESPACES[space], attr)(x, *self.args)


def _norm_spellings():
    for row in ops.NORMS.values():
        for spelling in row.spellings:
            for nd in spelling.nd or (None,):
                for kind in ("functions", "methods", "modules"):
                    for name in getattr(spelling, kind):
                        name = name.format(nd=nd)
                        yield pytest.param(row.name, kind, name, nd or 2, id=f"{row.name}-{name}")


@pytest.mark.parametrize("row, kind, name, nd", list(_norm_spellings()))
def test_every_norm_spelling_imports_as_its_stage(row, kind, name, nd):
    torch.manual_seed(0)
    model = Spelled(row, kind, name, nd)
    x = torch.randn((2, 3) + (8,) * nd)
    report = explain(model, x)
    assert report.fallbacks == [], str(report)
    (spec,) = report.specs
    assert [stage.op for stage in spec.epilogue] == ["mul", row]
    with torch.no_grad():
        torch.testing.assert_close(from_module(model, x)(x), model(x))


def test_the_norm_rows_spell_module_function_and_method_forms():
    kinds = {}
    for param in _norm_spellings():
        row, kind, name, _ = param.values
        kinds.setdefault(row, set()).add(kind)
    assert kinds["softmax"] == kinds["log_softmax"] == {"functions", "methods", "modules"}
    assert kinds["group_norm"] == kinds["layer_norm"] == kinds["instance_norm"] == {"functions", "modules"}


@pytest.mark.parametrize("form", ["module", "functional"])
@pytest.mark.parametrize("nd", [1, 2, 3])
def test_every_batch_norm_spelling_imports_in_training_mode(form, nd):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = getattr(nn, f"Conv{nd}d")(3, C, 3)
            self.bn = getattr(nn, f"BatchNorm{nd}d")(C)

        def forward(self, x):
            x = self.conv(x)
            if form == "module":
                return self.bn(x)
            return F.batch_norm(x, self.bn.running_mean, self.bn.running_var, self.bn.weight, self.bn.bias, True, 0.2, 1e-3)

    model = M().train()
    x = torch.randn((2, 3) + (6,) * nd)
    report = explain(model, x)
    assert report.fallbacks == []
    (bn,) = report.specs[0].epilogue
    assert bn.op == "batch_norm" and bn.kind == "norm" and bn.args.training
    assert (bn.args.momentum, bn.args.eps) == ((0.1, 1e-5) if form == "module" else (0.2, 1e-3))
    assert (bn.args.running_mean, bn.args.running_var) == ("bn_running_mean", "bn_running_var")


# ---- the arguments each spelling gives -------------------------------------------------------------


def _stage(model, x=None, index=-1):
    report = explain(model, torch.randn(im.IMG) if x is None else x)
    assert report.fallbacks == [], str(report)
    (spec,) = report.specs
    return spec, spec.epilogue[index].args


def test_group_norm_reads_groups_eps_and_affine():
    _, a = _stage(im.Norms(lambda: nn.GroupNorm(2, C, eps=1e-3)))
    assert (a.num_groups, a.eps, a.affine, a.weight, a.bias) == (2, 1e-3, True, "norm_weight", "norm_bias")
    _, a = _stage(im.Norms(lambda: nn.GroupNorm(4, C, affine=False)))
    assert (a.num_groups, a.affine, a.weight) == (4, False, None)
    spec, a = _stage(im.Norms(call=lambda m, x: F.group_norm(x, 1, m.w, m.w, 1e-4)))
    assert (a.num_groups, a.eps, a.weight, a.bias) == (1, 1e-4, "w", "w")
    assert spec.params() == {"w": (C, 1, 1)}  # (C,) in the model, viewed along dim 1


def test_instance_norm_reads_eps_and_affine():
    _, a = _stage(im.Norms(lambda: nn.InstanceNorm2d(C)))
    assert (a.eps, a.affine, a.weight) == (1e-5, False, None)
    _, a = _stage(im.Norms(lambda: nn.InstanceNorm2d(C, affine=True, eps=1e-3)))
    assert (a.eps, a.affine, a.weight, a.bias) == (1e-3, True, "norm_weight", "norm_bias")


def test_layer_norm_keeps_its_weight_of_the_normalized_shape():
    spec, a = _stage(im.LayerNormForms(), index=2)
    assert (a.normalized_shape, a.weight, a.bias) == ([6, 6], "w", "b")
    assert spec.params()["w"] == (6, 6) and spec.params()["ln_weight"] == (6,)
    _, a = _stage(im.Norms(lambda: nn.LayerNorm([6], elementwise_affine=False, eps=1e-3)))
    assert (a.normalized_shape, a.eps, a.elementwise_affine, a.weight) == ([6], 1e-3, False, None)
    fused = from_module(im.LayerNormForms(), torch.randn(im.IMG))
    (layer,) = _layers(fused)
    assert layer.w.shape == (6, 6) and layer.ln_weight.shape == (6,)


def test_softmax_dims_are_numbered_as_the_spec_numbers_them():
    assert _stage(im.SoftmaxOverPositions(), index=1)[1].dim == [2, 3]  # view(b, c, -1), softmax(2), view back
    assert _stage(im.Norms(lambda: nn.Softmax2d()))[1].dim == [-3]
    assert _stage(im.Norms(call=lambda m, x: x.log_softmax(dim=-1)))[1].dim == [-1]

    class AfterSqueeze(nn.Module):
        """sum(keepdim=True) then a view without the size-1 dims: dim 1 of the view is the channels."""

        def __init__(self):
            super().__init__()
            self.conv = im.conv2d()

        def forward(self, x):
            x = self.conv(x).sum((2, 3), keepdim=True)
            return torch.softmax(x.view(x.shape[0], -1), dim=-1)

    spec, a = _stage(AfterSqueeze())
    assert a.dim == [1] and spec.output_shape(2) == (2, C, 1, 1)
    x = torch.randn(im.IMG)
    model = AfterSqueeze()
    with torch.no_grad():
        torch.testing.assert_close(from_module(model, x)(x), model(x))


def test_a_flattened_softmax_whose_view_is_not_undone_is_not_fused():
    class Flat(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = im.conv2d()

        def forward(self, x):
            x = torch.relu(self.conv(x))
            return torch.softmax(x.view(x.shape[0], C, -1), dim=2) * 2  # returned flat

    report = explain(Flat(), torch.randn(im.IMG))
    assert [[s.op for s in spec.epilogue] for spec in report.specs] == [["relu"]]
    assert "reshapes [2, 4, 6, 6] to [2, 4, 36]" in dict(report.fallbacks)["view"]


def test_a_16_bit_softmax_over_the_channels_imports_whole():
    """The tail engine computes in float32 only, but a softmax over the channels alone runs in the
    TMA engine's epilogue, which has every precision: a .half() model imports it into its spec."""
    report = explain(im.Norms(lambda: nn.Softmax(dim=1)).half(), torch.randn(im.IMG).half())
    assert [[s.op for s in spec.epilogue] for spec in report.specs] == [["relu", "softmax"]]
    assert report.specs[0].precision == "fp16" and not report.fallbacks


@pytest.mark.filterwarnings("ignore:Implicit dimension choice")
def test_softmax_without_a_dim_is_refused_with_the_reason():
    report = explain(im.Norms(lambda: nn.Softmax()), torch.randn(im.IMG))
    assert "dim=None (PyTorch's implicit dim, deprecated) is not fused: give dim" in dict(report.fallbacks)["norm"]


def test_a_norm_of_a_value_the_spec_holds_in_another_shape_is_refused():
    class GroupNormOfAView(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = im.conv2d()

        def forward(self, x):
            x = self.conv(x).mean((2, 3), keepdim=True)
            return F.group_norm(x.view(x.shape[0], C), 2)

    report = explain(GroupNormOfAView(), torch.randn(im.IMG))
    assert "it normalizes the value shaped [2, 4], which the spec holds as [2, 4, 1, 1]" in dict(report.fallbacks)["group_norm"]


@pytest.mark.parametrize("dtype, precision", [(torch.bfloat16, "bf16"), (torch.float16, "fp16")])
def test_a_16_bit_chain_stops_before_its_norm_with_the_planners_reason(dtype, precision):
    model = im.GroupNormForms().to(dtype)
    x = torch.randn(im.IMG, dtype=dtype)
    report = explain(model, x)
    assert report.specs == []  # the norm comes right after the conv: nothing is left to fuse
    reasons = dict(report.fallbacks)
    assert f"a {precision} layer with it cannot be planned: precision: the tail engine's kernels compute in float32" in reasons["gn"]
    with torch.no_grad():
        torch.testing.assert_close(from_module(model, x)(x), model(x))


# ---- training mode: the model's running statistics -------------------------------------------------


def _assert_same_buffers(model: nn.Module, plain: nn.Module) -> None:
    mine, theirs = dict(model.named_buffers()), dict(plain.named_buffers())
    assert mine.keys() == theirs.keys()
    for name, buf in theirs.items():
        torch.testing.assert_close(mine[name], buf, msg=name)


@pytest.mark.parametrize("kw", [{}, {"momentum": None}, {"momentum": 0.3, "eps": 1e-3}, {"affine": False}],
                         ids=["default", "cumulative", "momentum", "no-affine"])
def test_running_statistics_after_fused_forwards_equal_pytorchs(kw):
    """One fused forward updates the model's running statistics and batch count as nn.BatchNormNd
    does; so do the next ones (momentum None: the cumulative average over the batches counted)."""
    torch.manual_seed(0)
    model = kb.randomize_batch_norms(im.BatchNormTraining(**kw).train())
    plain = copy.deepcopy(model)
    x = torch.randn(im.IMG)
    fused = from_module(model, x)
    _assert_same_buffers(model, plain)  # importing ran the model, but counts as no step
    for step in range(3):
        x = torch.randn(im.IMG)
        with torch.no_grad():
            torch.testing.assert_close(fused(x), plain(x))
        _assert_same_buffers(model, plain)
        assert int(model.bn.num_batches_tracked) == step + 1


def test_the_fused_layer_holds_the_models_very_buffers():
    model = im.BatchNormTraining().train()
    fused = from_module(model, torch.randn(im.IMG))
    (layer,) = _layers(fused)
    assert layer.bn_running_mean is model.bn.running_mean
    assert layer.bn_running_var is model.bn.running_var
    assert layer.bn_num_batches_tracked is model.bn.num_batches_tracked
    assert layer.bn_weight is model.bn.weight and layer.bn_bias is model.bn.bias
    ids = {id(b) for b in fused.buffers()}
    assert all(id(b) in ids for b in model.bn.buffers())
    assert set(dict(layer.named_buffers())) == {"bn_running_mean", "bn_running_var", "bn_num_batches_tracked"}
    fused(torch.randn(im.IMG))
    assert int(model.bn.num_batches_tracked) == 1 and fused.state_dict()[next(k for k in fused.state_dict() if "tracked" in k)] == 1


def test_gradients_of_a_training_mode_batch_norm_match_pytorchs():
    torch.manual_seed(0)
    model = kb.randomize_batch_norms(im.BatchNormTraining().train())
    plain = copy.deepcopy(model)
    x = torch.randn(im.IMG)
    fused = from_module(model, x)
    fused(x).square().sum().backward()
    plain(x).square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_after_eval_the_fused_layer_normalizes_with_the_running_statistics():
    torch.manual_seed(0)
    model = kb.randomize_batch_norms(im.BatchNormTraining().train())
    plain = copy.deepcopy(model)
    fused = from_module(model, torch.randn(im.IMG))
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(im.IMG)
            fused(x), plain(x)
        fused.eval(), plain.eval()
        x = torch.randn(im.IMG)
        torch.testing.assert_close(fused(x), plain(x))
    _assert_same_buffers(model, plain)  # eval mode updates nothing


def test_functional_batch_norm_updates_the_models_buffers_and_counts_in_the_layer():
    torch.manual_seed(0)
    model = im.FunctionalBatchNormTraining()
    plain = copy.deepcopy(model)
    (bn,) = _stage(model)[0].epilogue
    assert bn.args.num_batches_tracked == "mean_num_batches_tracked" and bn.args.momentum == 0.25
    fused = from_module(model, torch.randn(im.IMG))
    (layer,) = _layers(fused)
    assert layer.mean is model.mean and layer.var is model.var
    for _ in range(2):
        x = torch.randn(im.IMG)
        with torch.no_grad():
            torch.testing.assert_close(fused(x), plain(x))
        _assert_same_buffers(model, plain)
    assert int(layer.mean_num_batches_tracked) == 2  # the layer's own: F.batch_norm counts nothing


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_functional_batch_norm_in_training_mode_stays_so_in_either_mode(training):
    """F.batch_norm(training=True) normalizes with the batch's statistics whatever the model's mode:
    so does its fused layer, before and after the model's mode changes."""
    torch.manual_seed(0)
    model = im.FunctionalBatchNormTraining().train(training)
    plain = copy.deepcopy(model)
    fused = from_module(model, torch.randn(im.IMG))
    for mode in (training, not training, training):
        fused.train(mode), plain.train(mode)
        x = torch.randn(im.IMG)
        with torch.no_grad():
            torch.testing.assert_close(fused(x), plain(x))
        _assert_same_buffers(model, plain)


def test_a_module_and_a_functional_training_batch_norm_do_not_share_a_layer():
    class Both(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = im.conv2d()
            self.bn = nn.BatchNorm2d(C)
            self.register_buffer("mean", torch.zeros(C))
            self.register_buffer("var", torch.ones(C))

        def forward(self, x):
            x = torch.relu(self.bn(self.conv(x)))
            return F.batch_norm(x, self.mean, self.var, training=True)

    model = Both().train()
    x = torch.randn(im.IMG)
    report = explain(model, x)
    assert [[s.op for s in spec.epilogue] for spec in report.specs] == [["batch_norm", "relu"]]
    assert "one fused layer cannot do both" in dict(report.fallbacks)["batch_norm"]
    plain = copy.deepcopy(model)
    fused = from_module(model, x)
    for mode in (True, False):
        fused.train(mode), plain.train(mode)
        with torch.no_grad():
            torch.testing.assert_close(fused(x), plain(x))
    _assert_same_buffers(model, plain)


def test_a_batch_norm_without_running_statistics_keeps_none():
    torch.manual_seed(0)
    model = im.BatchNormUntracked()
    spec, _ = _stage(model)
    assert [s.args.track_running_stats for s in spec.epilogue if s.op == "batch_norm"] == [False, False]
    assert spec.buffers() == {}
    x = torch.randn(im.IMG)
    fused = from_module(model, x)
    for mode in (True, False):
        fused.train(mode), model.train(mode)
        with torch.no_grad():
            torch.testing.assert_close(fused(x), model(x))


def test_timing_leaves_the_buffers_as_they_were():
    """from_module times chains and the whole model on a GPU: running them must not train the model."""
    model = kb.randomize_batch_norms(im.BatchNormTraining().train())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with rewrite.buffers_kept(model):
        for _ in range(3):
            model(torch.randn(im.IMG))
        assert int(model.bn.num_batches_tracked) == 3
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("make", [im.BatchNormTraining, lambda: im.BatchNormTraining(momentum=None), im.BatchNormUntracked,
                                  im.FunctionalBatchNormTraining, im.LayerNormForms, im.SoftmaxOverPositions, im.GroupNormForms],
                         ids=["training", "cumulative", "untracked", "functional", "layer_norm", "softmax", "group_norm"])
def test_norm_specs_round_trip_through_yaml(make):
    report = explain(make(), torch.randn(im.IMG))
    (spec,) = report.specs
    assert validate(parse_yaml(report.yaml())[0]).shape_hash == spec.shape_hash


# ---- the public KernelBench problems, on the CPU ---------------------------------------------------


def _problems(names):
    return [pytest.param(p, id=p.stem) for p in kb.problems() if p.stem in names]


def _check_kernelbench(path, training: bool) -> None:
    model, inputs = kb.load(path, training=training)
    kb.randomize_batch_norms(model)
    plain = copy.deepcopy(model)
    fused = from_module(model, *inputs)
    report = fused.specgen_report
    assert len(report.specs) == 1 and not report.fallbacks, str(report)
    (layer,) = _layers(fused)
    with torch.no_grad():
        torch.testing.assert_close(fused(*inputs), plain(*inputs), msg=path.stem)
    _assert_same_buffers(model, plain)
    for name in layer.spec.buffers():  # the model's running statistics, not copies
        assert any(getattr(layer, name) is b for b in model.buffers()), name


@pytest.mark.skipif(kb.folder() is None, reason="the KernelBench problems are not beside the checkout")
@pytest.mark.parametrize("path", _problems(kb.FUSED))
def test_kernelbench_problems_fused_whole_match_the_model_in_eval_mode(path):
    _check_kernelbench(path, training=False)


@pytest.mark.skipif(kb.folder() is None, reason="the KernelBench problems are not beside the checkout")
@pytest.mark.parametrize("path", _problems(kb.FUSED_TRAIN))
def test_kernelbench_problems_fused_whole_match_the_model_in_training_mode(path):
    _check_kernelbench(path, training=True)


def test_the_readme_names_the_norm_spellings():
    """The README's importer lines list what the op table's NORMS rows spell."""
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    for name in ("nn.GroupNorm", "F.group_norm", "nn.InstanceNormNd", "nn.LayerNorm", "nn.Softmax2d", "F.log_softmax"):
        assert name in text, name
    assert re.search(r"training mode", text)


class NormResidual(nn.Module):
    """x + f(group_norm(x)) (KernelBench 92's pattern): the conv's value is read again after the norm."""

    def __init__(self, other_use: bool = False):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.gn = nn.GroupNorm(4, 8)
        self.other_use = other_use

    def forward(self, a, b=None):
        x = self.conv(a)
        y = F.hardswish(torch.tanh(self.gn(x)))
        if self.other_use:  # x also meets another input of the model: a use no chain can take
            return y + x * b
        return torch.logsumexp(x + y, dim=1, keepdim=True)


def test_a_value_read_again_after_its_norm_is_saved_and_fused():
    torch.manual_seed(0)
    model = NormResidual().eval()
    a = torch.randn(2, 3, 10, 10)
    report = explain(model, a)
    assert len(report.specs) == 1 and not report.fallbacks, str(report)
    (spec,) = report.specs
    ops_ = [st.op for st in spec.epilogue]
    assert ops_ == ["save", "group_norm", "tanh", "hardswish", "add", "logsumexp"]
    assert spec.epilogue[4].args.saved == spec.epilogue[0].args.name and not spec.inputs()
    fused = from_module(copy.deepcopy(model), a)
    with torch.no_grad():
        torch.testing.assert_close(fused(a), model(a))


def test_a_saved_value_with_a_use_outside_the_chain_ends_the_chain_there():
    torch.manual_seed(0)
    model = NormResidual(other_use=True).eval()
    a, b = torch.randn(2, 3, 10, 10), torch.randn(2, 8, 8, 8)
    report = explain(model, a, b)
    assert not any(st.op == "save" for spec in report.specs for st in spec.epilogue)
    assert any("used again after a statistic stage" in f.reason or "used by 2 nodes" in f.reason for f in report.fallbacks), str(report)
    fused = from_module(copy.deepcopy(model), a, b)
    with torch.no_grad():
        torch.testing.assert_close(fused(a, b), model(a, b))


class _WrittenLayerNorm(nn.Module):
    """A LayerNorm over the channels written out (mean, squared deviations, sqrt), with a twist."""

    def __init__(self, twist: str):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.twist = twist

    def forward(self, x):
        x = self.conv(x)
        dim = 2 if self.twist == "over H" else 1
        u = x.mean(dim, keepdim=True)
        d = x - u
        s = d.pow(4 if self.twist == "fourth power" else 2).mean(dim, keepdim=True)
        y = d / torch.sqrt(s + 1e-5)
        return (y, d) if self.twist == "deviation returned" else y


def test_a_layer_norm_written_out_is_one_stage_and_its_look_alikes_are_not():
    x = torch.randn(2, 3, 9, 9)
    spec = explain(_WrittenLayerNorm("none").eval(), x).specs[0]
    assert [st.op for st in spec.epilogue] == ["layer_norm_channels"]
    assert spec.epilogue[0].args.eps == 1e-5 and not spec.epilogue[0].args.elementwise_affine
    for twist in ("over H", "fourth power", "deviation returned"):
        model = _WrittenLayerNorm(twist).eval()
        report = explain(model, x)
        assert all(st.op != "layer_norm_channels" for s in report.specs for st in s.epilogue), twist
        fused = from_module(model, x)
        with torch.no_grad():
            got, want = fused(x), model(x)
        for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            torch.testing.assert_close(g, w)
