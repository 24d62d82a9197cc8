"""The example models (examples/models.py): each imports and, fused, computes what it computes.

CPU: every model is examined without error, its fusable chains are the ones its structure has,
and from_module's model (CPU reference path) equals the original in eval mode. GPU (marked
`gpu`): at batch 1 and 8, the fused model (never-slower rule on) matches the float64 original
within rel. L2 1e-5 with TF32 off (fp32 mode)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from example_models import example_models
from specgen.importer import explain, from_module
from specgen.module import FusedLayer


models = example_models()

# The chains each model's structure holds: conv (+ batch norm) (+ activation) (+ a pool that
# follows directly); a residual add or a concatenation ends a chain. ViT-S/16 (fp32 mode, cuBLAS's
# TF32 off by default): per block the qkv Linear alone, the projection + residual add, fc1 + GELU,
# fc2 + residual add.
CHAINS = {"ResNet18": 20, "ResNet50Stage": 13, "MobileNetV2": 52, "VGG11": 8, "UNet": 15, "Conv3dStack": 5,
          "ConvNeXtT": 55, "ViTS16": 48}


def test_every_model_is_listed():
    assert sorted(cls.__name__ for cls in models.MODELS) == sorted(CHAINS)


@pytest.mark.parametrize("cls", models.MODELS, ids=lambda c: c.__name__)
def test_model_imports_and_fused_output_equals_the_original(cls):
    model = cls.make()
    x = cls.example_input(batch=2, small=True)
    report = explain(model, x)
    assert len(report.specs) == CHAINS[cls.__name__], str(report)
    fused = from_module(model, x)
    assert len([m for m in fused.modules() if isinstance(m, FusedLayer)]) == CHAINS[cls.__name__]
    with torch.no_grad():
        want = model(x)
        torch.testing.assert_close(fused(x), want)
        other = cls.example_input(batch=3, small=True, seed=1)  # another batch size, other values
        torch.testing.assert_close(fused(other), model(other))
    assert want.abs().max() > 0


def test_make_gives_eval_models_with_nontrivial_batch_norm():
    model = models.ResNet18.make()
    assert not model.training
    assert model.bn1.running_var.min() >= 0.5 and model.bn1.running_mean.abs().max() > 0


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("cls", models.MODELS, ids=lambda c: c.__name__)
def test_fused_model_matches_float64_on_the_gpu(cls, batch):
    old = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False  # fp32 mode
    try:
        model = cls.make().cuda()
        x = cls.example_input(batch=batch, device="cuda")
        fused = from_module(model, x)
        with torch.no_grad():
            got = fused(x)
            want64 = model.double()(x.double())
        model.float()
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = old
    rel = ((got.double() - want64).norm() / want64.norm()).item()
    print(f"{cls.__name__} batch {batch}: rel L2 {rel:.2e}; {fused.specgen_report}")
    assert rel <= 1e-5, f"{cls.__name__} batch {batch}: rel L2 {rel:.3e}"


# -- specgen bench --model -----------------------------------------------------------------------


@pytest.fixture
def cpu_as_gpu(monkeypatch):
    """bench_model's GPU calls made to run on CPU: .cuda() keeps tensors where they are and each
    timing is one call that reports 1 ms (specgen) or 2 ms (anything else)."""
    from specgen import bench

    monkeypatch.setattr(torch.nn.Module, "cuda", lambda self, *a, **k: self)
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)

    ran_fused = [False]
    real_forward = FusedLayer.forward

    def forward(self, *args, **kwargs):
        ran_fused[0] = True
        return real_forward(self, *args, **kwargs)

    def fake_time(fn, reps, warmup=3):
        ran_fused[0] = False
        fn()
        return 1.0 if ran_fused[0] else 2.0

    monkeypatch.setattr(FusedLayer, "forward", forward)
    monkeypatch.setattr(bench, "_time", fake_time)
    return bench


def test_bench_model_rows_and_chains(cpu_as_gpu):
    bench = cpu_as_gpu
    cls = models.Conv3dStack
    result = bench.bench_model(cls.make(), cls.example_input(batch=2, small=True), reps=2, compile=False)
    names = [r["name"] for r in result["rows"]]  # (a CUDA graph taken: the fused model without it too)
    assert names in (["eager", "specgen"], ["eager", "specgen", "specgen, no CUDA graph"])
    assert result["chains_fusable"] == result["chains_fused"] == CHAINS["Conv3dStack"]
    eager, fused = result["rows"]
    assert "error" not in eager and "error" not in fused, result["rows"]
    assert eager["rel_l2"] < 1e-6 and fused["rel_l2"] < 1e-6  # both against the float64 model
    assert fused["ms"] == 1.0 and fused["vs_eager"] == 2.0 and not fused["slower_than_eager"]
    text = bench.format_model_table(result)
    assert "5 of 5 chain(s) fused" in text and "slower than eager" not in text
    assert "conv3d 3->32" in text
    assert all(c["how"] == "not measured (no GPU)" for c in result["chains"])


def test_bench_marks_rows_slower_than_eager():
    from specgen import bench

    rows = [
        {"name": "eager", "ms": 1.0, "vs_eager": 1.0, "vs_compile": None, "rel_l2": 0.0, "first_call_s": 0.1},
        {"name": "specgen", "ms": 1.5, "vs_eager": 0.67, "vs_compile": None, "rel_l2": 0.0, "first_call_s": 0.1,
         "slower_than_eager": True},
        {"name": "specgen + torch.compile", "ms": 0.5, "vs_eager": 2.0, "vs_compile": None, "rel_l2": 0.0,
         "first_call_s": 0.1, "slower_than_eager": False},
    ]
    result = {"model": "M", "input_shape": [1, 3, 8, 8], "specialize_s": 0.1, "chains_fusable": 0,
              "chains_fused": 0, "rows": rows, "chains": []}
    lines = bench.format_model_table(result).splitlines()
    marked = [line.split()[0] + " " + line.split()[1] for line in lines if line.endswith("<< slower than eager")]
    assert marked == ["specgen 1.500"]


def test_spec_bench_marks_specgen_rows_slower_than_eager():
    from specgen import bench

    def row(name, ms, slower):
        return {"name": name, "ms": ms, "vs_eager": 1.0 / ms, "vs_compile": None, "rel_l2": 0.0, "peak_bytes": 0,
                "slower_than_eager": slower, **({"pct_of_floor": 50.0} if name.startswith("specgen") else {})}

    result = {"spec": "s", "batch": 1, "flops": 1e9, "fewest_bytes": 1e6, "engine": "fp32 FFMA", "floor_ms": 0.1,
              "floor_ffma_ms": 0.1, "folding_speedup": 1.0,
              "rows": [row("eager", 1.0, False), row("specgen", 1.2, True), row("specgen runtime-dims", 0.9, False)]}
    marked = [line.split()[0] for line in bench.format_table(result).splitlines() if line.endswith("<< slower than eager")]
    assert marked == ["specgen"]
    # what bench decides: the rows a layer runs as, never the runtime-dims rendering (a measurement)
    assert bench.slower_than_eager("specgen", 1.2, 1.0) and bench.slower_than_eager("specgen channels_last in", 1.2, 1.0)
    assert not bench.slower_than_eager("specgen", 0.9, 1.0)
    assert not bench.slower_than_eager("specgen runtime-dims", 1.2, 1.0)
    assert not bench.slower_than_eager("eager channels_last", 1.2, 1.0)


def test_spec_bench_marks_a_row_slower_by_either_measure():
    from specgen import bench

    # (idle ms, streamed ms) of specgen against eager's (1.0, 1.0): which measure lost is named
    cases = {(1.2, 0.8): " (one call from idle)", (0.8, 1.2): " (streamed)", (1.2, 1.2): "", (0.9, 0.9): None}
    for (idle, streamed), says in cases.items():
        slower = bench.slower_than_eager("specgen", idle, 1.0, streamed, 1.0)
        assert slower == (says is not None)
        eager = {"name": "eager", "ms": 1.0, "ms_stream": 1.0, "vs_eager": 1.0, "stream_vs_eager": 1.0,
                 "vs_compile": None, "stream_vs_compile": None, "rel_l2": 0.0, "peak_bytes": 0, "slower_than_eager": False}
        me = {**eager, "name": "specgen", "ms": idle, "ms_stream": streamed, "vs_eager": 1.0 / idle,
              "stream_vs_eager": 1.0 / streamed, "slower_than_eager": slower, "pct_of_floor": 50.0}
        result = {"spec": "s", "batch": 1, "flops": 1e9, "fewest_bytes": 1e6, "engine": "fp32 FFMA", "floor_ms": 0.1,
                  "floor_ffma_ms": 0.1, "folding_speedup": None, "rows": [eager, me]}
        line = bench.format_table(result).splitlines()[-1]
        assert line.startswith("specgen") and f"{streamed:9.3f}{1.0 / streamed:9.2f}" in line
        if says is None:
            assert "slower" not in line
        else:
            assert line.endswith(bench.SLOWER_MARK + says)
    # the streamed times alone never mark a row that PyTorch runs
    assert not bench.slower_than_eager("eager channels_last", 1.0, 1.0, 1.5, 1.0)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["bench", "--model", "examples/models.py:VGG11"], "--model needs --input-shape"),
        (["bench", "--model", "examples/models.py:Nope", "--input-shape", "1,3,32,32"], "has no 'Nope'"),
        (["bench", "--model", "examples/models.py:VGG11", "--input-shape", "1,x"], "--input-shape: expected"),
        (["bench", "--model", "examples/models.py:VGG11", "--input-shape", "1,3,32,32", "--batch", "0"], "--batch"),
        (["bench"], "give FILE.yaml... or --model"),
    ],
)
def test_bench_model_bad_input_exits_2(argv, message, capsys, monkeypatch):
    from specgen import cli

    monkeypatch.chdir(Path(__file__).resolve().parent.parent)
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_bench_model_without_a_gpu_says_so(capsys, monkeypatch):
    from specgen import cli

    monkeypatch.chdir(Path(__file__).resolve().parent.parent)
    assert cli.main(["bench", "--model", "examples/models.py:VGG11", "--input-shape", "1,3,32,32"]) == 2
    assert "on a CUDA GPU; none is available" in capsys.readouterr().err


@pytest.mark.gpu
def test_bench_model_on_the_gpu():
    from specgen import bench

    cls = models.Conv3dStack
    result = bench.bench_model(cls.make(), cls.example_input(batch=2, small=True), reps=5, compile=False)
    names = [r["name"] for r in result["rows"]]  # (a CUDA graph taken: the fused model without it too)
    assert names in (["eager", "specgen"], ["eager", "specgen", "specgen, no CUDA graph"])
    assert all(r["ms"] > 0 and r["rel_l2"] < 1e-4 for r in result["rows"])
    assert all(c["how"] in ("measured", "cached") and c["specgen_ms"] > 0 for c in result["chains"])
    print(bench.format_model_table(result))


@pytest.mark.gpu
def test_spec_bench_keeps_going_without_its_runtime_dims_row(monkeypatch, capsys):
    """The runtime-dims rendering is a measurement no layer runs: where it cannot be built, the
    bench reports the layer without that row (and says why) rather than failing."""
    from specgen import bench, pipeline
    from specgen.compile import CompileError
    from specgen.spec import validate

    spec = validate({"name": "rt_row", "precision": "fp32", "input": {"channels": 8, "size": [16, 16]},
                     "conv": {"out_channels": 16, "kernel": 3}, "epilogue": ["relu"], "tile": {"engine": "ffma"}})
    result = bench.bench(spec, 2, reps=3, compile=False)
    assert "specgen runtime-dims" in [r["name"] for r in result["rows"]] and result["folding_speedup"] > 0

    def broken(*args, **kwargs):
        raise CompileError("nvcc failed (a stand-in)", command=["nvcc"], log="", returncode=1)

    monkeypatch.setattr(pipeline, "specialize_runtime_dims", broken)
    result = bench.bench(spec, 2, reps=3, compile=False)
    names = [r["name"] for r in result["rows"]]
    assert "specgen runtime-dims" not in names and "specgen" in names and result["folding_speedup"] is None
    assert "rt_row: no runtime-dims row (CompileError: nvcc failed (a stand-in))" in capsys.readouterr().err
