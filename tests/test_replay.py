"""specgen.replay: a fused model replayed from one CUDA graph, and from_module's choice of it.

Without a GPU: the wrapper refuses inputs it cannot capture, the capture caches' switch, and
from_module never wraps a model whose inputs are not on a GPU. On the GPU: replays match the
float64 model, return fresh tensors, write every output element (poisoned first), and every call
that cannot replay (autograd on, another batch, training mode, another capture underway) runs the
plain model; an in-place weight update captures again."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

from specgen import tmarun  # noqa: E402
from specgen.importer import WHOLE_MODEL_MARGIN, from_module  # noqa: E402
from specgen.replay import GraphReplay  # noqa: E402
from test_importer_measured import _fused, _names, gpu  # noqa: E402,F401  (gpu: the fixture)
from test_importer_measured import _model as _measured_model  # noqa: E402


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
    )
    with torch.no_grad():
        bn = model[1]
        bn.running_mean.normal_(0, 0.2)
        bn.running_var.uniform_(0.5, 1.5)
    return model.eval()


def test_refuses_inputs_that_are_not_cuda_tensors():
    with pytest.raises(ValueError, match=r"example inputs must be CUDA tensors \(argument 0 is Tensor on cpu\)"):
        GraphReplay(_model(), torch.randn(2, 3, 8, 8))
    with pytest.raises(ValueError, match="example inputs must be CUDA tensors"):
        GraphReplay(_model())


@pytest.fixture
def cpu_replay(monkeypatch):
    """GraphReplay on the CPU: its capture stood in for (records its inputs, "captures" nothing)."""
    from specgen import replay

    def capture(self, inputs):
        self._graph, self._static_in = object(), tuple(t.clone() for t in inputs)
        self._tensors = self._watched()
        self._versions = [t._version for t in self._tensors]
        self._flags = replay._flags()
        self.captures += 1

    monkeypatch.setattr(replay, "_check_inputs", lambda inputs: None)
    monkeypatch.setattr(GraphReplay, "_capture", capture)
    return GraphReplay(_model(), torch.randn(2, 3, 8, 8))


def test_conversions_and_copies_drop_the_graph(cpu_replay):
    import copy
    import pickle

    g = cpu_replay
    assert g.captures == 1 and g._graph is not None
    g.module.note = "from the module"
    assert g.note == "from the module"  # attributes the wrapper lacks come from the module
    g.module.__deepcopy__ = lambda memo: None  # as fx's GraphModule has one: never taken for the wrapper's
    assert getattr(g, "__deepcopy__", None) is None and getattr(g, "_lock") is not None
    del g.module.__deepcopy__
    twin = copy.deepcopy(g)
    assert isinstance(twin, GraphReplay) and twin.captures == 1
    assert twin._graph is None and twin._static_in == () and g._graph is not None  # the copy captures its own
    assert twin.fallback is twin.module and twin.module is not g.module
    assert twin._lock is not g._lock and twin._lock.acquire(blocking=False)
    back = pickle.loads(pickle.dumps(g))
    assert back._graph is None and back.captures == 1
    g.double()  # a conversion: parameters may move without their version counters
    assert g._graph is None and g.module[0].weight.dtype == torch.float64
    g.recapture()
    assert g._graph is None


def test_which_calls_replay(cpu_replay, monkeypatch):
    from specgen import replay

    g, x = cpu_replay, torch.randn(2, 3, 8, 8)
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    with torch.no_grad():
        assert g._replays((x,), {})
        assert not g._replays((x,), {"extra": 1})  # keywords
        assert not g._replays((x[:1],), {})  # another batch
        assert not g._replays((x.double(),), {})  # another dtype
        assert not g._replays((x, x), {})  # another number of inputs
        capturing[0] = True  # a caller's own capture
        assert not g._replays((x,), {})
        capturing[0] = False
        monkeypatch.setattr(replay, "_autocast", lambda: True)
        assert not g._replays((x,), {})
        monkeypatch.setattr(replay, "_autocast", lambda: False)
        old = torch.backends.cudnn.allow_tf32
        torch.backends.cudnn.allow_tf32 = not old  # PyTorch's kernels in the graph were chosen under the other
        try:
            assert not g._replays((x,), {})
            g._forget()  # no graph (a copy's, or after a conversion): the call captures one under these flags
            assert g._replays((x,), {})
        finally:
            torch.backends.cudnn.allow_tf32 = old
        assert g._replays((x,), {})
        g.train()
        assert not g._replays((x,), {})
        g.eval()
    assert not g._replays((x,), {})  # autograd on


def test_reusing_caches_nests_and_reads_only_under_capture():
    t = torch.randn(3)
    assert tmarun.cache_readable(t) == (True, True)  # no capture (a CPU tensor never is)
    assert not tmarun.reusing()
    with tmarun.reusing_caches():
        with tmarun.reusing_caches():
            assert tmarun.reusing()
        assert tmarun.reusing()
        assert tmarun.cache_readable(t) == (True, True)
    assert not tmarun.reusing()
    with pytest.raises(RuntimeError):
        with tmarun.reusing_caches():
            raise RuntimeError("boom")
    assert not tmarun.reusing()  # closed on the way out of an error


def test_from_module_on_cpu_inputs_takes_no_graph():
    model, x = _model(), torch.randn(2, 3, 16, 16)
    for cuda_graph in (None, True):
        fused = from_module(model, x, cuda_graph=cuda_graph)
        assert not isinstance(fused, GraphReplay)
        assert fused.specgen_report.graph is None


# -- from_module's choice, with the GPU stood in for (test_importer_measured's FakeGPU) ----------


class FakeReplay(nn.Module):
    """GraphReplay's stand-in: runs the module it would replay."""

    def __init__(self, module, *example_inputs, fallback=None):
        super().__init__()
        self.module = module
        object.__setattr__(self, "fallback", fallback)

    def forward(self, *args):
        return self.module(*args)


