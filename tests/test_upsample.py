"""A conv over a nearest-upsampled input (`conv: {upsample: 2}`), computed as the transposed conv it
equals (specgen.upsample): the derivation against PyTorch in float64, the spec (validation, shape,
hash), the plan and its weight transform, the reference, rendering and compiling, and the importer
taking nn.Upsample / F.interpolate into the conv's chain. CPU only; tests/test_upsample_gpu.py
runs the kernels."""

from __future__ import annotations

import itertools

import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from specgen import FusedLayer, explain, from_module, torchop, upsample  # noqa: E402
from specgen.plan import build_plan  # noqa: E402
from specgen.spec import SpecError, validate  # noqa: E402

CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
TRANSPOSED = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


def spec_of(conv: dict, size=(8, 8), cin=16, epilogue=("relu",), **extra):
    return validate({"name": "up", "input": {"channels": cin, "size": list(size)},
                     "conv": {"out_channels": 24, "kernel": 3, "padding": 1, **conv}, "epilogue": list(epilogue), **extra})


def _upsampled_conv(x, w, spec):
    g = spec.conv_geometry()
    up = F.interpolate(x, scale_factor=tuple(float(u) for u in g["upsample"]), mode="nearest")
    return CONV[spec.ndim](up, w, None, 1, g["padding"], 1, spec.conv.groups)


def test_every_derived_transposed_conv_equals_the_conv_over_the_upsampled_input():
    found = refused = 0
    for kernel, padding, scale in itertools.product(range(1, 8), range(0, 5), range(1, 5)):
        size = 7
        if scale * size + 2 * padding - kernel + 1 <= 0:
            continue
        d = upsample.derive(kernel, padding, scale)
        assert (d is None) == (padding > kernel - 1), (kernel, padding, scale)
        if d is None:
            refused += 1
            continue
        found += 1
        x, w = torch.randn(2, 3, size, dtype=torch.float64), torch.randn(4, 3, kernel, dtype=torch.float64)
        want = F.conv1d(F.interpolate(x, scale_factor=scale, mode="nearest"), w, padding=padding)
        wt = torch.zeros(3, 4, d.kernel, dtype=torch.float64)
        for j, ks in enumerate(d.taps):
            for k in ks:
                wt[:, :, j] += w[:, :, k].t()
        got = F.conv_transpose1d(x, wt, stride=scale, padding=d.padding, output_padding=d.output_padding)
        assert got.shape == want.shape, (kernel, padding, scale)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert found == 100 and refused == 40  # refused: exactly the paddings above kernel - 1
    # the common case: a 3-tap conv at scale 2 meets 2 taps per output (4 where the upsampled input had 9 in 2-D)
    assert upsample.derive(3, 1, 2) == upsample.Derived(4, 1, 0, ((2,), (1, 2), (0, 1), (0,)))
    assert upsample.derive(3, 1, 1) == upsample.Derived(3, 1, 0, ((2,), (1,), (0,)))  # no scale: the taps reversed


def test_the_spec_says_upsample_and_hashes_as_before_without_it():
    spec = spec_of({"upsample": 2})
    assert spec.upsampled() and spec.output_shape(3) == (3, 24, 16, 16)
    assert spec.weight_shape() == (24, 16, 3, 3)  # the conv's own weight
    assert spec.canonical()["conv"]["upsample"] == [2, 2]
    plain = spec_of({})
    assert "upsample" not in plain.canonical()["conv"] and plain.shape_hash == spec_of({"upsample": 1}).shape_hash
    assert spec_of({"upsample": [1, 3]}, size=(5, 6)).output_shape(1) == (1, 24, 5, 18)
    assert spec_of({"upsample": 2, "kernel": 1, "padding": 0}).output_shape(1) == (1, 24, 16, 16)


@pytest.mark.parametrize(
    "conv, expected",
    [
        ({"upsample": 2, "stride": 2}, "conv.upsample: an upsampled input is read by a conv of stride 1 and dilation 1, "
                                       "got stride [2, 2], dilation [1, 1]"),
        ({"upsample": 2, "dilation": 2, "padding": 2}, "conv of stride 1 and dilation 1"),
        ({"upsample": 9}, "conv.upsample: every factor must be in [1, 8], got [9, 9]"),
        ({"upsample": 0}, "conv.upsample: every factor must be in [1, 8], got [0, 0]"),
        ({"upsample": 2, "transposed": True}, "conv.upsample: only a plain conv reads its input upsampled"),
        ({"upsample": [1, 2], "padding": [1, 3]}, "along spatial dim 1 (kernel 3, padding 3, upsample 2) there is none"),
    ],
)
def test_bad_upsampling_names_the_field(conv, expected):
    with pytest.raises(SpecError) as err:
        spec_of(conv)
    assert expected in str(err.value), str(err.value)


