"""Never slower for the joins and pools no chain takes (`specgen.importer.standalone_choice`):
without a GPU, with the timing's verdicts forced, a join or pool measured not faster stays
PyTorch's code (the report says so among the fallbacks, with both times) and the model still
computes the original; on the GPU (marker `gpu`), each is timed once, the decision cached."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

from example_models import example_models  # noqa: E402
from random_models import force_choices  # noqa: E402
from specgen.concat import ConcatLayer  # noqa: E402
from specgen.importer.report import Choice  # noqa: E402
from specgen.maxpool import MaxPoolLayer  # noqa: E402


def _fused_with_verdicts(monkeypatch, model, x, slower: set):
    """(the fused graph module, its report, the nodes measured) of `model` on `x` with every chain
    fused and each join and pool "timed" here: the kernel slower where its node is in `slower`.
    Each timing also checks that the kernel and its reference agree on fresh inputs."""
    import specgen.importer as importer
    from specgen.importer import standalone_choice
    from specgen.importer.graph import shape_of

    force_choices(monkeypatch, lambda i: True)
    monkeypatch.setattr(importer, "_unmeasurable", lambda imp: None)
    timed = []

    def measure(imp, node, layer, reference, values, gpu_only=False):
        inputs = [torch.randn(shape_of(v)) for v in values]
        torch.testing.assert_close(layer(*inputs), reference(*inputs), rtol=0, atol=0)
        timed.append(node.name)
        ms = 2.0 if node.name in slower else 0.5
        return Choice(node.name, ms < 1.0, ms, 1.0, "measured")

    monkeypatch.setattr(standalone_choice, "measure", measure)
    imp = importer._importer(model, (x,), None)
    fused, _, report = importer._fused(imp, keep_slower=False, log=None)
    return fused, report, timed


@pytest.mark.parametrize("slower", [set(), {"cat"}, {"pool_1"}, {"cat_2", "pool"}, "all"])
def test_a_join_or_pool_measured_slower_stays_pytorch_s(monkeypatch, slower):
    models = example_models()
    torch.manual_seed(0)
    model = models.UNet.make().eval()
    x = models.UNet.example_input(2, small=True)
    all_nodes = {n.name for n in torch.fx.symbolic_trace(model).graph.nodes if n.name.startswith(("cat", "pool"))}
    slower = all_nodes if slower == "all" else slower
    fused, report, timed = _fused_with_verdicts(monkeypatch, model, x, slower)
    assert len(timed) == len(set(timed)) == 6, timed  # (three joins, three pools, each timed once)
    assert slower <= set(timed), (slower, timed)
    kept = [fb for fb in report.fallbacks if "kept as PyTorch" in fb.reason]
    assert sorted(fb.node for fb in kept) == sorted(slower), str(report)
    assert all("specgen 2.0000 ms, PyTorch 1.0000 ms" in fb.reason for fb in kept), str(report)
    listed = [line.split(": ", 1)[0] for line in report.joins + report.pools]
    assert sorted(listed) == sorted(set(timed) - slower), str(report)
    layers = [m for m in fused.modules() if isinstance(m, (ConcatLayer, MaxPoolLayer))]
    assert len(layers) == 6 - len(slower)
    assert str(report).count("[fused: specgen 0.5000 ms") == 6 - len(slower), str(report)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), model(x), rtol=1e-5, atol=1e-5)


def test_inside_the_cuda_graph_joins_and_pools_are_decided_by_gpu_time(monkeypatch):
    """At a small batch a join's or pool's kernel can lose on the host path (PyTorch's call
    launches faster) and win inside a CUDA graph (GPU time alone): the graph's model is rewritten
    with them, the host path's keeps PyTorch's code; where the decisions agree, one model serves."""
    import specgen.importer as importer
    from specgen.importer import rewrite, standalone_choice

    models = example_models()
    torch.manual_seed(0)
    model = models.UNet.make().eval()
    x = models.UNet.example_input(2, small=True)
    force_choices(monkeypatch, lambda i: True)
    monkeypatch.setattr(importer, "_unmeasurable", lambda imp: None)
    for graph_wins in (True, False):
        asked = []

        def measure(imp, node, layer, reference, values, gpu_only=False):
            asked.append(gpu_only)
            ms = 0.5 if gpu_only and graph_wins else 2.0
            return Choice(node.name, ms < 1.0, ms, 1.0, "graph measured" if gpu_only else "measured")

        monkeypatch.setattr(standalone_choice, "measure", measure)
        monkeypatch.setattr(rewrite, "measure", lambda imp, chain, gpu_only=False: Choice(chain.spec.name, True, 0.5, 1.0))
        fused, _, report = importer._fused(importer._importer(model, (x,), None), keep_slower=False, log=None)
        assert not [m for m in fused.modules() if isinstance(m, (ConcatLayer, MaxPoolLayer))]
        graphed = importer._graph_fused(model, (x,), None, fused, report.choices, report)
        assert asked == [False] * 6 + [True] * 6, asked
        assert [c.fused for c in report.graph_standalone_choices] == [graph_wins] * 6, str(report)
        layers = [m for m in graphed.modules() if isinstance(m, (ConcatLayer, MaxPoolLayer))]
        assert (graphed is not fused and len(layers) == 6) if graph_wins else graphed is fused
        if graph_wins:
            assert str(report).count("[in the CUDA graph: fused: specgen 0.5000 ms, PyTorch 1.0000 ms (graph measured)]") == 6, str(report)
            with torch.no_grad():
                torch.testing.assert_close(graphed(x), model(x), rtol=1e-5, atol=1e-5)


def test_keep_slower_times_no_join_or_pool(monkeypatch):
    import specgen.importer as importer
    from specgen.importer import standalone_choice

    models = example_models()
    force_choices(monkeypatch, lambda i: True)
    monkeypatch.setattr(importer, "_unmeasurable", lambda imp: None)
    monkeypatch.setattr(standalone_choice, "measure", lambda *a: pytest.fail("timed under keep_slower=True"))
    imp = importer._importer(models.UNet.make().eval(), (models.UNet.example_input(2, small=True),), None)
    fused, _, report = importer._fused(imp, keep_slower=True, log=None)
    assert len(report.joins) == 3 and len(report.pools) == 3 and not report.fallbacks, str(report)
    assert [c.how for c in report.standalone_choices] == ["not measured"] * 6


def _bf16_unet_on_the_gpu(tmp_path, monkeypatch, batch: int):
    """(the UNet example in bf16 on the GPU, an input of `batch`), with a cache of its own."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    monkeypatch.setenv("SPECGEN_CACHE_DIR", str(tmp_path))
    models = example_models()
    torch.manual_seed(0)
    return models.UNet.make().cuda().eval().bfloat16(), models.UNet.example_input(batch, device="cuda", seed=batch).bfloat16()