@pytest.fixture
def graph_gpu(gpu, monkeypatch):
    import specgen.importer as importer_pkg
    from specgen import measured, replay

    gpu.graph_times = {}
    gpu.graph_timed = []

    def compare_graphed(fused, original, inputs):
        gpu.graph_timed.append(fused.spec.name)
        with torch.no_grad():
            for x in inputs:
                torch.testing.assert_close(fused(x), original(x))
        return gpu.graph_times[fused.spec.name]

    monkeypatch.setattr(importer_pkg, "_graph_possible", lambda model, inputs: None)
    monkeypatch.setattr(measured, "compare_graphed", compare_graphed)
    monkeypatch.setattr(replay, "GraphReplay", FakeReplay)
    return gpu


def test_inside_the_graph_each_chain_is_decided_by_its_gpu_time(graph_gpu):
    model, x = _measured_model(), torch.randn(2, 3, 10, 10)
    first, second = _names(model, x)
    graph_gpu.times = {first: (0.5, 1.0), second: (0.5, 1.0)}  # both win with the host's time in
    graph_gpu.graph_times = {first: (2.0, 1.0), second: (0.25, 1.0)}  # the first loses on the GPU alone
    graph_gpu.whole = [(1.0, 2.0), (0.5, 1.0)] * 2  # fused beats the original; the graph beats the fused model
    result = from_module(model, x)
    assert isinstance(result, FakeReplay) and graph_gpu.graph_timed == [first, second]
    assert [layer.spec.name for layer in _fused(result.module)] == [second]  # what the graph replays
    assert [layer.spec.name for layer in _fused(result.fallback)] == [first, second]  # what other calls run
    report = result.specgen_report
    assert [c.fused for c in report.graph_choices] == [False, True] and report.graph == (0.5, 1.0)
    text = str(report)
    assert "[in the CUDA graph: kept as PyTorch: specgen 2.0000 ms, PyTorch 1.0000 ms (graph measured)]" in text
    assert "CUDA graph: 0.500 ms against 1.000 ms: replayed from the graph" in text
    with torch.no_grad():
        torch.testing.assert_close(result(x), model(x))
    from_module(model, x)  # a second import: the decisions come from the cache
    assert graph_gpu.graph_timed == [first, second]


def test_agreeing_decisions_replay_the_fused_model_itself(graph_gpu):
    model, x = _measured_model(), torch.randn(2, 3, 10, 10)
    names = _names(model, x)
    graph_gpu.times = {name: (0.5, 1.0) for name in names}
    graph_gpu.graph_times = {name: (0.5, 1.0) for name in names}
    graph_gpu.whole = [(1.0, 2.0), (0.5, 1.0)]
    result = from_module(model, x)
    assert isinstance(result, FakeReplay) and result.module is result.fallback


