"""from_module's never-slower rule and parallel build, on CPU with the GPU parts stood in for.

The stand-ins: `torch.cuda.is_available` says yes, specialization hands out fake kernels (so the
layers run their CPU reference), and `measured.compare` returns the times a test sets, after
checking that the two contenders it was given compute the same thing."""

from __future__ import annotations

import hashlib
import json
import types

import pytest
import torch
import torch.nn as nn

from specgen import importer, measured, pipeline
from specgen.importer import Choice, explain, from_module, rewrite
from specgen.module import FusedLayer


class TwoChains(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.second = nn.Conv2d(8, 4, 3)

    def forward(self, x):
        x = torch.relu(self.bn(self.first(x)))
        return torch.sigmoid(self.second(x)) * 2.0


def _model():
    torch.manual_seed(0)
    model = TwoChains().eval()
    with torch.no_grad():
        model.bn.running_mean.uniform_(-0.5, 0.5)
        model.bn.running_var.uniform_(0.5, 2.0)
    return model


class FakeGPU:
    """Records what the GPU side was asked to do; `times[layer] = (specgen_ms, pytorch_ms)`."""

    def __init__(self):
        self.built: dict[str, object] = {}
        self.batches: list[list[str]] = []
        self.serial: list[str] = []
        self.timed: list[str] = []
        self.times: dict[str, tuple[float, float]] = {}
        self.whole = (1.0, 2.0)  # the whole model, fused and original (ms): fused faster by default (a list: one per check)
        self.wholes = 0
        self.variants: list[list[str]] = []  # channels-last kernels asked for, per batch
        self.timed_channels_last: list[bool] = []  # per chain timing: whether its input came channels-last

    def fake(self, spec):
        key = hashlib.sha256(("fake\n" + spec.canonical_json()).encode()).hexdigest()
        return types.SimpleNamespace(key=key, spec=spec, plan={}, arch=None, follows_tuning=False)

    def specialize_many(self, specs, arch=None):
        self.batches.append([s.name for s in specs])
        for spec in specs:
            self.built[spec.canonical_json()] = self.fake(spec)
        return [self.built[s.canonical_json()] for s in specs]

    def specialize(self, spec, arch=None):
        hit = self.built.get(spec.canonical_json())
        if hit is None:  # a compile outside the parallel batch
            self.serial.append(spec.name)
            hit = self.built[spec.canonical_json()] = self.fake(spec)
        return hit

    def compare(self, fused, original, inputs):
        if not isinstance(fused, FusedLayer):  # from_module's last check: the whole model, both ways
            with torch.no_grad():
                for args in inputs:
                    torch.testing.assert_close(fused(args), original(args))
            self.wholes += 1
            return self.whole.pop(0) if isinstance(self.whole, list) else self.whole
        assert not isinstance(original, FusedLayer)
        assert all(x.abs().sum() > 0 for x in inputs), "timing inputs must be non-zero"
        with torch.no_grad():
            for x in inputs:  # the two contenders compute the same chain
                torch.testing.assert_close(fused(x), original(x))
        self.timed.append(fused.spec.name)
        self.timed_channels_last.append(not inputs[0].is_contiguous())
        return self.times[fused.spec.name]

    def build_variants(self, items):
        self.variants.append([sp.spec.name for sp in items])


@pytest.fixture
def gpu(monkeypatch, tmp_path):
    fake = FakeGPU()
    monkeypatch.setenv("SPECGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(pipeline, "specialize_many", fake.specialize_many)
    monkeypatch.setattr(pipeline, "specialize", fake.specialize)
    monkeypatch.setattr(importer, "_unmeasurable", lambda imp: None)
    monkeypatch.setattr(rewrite, "_is_gpu", lambda device: True)
    monkeypatch.setattr(measured, "gpu_identity", lambda device: "Fake GPU (1 SMs)")
    monkeypatch.setattr(measured, "compare", fake.compare)
    monkeypatch.setattr(pipeline, "build_channels_last_variants", fake.build_variants)
    return fake


def _names(model, x):
    return [spec.name for spec in explain(model, x).specs]


def _fused(module):
    return [m for m in module.modules() if isinstance(m, FusedLayer)]


# -- parallel build ------------------------------------------------------------------------------


def test_all_chains_compile_in_one_parallel_batch(gpu):
    model, x = _model(), torch.randn(2, 3, 10, 10)
    gpu.times = {name: (0.5, 1.0) for name in _names(model, x)}
    fused = from_module(model, x)
    assert gpu.batches == [_names(model, x)]  # one batch holding every chain
    assert gpu.serial == []  # and no layer compiled on its own afterwards
    assert len(_fused(fused)) == 2


# -- never slower --------------------------------------------------------------------------------


def test_a_chain_not_faster_fused_keeps_its_pytorch_code(gpu):
    model, x = _model(), torch.randn(2, 3, 10, 10)
    slow, fast = _names(model, x)
    gpu.times = {slow: (2.0, 1.0), fast: (0.25, 1.0)}
    fused = from_module(model, x)
    assert [layer.spec.name for layer in _fused(fused)] == [fast]
    with torch.no_grad():
        torch.testing.assert_close(fused(x), model(x))
    report = fused.specgen_report
    assert report.choices == [Choice(slow, False, 2.0, 1.0, "measured"), Choice(fast, True, 0.25, 1.0, "measured")]
    assert [s.name for s in report.fused_specs] == [fast]
    text = str(report)
    assert "1 fused layer(s) (1 more kept as PyTorch" in text
    assert f"{slow}: " in text and "kept as PyTorch: specgen 2.0000 ms, PyTorch 1.0000 ms (measured)" in text
    assert "fused: specgen 0.2500 ms, PyTorch 1.0000 ms (measured)" in text


def test_a_fused_model_not_faster_as_a_whole_gives_back_the_original(gpu):
    model, x = _model(), torch.randn(2, 3, 10, 10)
    gpu.times = {name: (0.5, 1.0) for name in _names(model, x)}  # every chain wins alone ...
    gpu.whole = (2.1, 2.0)  # ... but the fused model loses as a whole
    result = from_module(model, x)
    assert result is model and gpu.wholes == 1
    assert result.specgen_report.whole_model == (2.1, 2.0)
    assert "whole model: fused 2.100 ms, original 2.000 ms: kept the original" in str(result.specgen_report)
    gpu.whole = (1.9, 2.0)
    fused = from_module(model, x)
    assert fused is not model and len(_fused(fused)) == 2 and fused.specgen_report.whole_model == (1.9, 2.0)


def test_equal_times_keep_pytorch(gpu):
    model, x = _model(), torch.randn(2, 3, 10, 10)
    gpu.times = {name: (1.0, 1.0) for name in _names(model, x)}
    fused = from_module(model, x)
    assert _fused(fused) == [] and fused is model  # nothing fused: the original itself
    with torch.no_grad():
        torch.testing.assert_close(fused(x), model(x))
    assert not any(c.fused for c in fused.specgen_report.choices)


def test_keep_slower_fuses_every_chain_unmeasured(gpu):
    model, x = _model(), torch.randn(2, 3, 10, 10)
    gpu.times = {name: (2.0, 1.0) for name in _names(model, x)}
    fused = from_module(model, x, keep_slower=True)
    assert gpu.timed == []
    assert len(_fused(fused)) == 2
    assert all(c.fused and c.how == "not measured (keep_slower=True)" for c in fused.specgen_report.choices)


def test_a_decision_is_measured_once_per_batch_bucket(gpu, tmp_path):
    model = _model()
    slow, fast = _names(model, torch.randn(2, 3, 10, 10))
    gpu.times = {slow: (2.0, 1.0), fast: (0.25, 1.0)}
    from_module(model, torch.randn(2, 3, 10, 10))
    assert sorted(gpu.timed) == sorted([slow, fast])
    records = sorted((tmp_path / "cache" / "measured").glob("*.json"))
    assert len(records) == 2
    assert {json.loads(p.read_text())["layer"] for p in records} == {slow, fast}

    gpu.timed.clear()
    again = from_module(model, torch.randn(2, 3, 10, 10))  # same kernels, same bucket: from the cache
    assert gpu.timed == []
    assert [c.how for c in again.specgen_report.choices] == ["cached", "cached"]
    assert [c.fused for c in again.specgen_report.choices] == [False, True]
    assert len(_fused(again)) == 1

    from_module(model, torch.randn(1, 3, 10, 10))  # batch 1: another bucket
    assert sorted(gpu.timed) == sorted([slow, fast])


def test_explain_measures_only_when_asked(gpu):
    model, x = _model(), torch.randn(2, 3, 10, 10)
    slow, fast = _names(model, x)
    gpu.times = {slow: (2.0, 1.0), fast: (0.25, 1.0)}
    plain = explain(model, x)
    assert gpu.timed == [] and gpu.batches == []
    assert all(c.fused and c.specgen_ms is None for c in plain.choices)
    report = explain(model, x, measure=True)
    assert gpu.batches == [[slow, fast]]
    assert [(c.fused, c.specgen_ms, c.pytorch_ms) for c in report.choices] == [(False, 2.0, 1.0), (True, 0.25, 1.0)]


def test_without_a_gpu_nothing_is_measured():
    model, x = _model(), torch.randn(2, 3, 10, 10)
    fused = from_module(model, x)
    choices = fused.specgen_report.choices
    assert len(choices) == 2 and len(_fused(fused)) == 2
    assert all(c.fused and c.specgen_ms is None and c.how == "not measured (no GPU)" for c in choices)


def test_original_chain_reads_only_the_conv_input():
    model, x = _model(), torch.randn(2, 3, 10, 10)
    imp = importer._importer(model, (x,))
    first, second = imp.chains
    with torch.no_grad():
        mid = torch.relu(model.bn(model.first(x)))
        torch.testing.assert_close(rewrite.original(imp, first)(x), mid)
        torch.testing.assert_close(rewrite.original(imp, second)(mid), torch.sigmoid(model.second(mid)) * 2.0)


# -- the store -----------------------------------------------------------------------------------


@pytest.mark.parametrize("batch, bucket", [(1, 1), (2, 2), (3, 4), (8, 8), (9, 16), (64, 64), (65, 128)])
def test_batch_bucket(batch, bucket):
    assert measured.batch_bucket(batch) == bucket


def test_batch_bucket_refuses_nonpositive():
    with pytest.raises(ValueError, match="batch: expected a positive int, got 0"):
        measured.batch_bucket(0)


def test_store_round_trips_and_ignores_bad_records(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECGEN_CACHE_DIR", str(tmp_path / "cache"))
    key = measured.decision_key("k" * 64, "Fake GPU (1 SMs)", 8, {"torch": "x"})
    assert key != measured.decision_key("k" * 64, "Fake GPU (1 SMs)", 16, {"torch": "x"})
    assert key != measured.decision_key("k" * 64, "Other GPU (2 SMs)", 8, {"torch": "x"})
    assert measured.load(key) is None
    assert measured.store(key, {"layer": "a", "specgen_ms": 0.5, "pytorch_ms": 1.0})
    assert measured.load(key)["specgen_ms"] == 0.5
    folder = tmp_path / "cache" / "measured"
    assert [p.name for p in folder.iterdir()] == [f"{key}.json"]  # no temporary file left behind
    (folder / f"{key}.json").write_text("{not json")
    assert measured.load(key) is None
    (folder / f"{key}.json").write_text(json.dumps({"key": key, "specgen_ms": "fast", "pytorch_ms": 1.0}))
    assert measured.load(key) is None
    other = measured.decision_key("j" * 64, "Fake GPU (1 SMs)", 8)
    (folder / f"{other}.json").write_text(json.dumps({"key": key, "specgen_ms": 1.0, "pytorch_ms": 1.0}))
    assert measured.load(other) is None  # a record filed under the wrong name


def test_store_failure_is_not_an_error(monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("SPECGEN_CACHE_DIR", str(blocker))
    assert measured.store("a" * 64, {"specgen_ms": 1.0, "pytorch_ms": 1.0}) is False


# -- the timing itself, CUDA events stood in for -------------------------------------------------


def test_compare_alternates_the_contenders_and_divides_by_their_calls(monkeypatch):
    """compare's reps alternate first and second; each rep's time is divided by its calls. Events
    stood in for: a "GPU clock" advances by what each contender costs per call."""
    import contextlib

    clock = [0.0]
    cost = {"first": 0.5, "second": 0.125}  # ms per call (exact in binary: the loop sizes are exact)
    order = []

    class Event:
        def __init__(self, enable_timing=True):
            self.t = None

        def record(self):
            self.t = clock[0]

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return other.t - self.t

    def contender(name):
        def fn(x):
            assert x.abs().sum() > 0
            clock[0] += cost[name]
            order.append(name)
        return fn

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    inputs = [torch.randn(3) + 5, torch.randn(3) + 5]
    ms = measured.compare(contender("first"), contender("second"), inputs, reps=3, warmup=1)
    assert ms == pytest.approx((0.5, 0.125))
    inner_first = max(1, min(measured.MAX_INNER, int(measured.TARGET_REP_MS / 0.5)))
    inner_second = max(1, min(measured.MAX_INNER, int(measured.TARGET_REP_MS / 0.125)))
    timed = order[2 + 2:]  # after the warm-up and the two single calls that size the loops
    assert inner_second > inner_first  # (each contender's loop is its own length)
    assert timed == (["first"] * inner_first + ["second"] * inner_second) * 3


# -- memory formats ------------------------------------------------------------------------------


@pytest.fixture
def gpu_cl(gpu):
    return gpu


def _converts(module) -> bool:
    return any(n.op == "call_function" and n.target is rewrite.to_channels_last for n in module.graph.nodes)


def test_a_channels_last_candidate_is_built_timed_and_taken_when_faster(gpu_cl):
    model, x = _model(), torch.randn(2, 3, 10, 10)
    names = _names(model, x)
    gpu_cl.times = {name: (0.5, 1.0) for name in names}
    gpu_cl.whole = [(1.0, 2.0), (1.0, 3.0)]  # channels-last against as given; then the chosen against the original
    fused = from_module(model, x, memory_format="auto")
    assert gpu_cl.variants == [names]  # the channels-last kernels in one batch
    # every chain timed twice: on channels-last inputs (the candidate), then as given
    assert gpu_cl.timed_channels_last == [True] * len(names) + [False] * len(names)
    assert _converts(fused)
    report = fused.specgen_report
    assert report.memory_format == "channels_last" and report.memory_formats == (1.0, 2.0)
    assert "activations: channels-last 1.000 ms, as given 2.000 ms: channels_last" in str(report)
    with torch.no_grad():
        got = fused(x)
        torch.testing.assert_close(got, model(x))
    assert got.is_contiguous()  # (returned as the original returns it)


def test_activations_stay_as_given_where_channels_last_is_not_faster(gpu_cl):
    model, x = _model(), torch.randn(2, 3, 10, 10)
    gpu_cl.times = {name: (0.5, 1.0) for name in _names(model, x)}
    gpu_cl.whole = [(2.0, 1.99), (1.0, 3.0)]  # channels-last not faster by the margin
    fused = from_module(model, x, memory_format="auto")
    assert not _converts(fused)
    assert fused.specgen_report.memory_format == "as given" and fused.specgen_report.memory_formats == (2.0, 1.99)


def test_the_default_keep_slower_and_channels_last_inputs_try_no_candidate(gpu_cl):
    model, x = _model(), torch.randn(2, 3, 10, 10)
    gpu_cl.times = {name: (0.5, 1.0) for name in _names(model, x)}
    fused = from_module(model, x, keep_slower=True, memory_format="auto")
    assert not _converts(fused) and gpu_cl.variants == []
    fused = from_module(model, x)  # the default: as given, one candidate
    assert not _converts(fused) and gpu_cl.variants == [] and fused.specgen_report.memory_format == "as given"
    assert gpu_cl.wholes == 1
    cl = x.contiguous(memory_format=torch.channels_last)
    fused = from_module(model, cl, memory_format="auto")  # already channels-last: nothing to compare (a contiguous call is laid out on the way in)
    assert gpu_cl.wholes == 2 and fused.specgen_report.memory_formats is None
    assert fused.specgen_report.memory_format == "channels_last" and _converts(fused)
    assert gpu_cl.timed_channels_last == [False, False, True, True]


def test_channels_last_asked_for_runs_untimed_and_matches_on_cpu():
    model, x = _model(), torch.randn(2, 3, 10, 10)
    fused = from_module(model, x, memory_format="channels_last")
    assert _converts(fused) and fused.specgen_report.memory_format == "channels_last"
    with torch.no_grad():
        got = fused(x)
        torch.testing.assert_close(got, model(x))
    assert got.is_contiguous()
    with torch.no_grad():  # a channels-last caller: the same values
        torch.testing.assert_close(fused(x.contiguous(memory_format=torch.channels_last)), model(x))


def test_an_unknown_memory_format_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"memory_format: expected 'as_given', 'channels_last' or 'auto' \(both timed\), got 'nhwc'"):
        from_module(_model(), torch.randn(2, 3, 10, 10), memory_format="nhwc")
