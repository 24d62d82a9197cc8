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
        # bounds are literals or named constexprs (UPPER_CASE), never runtime values
        assert re.fullmatch(r"[A-Z0-9_ ()*/+\-]+", bound), f"loop over {var} has a runtime bound: {bound}"
        assert re.fullmatch(r"[A-Z0-9_ ()*/+\-]+", start), f"loop over {var} has a runtime start: {start}"
    assert "for (int e = threadIdx.x" not in text


@pytest.mark.parametrize("spec", SPECS, ids=IDS)
def test_kernel_parameters_are_pointers_and_the_batch(spec):
    text = render(spec)
    signature = re.search(rf"specgen_{spec.name}\(([^)]*)\)", text).group(1)
    params = [re.sub(r"//.*", "", p).strip() for p in signature.split("\n")]
    params = [p.rstrip(",") for p in params if p]
    assert params[-1] == "int batch"
    assert all(re.fullmatch(r"(const )?float\* __restrict__ \w+", p) for p in params[:-1]), params


def test_constants_are_named_with_comments():
    text = render(SPECS[[s.name for s in SPECS].index("kb90")])
    assert "constexpr float S0_NEGATIVE_SLOPE = 0.2f;  // epilogue[0] leaky_relu negative_slope = 0.2" in text
    assert "constexpr int C_IN = 8;  // input channels" in text
    assert "constexpr int OUT_PER_SAMPLE = 3444224;" in text


def test_avg_pool_fold_is_reported():
    kb65 = SPECS[[s.name for s in SPECS].index("kb65")]
    plan = build_plan(kb65)
    assert plan["rewrites"] and "avg-pool fold" in plan["rewrites"][0]
    assert plan["kernel"][1:] == (6, 6) and plan["stride"][1:] == (4, 4)
    unfolded = build_plan(kb65.model_copy(update={"rewrites": False}))
    assert not unfolded["rewrites"] and unfolded["kernel"][1:] == (3, 3)
    assert unfolded["flops_per_sample"] == 4 * plan["flops_per_sample"]


def test_template_errors_name_the_template_line():
    plan = build_plan(SPECS[0])
    del plan["box"]
    with pytest.raises(TemplateError, match=r"\.cu\.j2:\d+: UndefinedError: .*box"):
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
