"""The max-pool kernel without a GPU: its plan refuses what it cannot pool (naming the field) and
works out PyTorch's extents, renders every extent as a literal, compiles with nvcc without spills,
computes PyTorch's pool when its own source runs on the host, is PyTorch's pool on CPU (custom op
checked, gradient PyTorch's), and from_module gives it the pools no chain takes (padded and
ceil-mode ones too; not those returning indices)."""

from __future__ import annotations

import copy
import re

import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from example_models import example_models  # noqa: E402
from specgen import maxpool  # noqa: E402
from specgen.maxpool import MaxPoolLayer, MaxPoolPlan  # noqa: E402



def _plan(**over) -> MaxPoolPlan:
    return MaxPoolPlan(**(dict(channels=32, size=(16, 12), kernel=(2, 2), stride=(2, 2), dtype="bfloat16") | over))


@pytest.mark.parametrize("over, field", [
    ({"channels": 0}, "channels"),
    ({"size": (16, 12, 4, 4), "kernel": (2,) * 4, "stride": (2,) * 4}, "size"),
    ({"kernel": (2,)}, "kernel"),
    ({"stride": (2, 0)}, "stride[1]"),
    ({"kernel": (17, 2)}, "kernel[0]"),
    ({"kernel": (3, 3), "dilation": (1, 6)}, "kernel[1]"),  # (a window spanning 13 > 12)
    ({"padding": (1, 2)}, "padding[1]"),  # (more than half the window, which PyTorch refuses)
    ({"padding": (-1, 0)}, "padding[0]"),
    ({"dilation": (1,)}, "dilation"),
    ({"ceil_mode": 1}, "ceil_mode"),
    ({"dtype": "int8"}, "dtype"),
    ({"channels": True}, "channels"),
    ({"channels": 1 << 20, "size": (1 << 6, 1 << 6)}, "size"),
])
def test_the_plan_refuses_what_it_cannot_pool(over, field):
    with pytest.raises(ValueError, match=re.escape(field) + ":"):
        _plan(**over)


@pytest.mark.parametrize("size, kernel, stride, padding, dilation, ceil", [
    (7, 2, 2, 0, 1, True), (8, 3, 2, 1, 1, True), (9, 3, 2, 1, 1, False), (10, 3, 3, 1, 2, True), (5, 2, 2, 1, 1, True),
    (6, 3, 2, 0, 1, True), (13, 5, 4, 2, 1, True), (3, 3, 1, 1, 1, True), (1, 1, 2, 0, 1, True),
])
def test_the_output_extent_is_pytorch_s(size, kernel, stride, padding, dilation, ceil):
    plan = MaxPoolPlan(2, (size,), (kernel,), (stride,), "float32", (padding,), (dilation,), ceil)
    want = F.max_pool1d(torch.zeros(1, 2, size), kernel, stride, padding, dilation, ceil)
    assert plan.out_size == tuple(want.shape[2:])


def test_the_defaults_are_pytorch_s_and_name_one_kernel():
    assert _plan() == _plan(padding=(0, 0), dilation=(1, 1), ceil_mode=False)
    assert _plan().kernel_name == _plan(padding=(0, 0)).kernel_name != _plan(ceil_mode=True).kernel_name


def test_the_source_has_every_extent_window_and_stride_as_a_literal():
    plan = _plan(kernel=(3, 2), stride=(2, 1))
    source = maxpool.render(plan)
    assert plan.out_size == (7, 11)
    for line in ("constexpr int C = 32;", "constexpr int D = 1, H = 16, W = 12;", "constexpr int OD = 1, OH = 7, OW = 11;",
                 "constexpr int KD = 1, KH = 3, KW = 2;", "constexpr int SD = 1, SH = 2, SW = 1;"):
        assert line in source
    assert f"void __launch_bounds__(256) {plan.kernel_name}(" in source and "#include <cuda_bf16.h>" in source
    assert plan.kernel_name != _plan().kernel_name
    assert "constexpr bool CHECK_D = PD > 0" in source and "constexpr int PD = 0, PH = 0, PW = 0;" in source
    padded = maxpool.render(_plan(kernel=(3, 3), stride=(2, 2), padding=(1, 0), dilation=(1, 2), ceil_mode=True))
    assert "constexpr int PD = 0, PH = 1, PW = 0;" in padded and "constexpr int LD = 1, LH = 1, LW = 2;" in padded
    assert "ceil_mode=True" in padded