def test_chains_that_lose_only_on_the_host_are_replayed_from_a_graph(graph_gpu):
    """Every chain slower fused on the host path (a small batch's launch costs) but one faster on
    the GPU alone: the original runs outside the graph, the graph replays that chain fused."""
    model, x = _measured_model(), torch.randn(2, 3, 10, 10)
    first, second = _names(model, x)
    graph_gpu.times = {first: (2.0, 1.0), second: (2.0, 1.0)}
    graph_gpu.graph_times = {first: (2.0, 1.0), second: (0.25, 1.0)}
    graph_gpu.whole = [(0.5, 1.0)]  # (the graph against the original: no fused model to time before it)
    result = from_module(model, x)
    assert isinstance(result, FakeReplay) and result.fallback is model
    assert [layer.spec.name for layer in _fused(result.module)] == [second]
    report = result.specgen_report
    assert [c.fused for c in report.choices] == [False, False] and [c.fused for c in report.graph_choices] == [False, True]
    assert report.graph == (0.5, 1.0) and graph_gpu.whole == []
    assert "CUDA graph: 0.500 ms against 1.000 ms: replayed from the graph" in str(report)
    with torch.no_grad():
        torch.testing.assert_close(result(x), model(x))


def test_chains_that_lose_in_the_graph_too_give_back_the_original(graph_gpu, monkeypatch, tmp_path):
    monkeypatch.setenv("SPECGEN_CACHE_DIR", str(tmp_path / "other"))
    model, x = _measured_model(), torch.randn(2, 3, 10, 10)
    names = _names(model, x)
    graph_gpu.times = {name: (2.0, 1.0) for name in names}
    graph_gpu.graph_times = {name: (2.0, 1.0) for name in names}
    graph_gpu.whole = []  # (nothing timed whole)
    result = from_module(model, x)
    assert result is model and graph_gpu.graph_timed == names
    assert not isinstance(from_module(model, x, cuda_graph=False), FakeReplay)


def test_a_graph_not_faster_is_not_taken(graph_gpu):
    model, x = _measured_model(), torch.randn(2, 3, 10, 10)
    names = _names(model, x)
    graph_gpu.times = {name: (0.5, 1.0) for name in names}
    graph_gpu.graph_times = {name: (0.5, 1.0) for name in names}
    graph_gpu.whole = [(1.0, 2.0), (0.99, 1.0)]  # inside the 3% margin
    result = from_module(model, x)
    assert not isinstance(result, FakeReplay) and len(_fused(result)) == 2
    assert result.specgen_report.graph == (0.99, 1.0)
    assert "CUDA graph: 0.990 ms against 1.000 ms: replayed from the graph" not in str(result.specgen_report)
    graph_gpu.whole = [(1.0, 2.0)]
    assert not isinstance(from_module(model, x, cuda_graph=False), FakeReplay)
    assert graph_gpu.whole == []  # (no graph timed)
    assert not isinstance(from_module(model, x, keep_slower=True), FakeReplay)  # nothing timed: no graph
    assert isinstance(from_module(model, x, keep_slower=True, cuda_graph=True), FakeReplay)  # ... unless asked
    assert graph_gpu.wholes == 3  # (2 + 1 before them: neither keep_slower import timed the whole model)


# -- on the GPU ----------------------------------------------------------------------------------


def _rel_l2(got, want) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


def _reference(model, x):
    import copy

    with torch.no_grad():
        return copy.deepcopy(model).double()(x.double())


@pytest.fixture
def graphed():
    model = _model().cuda()
    x = torch.randn(2, 3, 16, 16, device="cuda")
    fused = from_module(model, x, precision="fp32", cuda_graph=True)
    assert isinstance(fused, GraphReplay) and fused.captures == 1
    return model, fused


