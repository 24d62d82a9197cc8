"""The box fold without a GPU: where it applies, the folded layer against the float64 reference
(the box means by torch's own average pool, tests/tail_model.box_means, then the 1x1 conv's
reference with the launch's weights), the plan, the source and nvcc."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import tail_model
from specgen import boxfold, reference
from specgen.plan import build_plan, describe
from specgen.render import render_plan
from specgen.spec import validate
from test_tapsum import random_tensors


@pytest.fixture(autouse=True)
def box_fold_on(monkeypatch):
    monkeypatch.setattr(boxfold, "ENABLED", True)  # (whatever the planner's default)


def layer(cin, size, cout, epilogue, **conv):
    return {"name": "box", "input": {"channels": cin, "size": size},
            "conv": {"out_channels": cout, "kernel": conv.pop("kernel", 3), **conv}, "epilogue": epilogue}


FOLDS = {
    # KernelBench 65's chain, smaller: a 3x3 conv, a pool of 4, sigmoid, the sum of everything
    "kb65_like": layer(8, [26, 23], 64, [{"avg_pool": 4}, "sigmoid", {"sum": {"dims": [1, 2, 3]}}]),
    # the conv's padding inside the windows, two groups, an affine stage before the pool
    "padded_groups": layer(6, [13, 18], 128, [{"mul": {"param": "s"}}, {"avg_pool": 4}, "relu"], padding=1, groups=2),
    # a 3-D layer: boxes of 3 x 4 x 4 for a 2 x 3 x 3 kernel; an eval batch norm before the pool
    "conv3d": layer(4, [7, 10, 9], 32, [{"batch_norm": {}}, {"avg_pool": [3, 4, 4]}, "gelu"], kernel=[2, 3, 3]),
    # 1-D, a kernel of 2 and windows of 8; a softmax over the channels after it (the 1x1 conv is a sequence)
    "conv1d_softmax": layer(8, [70], 64, [{"avg_pool": 8}, {"softmax": 1}], kernel=2, padding=[1]),
    # windows unlike along H and W; the kernel as wide as the window along W
    "uneven": layer(3, [17, 16], 96, [{"avg_pool": {"kernel": [5, 3]}}, "tanh"], kernel=[2, 3]),
}


def spec_of(key, **changes):
    return validate({**FOLDS[key], "precision": "fp32", **changes})


def folded_by_model(spec, x, w, b, params):
    """The layer as its plan runs it: the box means by torch's pool, the 1x1 conv's reference."""
    plan = build_plan(spec)
    assert plan["engine"] == "sequence" and plan["parts"][0]["role"] == "boxmean", plan.get("why")
    return tail_model.run_sequence(spec, plan, x, w, b, params)


@pytest.mark.parametrize("name", sorted(FOLDS))
@pytest.mark.parametrize("batch", [1, 3])
def test_the_folded_layer_is_the_layer(name, batch):
    spec = spec_of(name)
    assert boxfold.find(spec) is not None, name
    x, w, b, params = random_tensors(spec, batch, seed=batch + len(name))
    want = reference.forward(spec, x, w, b, params)
    got = folded_by_model(spec, x, w, b, params)
    assert got.shape == want.shape
    assert ((got - want).norm() / want.norm()).item() < 1e-12


def test_what_does_not_fold():
    base = FOLDS["kb65_like"]

    def fold(**changes):
        data = {**base, "precision": "fp32", **changes}
        return boxfold.find(validate(data))

    assert fold() is not None
    conv = base["conv"]
    assert fold(conv={**conv, "stride": 2}) is None  # a strided conv: the taps of neighbouring outputs interleave
    assert fold(conv={**conv, "dilation": 2}) is None
    assert fold(conv={**conv, "kernel": 5}) is None  # the taps reach past the window: boxes would overlap
    assert fold(epilogue=[{"avg_pool": {"kernel": 4, "stride": 2}}]) is None  # overlapping windows
    assert fold(epilogue=[{"avg_pool": {"kernel": 4, "padding": 1}}]) is None
    assert fold(epilogue=[{"max_pool": 4}]) is None
    assert fold(epilogue=["relu", {"avg_pool": 4}]) is None  # not linear before the pool
    assert fold(epilogue=[{"avg_pool": 2}]) is None  # (3 + 2 - 1)^2 / 3^2 = 1.8: too little to gain
    assert fold(conv={**conv, "out_channels": 8}) is None  # too few channels to pay for the means' round trip
    assert fold(precision="tf32") is None and fold(precision="bf16") is None  # fp32 tensors only
    assert fold(rewrites=False) is None
    assert boxfold.find(validate({**base, "precision": "fp32"}), rewrites=False) is None


def test_the_switch_turns_it_off(monkeypatch):
    spec = spec_of("kb65_like")
    monkeypatch.setattr(boxfold, "ENABLED", False)
    assert boxfold.find(spec) is None and "avg-pool fold" in build_plan(spec)["rewrites"][0]


def test_the_tf32_default_of_a_few_channel_layer_folds_as_fp32():
    """KernelBench 65 in PyTorch's default mode computes as fp32 (few input channels), so it folds."""
    plan = build_plan(validate({**FOLDS["kb65_like"], "precision": "tf32"}))
    assert plan["parts"][0]["role"] == "boxmean"
    body = next(p for p in plan["parts"] if p["role"] == "body")
    assert body["spec"].precision == "fp32"