@pytest.mark.nvcc
@pytest.mark.parametrize("plan", [_plan(), _plan(dtype="float32", kernel=(3, 3), stride=(1, 2)),
                                  MaxPoolPlan(7, (5, 6, 7), (2, 3, 2), (2, 2, 2), "float16"),
                                  MaxPoolPlan(3, (40,), (4,), (4,), "float32"),
                                  MaxPoolPlan(64, (112, 112), (3, 3), (2, 2), "bfloat16", (1, 1), None, True),
                                  MaxPoolPlan(7, (5, 6, 7), (3, 3, 2), (2, 2, 2), "float32", (1, 1, 0), (1, 2, 1), True)],
                         ids=["bf16_2d", "fp32_overlap", "fp16_3d", "fp32_1d", "bf16_padded_ceil", "fp32_3d_dilated_ceil"])
def test_the_kernel_compiles_without_spills(plan, tmp_path, monkeypatch):
    from specgen import cache

    monkeypatch.setenv("SPECGEN_CACHE_DIR", str(tmp_path))
    result = cache.get_or_build(maxpool.build_request(plan))
    assert result.spill_bytes == 0 and result.registers <= 64, result.log


def test_on_cpu_it_is_pytorch_s_pool_and_its_op_checks(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    plan = _plan(dtype="float32", kernel=(3, 2), stride=(2, 2))
    layer = MaxPoolLayer(plan)
    x = torch.randn(3, 32, 16, 12)
    assert torch.equal(layer(x), F.max_pool2d(x, (3, 2), (2, 2)))
    with pytest.raises(ValueError, match=r"expected \[batch, 32, 16, 12\]"):
        layer(x[:, :, :8])
    op = maxpool.custom_op(plan)
    assert maxpool.custom_op(plan) is op and copy.deepcopy(layer)._op is op
    torch.library.opcheck(op, (x.clone().requires_grad_(),))
    mine, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    w = torch.randn(3, 32, 7, 6)
    (op(mine) * w).sum().backward()
    (F.max_pool2d(theirs, (3, 2), (2, 2)) * w).sum().backward()
    assert torch.equal(mine.grad, theirs.grad)


class _Encoder(nn.Module):
    """A UNet encoder step: conv + ReLU, its value pooled and also returned (the skip)."""

    def __init__(self, padding: int = 0):
        super().__init__()
        self.block = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.pool = nn.MaxPool2d(2, padding=padding)
        self.last = nn.Sequential(nn.Conv2d(8, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))

    def forward(self, x):
        skip = self.block(x)
        return self.last(self.pool(skip)), skip


def _imported(model: nn.Module, seed: int):
    """(the model, from_module's model of it without a GPU, its pool layers, an input), after
    checking that both compute the same."""
    from specgen import from_module

    torch.manual_seed(seed)
    model = model.eval()
    x = torch.randn(2, 3, 16, 12)
    with torch.no_grad():
        fused = from_module(copy.deepcopy(model), x, keep_slower=True)
        for got, want in zip(fused(x), model(x), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    return model, fused, [m for m in fused.modules() if isinstance(m, MaxPoolLayer)], x


def test_from_module_runs_the_pools_no_chain_takes(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    model, fused, layers, x = _imported(_Encoder(), 0)
    assert [m.plan for m in layers] == [MaxPoolPlan(8, (16, 12), (2, 2), (2, 2), "float32")]  # (the last pool is its chain's)
    report = fused.specgen_report
    assert report.pools == ["pool: max_pool2d(block_1, kernel [2, 2], stride [2, 2])"], str(report)
    assert all(fb.node != "pool" for fb in report.fallbacks) and "pooled by one kernel: pool" in str(report)
    compiled = torch.compile(fused, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(x)[0], model(x)[0], rtol=1e-5, atol=1e-5)


def test_a_pool_of_a_pool_reads_the_first_pool_s_layer(monkeypatch):
    """Two pools in a row, neither a chain's (KernelBench 6 pools a softmax twice): the second
    layer reads the first one's output, not the pool node it replaced."""
    class Twice(_Encoder):
        def forward(self, x):
            skip = self.block(x)
            return self.pool(self.pool(skip)), skip

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _, fused, layers, _ = _imported(Twice(), 1)
    assert [m.plan.size for m in layers] == [(16, 12), (8, 6)], str(fused.specgen_report)


def test_a_padded_pool_in_ceil_mode_runs_by_the_kernel(monkeypatch):
    encoder = _Encoder(padding=1)
    encoder.pool = nn.MaxPool2d(3, 2, padding=1, ceil_mode=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _, fused, layers, _ = _imported(encoder, 2)
    assert [m.plan for m in layers] == [MaxPoolPlan(8, (16, 12), (3, 3), (2, 2), "float32", (1, 1), (1, 1), True)]
    assert fused.specgen_report.pools == [
        "pool: max_pool2d(block_1, kernel [3, 3], stride [2, 2], padding [1, 1], ceil mode)"], str(fused.specgen_report)


def test_a_pool_returning_indices_stays_pytorch_s(monkeypatch):
    class Indices(_Encoder):
        def forward(self, x):
            skip = self.block(x)
            pooled, where = F.max_pool2d(skip, 2, return_indices=True)
            return pooled, where, skip

    from specgen import from_module

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with torch.no_grad():
        fused = from_module(Indices().eval(), torch.randn(2, 3, 16, 12), keep_slower=True)
    assert not [m for m in fused.modules() if isinstance(m, MaxPoolLayer)] and fused.specgen_report.pools == []


def test_the_unet_example_pools_by_the_kernel(monkeypatch):
    models = example_models()
    from specgen import explain

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    report = explain(models.UNet.make().eval(), models.UNet.example_input(2, small=True))
    assert len(report.pools) == 3 and not report.fallbacks, str(report)


def test_a_batch_past_the_grid_limit_takes_several_launches_each_pointer_moved_on(monkeypatch):
    import ctypes
    import types

    from specgen import runtime
    from test_fast_launch import _Driver

    driver = _Driver({7: 2})  # (x, out; then its first int, the layout bit, read as "batch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(runtime, "_libcuda", driver)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(cuda_stream=5))
    layer = MaxPoolLayer(_plan(channels=3, size=(4, 6)))
    layer._kernels[0] = runtime.LoadedKernel(ctypes.c_void_p(7), ctypes.c_void_p(99), 256, 0, 0)
    layer._queue(0, [4096, 8192], [48, 12], (1,), 1, runtime.GRID_Y_MAX + 2)
    assert [(launch["grid"], launch["batch"]) for launch in driver.launches] == [((1, runtime.GRID_Y_MAX), 1), ((1, 2), 1)]
    assert [launch["pointers"] for launch in driver.launches] == [
        [4096, 8192], [4096 + 48 * runtime.GRID_Y_MAX, 8192 + 12 * runtime.GRID_Y_MAX]]


# The kernel's own source, run on the host: the generated .cu compiled by the host's C++ compiler
# with CUDA's few keywords defined away, its grid walked block by block and thread by thread
# (the kernel has no shared memory and no synchronization, so the order does not matter).
_HOST_PRELUDE = r"""
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
struct Index3 { unsigned x, y, z; };
static Index3 blockIdx, threadIdx;
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(n)
static inline float __int_as_float(unsigned u) { float f; std::memcpy(&f, &u, sizeof f); return f; }
"""

_HOST_MAIN = r"""
int main(int argc, char** argv) {  // x.bin out.bin batch channels_last
  const int batch = std::atoi(argv[3]), channels_last = std::atoi(argv[4]);
  std::vector<float> x(static_cast<size_t>(batch) * C * IN_POS), out(static_cast<size_t>(batch) * PER_SAMPLE);
  FILE* f = std::fopen(argv[1], "rb");
  if (std::fread(x.data(), sizeof(float), x.size(), f) != x.size()) return 1;
  std::fclose(f);
  for (unsigned n = 0; n < static_cast<unsigned>(batch); ++n)
    for (unsigned b = 0; b < (PER_SAMPLE + 255) / 256; ++b)
      for (unsigned t = 0; t < 256; ++t) {
        blockIdx = {b, n, 0};
        threadIdx = {t, 0, 0};
        KERNEL(x.data(), out.data(), channels_last, batch);
      }
  f = std::fopen(argv[2], "wb");
  std::fwrite(out.data(), sizeof(float), out.size(), f);
  std::fclose(f);
  return 0;
}
"""


@pytest.mark.skipif(__import__("shutil").which("g++") is None, reason="needs a host C++ compiler (g++)")
@pytest.mark.parametrize("plan", [
    MaxPoolPlan(5, (9, 10), (3, 3), (2, 2), "float32", (1, 1), None, True),
    MaxPoolPlan(3, (7, 11), (2, 3), (2, 2), "float32", (0, 1), (1, 1), True),
    MaxPoolPlan(4, (8, 9), (3, 2), (1, 2), "float32", (1, 0), (2, 1), False),
    MaxPoolPlan(2, (5, 6, 7), (3, 3, 2), (2, 2, 2), "float32", (1, 1, 0), (1, 2, 1), True),
    MaxPoolPlan(3, (21,), (3,), (2,), "float32", (1,), (3,), True),
    MaxPoolPlan(6, (8, 8), (2, 2), (2, 2), "float32"),
], ids=["stem_ceil", "uneven_ceil", "dilated", "3d_dilated_ceil", "1d", "plain"])
def test_the_kernel_source_run_on_the_host_is_pytorch_s_pool(plan, tmp_path):
    import subprocess

    source = tmp_path / "pool.cpp"
    source.write_text(_HOST_PRELUDE + maxpool.render(plan) + f"\n#define KERNEL {plan.kernel_name}\n" + _HOST_MAIN)
    binary = tmp_path / "pool"
    subprocess.run(["g++", "-std=c++17", "-O1", "-Wno-unknown-pragmas", "-x", "c++", str(source), "-o", str(binary)],
                   check=True, capture_output=True)
    torch.manual_seed(len(plan.size) * 7 + plan.channels)
    pool = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}[len(plan.size)]
    for batch, channels_last in ((1, False), (3, False), (2, True)):
        if channels_last and len(plan.size) == 1:
            continue
        x = torch.randn(batch, plan.channels, *plan.size)
        x.view(-1)[::13] = float("nan")  # (a NaN in some windows: the result there)
        want = pool(x, list(plan.kernel), list(plan.stride), list(plan.padding), list(plan.dilation), plan.ceil_mode)
        order = (0, *range(2, x.dim()), 1) if channels_last else tuple(range(x.dim()))
        (tmp_path / "x.bin").write_bytes(x.permute(order).contiguous().numpy().tobytes())
        subprocess.run([str(binary), str(tmp_path / "x.bin"), str(tmp_path / "out.bin"), str(batch), str(int(channels_last))],
                       check=True)
        got = torch.frombuffer(bytearray((tmp_path / "out.bin").read_bytes()), dtype=torch.float32)
        want = want.permute(order).contiguous().view(-1)
        assert got.shape == want.shape and torch.equal(got.isnan(), want.isnan()), (batch, channels_last)
        assert torch.equal(got.nan_to_num(), want.nan_to_num()), (batch, channels_last)
