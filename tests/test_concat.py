"""The concatenation kernel without a GPU: its plan refuses what it cannot join (naming the
field), renders every extent as a literal, compiles with nvcc without spills, falls back to
PyTorch's ops on CPU tensors, and from_module joins a UNet decoder's upsample and cat."""

from __future__ import annotations

import copy
import re

import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from example_models import example_models  # noqa: E402
from specgen import concat  # noqa: E402
from specgen.concat import ConcatLayer, ConcatPlan, Source  # noqa: E402



def _plan(**over) -> ConcatPlan:
    fields = dict(sources=(Source(64, (8, 8), (2, 2)), Source(32, (16, 16), (1, 1))), size=(16, 16), dtype="bfloat16",
                  channels_last=True)
    return ConcatPlan(**(fields | over))


@pytest.mark.parametrize("over, field", [
    ({"size": (16, 16, 2, 2)}, "size"),
    ({"size": (16, 0)}, "size[1]"),
    ({"dtype": "float64"}, "dtype"),
    ({"channels_last": 1}, "channels_last"),
    ({"tile": 48}, "tile"),
    ({"sources": ()}, "sources"),
    ({"sources": (Source(0, (16, 16), (1, 1)),)}, "sources[0].channels"),
    ({"sources": (Source(4, (8, 8), (2, 9)),)}, "sources[0].factors[1]"),
    ({"sources": (Source(4, (8, 8), (2, 1)),)}, "sources[0]"),
    ({"sources": (Source(4, (8,), (2,)),)}, "sources[0]"),
    ({"sources": (Source(True, (16, 16), (1, 1)),)}, "sources[0].channels"),
    ({"sources": (Source(4, (16,), (1,)),), "size": (16,)}, "channels_last"),
    ({"sources": (Source(1 << 16, (1 << 8, 1 << 8), (1, 1)),), "size": (1 << 8, 1 << 8)}, "size"),
])
def test_the_plan_refuses_what_it_cannot_join(over, field):
    with pytest.raises(ValueError, match=re.escape(field) + ":"):
        _plan(**over)


def test_the_source_has_every_extent_and_factor_as_a_literal():
    plan = _plan()
    source = concat.render(plan)
    assert plan.kernel_name.startswith("specgen_concat_") and f"void __launch_bounds__(256) {plan.kernel_name}(" in source
    for line in ("constexpr int C_OUT = 96;", "constexpr int OD = 1, OH = 16, OW = 16;",
                 "constexpr int C0 = 64, FIRST0 = 0;", "constexpr int SD0 = 1, SH0 = 2, SW0 = 2;",
                 "constexpr int C1 = 32, FIRST1 = 64;", "constexpr int D1 = 1, H1 = 16, W1 = 16;"):
        assert line in source
    assert "torch.cat([upsample_nearest(x0, [2, 2]), x1], dim=1), written channels-last" in source
    assert "y[static_cast<size_t>(p) * C_OUT + c]" in source  # (channels-last stores)
    contiguous = concat.render(_plan(channels_last=False))
    assert "y[static_cast<size_t>(c) * POSITIONS + p]" in contiguous and "C_OUT + c]" not in contiguous
    assert _plan().kernel_name == plan.kernel_name != _plan(channels_last=False).kernel_name


@pytest.mark.nvcc
@pytest.mark.parametrize("plan", [
    _plan(),
    _plan(dtype="float32", channels_last=False),
    _plan(tile=64),
    ConcatPlan((Source(5, (3, 4, 6), (2, 1, 3)), Source(7, (6, 4, 18), (1, 1, 1)), Source(1, (1, 2, 9), (6, 2, 2))),
               (6, 4, 18), "float16", True),
    ConcatPlan((Source(3, (10,), (4,)), Source(2, (40,), (1,))), (40,), "float32"),
    ConcatPlan((Source(3, (5, 5), (3, 1)), Source(33, (15, 5), (1, 1))), (15, 5), "bfloat16"),
], ids=["bf16_2d_cl", "fp32_2d", "bf16_2d_cl_tile64", "fp16_3d_cl", "fp32_1d", "bf16_odd_nchw"])
def test_the_kernel_compiles_without_spills(plan, tmp_path, monkeypatch):
    from specgen import cache

    monkeypatch.setenv("SPECGEN_CACHE_DIR", str(tmp_path))
    result = cache.get_or_build(concat.build_request(plan))
    assert result.spill_bytes == 0 and result.registers <= 64, result.log
    assert result.smem_bytes == plan.tile * (plan.tile + 1) * 4