@pytest.mark.gpu
def test_on_the_gpu_each_join_and_pool_is_timed_once_then_cached(tmp_path, monkeypatch):
    from specgen import from_module, measured

    model, x = _bf16_unet_on_the_gpu(tmp_path, monkeypatch, 8)

    compare, joined_inputs = measured.compare, []

    def recording(first, second, inputs, *args, **kwargs):
        a = inputs[0]
        if isinstance(a, tuple) and len(a) >= 2 and a[0].shape == a[-1].shape and not a[0].is_contiguous() \
                and a[-1].is_contiguous():
            joined_inputs.append(a[0].shape)  # (a chain reading a channels-last join: the kernel's input, then PyTorch's)
        return compare(first, second, inputs, *args, **kwargs)

    monkeypatch.setattr(measured, "compare", recording)
    reports = []
    for _ in range(2):
        fused = from_module(copy.deepcopy(model), x, cuda_graph=False)
        reports.append(fused.specgen_report)
        choices = reports[-1].standalone_choices
        assert len(choices) == 6 and all(c.specgen_ms > 0 and c.pytorch_ms > 0 for c in choices), str(reports[-1])
        kept = {fb.node for fb in reports[-1].fallbacks if "kept as PyTorch" in fb.reason}
        assert kept == {c.layer for c in choices if not c.fused}, str(reports[-1])
        with torch.no_grad():
            torch.testing.assert_close(fused(x).float(), model(x).float(), rtol=3e-2, atol=3e-2)
    # (the joins were timed first while the convs reading them were: found cached when the graph is written)
    assert [c.how for c in reports[0].standalone_choices] == ["cached"] * 3 + ["measured"] * 3
    assert [c.how for c in reports[1].standalone_choices] == ["cached"] * 6
    # bf16's decoder convs (TMA engine) read channels-last in place: each timed on the format of a
    # join that wins, once
    assert len(joined_inputs) == sum(c.fused for c in reports[0].standalone_choices[:3]), joined_inputs
    assert [c.fused for c in reports[0].standalone_choices] == [c.fused for c in reports[1].standalone_choices]


