"""The planner's choices: tensor cores or FFMA, the tensor-core tiling, the affine fold (no GPU)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings

from specgen.literals import to_float32
from specgen.plan import PlanError, build_plan, describe
from specgen.render import render_plan
from specgen.spec import SpecError, load_specs, validate
from strategies import specs as random_specs

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
SPECS = {s.name: s for path in sorted(EXAMPLES.glob("*.yaml")) for s in load_specs(path)}


def with_(name: str, **changes) -> dict:
    data = SPECS[name].model_dump()
    data.update(changes)
    return data


@pytest.mark.parametrize("name,instruction", [("kb90", "wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32"),
                                              ("kb65", "wgmma.mma_async.sync.aligned.m64n96k8.f32.tf32.tf32")])
def test_the_seeds_run_on_tensor_cores(name, instruction):
    """kb90 on wgmma (its output stored as computed), kb65 too: its box fold's second kernel is a 1x1
    conv with the sum after it, measured faster on wgmma (`plan.SLAB_WGMMA_DEFAULT`)."""
    plan = build_plan(SPECS[name])
    assert plan["mma"] is not None
    assert "tensor cores (3xTF32" in describe(plan)
    text = render_plan(plan)
    assert instruction in text
    assert "lo(a)hi(b) + hi(a)lo(b) + hi(a)hi(b)" in text  # the banner explains 3xTF32


def test_tensor_cores_can_be_turned_off():
    plan = build_plan(validate(with_("kb90", tile={"tensor_cores": False})))
    assert plan["mma"] is None
    assert "mma.sync" not in render_plan(plan)
    assert "fp32 FFMA" in describe(plan)


def test_pinning_an_ffma_register_tile_keeps_ffma():
    plan = build_plan(validate(with_("kb90", tile={"channels_per_thread": 4})))
    assert plan["mma"] is None and plan["ct"] == 4


def test_tensor_cores_refused_with_a_reason():
    data = with_("depthwise_mish", tile={"tensor_cores": True})
    with pytest.raises(PlanError) as err:
        build_plan(validate(data))
    assert "tile.tensor_cores" in str(err.value) and "groups" in str(err.value)


def test_shallow_layers_stay_on_ffma_unless_asked():
    # K = 3 channels x 9 taps: staging the input costs more than tensor cores save
    assert build_plan(SPECS["conv2d_min_tanh_tanh"])["mma"] is None
    forced = build_plan(validate(with_("conv2d_min_tanh_tanh", tile={"tensor_cores": True})))
    assert forced["mma"] is not None and forced["mma"]["cip"] % 4 == 0


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_specs())
def test_tensor_core_tiling_invariants(spec):  # spec: a mapping
    """Whatever the layer: the warp tiles cover the slab, K is padded to whole k-steps, the staged
    input holds every tap of every position, and shared memory fits."""
    try:  # (mma.sync's tiling: the wgmma slab's is tests/test_slab_wgmma.py's)
        valid = validate({**spec, "tile": {"tensor_cores": True, "wgmma": False}})
    except SpecError as err:  # the strategy can draw an empty pooled output: a clean rejection
        assert "spans" in str(err)
        return
    try:
        plan = build_plan(valid)
    except PlanError as err:
        assert "tile.tensor_cores" in str(err)
        return
    m = plan["mma"]
    assert m["k_pad"] % 8 == 0 and m["k_pad"] >= plan["taps"] * m["cip"] >= plan["taps"] * plan["cin_g"]
    assert m["cip"] % 4 == 0
    n_tiles = math.ceil(plan["box"][0] / 8)
    assert math.ceil(m["mt"] / m["wm"]) * m["n_groups"] == m["units"] and m["n_groups"] * m["wn"] >= n_tiles
    assert m["unit_iters"] * m["warps"] >= m["units"] and plan["threads"] == 32 * m["warps"]
    sd, sh = m["slab"]
    assert m["m_slab"] == sd * sh * plan["box"][3] and m["mt"] * 16 >= m["m_slab"]
    assert m["slabs"][0] * sd >= plan["box"][1] and m["slabs"][1] * sh >= plan["box"][2]
    for extent, stride, kernel, dil, staged in zip((sd, sh, plan["box"][3]), plan["stride"], plan["kernel"], plan["dilation"], m["xs"]):
        assert staged == (extent - 1) * stride + (kernel - 1) * dil + 1
    assert m["ci_stride"] >= m["xs"][0] * m["xs"][1] * m["xs_wp"]
    assert m["ws"] % 32 in (8, 24) and m["ws"] >= plan["box"][0]
    assert plan["smem_bytes"] <= 227 * 1024
    assert "mma.sync" in render_plan(plan)


# ---- the affine fold --------------------------------------------------------------------------


def affine_spec(*stages, rewrites=True, **conv):
    return validate(
        {
            "name": "affine",
            "input": {"channels": 4, "size": [16, 16]},
            "conv": {"out_channels": 8, "kernel": 3, **conv},
            "epilogue": [*stages, "relu"],
            "rewrites": rewrites,
        }
    )


def test_affine_ops_after_the_conv_fold_into_weights_and_bias():
    plan = build_plan(affine_spec({"mul": 3.0}, {"add": 0.5}, {"div": 4.0}, {"sub": 1.0}))
    assert plan["affine"]["scale"] == 0.75 and plan["affine"]["shift"] == 0.5 / 4 - 1.0
    assert [st["op"] for st in plan["levels"][0]["pointwise"]] == ["relu"]
    assert any(r.startswith("affine fold: epilogue[0..3] (mul, add, div, sub)") for r in plan["rewrites"])
    text = render_plan(plan)
    assert "constexpr float AFFINE_SCALE = 0.75f;" in text
    assert "constexpr float AFFINE_SHIFT = -0.875f;" in text
    assert "fmaf(__ldg(bias + c + j), AFFINE_SCALE, AFFINE_SHIFT)" in text
    assert "S0_VALUE" not in text  # the folded stages leave no constants behind


def test_affine_fold_constants_are_float32_exact_literals():
    plan = build_plan(affine_spec({"div": 3.0}))
    text = render_plan(plan)
    line = next(ln for ln in text.splitlines() if "constexpr float AFFINE_SCALE" in ln)
    literal = line.split("=")[1].split(";")[0].strip().rstrip("f")
    assert to_float32(float(literal)) == to_float32(1 / 3)


@pytest.mark.parametrize(
    "stages, why",
    [
        (({"add": {"param": "shift"}},), "a learnable parameter is not a constant"),
        (({"mul": 0.0},), "scale 0 would turn inf/NaN conv outputs into finite ones"),
        (({"mul": 1e30}, {"mul": 1e30}), "a scale beyond 2^64 could overflow the weights"),
        (("tanh", {"mul": 2.0}), "only ops directly after the conv fold"),
    ],
)
def test_affine_fold_declines(stages, why):
    plan = build_plan(affine_spec(*stages))
    assert plan["affine"] is None, why
    assert not any("affine" in r for r in plan["rewrites"])


def test_affine_fold_off_with_rewrites_false():
    plan = build_plan(affine_spec({"mul": 2.0}, rewrites=False))
    assert plan["affine"] is None and plan["levels"][0]["pointwise"][0]["op"] == "mul"


def test_affine_and_avg_pool_folds_compose():
    spec = validate(
        {
            "name": "both",
            "input": {"channels": 4, "size": [32, 32]},
            "conv": {"out_channels": 8, "kernel": 3},
            "epilogue": [{"avg_pool": {"kernel": 2}}, {"mul": 2.0}, "sigmoid"],
        }
    )
    plan = build_plan(spec)
    assert plan["fold"] is not None and plan["affine"]["scale"] == 2.0
    assert "return sum / FOLD_WINDOW * AFFINE_SCALE;" in render_plan(plan)


# ---- nested reductions ------------------------------------------------------------------------


def test_nested_reductions_take_the_outer_axes_a_box_at_a_time():
    plan = build_plan(SPECS["conv2d_nested_reductions"])
    assert plan["batched"] and plan["role"]["h"] == plan["role"]["w"] == "R2"
    assert plan["box"][2] > 1 and plan["box"][3] > 1  # a box holds many outer positions
    assert plan["blocks_per_sample"] == 1
    text = render_plan(plan)
    assert "for (int o_h = 0; o_h < T1_H; o_h += BOX_H)" in text
    assert "Join the threads' accumulators with a fixed tree." in text


def test_nested_reductions_with_kept_elements_walk_the_outer_axes():
    data = {
        "name": "kept",
        "input": {"channels": 4, "size": [12, 12]},
        "conv": {"out_channels": 8, "kernel": 3},
        "epilogue": [{"sum": {"dims": [1], "keepdim": True}}, {"amax": {"dims": [3]}}],
    }
    plan = build_plan(validate(data))  # H is kept: several values per sample, the old walk
    assert not plan["batched"]
    assert "for (int o_w = 0; o_w < T1_W; ++o_w)" in render_plan(plan)


def test_a_user_box_on_tensor_cores_is_one_slab():
    plan = build_plan(validate(with_("kb90", tile={"tensor_cores": True, "box": [64, 1, 2, 62]})))
    assert plan["box"] == [64, 1, 2, 62] and plan["mma"]["slab"] == (1, 2) and plan["mma"]["slabs"] == (1, 1)


@pytest.mark.parametrize(
    "box, expected",
    [
        ([60, 1, 2, 62], "multiple of 8"),
        ([64, 1, 16, 62], "choose a smaller box"),
    ],
)
def test_a_user_box_on_tensor_cores_is_checked(box, expected):
    with pytest.raises(PlanError) as err:
        build_plan(validate(with_("kb90", tile={"tensor_cores": True, "box": box})))
    assert "tile.box" in str(err.value) and expected in str(err.value)


# ---- the tensor-core and nested renderings compile (real nvcc, no GPU) -------------------------


@pytest.mark.nvcc
@pytest.mark.parametrize("name", ["kb90", "kb65", "conv2d_nested_reductions"])
def test_runtime_dims_rendering_compiles(name, tmp_path):
    """`specgen bench` builds this variant on the GPU machine; make sure it builds everywhere."""
    from specgen.compile import compile_cubin

    from specgen.pipeline import build_arch

    src = tmp_path / "kernel.cu"
    # (kb65 pinned to the slab engine: its one kernel; the box fold's sequence, where the planner
    # takes it, is built this way in test_boxfold)
    plan = build_plan(validate(with_(name, tile={"engine": "slab"})) if name == "kb65" else SPECS[name])
    src.write_text(render_plan(plan, runtime_dims=True))
    report = compile_cubin(src, tmp_path / "kernel.cubin", build_arch(plan, "sm_90"))
    assert report.registers > 0, report.log


TC_VARIANTS = [
    # (what it exercises, spec)
    ("3 input channels (padded to 4), odd taps (K padded), 20 channels (n-tile padding)",
     {"input": {"channels": 3, "size": [17, 19]}, "conv": {"out_channels": 20, "kernel": 3, "padding": 1}, "epilogue": ["relu"]}),
    ("stride 2, dilation 2, 1D, a tail over width",
     {"input": {"channels": 16, "size": [300]}, "conv": {"out_channels": 32, "kernel": 5, "stride": 2, "dilation": 2},
      "epilogue": [{"amax": {"dims": [2]}}]}),
    ("3D, padding, logsumexp over everything (direct fold)",
     {"input": {"channels": 8, "size": [6, 20, 20]}, "conv": {"out_channels": 64, "kernel": 3, "padding": 1},
      "epilogue": [{"logsumexp": {"dims": [1, 2, 3, 4]}}]}),
    ("more than 128 channels (several channel tiles), affine fold, no bias",
     {"input": {"channels": 12, "size": [20, 24]}, "conv": {"out_channels": 192, "kernel": 3, "bias": False},
      "epilogue": [{"mul": 0.5}, {"add": 1.0}, "silu"]}),
    ("avg-pool fold with stride 3, a per-channel parameter",
     {"input": {"channels": 8, "size": [45, 45]}, "conv": {"out_channels": 32, "kernel": 3},
      "epilogue": [{"avg_pool": {"kernel": 3}}, {"mul": {"param": "gain"}}, "tanh"]}),
    ("nested reductions, batched",
     {"input": {"channels": 8, "size": [30, 30]}, "conv": {"out_channels": 32, "kernel": 3},
      "epilogue": [{"mean": {"dims": [1], "keepdim": True}}, "sigmoid", {"amax": {"dims": [2, 3]}}]}),
]


@pytest.mark.nvcc
@pytest.mark.parametrize("what, data", TC_VARIANTS, ids=[f"v{i}" for i in range(len(TC_VARIANTS))])
def test_tensor_core_variants_build_without_spills(what, data, tmp_path, monkeypatch):
    """Through the pipeline (nvcc, the cache), as FusedLayer and `specgen build` do."""
    from specgen import pipeline

    monkeypatch.setenv("SPECGEN_CACHE_DIR", str(tmp_path / "cache"))
    item = pipeline.specialize(validate({"name": "variant", **data, "tile": {"tensor_cores": True}}))
    assert item.plan["mma"] is not None, what
    assert item.build.registers > 0 and item.build.spill_bytes == 0, (what, item.build.log)


@pytest.mark.nvcc
def test_a_build_that_spills_is_rebuilt_with_one_block_per_sm(tmp_path, monkeypatch):
    """Two blocks per SM cap a thread at 128 registers; this layer needs a few more."""
    from specgen import pipeline
    from specgen.compile import compile_cubin

    monkeypatch.setenv("SPECGEN_CACHE_DIR", str(tmp_path / "cache"))
    spec = validate({"name": "tight", "input": {"channels": 8, "size": [33, 40]},
                     "conv": {"out_channels": 96, "kernel": 3}, "epilogue": ["relu"], "tile": {"tensor_cores": True, "wgmma": False}})
    plan = build_plan(spec)
    assert plan["min_blocks"] == 2
    (tmp_path / "k.cu").write_text(render_plan(plan))
    direct = compile_cubin(tmp_path / "k.cu", tmp_path / "k.cubin", "sm_90")
    assert direct.spill_bytes > 0, "this layer no longer spills under 128 registers: pick another for this test"
    item = pipeline.specialize(spec)
    assert item.build.spill_bytes == 0, item.build.log
    assert item.plan["min_blocks"] == 1 and "__launch_bounds__(THREADS)" in item.source
    pinned = validate({**spec.model_dump(), "tile": {"tensor_cores": True, "wgmma": False, "min_blocks": 2}})
    assert pipeline.specialize(pinned).plan["min_blocks"] == 2  # what the user writes is kept


def test_a_strided_1x1_row_loads_whole_vectors():
    """Kernel 1, stride 2 along W, two positions per thread: the row segment is 3 floats. The load
    width is a power of two (a width of 3 once left every third float unset); the row of 4 is one
    aligned float4 (whole vectors from the tile's aligned start, `_box_access`)."""
    spec = validate({"name": "s2k1", "input": {"channels": 1, "size": [4]}, "conv": {"out_channels": 1, "kernel": 1, "stride": 2},
                     "epilogue": [], "rewrites": False})
    plan = build_plan(spec)
    assert plan["conv_span"] == 3 and (plan["in_vec"], plan["in_lead"], plan["in_vectors"]) == (4, 0, 1)
    assert "float xin[IN_VECTORS * IN_VEC];" in render_plan(plan)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(random_specs())
def test_input_vectors_are_float4_float2_or_single(data):
    try:
        spec = validate(data)
    except SpecError:
        return
    plan = build_plan(spec)
    if plan["engine"] == "ffma":
        assert plan["in_vec"] in (1, 2, 4), plan["in_vec"]
        if plan["in_vectors"]:  # whole vectors from an aligned start IN_LEAD before the first tap
            assert 0 <= plan["in_lead"] < plan["in_vec"]
            assert plan["in_vectors"] * plan["in_vec"] >= plan["in_lead"] + plan["conv_span"] > (plan["in_vectors"] - 1) * plan["in_vec"]
            assert plan["in"][2] % plan["in_vec"] == 0  # the row's length: each vector wholly in or out of it
        else:
            assert plan["in_vec"] <= max(plan["conv_span"], 1), plan["in_vec"]


# ---- planner settings: plan inputs, never a modified spec -------------------------------------------------

def test_planner_settings_change_the_plan_not_the_spec():
    from specgen.plan import Settings

    # (FFMA, whole: without its avg-pool fold, kb65 left to the planner splits before the pool)
    kb65 = load_specs(Path(__file__).resolve().parent.parent / "examples" / "kb65.yaml")[0]
    spec = validate({**kb65.model_dump(), "tile": {"tensor_cores": False}})
    base = build_plan(spec)
    assert base["rewrites"] and "planner settings" not in describe(base)
    plain = build_plan(spec, settings=Settings(rewrites=False))
    assert plain["rewrites"] == [] and plain["fold"] is None and plain["affine"] is None
    assert plain["spec_yaml"] == base["spec_yaml"]  # the banner shows the spec the user wrote
    assert "planner settings: no rewrites" in describe(plain)
    one = build_plan(spec, settings=Settings(min_blocks=1))
    assert one["min_blocks"] == 1 and one["spec_yaml"] == base["spec_yaml"]
    assert spec.tile.tensor_cores is False and spec.tile.min_blocks is None and spec.rewrites  # untouched
    assert build_plan(kb65, settings=Settings(rewrites=False))["engine"] == "sequence"


def test_a_tile_min_blocks_the_user_wrote_wins_over_the_setting():
    from specgen.plan import Settings

    spec = validate({"name": "mb", "input": {"channels": 16, "size": [20, 20]}, "conv": {"out_channels": 16, "kernel": 3},
                     "epilogue": ["relu"], "tile": {"min_blocks": 2}})
    assert build_plan(spec, settings=Settings(min_blocks=1))["min_blocks"] == 2


def test_the_spill_retry_keeps_the_users_spec_in_the_cache_key(monkeypatch):
    """pipeline._without_spills rebuilds with one block per SM as a setting: the request's spec JSON
    (the cache key's and `specgen cache ls`'s) is the user's, and so is the banner."""
    from specgen import pipeline

    spec = validate({"name": "sp", "input": {"channels": 8, "size": [64, 64]}, "conv": {"out_channels": 16, "kernel": 3},
                     "epilogue": ["relu"]})
    plan = build_plan(spec)
    assert plan["min_blocks"] > 1
    seen = []

    class Built:
        def __init__(self, spill_bytes):
            self.spill_bytes = spill_bytes

    def fake_build(req):
        seen.append(req)
        return Built(0)

    monkeypatch.setattr(pipeline.cache, "get_or_build", fake_build)
    out = pipeline._without_spills(pipeline.Specialized(spec, plan, render_plan(plan), Built(64)), None)
    assert len(seen) == 1 and seen[0].canonical_spec == spec.canonical_json()
    assert out.plan["min_blocks"] == 1 and out.spec is spec and out.build.spill_bytes == 0
    assert out.plan["spec_yaml"] == plan["spec_yaml"] and "min_blocks" not in out.plan["spec_yaml"]
    assert f"__launch_bounds__(THREADS, {plan['min_blocks']})" in render_plan(plan)
    assert f"__launch_bounds__(THREADS, {plan['min_blocks']})" not in seen[0].source


def _tf32_conv(cin, cout=64, kernel=3, **conv):
    return validate({"name": "e", "input": {"channels": cin, "size": [9] * (len(kernel) if isinstance(kernel, list) else 2)},
                     "conv": {"out_channels": cout, "kernel": kernel, **conv}, "epilogue": ["relu"], "precision": "tf32"})


@pytest.mark.parametrize("cin,cout,kernel,conv,exact", [
    (3, 64, 3, {}, True), (8, 64, 3, {}, True), (8, 64, [3, 3, 3], {}, True), (9, 64, 3, {}, False),
    (16, 64, 3, {}, False), (3, 64, 7, {"stride": 2, "padding": 3}, False),  # the stem: cuDNN in TF32 too
    (3, 16, 7, {}, True), (3, 16, [4, 4, 4], {}, True), (8, 64, 3, {"groups": 2}, False),
    (3, 64, 4, {"transposed": True, "stride": 2}, False),
])
def test_tf32_layers_of_few_input_channels_compute_in_fp32(cin, cout, kernel, conv, exact):
    """Measured: cuDNN runs such convs in fp32 in TF32 mode (benchmarks/NOTES.md v26)."""
    from specgen.plan import EXACT_TF32_NOTE, exact_tf32

    spec = _tf32_conv(cin, cout, kernel, **conv)
    assert exact_tf32(spec) is exact
    plan = build_plan(spec)
    assert plan["precision"] == ("fp32" if exact else "tf32")
    assert (EXACT_TF32_NOTE in plan["rewrites"]) is exact
    assert plan["spec_hash"] == spec.shape_hash  # the banner and key stay the user's tf32 spec
    if exact:
        source = render_plan(plan)
        assert "precision: tf32" in source and "TF32 wgmma" not in source
    other = spec.model_copy(update={"precision": "fp32"})
    assert not exact_tf32(other) and not exact_tf32(spec.model_copy(update={"precision": "bf16"}))


@pytest.mark.parametrize("arch,tile", [("sm_90", {"wgmma": False}), ("sm_80", None), ("sm_80", {"engine": "igemm"})])
def test_exact_tf32_layers_sum_each_k_step_apart_on_mma_sync(arch, tile):
    """mma.sync adds with truncation: a tf32 layer computed exactly sums each k-step's three
    products apart (measured on kb90's layer: rel. L2 7.9e-7 -> 8.3e-8); fp32 layers keep the faster
    running sum (its 7.9e-7 is well inside the fp32 bar of 1e-5). (On sm_90a the planner runs this
    slab on wgmma, with its own exact sums: tests/test_slab_wgmma.py; here it is pinned to mma.sync.)"""
    from specgen.target import BUILTIN

    data = {"name": "e", "input": {"channels": 8, "size": [6, 10, 12]}, "conv": {"out_channels": 64, "kernel": 3},
            "epilogue": ["relu"], **({"tile": tile} if tile else {})}
    exact = build_plan(validate({**data, "precision": "tf32"}), target=BUILTIN[arch])
    plain = build_plan(validate({**data, "precision": "fp32"}), target=BUILTIN[arch])
    assert exact["engine"] == plain["engine"] == ("igemm" if tile and tile.get("engine") else "slab")
    assert exact["engine"] == "igemm" or not exact["mma"].wgmma
    assert exact["settings"].exact_sums and not plain["settings"].exact_sums
    assert "acc[i][j][e] += part[e]" in render_plan(exact)
    assert "part[4]" not in render_plan(plain)