# ---- the plan, the source, nvcc ----------------------------------------------------------------------


def test_the_plan_says_what_it_does():
    spec = spec_of("padded_groups")
    plan = build_plan(spec)
    assert [t["kind"] for t in plan["weight_transforms"]] == ["box_fold"]
    assert plan["rewrites"][0].startswith("box fold: epilogue[1] avg_pool 4x4")
    text = describe(plan)
    assert "box means: for each of the 9 taps of the 3x3 conv, the input's mean over each 4x4 window" in text
    body = next(p for p in plan["parts"] if p["role"] == "body")["spec"]
    assert body.input.channels == 6 * 9 and body.conv.groups == 2 and body.conv_geometry()["kernel"] == (1, 1)
    assert [s.op for s in body.epilogue] == ["mul", "relu"]  # the pool taken out, the affine stage kept
    bp = plan["parts"][0]["plan"]
    assert plan["buffers"] == {"s": bp.s_per_sample} and bp.s_per_sample == 6 * 9 * 3 * 4  # pooled (13 // 4) x (18 // 4) (padding 1: the conv keeps the size)


def test_the_weights_are_the_users_read_per_tap():
    from specgen.torchop import transformed_weight

    w = torch.randn(64, 3, 3, 3)
    got = transformed_weight(w, {"kind": "box_fold", "taps": 9})
    assert got.shape == (64, 27, 1, 1)
    assert torch.equal(got[5, 1 * 9 + 2 * 3 + 1, 0, 0], w[5, 1, 2, 1])  # channel 1, tap (2, 1)


def test_the_source_says_how_it_works():
    text = render_plan(build_plan(spec_of("conv3d")))
    assert "specgen_box_boxmean" in text and "How this kernel works" in text
    assert "constexpr int KD = 2, PD = 3, ED = 4, PAD_D = 0, OD = 2;" in text
    assert "ih >= 0" not in text  # no padding: no bounds checks
    padded = render_plan(build_plan(spec_of("padded_groups")))
    assert "ih >= 0 && ih < H" in padded and "iw >= 0 && iw < W" in padded


@pytest.mark.nvcc
def test_box_fold_variants_compile_without_spills(tmp_path, monkeypatch):
    from specgen import pipeline

    monkeypatch.setenv("SPECGEN_CACHE_DIR", str(tmp_path / "cache"))
    specs = [spec_of(n, name=n) for n in ("kb65_like", "padded_groups", "conv3d", "conv1d_softmax")]
    built = pipeline.specialize_many(specs, "sm_90", tuned=False)
    for item in built:
        assert item.build.spill_bytes == 0, (item.spec.name, item.build.log)
        assert f"specgen_{item.spec.name}_boxmean" in item.build.log


@pytest.mark.nvcc
def test_the_run_time_dimensions_rendering_of_a_box_fold(tmp_path):
    """`specgen bench` times a box-folded layer against its rendering with the extents read at run
    time: every part of the sequence renders that way where its engine has one, and it builds."""
    from specgen.compile import compile_cubin
    from specgen.pipeline import build_arch
    from specgen.render import TemplateError, has_runtime_dims

    plan = build_plan(spec_of("kb65_like"))
    assert has_runtime_dims(plan)
    text = render_plan(plan, runtime_dims=True)
    assert text != render_plan(plan)
    assert "__constant__ int OUT_POS" in text and "__constant__ int C_IN" in text  # the box means' extents
    assert text.count("RUNTIME-DIMENSIONS VARIANT") == 2  # the box-mean kernel's, the 1x1 conv's
    (tmp_path / "kernel.cu").write_text(text)
    report = compile_cubin(tmp_path / "kernel.cu", tmp_path / "kernel.cubin", build_arch(plan, "sm_90"))
    assert report.registers > 0 and report.spill_bytes == 0, report.log
    # a statistic stage's kernels (the softmax after the 1x1 conv) have none, nor its GEMM engine
    with_tail = build_plan(spec_of("conv1d_softmax"))
    assert not has_runtime_dims(with_tail)
    with pytest.raises(TemplateError, match="no run-time-dimensions rendering"):
        render_plan(with_tail, runtime_dims=True)


# ---- random foldable layers ---------------------------------------------------------------------