@pytest.mark.gpu
def test_replays_match_float64_and_write_every_element(graphed):
    model, fused = graphed
    for _ in range(3):
        x = torch.randn(2, 3, 16, 16, device="cuda")
        fused._static_out.fill_(float("nan"))  # poisoned: the replay must write all of it
        before = fused.replays
        with torch.no_grad():
            y = fused(x)
        assert fused.replays == before + 1
        assert torch.isfinite(y).all()
        assert _rel_l2(y, _reference(model, x)) <= 1e-5
        with torch.no_grad():
            torch.testing.assert_close(y, model(x), atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
def test_each_call_returns_a_fresh_tensor(graphed):
    model, fused = graphed
    x1, x2 = (torch.randn(2, 3, 16, 16, device="cuda") for _ in range(2))
    with torch.inference_mode():
        y1 = fused(x1)
        kept = y1.clone()
        y2 = fused(x2)
    assert fused.replays == 2
    assert y1.data_ptr() != y2.data_ptr() and torch.equal(y1, kept)  # the second call did not overwrite the first
    assert not torch.equal(y1, y2)


@pytest.mark.gpu
def test_calls_that_cannot_replay_run_the_plain_model(graphed):
    model, fused = graphed
    x = torch.randn(2, 3, 16, 16, device="cuda")
    y = fused(x)  # autograd on: the plain path, differentiable
    assert fused.replays == 0 and y.requires_grad
    y.sum().backward()
    assert model[0].weight.grad is not None
    with torch.no_grad():
        other = torch.randn(5, 3, 16, 16, device="cuda")  # another batch
        assert _rel_l2(fused(other), _reference(model, other)) <= 1e-5
        assert fused.replays == 0
        graph = torch.cuda.CUDAGraph()  # a caller's own capture records the plain path
        with torch.cuda.graph(graph):
            captured = fused(x)
        graph.replay()
        assert fused.replays == 0
        assert _rel_l2(captured, _reference(model, x)) <= 1e-5
        model.train()
        fused.train()
        fused(x)
        assert fused.replays == 0
        model.eval()
        fused.eval()
        fused(x)
        assert fused.replays == 1


@pytest.mark.gpu
def test_an_in_place_weight_update_captures_again(graphed):
    model, fused = graphed
    x = torch.randn(2, 3, 16, 16, device="cuda")
    with torch.no_grad():
        fused(x)
        model[0].weight.mul_(-0.5)  # the parameter object from_module shares with the fused layer
        model[3].bias.add_(1.0)
        y = fused(x)
    assert fused.captures == 2 and fused.replays == 2
    assert _rel_l2(y, _reference(model, x)) <= 1e-5


@pytest.mark.gpu
def test_from_module_keeps_the_graph_only_where_it_measures_faster():
    model = _model().cuda()
    x = torch.randn(2, 3, 16, 16, device="cuda")
    fused = from_module(model, x, precision="fp32")
    report = fused.specgen_report
    assert report.graph is not None
    graph_ms, plain_ms = report.graph
    assert isinstance(fused, GraphReplay) == (graph_ms < plain_ms * WHOLE_MODEL_MARGIN) == report.graph_taken
    # each chain timed again inside a CUDA graph (GPU time alone), with positive times
    assert [c.layer for c in report.graph_choices] == [c.layer for c in report.choices]
    assert all(c.how in ("graph measured", "graph cached") and c.specgen_ms > 0 and c.pytorch_ms > 0
               for c in report.graph_choices)
    assert "CUDA graph:" in str(report)
    with torch.no_grad():
        x2 = torch.randn(2, 3, 16, 16, device="cuda")
        assert _rel_l2(fused(x2), _reference(model, x2)) <= 1e-5
    assert not isinstance(from_module(model, x, precision="fp32", cuda_graph=False), GraphReplay)


@pytest.mark.gpu
def test_a_copy_or_a_conversion_captures_its_own_graph(graphed):
    import copy

    model, fused = graphed
    twin = copy.deepcopy(fused)
    x = torch.randn(2, 3, 16, 16, device="cuda")
    with torch.no_grad():
        want = _reference(model, x)
        assert _rel_l2(twin(x), want) <= 1e-5 and twin.captures == 2 and twin.replays == 1
        fused.cuda()  # a conversion (here to where it is): the graph goes, the next call captures again
        assert _rel_l2(fused(x), want) <= 1e-5 and fused.captures == 2 and fused.replays == 1
        next(twin.module.parameters()).mul_(2.0)  # the copy's parameters are its own
        assert _rel_l2(fused(x), want) <= 1e-5