@pytest.mark.parametrize("channels_last", [False, True])
def test_on_cpu_it_is_pytorch_s_upsample_and_cat(channels_last, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # (no build at construction)
    layer = ConcatLayer(_plan(dtype="float32", channels_last=channels_last))
    a, b = torch.randn(3, 64, 8, 8), torch.randn(3, 32, 16, 16)
    got = layer(a, b)
    assert torch.equal(got, torch.cat([F.interpolate(a, scale_factor=2.0), b], 1))
    assert got.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    with pytest.raises(ValueError, match=r"input 1: expected \[3, 32, 16, 16\]"):
        layer(a, b[:, :16])
    with pytest.raises(ValueError, match="expected 2 tensors, got 1"):
        layer(a)


class _Decoder(nn.Module):
    """A UNet decoder step: upsample, join the skip, conv + BN + ReLU."""

    def __init__(self):
        super().__init__()
        self.up = nn.Upsample(scale_factor=2, mode="nearest")
        self.block = nn.Sequential(nn.Conv2d(24, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.skip = nn.Conv2d(3, 8, 1)

    def forward(self, x, low):
        return self.block(torch.cat([self.up(low), self.skip(x)], dim=1))


def _imported_decoder(seed: int):
    """(the decoder, from_module's model of it, its two inputs), without a GPU."""
    from specgen import from_module

    torch.manual_seed(seed)
    model = _Decoder().eval()
    x, low = torch.randn(2, 3, 12, 10), torch.randn(2, 16, 6, 5)
    with torch.no_grad():
        return model, from_module(copy.deepcopy(model), x, low, keep_slower=True), x, low


def test_from_module_joins_an_upsample_and_its_cat(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    model, fused, x, low = _imported_decoder(0)
    with torch.no_grad():
        joins = [m for m in fused.modules() if isinstance(m, ConcatLayer)]
        assert len(joins) == 1 and joins[0].plan.sources == (Source(16, (6, 5), (2, 2)), Source(8, (12, 10), (1, 1)))
        assert not joins[0].plan.channels_last  # (nothing planned without a GPU)
        report = fused.specgen_report
        assert report.joins == ["cat: cat([upsample(low, [2, 2]), skip], 1)"], str(report)
        assert all(fb.node not in ("up", "cat") for fb in report.fallbacks), str(report)
        assert "joined by one kernel: cat" in str(report)
        assert "up" not in {n.target for n in fused.graph.nodes if n.op == "call_module"}
        torch.testing.assert_close(fused(x, low), model(x, low), rtol=1e-5, atol=1e-5)


def test_a_join_of_a_join_reads_the_first_join_s_layer(monkeypatch):
    """A cat whose value is another joined cat, upsampled: the second layer reads the first
    one's output, not the cat node it replaced."""
    from specgen import from_module

    class Twice(_Decoder):
        def __init__(self):
            super().__init__()
            self.last = nn.Sequential(nn.Conv2d(32, 8, 3, padding=1), nn.ReLU())

        def forward(self, x, low):
            first = torch.cat([self.up(low), self.skip(x)], dim=1)
            return self.last(torch.cat([self.up(first), self.up(self.skip(x))], dim=1))

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    torch.manual_seed(2)
    model = Twice().eval()
    x, low = torch.randn(2, 3, 12, 10), torch.randn(2, 16, 6, 5)
    with torch.no_grad():
        fused = from_module(copy.deepcopy(model), x, low, keep_slower=True)
        assert len([m for m in fused.modules() if isinstance(m, ConcatLayer)]) == 2, str(fused.specgen_report)
        torch.testing.assert_close(fused(x, low), model(x, low), rtol=1e-5, atol=1e-5)


def test_a_cat_without_an_upsample_stays_pytorch_s(monkeypatch):
    from specgen import from_module

    class Plain(_Decoder):
        def forward(self, x, low):
            return self.block(torch.cat([low, self.skip(x)], dim=1))

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    model = Plain().eval()
    with torch.no_grad():
        fused = from_module(model, torch.randn(2, 3, 6, 5), torch.randn(2, 16, 6, 5), keep_slower=True)
    assert not [m for m in fused.modules() if isinstance(m, ConcatLayer)] and fused.specgen_report.joins == []


def test_the_unet_example_joins_its_three_decoder_steps(monkeypatch):
    models = example_models()
    from specgen import explain

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    report = explain(models.UNet.make().eval(), models.UNet.example_input(2, small=True))
    assert len(report.joins) == 3 and all("upsample(" in j for j in report.joins), str(report)
    assert all(not fb.node.startswith(("up", "cat")) for fb in report.fallbacks), str(report)


def test_the_custom_op_passes_opcheck_and_its_gradient_is_pytorch_s(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    plan = ConcatPlan((Source(3, (2, 3), (2, 1)), Source(2, (4, 3), (1, 1)), Source(1, (1, 1), (4, 3))), (4, 3), "float32")
    op = concat.custom_op(plan)
    assert concat.custom_op(plan) is op  # (registered once per plan)
    values = [torch.randn(2, 3, 2, 3, dtype=torch.float32), torch.randn(2, 2, 4, 3), torch.randn(2, 1, 1, 1)]
    torch.library.opcheck(op, ([v.clone().requires_grad_() for v in values],))
    factors = [s.factors for s in plan.sources]
    mine = [v.clone().requires_grad_() for v in values]
    theirs = [v.clone().requires_grad_() for v in values]
    weights = torch.randn(2, 6, 4, 3)
    (op(mine) * weights).sum().backward()
    (concat.reference(theirs, factors) * weights).sum().backward()
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a.grad, b.grad)


def test_torch_compile_traces_an_imported_join_whole(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    model, fused, x, low = _imported_decoder(1)
    compiled = torch.compile(fused, fullgraph=True, backend="aot_eager")
    low = low.clone().requires_grad_()
    got = compiled(x, low)
    torch.testing.assert_close(got, model(x, low), rtol=1e-5, atol=1e-5)
    got.sum().backward()
    want = low.detach().clone().requires_grad_()
    model(x, want).sum().backward()
    torch.testing.assert_close(low.grad, want.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.nvcc
def test_the_import_builds_its_kernels_in_one_build_and_the_layers_take_them(tmp_path, monkeypatch):
    from specgen import maxpool
    from specgen.standalone import prebuild

    monkeypatch.setenv("SPECGEN_CACHE_DIR", str(tmp_path))
    plans = [_plan(), maxpool.MaxPoolPlan(8, (6, 6), (2, 2), (2, 2), "float16")]
    requests = [concat.build_request(plans[0]), maxpool.build_request(plans[1])]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert prebuild(requests) == [None, None]  # (no GPU: nothing built)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    built = prebuild(requests)
    assert [b.name for b in built] == [p.kernel_name for p in plans] and all(b.spill_bytes == 0 for b in built)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert ConcatLayer(plans[0], built=built[0]).build() is built[0]
    assert maxpool.MaxPoolLayer(plans[1], built=built[1]).build() is built[1]