@st.composite
def foldable(draw):
    nd = draw(st.integers(1, 3))
    kernel = [draw(st.integers(1, 3)) for _ in range(nd)]
    window = [draw(st.integers(k, 5)) for k in kernel]
    padding = [draw(st.integers(0, k - 1)) for k in kernel]
    size = [draw(st.integers(max(1, w - 2 * p + k - 1), 2 * w + 6)) for k, w, p in zip(kernel, window, padding)]
    groups = draw(st.sampled_from([1, 2]))
    cin = groups * draw(st.integers(1, 3))
    pre = draw(st.sampled_from([[], [{"mul": 0.5}], [{"add": {"param": "b1"}}]]))
    post = draw(st.sampled_from([[], ["sigmoid"], [{"sum": {"dims": [1]}}]]))
    return layer(cin, size, 64, [*pre, {"avg_pool": {"kernel": window}}, *post], kernel=kernel, padding=padding,
                 groups=groups)


ran = {"cases": 0}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=foldable(), batch=st.integers(1, 2))
def test_random_folds_match_the_reference(data, batch):
    spec = validate({**data, "precision": "fp32"})
    assume(boxfold.find(spec) is not None)
    ran["cases"] += 1
    x, w, b, params = random_tensors(spec, batch, seed=batch)
    want = reference.forward(spec, x, w, b, params)
    got = folded_by_model(spec, x, w, b, params)
    assert ((got - want).norm() / max(want.norm(), 1e-30)).item() < 1e-11


def test_the_random_folds_ran():
    assert ran["cases"] >= 20, ran  # (after the test above, in file order: most drawn layers fold)


# ---- the box-mean kernel itself, compiled for the host ---------------------------------------------

HOST_PRELUDE = """// the CUDA names the kernel uses, for a host build that runs every thread in turn
#include <cstdio>
#include <cstdlib>
struct Index3 { int x, y, z; };
static Index3 blockIdx, threadIdx;
#define __global__
#define __constant__
#define __launch_bounds__(n)
#define __restrict__
"""

HOST_MAIN = """
int main(int argc, char** argv) {
  // argv: batch, x file, b file; every (block, thread) of the grid in turn
  const int batch = atoi(argv[1]);
  float* x = (float*)malloc(sizeof(float) * (size_t)batch * PER_SAMPLE_IN);
  float* b = (float*)malloc(sizeof(float) * (size_t)batch * PER_SAMPLE_B);
  FILE* f = fopen(argv[2], "rb");
  if (fread(x, sizeof(float), (size_t)batch * PER_SAMPLE_IN, f) != (size_t)batch * PER_SAMPLE_IN) return 2;
  fclose(f);
  for (size_t i = 0; i < (size_t)batch * PER_SAMPLE_B; ++i) b[i] = 0.0f / 0.0f;  // poisoned
  for (int n = 0; n < batch; ++n)
    for (int bx = 0; bx < GRID_X; ++bx)
      for (int tx = 0; tx < THREADS; ++tx) {
        blockIdx = {bx, n, 0};
        threadIdx = {tx, 0, 0};
        KERNEL(x, b, batch);
      }
  f = fopen(argv[3], "wb");
  fwrite(b, sizeof(float), (size_t)batch * PER_SAMPLE_B, f);
  fclose(f);
  return 0;
}
"""


@pytest.mark.skipif(__import__("shutil").which("g++") is None, reason="needs a host C++ compiler (g++)")
@pytest.mark.parametrize("runtime_dims", [False, True], ids=["literal", "runtime_dims"])
@pytest.mark.parametrize("name", sorted(FOLDS))
def test_the_box_mean_kernel_computes_the_means(name, runtime_dims, tmp_path):
    """The rendered box-mean kernel, built for the host with every thread run in turn, against the
    model of the means (torch's pool): its index arithmetic, bounds and write layout; also in the
    rendering `specgen bench` measures constant folding against (extents as variables)."""
    import subprocess

    import numpy as np

    spec = spec_of(name)
    plan = build_plan(spec)
    bp = plan["parts"][0]["plan"]
    source = render_plan(bp, "boxmean.cu.j2", runtime_dims=runtime_dims)
    assert ("__constant__ int OUT_POS" in source) == runtime_dims
    (tmp_path / "box.cpp").write_text(HOST_PRELUDE + source + f"\n#define KERNEL {bp.kernel_name}\n"
                                      f"constexpr int GRID_X = {bp.grid_x};\n" + HOST_MAIN)
    subprocess.run(["g++", "-O1", "-std=c++17", "-o", str(tmp_path / "box"), str(tmp_path / "box.cpp")], check=True,
                   capture_output=True)
    batch = 2
    x = torch.rand(batch, bp.per_sample_in, generator=torch.Generator().manual_seed(len(name)), dtype=torch.float32)
    x.numpy().tofile(tmp_path / "x.bin")
    subprocess.run([str(tmp_path / "box"), str(batch), str(tmp_path / "x.bin"), str(tmp_path / "b.bin")], check=True)
    got = torch.from_numpy(np.fromfile(tmp_path / "b.bin", dtype=np.float32)).double().reshape(batch, -1)
    want = tail_model.box_means(bp, x).reshape(batch, -1)
    assert not got.isnan().any()
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6), (got - want).abs().max()