CASES = {  # name -> (conv, size, precision, engine)
    "tma": ({"upsample": 2}, (12, 12), "tf32", "tma"),
    "igemm_1d": ({"upsample": 2, "kernel": 5, "padding": 2}, (40,), "fp32", "igemm"),
    "ffma_groups": ({"upsample": [2, 3], "kernel": [3, 5], "padding": [1, 2], "groups": 4}, (6, 9), "fp32", "ffma"),
    "ffma_3d": ({"upsample": [1, 2, 2], "groups": 2}, (3, 4, 5), "fp32", "ffma"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_plan_runs_the_transposed_conv_and_its_weights_equal_the_convs(name):
    conv, size, precision, engine = CASES[name]
    spec = spec_of(conv, size, precision=precision)
    plan = build_plan(spec)
    assert plan["engine"] == engine
    assert plan["rewrites"][0].startswith("upsample fold: the conv over the input upsampled")
    assert plan["spec_hash"] == spec.shape_hash
    (transform,) = [t for t in plan["weight_transforms"] if t["kind"] == "upsample_fold"]
    twin = upsample.equivalent(spec)
    g = twin.conv_geometry()
    torch.manual_seed(0)
    x, w = torch.randn(2, 16, *size, dtype=torch.float64), torch.randn(spec.weight_shape(), dtype=torch.float64)
    wt = torchop.transformed_weight(w, transform)
    assert tuple(wt.shape) == twin.weight_shape()
    got = TRANSPOSED[spec.ndim](x, wt, None, g["stride"], g["padding"], g["output_padding"], spec.conv.groups)
    torch.testing.assert_close(got, _upsampled_conv(x, w, spec), rtol=1e-12, atol=1e-12)
    assert tuple(got.shape) == spec.output_shape(2)


def test_the_layer_and_its_gradients_follow_upsample_then_conv():
    torch.manual_seed(0)
    spec = spec_of({"upsample": 2}, epilogue=["batch_norm", "relu"])
    layer = FusedLayer(spec).eval()
    up = nn.Sequential(nn.Upsample(scale_factor=2), layer.conv)
    x = torch.randn(3, 16, 8, 8, requires_grad=True)
    y = layer(x)
    bn = (up(x) - layer.bn_running_mean) / torch.sqrt(layer.bn_running_var + 1e-5) * layer.bn_weight + layer.bn_bias
    torch.testing.assert_close(y, torch.relu(bn))
    (gx,) = torch.autograd.grad(y.sum(), [x])
    (want,) = torch.autograd.grad(torch.relu(bn).sum(), [x])
    torch.testing.assert_close(gx, want)


@pytest.mark.nvcc
@pytest.mark.parametrize("name", sorted(CASES))
def test_upsampled_kernels_build_without_spills(name, tmp_path, monkeypatch):
    """As the pipeline builds them (its spill retry included: the planner's first FFMA tile for the
    grouped case spills, the retry's smaller one does not)."""
    from specgen import pipeline

    monkeypatch.setenv("SPECGEN_CACHE_DIR", str(tmp_path / "cache"))
    conv, size, precision, _ = CASES[name]
    item = pipeline.specialize(spec_of(conv, size, precision=precision), "sm_90")
    assert "upsample fold" in item.source
    assert item.build.spill_bytes == 0


# -- the importer ------------------------------------------------------------------------------------


class Decoder(nn.Module):
    """nn.Upsample then a conv chain; F.interpolate (default mode: nearest) then another; a
    nearest-exact upsample given by size; and what stays apart: a bilinear upsample, an upsample
    two ops read."""

    def __init__(self, c: int = 8, kind: str = "module"):
        super().__init__()
        self.kind = kind
        self.up = nn.Upsample(scale_factor=2, mode="nearest")
        self.c1, self.bn = nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c)
        self.c2 = nn.Conv2d(c, 4, 3, padding=1)

    def forward(self, x):
        if self.kind == "module":
            h = torch.relu(self.bn(self.c1(self.up(x))))
            return torch.tanh(self.c2(F.interpolate(h, scale_factor=2)))
        if self.kind == "exact_size":
            h = F.interpolate(x, size=(3 * x.shape[2], 3 * x.shape[3]), mode="nearest-exact")
            return torch.relu(self.c1(h))
        if self.kind == "bilinear":
            return torch.relu(self.c1(F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False)))
        u = self.up(x)  # read twice
        return torch.relu(self.c1(u)) + u


@pytest.mark.parametrize("kind, upsamples", [("module", [[2, 2], [2, 2]]), ("exact_size", [[3, 3]]), ("bilinear", [None]),
                                             ("twice", [None])])
def test_the_importer_takes_a_nearest_upsample_into_the_conv_it_feeds(kind, upsamples):
    torch.manual_seed(0)
    model = Decoder(kind=kind).eval()
    x = torch.randn(2, 8, 5, 6)
    report = explain(model, x)
    got = [list(s.conv_geometry()["upsample"]) if s.upsampled() else None for s in report.specs]
    assert got == upsamples, str(report)
    if upsamples[0] is not None:
        assert "over its input upsampled" in str(report)
        assert not [f for f in report.fallbacks if "upsample" in f.node or "interpolate" in f.node], str(report)
    fused = from_module(model, x)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), model(x))
