"""Rendering: golden files, determinism, constant trip counts, readable banners (no GPU)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from specgen import __version__
from specgen.plan import build_plan
from specgen.render import TemplateError, render, render_plan
from specgen.spec import load_specs

ROOT = Path(__file__).resolve().parent.parent
SPECS = [s for path in sorted((ROOT / "examples").glob("*.yaml")) for s in load_specs(path)]
IDS = [s.name for s in SPECS]


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_generated_files_are_up_to_date(spec):
    golden = ROOT / "generated" / f"{spec.name}.cu"
    assert golden.is_file(), f"{golden} is missing: run `specgen build examples/*.yaml`"
    assert render(spec) == golden.read_text(), (
        f"{golden.name} is stale: the templates or the plan changed; run `specgen build examples/*.yaml`"
    )


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_rendering_is_byte_identical(spec):
    assert render(spec) == render(spec.model_validate(spec.canonical()))


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_banner_names_version_hash_and_spec(spec):
    text = render(spec)
    head = text.split("#include")[0]
    assert f"specgen {__version__}" in head
    assert spec.shape_hash in head
    assert f"name: {spec.name}" in head


LOOP = re.compile(r"for \(int (\w+) = ([^;]+); \1 (?:<|<=|>|>=) ([^;]+);")


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_every_loop_has_a_constant_trip_count(spec):
    text = render(spec)
    loops = LOOP.findall(text)
    assert loops, "no loops found: the pattern is stale"
    for var, start, bound in loops:
        # bounds are literals or named constexprs (UPPER_CASE, a GEMM's G::member, a stride phase's
        # Ph::MEMBER), never runtime values but the batch (which only a training-mode batch norm's
        # finalize kernel walks: its statistics span it, and a TMA block's walk over the batch's
        # tiles: tile_total, from the batch; and a wgmma slab block's walk over the batch's boxes,
        # from blockIdx.x, `SlabTiling.walk`)
        if var == "tile":
            assert bound == "tile_total" and "const int tile_total = (m_total + BM - 1) / BM * N_TILES;" in text
            continue
        if var == "item":
            assert start == "blockIdx.x" and bound == "batch * TILES_PER_SAMPLE"
            assert "const int TILES_PER_SAMPLE = TILES_D * TILES_H * TILES_W;" in text and "item += gridDim.x" in text
            continue
        assert re.fullmatch(r"(?:[A-Z0-9_ ()*/+\-]|batch|G::[a-z_]+|Ph::[A-Z_]+)+", bound), f"loop over {var} has a runtime bound: {bound}"
        assert re.fullmatch(r"(?:[A-Z0-9_ ()*/+\-]|Ph::[A-Z_]+)+", start), f"loop over {var} has a runtime start: {start}"
    assert "for (int e = threadIdx.x" not in text
    # a GEMM's members (the implicit-GEMM engine's G::...) are literals or named constexprs too
    for members in re.findall(r"static constexpr (?:int|size_t) ([^;]+);", text):
        for value in re.findall(r"= ([^,]+)", members):
            assert re.fullmatch(r"-?[A-Z0-9_]+", value.strip()), f"a GEMM member is not a constant: {members}"


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_kernel_parameters_are_pointers_and_the_batch(spec):
    text = render(spec)
    signatures = re.findall(rf"extern \"C\" __global__ void .* specgen_{spec.name}(?:_body|_e\d+_\w+)?\(([^)]*)\)", text)
    assert signatures  # one kernel, or a sequence's (specgen/tail.py)
    tma = build_plan(spec)["engine"] == "tma"
    for signature in signatures:
        params = [re.sub(r"//.*", "", p).strip() for p in signature.split("\n")]
        params = [p.rstrip(",") for p in params if p]
        assert params[-1] == "int batch"
        pointers = params[:-1]
        maps = [p for p in pointers if p.startswith("const __grid_constant__ TensorMap ")]
        assert pointers[: len(maps)] == maps and (maps or not tma), params  # Hopper's engine: tensor maps first
        pointers = pointers[len(maps):]
        assert all(re.fullmatch(r"(const )?(float|__nv_bfloat16|__half)\* __restrict__ \w+", p) for p in pointers), params


def test_constants_are_named_with_comments():
    text = render(SPECS[[s.name for s in SPECS].index("kb90")])
    assert "constexpr float S0_NEGATIVE_SLOPE = 0.2f;  // epilogue[0] leaky_relu negative_slope = 0.2" in text
    assert "constexpr int C_IN = 8;  // input channels" in text
    assert "constexpr int OUT_PER_SAMPLE = 3444224;" in text


def test_avg_pool_fold_is_reported(monkeypatch):
    from specgen import boxfold
    from specgen.spec import TileSpec

    monkeypatch.setattr(boxfold, "ENABLED", True)

    kb65 = SPECS[[s.name for s in SPECS].index("kb65")]
    assert build_plan(kb65)["rewrites"][0].startswith("box fold")  # left to the planner: the box fold (specgen.boxfold)
    plan = build_plan(kb65.model_copy(update={"tile": TileSpec(engine="slab")}))  # one kernel
    assert plan["rewrites"] and "avg-pool fold" in plan["rewrites"][0]
    assert plan["kernel"][1:] == (6, 6) and plan["stride"][1:] == (4, 4)
    # (left to the planner, an unfolded pool would split the layer in two: pinned whole here)
    unfolded = build_plan(kb65.model_copy(update={"rewrites": False, "tile": TileSpec(engine="ffma")}))
    assert not unfolded["rewrites"] and unfolded["kernel"][1:] == (3, 3)
    assert unfolded["flops_per_sample"] == 4 * plan["flops_per_sample"]


def test_template_errors_name_the_template_line():
    plan = dict(build_plan(next(s for s in SPECS if s.name == "kb90")))  # (a plain dict: a KernelPlan lacks no field)
    del plan["box"]
    with pytest.raises(TemplateError, match=r"\.cu\.j2:\d+: UndefinedError: .*box"):
        render_plan(plan)


ENGINE_EXAMPLES = {"slab": "kb90", "ffma": "depthwise3x3_144_relu6", "igemm": "conv1x1_256_64_relu", "tma": "conv3x3_64_56_relu"}


@pytest.mark.parametrize("engine", sorted(ENGINE_EXAMPLES))
def test_each_engine_renders_from_its_own_template(engine, monkeypatch):
    from specgen.render import TEMPLATES, environment

    plan = build_plan(next(s for s in SPECS if s.name == ENGINE_EXAMPLES[engine]))
    assert plan["engine"] == engine and TEMPLATES[engine] == f"{engine}.cu.j2"
    env, asked = environment(), []
    get_template = env.get_template
    monkeypatch.setattr(env, "get_template", lambda name, *a, **kw: asked.append(name) or get_template(name, *a, **kw))
    render_plan(plan)
    assert asked[0] == f"{engine}.cu.j2", asked
    if engine in ("slab", "ffma"):  # both extend the box kernel, and nothing there switches on the engine
        assert "box.cu.j2" in asked, asked
        for name in ("box.cu.j2", f"{engine}.cu.j2"):
            source = env.loader.get_source(env, name)[0]
            assert not re.search(r"\{%-?\s*(el)?if\s+(not\s+)?mma(\s+and\s+[^%]*)?\s*-?%\}", source), name


def test_an_unknown_engine_has_no_template():
    plan = dict(build_plan(next(s for s in SPECS if s.name == "kb90")))
    plan["engine"] = "warp_specialized"
    with pytest.raises(TemplateError, match="no template for the engine 'warp_specialized'"):
        render_plan(plan)


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_the_reference_compiles_without_graph_breaks(spec):
    """`specgen bench` compares against torch.compile of the reference: it must be one graph."""
    torch = pytest.importorskip("torch")
    import torch._dynamo as dynamo

    from specgen.reference import Reference

    model = Reference(spec)
    x = torch.randn(1, spec.input.channels, *spec.input.size)
    dynamo.reset()
    assert dynamo.explain(model)(x).graph_break_count == 0


# ---- user names never collide with the template's own names --------------------------------------

def _template_identifiers() -> set[str]:
    from specgen.expr import IDENTIFIER, RESERVED
    from specgen.spec import RESERVED_PARAM_NAMES

    words = set()
    for path in (ROOT / "templates").glob("*.j2"):
        code = re.sub(r"\{#.*?#\}|/\*.*?\*/", " ", path.read_text(), flags=re.S)  # comments are no names
        code = re.sub(r"//[^\n]*", " ", code)
        words |= set(re.findall(r"\b[A-Za-z_][A-Za-z0-9_]*\b", code))
    # A parameter `name` is spelled p_<name> in the kernel: `ok` meets a local p_ok.
    names = words | {w[2:] for w in words if w.startswith("p_")}
    return {n for n in names if IDENTIFIER.match(n) and n not in RESERVED and n not in RESERVED_PARAM_NAMES}


def _with_params(base: dict, names: list[str]) -> dict:
    """`base` with every name added as a per-channel parameter: in expr stages of up to 500
    characters, or (Python keywords, which expr cannot parse) one `add: {param: name}` each."""
    import keyword

    stages, text = [], "x"
    for name in names:
        if keyword.iskeyword(name):
            stages.append({"add": {"param": name}})
            continue
        if len(text) + len(name) + 3 > 500:
            stages.append({"expr": text})
            text = "x"
        text += " + " + name
    stages.append({"expr": text})
    return {**base, "epilogue": [*stages, *base.get("epilogue", [])]}


COLLISION_BASES = [
    # tensor cores, stored straight to the output (the engine with a local once named p_ok)
    {"name": "names_mma", "input": {"channels": 8, "size": [8, 16]}, "conv": {"out_channels": 32, "kernel": 3},
     "epilogue": [{"leaky_relu": {"negative_slope": 3.4028234e38}}]},
    # fp32 FFMA with a pool
    {"name": "names_ffma", "input": {"channels": 2, "size": [12, 12]}, "conv": {"out_channels": 4, "kernel": 3},
     "epilogue": [{"max_pool": 2}, {"clamp": {"min": -3.4028234e38, "max": 3.4028234e38}}]},
    # Hopper's TMA engine (its epilogue reads each channel's parameters into pc_<name> first)
    {"name": "names_tma", "input": {"channels": 64, "size": [16, 16]}, "conv": {"out_channels": 64, "kernel": 3},
     "precision": "tf32", "epilogue": ["relu"]},
    # a reduction tail
    {"name": "names_tail", "input": {"channels": 4, "size": [10, 10]}, "conv": {"out_channels": 8, "kernel": 3},
     "epilogue": [{"logsumexp": {"dims": [1]}}, {"sum": {"dims": [1, 2]}}]},
]


def test_param_names_equal_to_every_template_identifier_render():
    from specgen.spec import validate

    names = sorted(_template_identifiers())
    assert {"ok", "acc", "v", "c", "w_s"} <= set(names)
    for base in COLLISION_BASES:
        spec = validate(_with_params(base, names))
        assert set(names) <= set(spec.params())
        source = render(spec)
        assert "p_ok," in source or "p_ok)" in source


@pytest.mark.nvcc
@pytest.mark.parametrize("base", COLLISION_BASES, ids=[b["name"] for b in COLLISION_BASES])
def test_param_names_equal_to_every_template_identifier_compile(base):
    from specgen import compile as nvcc
    from specgen.spec import validate

    spec = validate(_with_params(base, sorted(_template_identifiers())))
    ptx = nvcc.compile_ptx(render(spec), "sm_90a")  # raises CompileError with the log on a collision (sm_90a: wgmma)
    assert f".entry specgen_{spec.name}" in ptx


# ---- the source stays small: each sub-expression written once; a cap on the rest ------------------

NESTED_POWERS = "(((((((sigmoid(exp(x)) ** 4) ** 4) ** 4) ** 4) ** 4) ** 4) ** 4)"  # 4^7 copies, spelled out


def _expr_spec(code: str) -> dict:
    return {"name": "powers", "input": {"channels": 2, "size": [16]}, "conv": {"out_channels": 2, "kernel": 3},
            "epilogue": [{"expr": code}]}


def test_nested_powers_write_their_base_once():
    from specgen.spec import validate

    sizes = [len(render(validate(_expr_spec(NESTED_POWERS.replace("** 4", "** 2", k))))) for k in (0, 7)]
    source = render(validate(_expr_spec(NESTED_POWERS)))
    assert len(source) < 40_000, len(source)  # spelled out: about 20 MB
    assert source.count("expf(-(expf(") == 1  # sigmoid(exp(x)) appears once
    assert sizes[1] - sizes[0] < 2_000  # each power adds a constant amount, not a copy of its base


def test_powers_multiply_in_the_reference_order():
    from specgen.expr import parse

    code = parse("(x + 1) ** 3 - x ** 2").to_cuda("v", {})
    assert "return t * t * t;" in code and "return t * t;" in code and code.count("(v + 1.0f)") == 1


def test_a_source_over_the_cap_is_refused_with_the_numbers(monkeypatch):
    from specgen import render as render_mod
    from specgen.spec import SpecError, validate

    spec = validate(_expr_spec("x * 2"))
    size = len(render(spec).encode())
    monkeypatch.setattr(render_mod, "MAX_SOURCE_BYTES", size - 1)
    with pytest.raises(SpecError, match=rf"the kernel source would be {size} bytes, more than specgen's limit of {size - 1}"):
        render(spec)


@pytest.mark.nvcc
def test_nested_powers_compile():
    from specgen import compile as nvcc
    from specgen.spec import validate

    ptx = nvcc.compile_ptx(render(validate(_expr_spec(NESTED_POWERS))), "sm_90")
    assert ".entry specgen_powers" in ptx


def test_the_banner_prints_no_unset_fields():
    from specgen.spec import validate

    spec = validate({**_expr_spec("x * 2"), "epilogue": [{"add": {"param": "shift"}}, {"clamp": {"max": 1.0}}]})
    banner = render(spec).split("How this kernel works")[0]
    assert "add: {param: shift}" in banner and "clamp: {max: 1.0}" in banner and "null" not in banner
    assert "spec hash: " + spec.shape_hash in banner and "cache key" in banner


def test_which_plans_have_a_run_time_dimensions_rendering():
    """`specgen bench` adds the run-time-dimensions row only where every kernel of the plan has that
    rendering: the FFMA and slab engines, a sequence of them, not the GEMM engines nor a statistic
    stage's kernels (a training batch norm after an FFMA body)."""
    from specgen.render import has_runtime_dims
    from specgen.spec import validate

    def plan_of(epilogue, cin=8, cout=16, size=(32, 32), **tile):
        return build_plan(validate({"name": "rt", "precision": "fp32", "input": {"channels": cin, "size": list(size)},
                                    "conv": {"out_channels": cout, "kernel": 3}, "epilogue": epilogue,
                                    **({"tile": tile} if tile else {})}))

    ffma = plan_of(["relu"], engine="ffma")
    assert ffma["engine"] == "ffma" and has_runtime_dims(ffma)
    assert "__constant__ int C_IN" in render_plan(ffma, runtime_dims=True)
    gemm = plan_of(["relu"], cin=64, cout=128, size=(56, 56), engine="igemm")
    assert gemm["engine"] == "igemm" and not has_runtime_dims(gemm)
    with pytest.raises(TemplateError, match=r"igemm.cu.j2 \(the igemm engine\): no run-time-dimensions rendering"):
        render_plan(gemm, runtime_dims=True)
    stats = plan_of([{"batch_norm": {"training": True}}])
    roles = [(p.role, p.plan.get("engine")) for p in stats.parts]
    assert roles == [("body", "ffma"), ("tail", None)] and not has_runtime_dims(stats)
    with pytest.raises(TemplateError, match="tail.cu.j2"):
        render_plan(stats, runtime_dims=True)