def test_a_chain_reading_a_channels_last_join_is_timed_on_such_an_input(monkeypatch):
    """The UNet's decoder convs each alone read a join; where their kernels read channels-last in
    place, the join writes so, and their timing must run that kernel (not the NC(D)HW one)."""
    import specgen.importer as importer
    from specgen.importer import joins

    models = example_models()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    imp = importer._importer(models.UNet.make().eval(), (models.UNet.example_input(2, small=True),), None)
    readers = [c.spec.name for c in imp.chains if joins._join(imp, c.input_node) is not None]
    assert len(readers) == 3, [c.spec.name for c in imp.chains]
    for reads_in_place in (False, True):
        monkeypatch.setattr(joins, "_reads_in_place", lambda layer, answer=reads_in_place: answer)
        told = [c.spec.name for c in imp.chains if joins.writes_channels_last_for(imp, c, None)]
        assert told == (readers if reads_in_place else []), told
    # timed, a join measured not faster stays PyTorch's cat (NC(D)HW): its reader is timed on that
    from specgen.importer import standalone_choice

    asked = []

    def measure(imp, node, layer, reference, values, gpu_only=False):
        asked.append((node.name, layer.plan.channels_last, gpu_only))
        return Choice(node.name, node.name != "cat_1", 1.0, 1.5, "measured")

    monkeypatch.setattr(standalone_choice, "measure", measure)
    told = [c.spec.name for c in imp.chains if joins.writes_channels_last_for(imp, c, None, measure=True, gpu_only=True)]
    assert len(told) == 2 and [n for n, _, _ in asked] == ["cat", "cat_1", "cat_2"], (told, asked)
    assert all(cl and gpu_only for _, cl, gpu_only in asked), asked


@pytest.mark.gpu
def test_on_the_gpu_a_batch_1_graph_times_its_joins_and_pools_inside_graphs(tmp_path, monkeypatch):
    from specgen import from_module

    model, x = _bf16_unet_on_the_gpu(tmp_path, monkeypatch, 1)
    fused = from_module(copy.deepcopy(model), x)
    report = fused.specgen_report
    graph = report.graph_standalone_choices
    # (a join is timed inside graphs before the conv that reads it, so the graph pass finds it cached)
    assert len(graph) == 6 and all(c.how in ("graph measured", "graph cached") and c.specgen_ms > 0 for c in graph), str(report)
    assert {c.layer for c in graph if c.how == "graph measured"} >= {"pool", "pool_1", "pool_2"}, str(report)
    with torch.no_grad():
        torch.testing.assert_close(fused(x).float(), model(x).float(), rtol=3e-2, atol=3e-2)


def test_explain_with_measure_times_the_joins_and_pools_too(monkeypatch):
    from specgen import explain

    models = example_models()
    force_choices(monkeypatch, lambda i: True, lambda i: i != 1)  # (the second decided, cat_1, kept)
    report = explain(models.UNet.make().eval(), models.UNet.example_input(2, small=True), measure=True)
    assert [c.fused for c in report.standalone_choices] == [True, False, True, True, True, True], str(report)
    assert [fb.node for fb in report.fallbacks] == ["cat_1"] and len(report.joins) == 2, str(report)
    plain = explain(models.UNet.make().eval(), models.UNet.example_input(2, small=True))
    assert not plain.standalone_choices and len(plain.joins) == 3
