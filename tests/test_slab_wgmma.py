"""The slab engine on wgmma (`tile: {wgmma: true}`, sm_90a): the planner's refusals, the geometry
of its plan checked by a numpy model of the kernel (the staged planes, each tap one row offset,
the positions a warpgroup tile covers and where the epilogue puts them), the rendered source, the
nvcc build (no spills, no serialized wgmma), and on the GPU (marker `gpu`) the results against the
precision's bar."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings, strategies as st

from specgen import target as targets
from specgen.plan import PlanError, build_plan, describe, exact_tf32
from specgen.render import render_plan
from specgen.spec import SpecError, validate


def layer(name, channels, size, out, kernel, precision="fp32", epilogue=("relu",), tile=None, **conv):
    return {"name": name, "input": {"channels": channels, "size": size}, "precision": precision,
            "conv": {"out_channels": out, "kernel": kernel, **conv}, "epilogue": list(epilogue),
            "tile": {"wgmma": True, **(tile or {})}}


LAYERS = [
    # the seed kb90's layer, smaller: 8 channels, 3x3x3, no padding, its epilogue
    layer("kb90_small", 8, [6, 12, 20], 64, 3, epilogue=[{"leaky_relu": {"negative_slope": 0.2}},
                                                           {"add": {"param": "sum_tensor"}},
                                                           {"clamp": {"min": -1.0, "max": 1.0}}, "gelu"]),
    layer("padded_40", 3, [10, 30], 40, 3, padding=1),  # 3 channels padded to 8; 40 of a 64-channel tile
    layer("dilated_two_planes", 12, [9, 17], 64, 3, padding=2, dilation=2),  # 16 padded channels: 2 planes
    layer("line_128", 8, [70], 128, 5, padding=2),  # two 64-channel tiles
    layer("depth_stride", 4, [7, 9, 11], 64, 3, stride=[2, 1, 1], padding=1),
    layer("wide_rows", 8, [5, 300], 64, 3, padding=1),  # rows wider than one N tile: boxes along W
    layer("tf32_stem", 3, [20, 36], 64, 7, precision="tf32", padding=3),  # TF32 products (`slab_in_tf32`)
    layer("bn_relu", 8, [12, 20], 64, 3, padding=1, bias=False, epilogue=[{"batch_norm": {}}, "relu"]),
    layer("sum_hw", 8, [12, 20], 64, 3, epilogue=["relu", {"sum": {"dims": [2, 3]}}]),
    layer("mean_all", 8, [16, 16], 64, 3, epilogue=["sigmoid", {"mean": {"dims": [1, 2, 3]}}]),
    # strided along H or W: the input staged by phase
    layer("kb65_small", 8, [42, 46], 64, 3, epilogue=[{"avg_pool": {"kernel": 4}}, "sigmoid",  # folded: 6x6, stride 4
                                                      {"sum": {"dims": [1, 2, 3]}}]),
    layer("stem_fp32", 3, [30, 46], 64, 7, stride=2, padding=3, bias=False, epilogue=[{"batch_norm": {}}, "relu"]),
    layer("stem_tf32", 3, [30, 46], 64, 7, precision="tf32", stride=2, padding=3),
    layer("stride_dilation", 8, [23, 25], 40, 3, stride=[3, 2], padding=[2, 1], dilation=2),  # 3 H phases; 1 W phase
    layer("line_stride_3", 8, [95], 128, 4, stride=3, padding=1),
    layer("strided_3d", 4, [6, 11, 13], 64, 3, stride=2, padding=1),
    # the ResNet stem at its size: alone on its SM (its planes and weights take 190 KB)
    layer("stem_224", 3, [224, 224], 64, 7, stride=2, padding=3),
    # tf32 layers computed as fp32 (`exact_tf32`): each k-step's products summed apart
    layer("exact_kb90", 8, [6, 12, 20], 64, 3, precision="tf32", epilogue=[{"leaky_relu": {"negative_slope": 0.2}}, "gelu"]),
    layer("exact_kb65", 8, [42, 46], 64, 3, precision="tf32", epilogue=[{"avg_pool": {"kernel": 4}}, "sigmoid",
                                                                         {"sum": {"dims": [1, 2, 3]}}]),
    layer("exact_deep", 8, [10, 12, 14], 32, [3, 5, 5], precision="tf32", padding=1),  # K = 600: past one running sum's 512
]
IDS = [d["name"] for d in LAYERS]


def slab_plan(data):
    plan = build_plan(validate(data))
    plans = [p["plan"] for p in plan["parts"]] if plan.get("parts") else [plan]
    (body,) = [p for p in plans if p.get("engine") == "slab"]  # (a fold's first kernel has no engine)
    return body


@pytest.mark.parametrize("data", LAYERS, ids=IDS)
def test_the_plan_runs_the_slab_engine_on_wgmma(data):
    plan = slab_plan(data)
    mma = plan["mma"]
    assert mma.wgmma and plan["threads"] == 256
    assert mma.n_tiles * mma.nb >= mma.slab[1] * mma.xs[2] and mma.nb % 8 == 0 and 8 <= mma.nb <= 256
    k_d, k_h, k_w = plan["kernel"]
    gemm_taps = k_d * k_h if mma.packed_w else plan["taps"]  # (the W taps packed into K: one run per (kd, kh))
    assert mma.c_tiles * 64 >= plan["box"][0] and mma.k_pad == gemm_taps * mma.cip and mma.cip % 8 == 0
    assert mma.packed_w == (plan["cin"] < 8 and -(-k_w * plan["cin"] // 8) < k_w * -(-plan["cin"] // 8))
    exact = exact_tf32(validate(data))
    assert exact == data["name"].startswith("exact")  # (the layers named so are the exact ones)
    assert mma.products == (1 if data["precision"] == "tf32" and not exact else 3)
    assert bool(plan["settings"].exact_sums) == exact
    assert "wgmma m64n" in describe(build_plan(validate(data)))


def gemm_taps(plan):
    """The GEMM's taps (kd, kh, kw) and the K run of each: its channels, or, the W taps packed into
    K, (kd, kh) and (kw, ci) = divmod(k, C_IN_G) of its run (`plan.wgmma_k`). Returns the taps'
    (kd, kh, kw), each K value's (kw, ci) within a run, and which of them are not padding."""
    mma, cin = plan["mma"], plan["cin"]
    k_d, k_h, k_w = plan["kernel"]
    k_w_gemm = 1 if mma.packed_w else k_w
    taps = np.arange(k_d * k_h * k_w_gemm)
    kd, kh, kw = taps // (k_h * k_w_gemm), taps // k_w_gemm % k_h, taps % k_w_gemm
    run_kw, run_ci = (np.arange(mma.cip) // cin, np.arange(mma.cip) % cin) if mma.packed_w else \
        (np.zeros(mma.cip, dtype=int), np.arange(mma.cip))
    return (kd, kh, kw), (run_kw, run_ci), (run_kw < k_w) & (run_ci < cin)


def model_tap_rows(plan):
    """tap_row() of the template: the plane row each GEMM tap reads, less the position's own."""
    mma = plan["mma"]
    (kd, kh, kw), _, _ = gemm_taps(plan)
    _, s_h, s_w = plan["stride"]
    _, dil_h, dil_w = plan["dilation"]
    (period_h, period_w), phase_rows, base = mma.periods, np.array(mma.phase_rows), np.array(mma.phase_base)
    hp, wp = kh % period_h, kw % period_w
    return base[hp] + ((kd * mma.w_phases + wp) * phase_rows[hp] + kh * dil_h // s_h) * mma.xs[2] + kw * dil_w // s_w


def model_planes(plan, x, d0, h0, w0):
    """load_row() of the template over every row: the planes ([PLANE_ROWS][CIP], the K values of
    each row) of the slab whose first output is T1 position (d0, h0, w0), from one sample `x`
    ([C_IN, IN_D, IN_H, IN_W]); zeros outside the input and past XS_ROWS."""
    mma = plan["mma"]
    s_d, s_h, s_w = plan["stride"]
    dil_d, dil_h, dil_w = plan["dilation"]
    p_d, p_h, p_w = plan["padding"]
    in_d, in_h, in_w = plan["in"]
    xs_w, w_phases, phase_rows, base = mma.xs[2], mma.w_phases, np.array(mma.phase_rows), np.array(mma.phase_base)
    _, (run_kw, run_ci), run_ok = gemm_taps(plan)
    r = np.arange(mma.plane_rows)
    rp = np.searchsorted(base, r, side="right") - 1  # the H phase of row r
    u = r - base[rp]
    zd = u // (w_phases * phase_rows[rp] * xs_w)
    zh = s_h * (u // xs_w % phase_rows[rp]) + rp * dil_h % s_h  # input row past the slab's first, likewise column
    zw = s_w * (u % xs_w) + u // (phase_rows[rp] * xs_w) % w_phases * dil_w % s_w
    d_in, h_in, w_in = d0 * s_d - p_d + zd * dil_d, h0 * s_h - p_h + zh, w0 * s_w - p_w + zw
    planes = np.zeros((mma.plane_rows, mma.cip))
    for k in np.nonzero(run_ok)[0]:  # K value k of every row: channel run_ci[k] at column w_in + run_kw[k] DIL_W
        col = w_in + run_kw[k] * dil_w
        ok = (r < mma.xs_rows) & (d_in >= 0) & (d_in < in_d) & (h_in >= 0) & (h_in < in_h) & (col >= 0) & (col < in_w)
        planes[ok, k] = x[run_ci[k], d_in[ok], h_in[ok], col[ok]]
    return planes


def simulate(plan, x, weight, bias):
    """The conv (T1 before the epilogue's ops, bias added) of one sample as the kernel computes it,
    in float64: every box, slab and warpgroup tile, the planes staged row by row, each k-step's B
    rows at p0 + tap_row(tap), and the epilogue's map from (tile, position) to T1. Also checks that
    no tile reads past a plane's rows and that every T1 element is written exactly once."""
    mma = plan["mma"]
    cin, cout = plan["cin"], plan["cout"]
    k_d, k_h, k_w = plan["kernel"]
    in_d, in_h, in_w = plan["in"]
    t1 = plan["t1"]
    box = plan["box"]
    xs_w = mma.xs[2]
    slab_h, (slabs_d, slabs_h) = mma.slab[1], mma.slabs
    nb, rows = mma.nb, mma.plane_rows
    x = x.reshape(cin, in_d, in_h, in_w)
    w = weight.reshape(cout, cin, k_d * k_h * k_w)
    _, (run_kw, run_ci), run_ok = gemm_taps(plan)
    tap_row = model_tap_rows(plan)
    out = np.zeros(t1)
    written = np.zeros(t1, dtype=int)
    tiles = [math.ceil(t / b) for t, b in zip(t1, box)]
    for tc, td, th, tw in np.ndindex(*tiles):
        cb, db, hb, wb = tc * box[0], td * box[1], th * box[2], tw * box[3]
        for slab in range(slabs_d * slabs_h):
            sd0, sh0 = slab // slabs_h, slab % slabs_h * slab_h
            planes = model_planes(plan, x, db + sd0, hb + sh0, wb)
            for unit in range(mma.units):
                ct, nt = unit % mma.c_tiles, unit // mma.c_tiles
                p = nt * nb + np.arange(nb)
                assert (p[-1] + tap_row.max()) < rows, "a tile reads past its plane"
                ch = cb + ct * 64 + np.arange(64)
                a = np.zeros((64, len(tap_row), mma.cip))  # [channel][GEMM tap][K of its run]: the template's w_s
                valid = ch < min(cout, cb + box[0])
                conv_tap = np.arange(len(tap_row))[:, None] * (k_w if mma.packed_w else 1) + run_kw[None, :]  # (kd, kh, kw) of each K
                for k in np.nonzero(run_ok)[0]:
                    a[np.ix_(valid, np.arange(len(tap_row)), [k])] = w[ch[valid]][:, run_ci[k], conv_tap[:, k]][:, :, None]
                acc = np.einsum("ctk,tpk->cp", a, planes[p[None, :] + tap_row[:, None]])
                ph, pw = sh0 + p // xs_w, p % xs_w
                d, h, wo = db + sd0, hb + ph, wb + pw
                keep_p = (p < slab_h * xs_w) & (pw < box[3]) & (d < t1[1]) & (h < t1[2]) & (wo < t1[3])
                if mma.pair_stores:  # the epilogue stores p and p + 1 (p even) together, kept where p is
                    assert (keep_p[0::2] == keep_p[1::2]).all() and nb % 2 == 0, "a pair store splits"
                keep_c = (np.arange(64) + ct * 64 < box[0]) & (ch < t1[0])
                cc, pp = np.nonzero(keep_c[:, None] & keep_p[None, :])
                if d >= t1[1]:  # a slab past the last depth (the box's last slabs): nothing kept
                    continue
                out[ch[cc], d, h[pp], wo[pp]] = acc[cc, pp] + (bias[ch[cc]] if bias is not None else 0.0)
                np.add.at(written, (ch[cc], d, h[pp], wo[pp]), 1)
    assert written.min() == 1 and written.max() == 1, "every T1 element written exactly once"
    return out


@pytest.mark.parametrize("data", LAYERS, ids=IDS)
def test_the_plans_geometry_computes_the_conv(data):
    check_geometry(data)


def check_geometry(data):
    plan = slab_plan(data)
    spec = validate(data)
    g = spec.conv_geometry()
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(1, spec.input.channels, *spec.input.size, generator=gen, dtype=torch.float64)
    weight = torch.randn(spec.conv.out_channels, spec.input.channels, *g["kernel"], generator=gen, dtype=torch.float64)
    bias = torch.randn(spec.conv.out_channels, generator=gen, dtype=torch.float64)
    conv = {1: torch.nn.functional.conv1d, 2: torch.nn.functional.conv2d, 3: torch.nn.functional.conv3d}[spec.ndim]
    want = conv(x, weight, bias, stride=g["stride"], padding=g["padding"], dilation=g["dilation"])[0]
    fold = plan.get("fold")
    if fold is not None:  # an average pool folded into the conv: its weights W'(t) = sum over e of W(t - e) / window
        window = fold["window"][3 - spec.ndim:]
        pool = {1: torch.nn.functional.avg_pool1d, 2: torch.nn.functional.avg_pool2d,
                3: torch.nn.functional.avg_pool3d}[spec.ndim]
        want = pool(want[None], window)[0]
        ones = torch.ones(1, 1, *window, dtype=torch.float64)
        flat = weight.reshape(-1, 1, *weight.shape[2:])
        weight = conv(flat, ones, padding=[w - 1 for w in window]).reshape(*weight.shape[:2], -1) / math.prod(window)
    got = simulate(plan, x.numpy(), weight.numpy(), bias.numpy())
    np.testing.assert_allclose(got.reshape(want.shape), want.numpy(), rtol=1e-12, atol=1e-12)


# ---- the generated staging code, compiled for the host ------------------------------------------

HOST_SHIMS = """#include <cstdio>
#include <cstdlib>
#include <vector>
#define __device__
#define __forceinline__ inline
#define __restrict__
static inline float __ldg(const float* p) { return *p; }
"""

HOST_MAIN = """
// argv: the sample's input file (float32, [C_IN][IN_D][IN_H][IN_W]), then slab origins d0 h0 w0 ...
// stdout (binary): each GEMM tap's tap_row(), then per origin the planes [CHUNKS][PLANE_ROWS][8]
// as load_row() fills them, from the origins load_rows() and stage_planes() pass it.
int main(int argc, char** argv) {
  std::vector<float> x(IN_PER_SAMPLE);
  FILE* f = std::fopen(argv[1], "rb");
  if (!f || std::fread(x.data(), sizeof(float), x.size(), f) != x.size()) return 2;
  std::fclose(f);
  for (int t = 0; t < KSTEPS / CHUNKS; ++t) {
    const int row = tap_row(t);
    std::fwrite(&row, sizeof(int), 1, stdout);
  }
  for (int a = 2; a + 2 < argc; a += 3) {
    const int d0 = std::atoi(argv[a]), h0 = std::atoi(argv[a + 1]), w0 = std::atoi(argv[a + 2]);
    for (int chunk = 0; chunk < CHUNKS; ++chunk)
      for (int r = 0; r < PLANE_ROWS; ++r) {
        float v[8];
        load_row(x.data(), chunk, r, d0 * S_D - P_D, h0 * S_H - P_H, w0 * S_W - P_W, v);
        std::fwrite(v, sizeof(float), 8, stdout);
      }
  }
  return 0;
}
"""


def _function(source: str, head: str) -> str:
    """The definition that starts with `head` in `source`, through its closing brace."""
    start = source.index(head)
    depth, i = 0, source.index("{", start)
    while True:
        depth += {"{": 1, "}": -1}.get(source[i], 0)
        if depth == 0:
            return source[start:i + 1]
        i += 1


def host_staging_program(source: str) -> str:
    """The generated kernel's constants, tap_row() and load_row(), as a host C++ program."""
    namespace = source[source.index("namespace {"):source.index("}  // namespace")]
    constants, pending = [], ""
    for line in namespace.splitlines():
        if pending or line.startswith("constexpr "):
            pending += line + "\n"
            if ";" in line.split("//")[0]:
                constants.append(pending)
                pending = ""
    return (HOST_SHIMS + "".join(constants) + _function(source, "__device__ __forceinline__ int tap_row(")
            + "\n" + _function(source, "__device__ __forceinline__ void load_row(") + "\n" + HOST_MAIN)


@pytest.mark.parametrize("data", LAYERS, ids=IDS)
def test_the_generated_staging_code_stages_the_models_planes(data, tmp_path):
    """The rendered tap_row() and load_row(), compiled for the host (g++) and run over slabs at the
    box's corners and past the input's edges: the same tap rows and the same planes, value for value,
    as the numpy model whose walk computes the conv (`simulate`). The model checks the plan; this
    checks that the template renders it."""
    check_staging_code(data, tmp_path)


def check_staging_code(data, tmp_path):
    import shutil
    import subprocess

    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    plan = slab_plan(data)
    source = render_plan(plan)
    for call in ("load_row(x_n, chunk, i * THREADS + threadIdx.x, d0 * S_D - P_D, h0 * S_H - P_H, w0 * S_W - P_W",):
        assert call in source  # (the origins the harness passes, as the kernel passes them)
    (tmp_path / "staging.cpp").write_text(host_staging_program(source))
    subprocess.run([cxx, "-std=c++17", "-O1", "-o", str(tmp_path / "staging"), str(tmp_path / "staging.cpp")], check=True,
                   capture_output=True)
    cin, (in_d, in_h, in_w), t1, box = plan["cin"], plan["in"], plan["t1"], plan["box"]
    x = np.random.default_rng(5).standard_normal((cin, in_d, in_h, in_w)).astype(np.float32)
    (tmp_path / "x.bin").write_bytes(x.tobytes())
    origins = {(0, 0, 0), (max(0, t1[1] - 1), max(0, t1[2] - 1), max(0, t1[3] - box[3])),
               (t1[1] // 2, t1[2] // 2, (t1[3] // 2) // box[3] * box[3]), (0, t1[2] - plan["mma"].slab[1], 0)}
    args = [str(v) for o in sorted(origins) for v in o]
    run = subprocess.run([str(tmp_path / "staging"), str(tmp_path / "x.bin"), *args], check=True, capture_output=True)
    taps = len(model_tap_rows(plan))
    rows = np.frombuffer(run.stdout[:4 * taps], dtype=np.int32)
    np.testing.assert_array_equal(rows, model_tap_rows(plan))
    planes = np.frombuffer(run.stdout[4 * taps:], dtype=np.float32).reshape(len(origins), plan["mma"].chunks, -1, 8)
    for got, origin in zip(planes, sorted(origins)):
        want = model_planes(plan, x.astype(np.float64), *origin).reshape(-1, plan["mma"].chunks, 8).transpose(1, 0, 2)
        np.testing.assert_array_equal(got, want.astype(np.float32), err_msg=f"slab at T1 {origin}")


@st.composite
def wgmma_layers(draw):
    """Random layers the wgmma slab takes: 1 to 3 spatial dims, stride 1 to 4 (the input staged by
    phase where it is not 1 along H or W), padding, dilation, 1 to 16 input channels, 8 to 200
    output channels, an optional sum."""
    nd = draw(st.integers(1, 3))
    kernel = [draw(st.integers(1, 7)) for _ in range(nd)]
    dilation = [draw(st.integers(1, 3)) for _ in range(nd)]
    padding = [draw(st.integers(0, (k - 1) * d)) for k, d in zip(kernel, dilation)]
    stride = [draw(st.integers(1, 4)) for _ in range(nd)]
    size = [draw(st.integers((k - 1) * d + 1, (k - 1) * d + 1 + (12 if i + 1 < nd else 60)))
            for i, (k, d) in enumerate(zip(kernel, dilation))]
    cin = draw(st.integers(1, 16))
    k_pad = -(-cin // 8) * 8 * math.prod(kernel)
    if k_pad > 512:  # (fp32 mode's limit: one running sum)
        kernel, padding, k_pad = [1] * nd, [0] * nd, -(-cin // 8) * 8
    most = min(25, 80_000 // (4 * k_pad * 8))  # output channels x 8 whose weights leave room for the planes and a box
    epilogue = ["relu"] + ([{"sum": {"dims": [1]}}] if draw(st.booleans()) else [])
    return layer("random", cin, size, draw(st.integers(1, most)) * 8, kernel, stride=stride, padding=padding,
                 dilation=dilation, epilogue=epilogue)


@settings(max_examples=40, deadline=None)
@given(wgmma_layers())
def test_random_layers_generated_staging_code(data):
    """The host-compiled staging code against the model on random geometry (dilations with W
    phases, packed W taps with dilation: what the fixed layers do not reach)."""
    import tempfile

    try:
        build_plan(validate(data))
    except PlanError as e:
        assume("staged planes and weights do not fit in shared memory" not in str(e))
        raise
    with tempfile.TemporaryDirectory() as tmp:
        check_staging_code(data, __import__("pathlib").Path(tmp))


@settings(max_examples=200, deadline=None)
@given(wgmma_layers())
def test_random_plans_compute_the_conv(data):
    """The numpy model of the kernel's walk, on random geometry: the conv in float64, no read past a
    plane, every output written once. (A layer whose planes do not fit is refused, with that reason.)"""
    try:
        build_plan(validate(data))
    except PlanError as e:
        assume("staged planes and weights do not fit in shared memory" not in str(e))
        raise
    check_geometry(data)


@pytest.mark.parametrize("data", LAYERS, ids=IDS)
def test_the_source_multiplies_on_wgmma(data):
    plan = slab_plan(data)
    text = render_plan(plan)
    mma = plan["mma"]
    assert f"wgmma.mma_async.sync.aligned.m64n{mma.nb}k8.f32.tf32.tf32" in text
    assert "mma.sync.aligned" not in text
    assert ("split_tf32(" in text) == (mma.products == 3) and ("tf32_round(" in text) == (mma.products == 1)
    assert "fence.proxy.async.shared::cta" in text  # the planes' stores made visible to wgmma
    assert ("store_pair(out_n" in text) == mma.pair_stores
    # prefetching: the next slab's rows loaded before the products, the K loop not unrolled
    assert ("load_rows(x_n, next" in text) == mma.prefetch and ("stage_planes(x_n" in text) == (not mma.prefetch)
    assert ("#pragma unroll 1\n  for (int s = 0; s < KSTEPS; s += 2)" in text) == mma.prefetch


def test_prefetch_where_a_block_is_alone_on_its_sm():
    """The planner does not prefetch the next slab's rows (measured slower on every layer timed); a
    planner setting (the tuner's candidates) turns it on where a block is alone on its SM, and
    refuses it with the reason where a box holds one slab."""
    from specgen.plan import SlabConfig, Settings

    def plan_of(data, **slab):
        plan = build_plan(validate(data), settings=Settings(slab=SlabConfig(1, **slab)) if slab else None) \
            if slab else build_plan(validate(data))
        plans = [p["plan"] for p in plan["parts"]] if plan.get("parts") else [plan]
        (body,) = [p for p in plans if p["engine"] == "slab"]
        return body

    stem = plan_of(by_name("stem_224"))
    assert not stem["mma"].prefetch and stem["min_blocks"] == 1
    stem = plan_of(by_name("stem_224"), prefetch=1)
    assert stem["mma"].prefetch and stem["min_blocks"] == 1 and stem["mma"].slabs[0] * stem["mma"].slabs[1] > 1
    slab = SlabConfig(1, prefetch=1)
    assert "the next slab's input prefetched into registers" in describe(build_plan(validate(by_name("stem_224")),
                                                                                   settings=Settings(slab=slab)))
    kb90 = plan_of(by_name("kb90_small"))
    assert not kb90["mma"].prefetch and kb90["min_blocks"] == 2  # (a second block hides staging)
    assert plan_of(by_name("kb90_small"), prefetch=1)["mma"].prefetch
    assert not plan_of(by_name("stem_224"), prefetch=2)["mma"].prefetch
    with pytest.raises(PlanError, match="no slab of this layer can prefetch the next one"):
        plan_of(by_name("line_128"), prefetch=1)  # one slab a box


def by_name(name):
    return next(d for d in LAYERS if d["name"] == name)


def test_wgmma_refuses_what_it_cannot_run():
    with pytest.raises(PlanError, match="wgmma needs sm_90a"):
        build_plan(validate(layer("ampere", 8, [20, 20], 64, 3)), target=targets.resolve("sm_80"))
    with pytest.raises(PlanError, match="more than the 512 one running 3xTF32 sum"):
        build_plan(validate(layer("deep", 16, [9, 20, 20], 64, 5)))
    with pytest.raises(PlanError, match="tile.wgmma: the slab engine cannot run this layer: the conv has groups"):
        build_plan(validate(layer("grouped", 16, [20, 20], 32, 3, groups=2)))
    with pytest.raises(SpecError, match="tile.wgmma: chooses the slab engine's instruction; tile.engine is 'tma'"):
        validate(layer("tma", 8, [20, 20], 64, 3, tile={"engine": "tma"}))


def test_the_planners_wgmma_switch(monkeypatch):
    """`plan.SLAB_WGMMA_DEFAULT` (on: measured faster where the conv's output is stored as computed,
    and after an unstrided 1x1 conv with a reduction): the planner runs such slab layers on wgmma on
    sm_90a (the 1x1 conv prefetching the next slab), and mma.sync where a reduction follows another
    conv in the same kernel, where the spec says
    `tile: {wgmma: false}` or a tuned choice pins mma.sync, and on sm_80. Off, mma.sync."""
    from specgen import plan as plan_module
    from specgen.plan import Settings, SlabConfig

    def on_slab(data):
        plan = build_plan(validate(data))
        return any(p["plan"].get("engine") == "slab" for p in plan["parts"]) if plan.get("parts") else plan["engine"] == "slab"

    free_layers = [{k: v for k, v in data.items() if k != "tile"} for data in LAYERS]
    slab_layers = [data for data in free_layers if on_slab(data)]  # (the others the planner gives another engine)
    assert len(slab_layers) >= 8
    def one_tap(body):  # an unstrided 1x1 conv in 3xTF32 (a box-folded layer's second kernel, say)
        return body["taps"] == 1 and all(s == 1 for s in body["stride"]) and body["mma"].products == 3

    def few_exact(body):  # exact sums over at most 32 output channels: half of wgmma's M tile padding
        return body["settings"].exact_sums and body["cout"] <= plan_module.WGMMA_EXACT_MIN_CHANNELS

    stored = [d for d in slab_layers if (not slab_plan(d)["reductions"] or one_tap(slab_plan(d))) and not few_exact(slab_plan(d))]
    assert {"kb90_small", "stem_224", "exact_kb90"} <= {d["name"] for d in stored} and len(stored) < len(slab_layers)
    assert any(slab_plan(d)["settings"].exact_sums for d in stored)  # (exact sums take wgmma too, v47)
    assert few_exact(slab_plan(by_name("exact_deep"))) and "exact_deep" not in {d["name"] for d in stored}  # (32 channels)
    for free in slab_layers:
        assert slab_plan(free)["mma"].wgmma == (free in stored), free["name"]
        assert not slab_plan({**free, "tile": {"wgmma": False}})["mma"].wgmma
        sm80 = build_plan(validate(free), target=targets.resolve("sm_80"))
        assert not any(p["plan"].get("mma") is not None and p["plan"]["mma"].wgmma for p in sm80.get("parts") or [{"plan": sm80}])
    kb90 = {k: v for k, v in LAYERS[0].items() if k != "tile"}
    assert not build_plan(validate(kb90), settings=Settings(slab=SlabConfig(0, 2, 4)))["mma"].wgmma  # a tuned mma.sync tile
    assert not build_plan(validate(kb90), settings=Settings(slab=SlabConfig(0)))["mma"].wgmma  # the planner's mma.sync tile
    # a reduction after the conv: mma.sync, unless the conv is an unstrided 1x1 (the box fold's second kernel)
    summed = {"name": "summed", "input": {"channels": 72, "size": [95, 95]}, "conv": {"out_channels": 64, "kernel": 3},
              "epilogue": ["sigmoid", {"sum": {"dims": [1, 2, 3]}}]}
    assert not slab_plan(summed)["mma"].wgmma
    one_tap = slab_plan({**summed, "conv": {"out_channels": 64, "kernel": 1}})["mma"]
    assert one_tap.wgmma and one_tap.prefetch
    assert not slab_plan({**summed, "conv": {"out_channels": 64, "kernel": 1, "stride": 2}})["mma"].wgmma
    exact = layer("exact", 8, [12, 20], 64, 3, precision="tf32", padding=1)
    assert build_plan(validate(exact))["mma"].wgmma and build_plan(validate(exact))["settings"].exact_sums  # (asked)
    free_exact = slab_plan({k: v for k, v in exact.items() if k != "tile"})  # (not asked: the planner's default since v47)
    assert free_exact["mma"].wgmma and not free_exact["mma"].prefetch and free_exact["settings"].exact_sums
    monkeypatch.setattr(plan_module, "SLAB_WGMMA_DEFAULT", False)
    assert not any(slab_plan(free)["mma"].wgmma for free in slab_layers)


def test_exact_sums_on_wgmma():
    """A tf32 layer computed as fp32 (`exact_tf32`) sums each k-step's three products into one of
    two register sets (the first product overwrites it) and adds it to the total once waited for,
    rounded to nearest, as mma.sync's exact sums do; no running sum limits its K; its two sets are
    in the register estimate. The fp32 layer keeps the running sum."""
    from specgen.plan import wgmma_registers

    exact = slab_plan(by_name("exact_kb90"))
    fp32 = slab_plan({**by_name("exact_kb90"), "precision": "fp32"})
    text, plain = render_plan(exact), render_plan(fp32)
    assert exact["settings"].exact_sums and not fp32["settings"].exact_sums
    assert "wgmma_tf32(part, a_lo, hi_d + rows, 0);" in text and "add_part(acc, part);" in text
    assert "add_part" not in plain and "wgmma_tf32(acc, a_lo, hi_d + rows, 1);" in plain
    mma = exact["mma"]
    assert wgmma_registers(mma.nb, 0, False, False, True) == wgmma_registers(mma.nb, 0, False) + mma.nb
    assert slab_plan(by_name("exact_deep"))["mma"].k_pad > 512
    # the estimate with the two sets decides the blocks per SM, and caps NB (one row of 4 x 100
    # positions, 3-D: alone on its SM, its planner once took NB 200, 364 estimated registers)
    from specgen.plan import WGMMA_MAX_REGS

    wide = layer("exact_wide", 8, [4, 6, 100], 64, 3, precision="tf32")
    for data in (wide, by_name("exact_kb90"), by_name("exact_deep"), by_name("exact_kb65")):
        plan = slab_plan(data)
        m = plan["mma"]
        regs = wgmma_registers(m.nb, m.stage_iters, m.prefetch, m.packed_w, True)
        assert plan["settings"].exact_sums and regs <= WGMMA_MAX_REGS and (plan["min_blocks"] == 1 or regs <= 128), data["name"]
    with pytest.raises(PlanError, match="more than the 512 one running 3xTF32 sum"):
        build_plan(validate({**by_name("exact_deep"), "precision": "fp32"}))


@pytest.mark.nvcc
def test_wgmma_slab_kernels_build_for_sm_90a_without_spills(tmp_path, monkeypatch):
    from specgen import pipeline

    monkeypatch.setenv("SPECGEN_CACHE_DIR", str(tmp_path / "cache"))
    # 3-D fp32, two planes, tf32, a tail, a full reduction; staged by phase: a fold, a stem, three H phases
    # the stem at its size: packed W taps, by phase
    picked = [LAYERS[i] for i in (0, 2, 6, 8, 9, 10, 11, 13)] + [by_name(n) for n in ("exact_kb90", "exact_deep", "stem_224")]
    built = pipeline.specialize_many([validate(d) for d in picked], "sm_90", tuned=False)
    assert len(built) == len(picked)
    assert built[-1].plan["mma"].packed_w
    for item in built:
        log = item.build.log
        assert item.build.spill_bytes == 0, (item.spec.name, log)
        assert "sm_90a" in log, (item.spec.name, log)
        # ptxas serializes wgmma (and says so) when it cannot prove the A registers are not rewritten in flight
        assert "serialized" not in log and "C7510" not in log and "C7511" not in log, (item.spec.name, log)
    from specgen import cache
    from specgen.plan import SlabConfig

    # the stem prefetching (a tuner's candidate): its K loop not unrolled, no spill
    plan, _, req = pipeline.request(validate(by_name("stem_224")), None, igemm_config=SlabConfig(1, prefetch=1))
    assert plan["mma"].prefetch and plan["mma"].packed_w
    build = cache.get_or_build(req)
    assert build.spill_bytes == 0 and "serialized" not in build.log, build.log
    # exact sums at kb65's size, alone on its SM: not prefetching (in a K loop that a prefetching
    # kernel does not unroll, ptxas serialized the products of their register sets)

    kb65 = {**by_name("exact_kb65"), "input": {"channels": 8, "size": [256, 256]}}
    plan, _, req = pipeline.request(validate(kb65), None)
    assert not plan["mma"].prefetch and plan["settings"].exact_sums and plan["min_blocks"] == 1
    build = cache.get_or_build(req)
    assert build.spill_bytes == 0 and "serialized" not in build.log, build.log
    from specgen.plan import Settings

    as_fp32 = validate({**kb65, "precision": "fp32"})  # (what `exact_tf32` plans, with exact sums)
    assert build_plan(as_fp32, settings=Settings(slab=SlabConfig(1, prefetch=1)))["mma"].prefetch
    with pytest.raises(PlanError, match="no slab of this layer can prefetch the next one"):
        build_plan(as_fp32, settings=Settings(exact_sums=True, slab=SlabConfig(1, prefetch=1)))
    # the run-time-extents rendering `specgen bench` times against (its K loop not unrolled) builds too
    for data, cfg in ((picked[0], None), (by_name("stem_224"), SlabConfig(1, prefetch=1))):  # (prefetching: rows in a register array)
        plan, source, req = pipeline.request(validate(data), "sm_90", igemm_config=cfg, runtime_dims=True)
        assert cache.get_or_build(req).spill_bytes == 0 and "__constant__ int KSTEPS" in source


@pytest.mark.gpu
@pytest.mark.parametrize("data", LAYERS, ids=IDS)
@pytest.mark.parametrize("batch", [1, 3])
def test_wgmma_slab_layers_meet_the_bar(data, batch, fp32_reference):
    from specgen.module import FusedLayer

    from gpu_helpers import compare

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("wgmma runs on sm_90a (H100 / H200) only")
    compare(FusedLayer(validate(data)).cuda(), batch, seed=batch)


@pytest.mark.gpu
@pytest.mark.parametrize("data", [LAYERS[0], LAYERS[1], LAYERS[8]], ids=[LAYERS[i]["name"] for i in (0, 1, 8)])
def test_wgmma_slab_layers_take_channels_last_inputs(data, fp32_reference):
    """A channels-last input reaches the slab engine through its layout pass (`_from_cl`)."""
    from specgen.module import FusedLayer

    from gpu_helpers import compare

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("wgmma runs on sm_90a (H100 / H200) only")
    compare(FusedLayer(validate(data)).cuda(), 2, seed=11, channels_last=True)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["kb90_small", "stem_fp32", "kb65_small", "strided_3d", "mean_all", "stem_224"])
@pytest.mark.parametrize("prefetch", [1, 2])
def test_wgmma_slab_with_and_without_prefetch(name, prefetch, fp32_reference):
    """Each layer with the next slab's rows prefetched into registers (1) and staged in turn (2), as
    the tuner's candidates build them, against float64 (poisoned output, fresh inputs)."""
    from specgen import cache, pipeline, tune
    from specgen.plan import SlabConfig

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("wgmma runs on sm_90a (H100 / H200) only")
    spec = validate(by_name(name))
    plan, source, req = pipeline.request(spec, None, igemm_config=SlabConfig(1, prefetch=prefetch))
    assert plan["mma"].prefetch == (prefetch == 1)
    cand = tune.Candidate(SlabConfig(1, prefetch=prefetch), pipeline.Specialized(spec, plan, source, cache.get_or_build(req)))
    tune.measure(spec, [cand], batch=3, reps=1)
    assert cand.ok, (name, prefetch, cand.rel_l2)



def test_wgmma_slab_blocks_walk_the_batchs_boxes(monkeypatch):
    """`SlabTiling.walk`: a wgmma slab layer whose boxes all hold the same channels and keep no
    reduction has its blocks walk the batch's boxes (the weights staged once a block); a reduction,
    a prefetch, mma.sync, boxes of several channel ranges and `plan.SLAB_WALK = False` keep a
    block per box. The rendering walks items from blockIdx.x by gridDim.x."""
    from specgen import plan as plan_module
    from specgen.plan import Settings, SlabConfig

    kb90 = {k: v for k, v in by_name("kb90_small").items() if k != "tile"}
    assert not plan_module.SLAB_WALK and not slab_plan(kb90)["mma"].walk  # (off by default: NOTES v47)
    monkeypatch.setattr(plan_module, "SLAB_WALK", True)
    body = slab_plan(kb90)
    assert body["mma"].wgmma and body["mma"].walk and not body["reductions"]
    source = render_plan(body)
    assert "for (int item = blockIdx.x; item < batch * TILES_PER_SAMPLE; item += gridDim.x)" in source
    assert "const int n = blockIdx.y;" not in source  # (the sample comes from the item)
    assert not slab_plan({**kb90, "tile": {"wgmma": False}})["mma"].walk  # mma.sync
    prefetching = build_plan(validate(kb90), settings=Settings(slab=SlabConfig(1, prefetch=1)))
    assert prefetching["mma"].prefetch and not prefetching["mma"].walk
    summed = {"name": "summed", "input": {"channels": 72, "size": [95, 95]}, "conv": {"out_channels": 64, "kernel": 1},
              "epilogue": ["sigmoid", {"sum": {"dims": [1, 2, 3]}}]}
    assert slab_plan(summed)["mma"].wgmma and not slab_plan(summed)["mma"].walk  # a reduction
    wide = build_plan(validate({**layer("wide", 16, [6, 20], 320, 3), "tile": {"engine": "slab", "wgmma": True}}))
    assert wide["tiles"]["c"] > 1 and not wide["mma"].walk  # boxes of two channel ranges: weights per box
    monkeypatch.setattr(plan_module, "SLAB_WALK", False)
    off = slab_plan(kb90)
    assert off["mma"].wgmma and not off["mma"].walk and "const int n = blockIdx.y;" in render_plan(off)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["kb90_small", "depth_stride", "dilated_two_planes", "stem_224", "exact_kb90"])
def test_walking_blocks_cover_every_box(name, monkeypatch, fp32_reference):
    """Walking switched on (`plan.SLAB_WALK`), each block walks several boxes (the launch capped at
    5 blocks, `runtime.WALK_BLOCKS_MAX`), at batch 3, against float64 (poisoned output, fresh inputs)."""
    from specgen import plan as plan_module, runtime
    from specgen.module import FusedLayer

    from gpu_helpers import compare

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("wgmma runs on sm_90a (H100 / H200) only")
    monkeypatch.setattr(plan_module, "SLAB_WALK", True)
    # (renamed: a request for the same spec made with walking off may be memoized, or indexed on disk)
    data = {**{k: v for k, v in by_name(name).items() if k != "tile"}, "name": f"walking_{name}"}
    monkeypatch.setattr(runtime, "WALK_BLOCKS_MAX", 5)
    layer = FusedLayer(validate(data)).cuda()
    assert slab_plan(data)["mma"].walk and layer.specialize().plan["mma"].walk  # (the plan the layer runs)
    compare(layer, 3, seed=5)


def test_wgmma_boxes_grow_where_a_sample_keeps_blocks_enough():
    """A wgmma slab block walks WGMMA_TALL_BOX_SLABS slabs where a sample still has at least
    WGMMA_TALL_BOX_MIN_BOXES boxes of that height (kb90: 56 boxes of 16 rows), else WGMMA_BOX_SLABS
    (the 3-channel stem: 4 boxes of 32 rows would leave a small batch's SMs idle)."""
    import specgen
    from specgen import plan as plan_module

    kb90 = build_plan(specgen.load_specs("examples/kb90.yaml")[0])
    assert kb90["mma"].wgmma and kb90["mma"].slabs == (1, plan_module.WGMMA_TALL_BOX_SLABS)
    assert kb90["blocks_per_sample"] >= plan_module.WGMMA_TALL_BOX_MIN_BOXES
    stem = {**layer("stem", 3, [224, 224], 64, 7, precision="tf32", stride=2, padding=3)}
    body = slab_plan({k: v for k, v in stem.items() if k != "tile"})
    assert body["mma"].wgmma and body["mma"].slabs[1] == plan_module.WGMMA_BOX_SLABS


def test_the_tuners_walk_and_box_candidates():
    """`SlabConfig.walk` and `SlabConfig.box_slabs` (tuner candidates on wgmma): walking asked for
    walks where it applies whatever `plan.SLAB_WALK` says, and not asked for never; a box's slabs as
    asked; both refused on mma.sync and out of range; a stored record without them still loads."""
    import specgen
    from specgen import tune
    from specgen.plan import Settings, SlabConfig

    kb90 = specgen.load_specs("examples/kb90.yaml")[0]
    walking = build_plan(kb90, settings=Settings(slab=SlabConfig(1, walk=1)))
    assert walking["mma"].walk and not build_plan(kb90)["mma"].walk
    assert not build_plan(kb90, settings=Settings(slab=SlabConfig(1, walk=2)))["mma"].walk
    four = build_plan(kb90, settings=Settings(slab=SlabConfig(1, box_slabs=4)))["mma"]
    assert four.slabs == (1, 4) and build_plan(kb90)["mma"].slabs == (1, 8)
    labels = [tune.label(c) for c in tune.candidates(kb90)]
    assert "slab wgmma 4 slabs a box" in labels and "slab wgmma walking" in labels
    for bad in ({"wgmma": 0, "walk": 1}, {"wgmma": 1, "walk": 3}, {"wgmma": 0, "box_slabs": 4}, {"wgmma": 1, "box_slabs": 99}):
        with pytest.raises(ValueError):
            SlabConfig(**bad)
    record = tune.config_record(SlabConfig(1, walk=1, box_slabs=8))
    assert tune.config_from(record) == SlabConfig(1, walk=1, box_slabs=8)
    old = {k: v for k, v in record.items() if k not in ("walk", "box_slabs")}  # (written before v47)
    assert tune.config_from(old) == SlabConfig(1)


@pytest.mark.nvcc
def test_walking_kernels_build_for_sm_90a_without_spills(tmp_path, monkeypatch):
    """The walking rendering (`plan.SLAB_WALK` on) of the GPU test's layers and of kb90 at its size
    builds for sm_90a with no spill and no serialized wgmma, as does its run-time-dimensions rendering."""
    import specgen
    from specgen import compile as compile_mod, pipeline
    from specgen import plan as plan_module

    monkeypatch.setenv("SPECGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(plan_module, "SLAB_WALK", True)
    picked = [{**{k: v for k, v in by_name(n).items() if k != "tile"}, "name": f"walking_{n}"}
              for n in ("kb90_small", "depth_stride", "stem_224", "exact_kb90")]
    specs = [validate(d) for d in picked] + [specgen.load_specs("examples/kb90.yaml")[0].model_copy(update={"name": "walking_kb90"})]
    built = pipeline.specialize_many(specs, "sm_90", tuned=False)
    assert len(built) == len(specs)
    for item in built:
        body = slab_plan(item.spec.model_dump(exclude_none=True)) if item.plan["engine"] == "sequence" else item.plan
        assert body["mma"].walk and "item += gridDim.x" in item.source, item.spec.name
        assert item.build.spill_bytes == 0 and "serialized" not in item.build.log, (item.spec.name, item.build.log)
    kb90 = built[-1]
    ptx = compile_mod.compile_ptx(render_plan(kb90.plan, runtime_dims=True), "sm_90a")
    assert "specgen_walking_kb90" in ptx
