"""The op table: every op's meaning is one row of specgen.ops, and the templates know no op by name (no GPU)."""

from __future__ import annotations

import dataclasses

import pytest

from specgen import ops
from specgen.plan import build_plan
from specgen.render import render, render_plan
from specgen.spec import validate


def layer(*epilogue, size=(12, 12)) -> dict:
    return {
        "name": "ops_table",
        "input": {"channels": 4, "size": list(size)},
        "conv": {"out_channels": 8, "kernel": 3},
        "epilogue": list(epilogue),
    }


# ---- reductions -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(ops.REDUCTIONS))
def test_every_reduction_row_has_all_its_cuda(name):
    snippets = ops.REDUCTIONS[name].cuda()
    assert set(snippets) == {"init", "fold", "merge", "finalize"}
    assert "%(v)s" in snippets["fold"] and "%(a)s" in snippets["fold"]
    assert "%(a2)s" in snippets["merge"] and "%(a)s" in snippets["merge"]
    assert "%(a)s" in snippets["finalize"]


def test_a_reduction_without_a_merge_is_an_error_at_render_time(monkeypatch):
    no_merge = dataclasses.replace(ops.REDUCTIONS["sum"], merge=None)
    monkeypatch.setitem(ops.REDUCTIONS, "sum", no_merge)
    with pytest.raises(ops.OpTableError) as err:
        render(validate(layer("relu", {"sum": {"dims": [1]}})))
    message = str(err.value)
    assert "reduction 'sum'" in message and "merge" in message and "fold" not in message.split(":")[0]


def test_a_reduction_without_a_finalize_is_an_error_at_render_time(monkeypatch):
    monkeypatch.setitem(ops.REDUCTIONS, "amax", dataclasses.replace(ops.REDUCTIONS["amax"], finalize=""))
    with pytest.raises(ops.OpTableError, match="reduction 'amax' has no CUDA finalize"):
        render(validate(layer({"amax": {"dims": [2, 3]}})))


def test_the_tail_uses_the_rows_cuda_and_nothing_else(monkeypatch):
    # A row with its own spellings: the kernel must fold, merge and finalize with them (the
    # template once fell through to fminf for any reduction it did not know).
    row = ops.Reduction(
        "amin",
        ops.REDUCTIONS["amin"].torch_ref,
        init="FAKE_INIT",
        fold="fake_fold(%(a)s, %(b)s, %(v)s);",
        merge="fake_merge(%(a)s, %(b)s, %(a2)s, %(b2)s);",
        finalize="fake_value(%(a)s, %(b)s, %(count)s)",
        helpers="// fake helpers",
        note=" (fake pair)",
    )
    monkeypatch.setitem(ops.REDUCTIONS, "amin", row)
    plan = build_plan(validate(layer({"amin": {"dims": [1]}})))
    text = render_plan(plan)
    assert "a1[k] = FAKE_INIT;" in text
    assert "fake_fold(a1[k], b1[k], v);" in text
    assert "fake_merge(" in text and "fminf" not in text.split("// fake helpers")[1]
    assert "fake_value(a1[k], b1[k], R1_COUNT)" in text
    assert text.count("// fake helpers") == 1
    assert "// accumulator (fake pair)" in text
    # the finalize names the count, so the plan emits it
    assert "R1_COUNT = 8.0f" in text


def test_helpers_are_emitted_once_per_kernel():
    text = render(validate(layer({"logsumexp": {"dims": [1], "keepdim": True}}, {"logsumexp": {"dims": [2, 3]}})))
    assert text.count("__device__ __forceinline__ void lse_merge(") == 1
    assert "lse_merge(" in text.split("lse_value(float m")[1]


def test_only_a_finalize_that_uses_the_count_gets_one():
    # (after a relu: a mean right after the conv folds before it, specgen.tapsum)
    assert "R1_COUNT" in render(validate(layer("relu", {"mean": {"dims": [2, 3]}})))
    assert "R1_COUNT" not in render(validate(layer("relu", {"sum": {"dims": [2, 3]}})))


# ---- pools ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(ops.POOLS))
def test_every_pool_row_has_all_its_cuda(name):
    pool = ops.POOLS[name]
    assert set(pool.cuda()) == {"init", "combine", "finalize"}
    assert pool.global_reduction().name in ops.REDUCTIONS


def test_a_pool_without_a_combine_is_an_error_at_render_time(monkeypatch):
    monkeypatch.setitem(ops.POOLS, "max_pool", dataclasses.replace(ops.POOLS["max_pool"], combine=None))
    with pytest.raises(ops.OpTableError, match="pool 'max_pool' has no CUDA combine"):
        render(validate(layer({"max_pool": 2}, "relu")))


def test_a_global_pool_naming_no_reduction_is_an_error(monkeypatch):
    bad = dataclasses.replace(ops.POOLS["global_max_pool"], reduction="nope")
    monkeypatch.setitem(ops.POOLS, "global_max_pool", bad)
    with pytest.raises(ops.OpTableError, match="'global_max_pool' names reduction 'nope'"):
        render(validate(layer("global_max_pool")))


def test_the_pool_level_uses_the_rows_cuda(monkeypatch):
    row = dataclasses.replace(
        ops.POOLS["max_pool"], init="FAKE_START", combine="fake_combine(%(acc)s, %(v)s)", finalize="fake_end(%(acc)s, %(count)s)"
    )
    monkeypatch.setitem(ops.POOLS, "max_pool", row)
    text = render(validate(layer({"max_pool": 2}, "relu")))
    assert "acc[j][i] = FAKE_START;" in text
    assert "acc[j][i] = fake_combine(acc[j][i], u[j][i]);" in text
    assert "float v = fake_end(acc[j][i], L1_WINDOW);" in text
    assert "fmaxf(acc[j][i], u[j][i])" not in text


def test_a_global_pool_at_the_end_is_computed_as_its_rows_reduction(monkeypatch):
    monkeypatch.setitem(ops.POOLS, "global_avg_pool", dataclasses.replace(ops.POOLS["global_avg_pool"], reduction="sum"))
    plan = build_plan(validate(layer("relu", "global_avg_pool")))  # (relu: no tap-sum fold)
    assert [r["op"] for r in plan["reductions"]] == ["sum"]


# ---- the affine fold ----------------------------------------------------------------------------


def test_the_affine_ops_are_the_rows_with_an_affine_column():
    assert {n for n, row in ops.POINTWISE.items() if row.affine is not None} == {"add", "sub", "mul", "div"}


@pytest.mark.parametrize(
    "op, value, expected",
    [("mul", 3.0, (6.0, 1.5)), ("div", 4.0, (0.5, 0.125)), ("add", 0.25, (2.0, 0.75)), ("sub", 0.25, (2.0, 0.25)), ("div", 0.0, None)],
)
def test_affine_composes_onto_scale_and_shift(op, value, expected):
    row = ops.POINTWISE[op]
    assert row.affine(row.args.model_validate(value), 2.0, 0.5) == expected


def test_a_per_channel_operand_is_not_affine():
    row = ops.POINTWISE["mul"]
    assert row.affine(row.args.model_validate("scale"), 1.0, 0.0) is None


def test_the_fold_reads_the_affine_column(monkeypatch):
    spec = validate(layer({"mul": 2.0}, "relu"))
    assert build_plan(spec)["affine"]["scale"] == 2.0
    monkeypatch.setitem(ops.POINTWISE, "mul", dataclasses.replace(ops.POINTWISE["mul"], affine=None))
    assert build_plan(spec)["affine"] is None
    # and an op the table marks affine folds, whatever its name
    relu = dataclasses.replace(ops.POINTWISE["relu"], affine=lambda a, s, t: (s * 3.0, t))
    monkeypatch.setitem(ops.POINTWISE, "relu", relu)
    assert build_plan(validate(layer("relu")))["affine"]["scale"] == 3.0


# ---- expr's functions against the pointwise table ------------------------------------------------


def test_expr_functions_agree_with_the_pointwise_rows_that_name_them():
    named = {row.expr_function for row in ops.POINTWISE.values() if row.expr_function}
    assert named == {"relu", "sigmoid", "tanh", "min", "max", "clamp"}
    assert ops.expr_function_mismatches() == []


def test_a_diverging_expr_spelling_is_caught(monkeypatch):
    from specgen import expr

    monkeypatch.setitem(expr.FUNCTIONS, "relu", (1, "fmaxf({0}, 1.0f)", "relu"))
    monkeypatch.setitem(expr.FUNCTIONS, "max", (2, "fmaxf({0}, {1})", "minimum"))
    monkeypatch.setattr(expr, "_compiled", {})  # torch closures are memoized by text
    problems = ops.expr_function_mismatches()
    assert len(problems) == 2
    assert "pointwise 'relu' / expr function 'relu': CUDA 'fmaxf({0}, 0.0f)' != 'fmaxf({0}, 1.0f)'" in problems
    assert any(p.startswith("pointwise 'max' / expr function 'max': PyTorch") for p in problems)


def test_a_wrong_arity_is_caught(monkeypatch):
    rows = [dataclasses.replace(r, expr_operands=("min",)) if r.name == "clamp" else r for r in ops._POINTWISE_ROWS]
    monkeypatch.setattr(ops, "_POINTWISE_ROWS", rows)
    assert ops.expr_function_mismatches() == ["pointwise 'clamp' / expr function 'clamp': expr takes 3 argument(s), the row gives 1 + 1"]


def test_comparisons_are_one_or_zero_and_where_selects():
    torch = pytest.importorskip("torch")
    from specgen.expr import parse

    e = parse("where(x > 0, x, 0.2 * x) + (x <= a) * 3")
    assert e.params == ("a",)
    code = e.to_cuda("v", {"a": "pa"})
    assert "(v > 0.0f ? 1.0f : 0.0f)" in code and "!= 0.0f ? (v) : ((0.2f * v))" in code and "(v <= pa ? 1.0f : 0.0f)" in code
    x = torch.tensor([-2.0, -0.5, 0.0, 1.5, float("nan")])
    a = torch.tensor(0.0)
    got = e.to_torch(x, {"a": a})
    want = torch.where(x > 0, x, 0.2 * x) + (x <= a).float() * 3
    assert torch.equal(got[:4], want[:4]) and torch.isnan(got[4])  # NaN compares false: the other branch
    assert parse("x * (x >= 1)").to_torch(torch.tensor([0.5, 1.0, 2.0]), {}).tolist() == [0.0, 1.0, 2.0]
    assert parse("where(x < 1, 1, x)").to_torch(torch.tensor([0.5, 3.0]), {}).tolist() == [1.0, 3.0]


def test_tanh_of_softplus_is_one_exp_and_a_division():
    """mish written out (tanh(softplus(x)) * x, as KernelBench 52 writes it) gets mish's cheap form:
    tanh(log1p(e)) = n / (n + 2), n = e (e + 2), e = exp(x); checked here in float32 on a sweep
    against float64 (the relative error stays at a few float32 roundings, as PyTorch's own)."""
    torch = pytest.importorskip("torch")
    from specgen.expr import parse

    code = parse("tanh(softplus(x)) * x").to_cuda("v", {})
    assert code.count("expf") == 1 and "tanhf" not in code and "log1pf" not in code and "20.0f" in code
    assert parse("tanh(x) + softplus(x)").to_cuda("v", {}).count("tanhf") == 1  # only the composition
    t = torch.linspace(-80, 25, 400001, dtype=torch.float32)
    e = torch.exp(t)
    n = e * (e + 2)
    got = torch.where(t > 20, torch.ones_like(t), n / (n + 2))
    want = torch.tanh(torch.nn.functional.softplus(t.double()))
    torch_own = torch.tanh(torch.nn.functional.softplus(t))
    rel = ((got.double() - want).abs() / want.abs()).max().item()
    rel_torch = ((torch_own.double() - want).abs() / want.abs()).max().item()
    assert rel < 1e-6 and rel <= 2 * rel_torch + 1e-7, (rel, rel_torch)


# ---- the exact GELU of a bounded value ----------------------------------------------------------

@pytest.mark.parametrize("before,bounded", [
    ({"clamp": {"min": -1.0, "max": 1.0}}, True),  # KernelBench 90's chain
    ({"hardtanh": {"min_val": -1.4, "max_val": 0.5}}, True),
    ("tanh", True),
    ("sigmoid", True),
    ({"clamp": {"min": -2.0, "max": 1.0}}, False),  # past sqrt(2): outside the fit
    ({"clamp": {"max": 1.0}}, False),  # one bound only
    ("relu", False),
])
def test_a_gelu_after_a_bounding_stage_is_a_polynomial(before, bounded):
    """The stage before an exact GELU bounds |x| to sqrt(2) or less: the GELU is x/2 + x^2 R(x^2)
    (ops.GELU_BOUNDED_R, its coefficients named constants), not erff."""
    text = render_plan(build_plan(validate(layer(before, "gelu"))))
    gelu = next(line for line in text.splitlines() if "gelu (approximate='none'" in line and "v = " in line)
    assert ("erff(" not in gelu and "S1_R5" in gelu) == bounded, gelu
    assert ("constexpr float S1_R0 = " in text) == bounded
    tanh_form = render_plan(build_plan(validate(layer(before, {"gelu": {"approximate": "tanh"}}))))
    assert "S1_R0" not in tanh_form and "tanhf(0.797884560802865356f" in tanh_form


@pytest.mark.nvcc
def test_the_bounded_gelu_is_as_close_to_gelu_as_float32_allows(tmp_path):
    """The polynomial as specgen emits it (same text, same constants) and the erff form, compiled by
    nvcc as host code (fmaf and float multiplies round there as on the GPU), on 2^20 + 1 points over
    |x| <= sqrt(2), against the float64 GELU: the polynomial stays within 1e-6 relative (a tenth of
    fp32 mode's bar on the whole output) and twice the erff form's absolute error."""
    import subprocess

    from specgen.compile import find_nvcc
    from specgen.literals import c_float

    names = [f"R{i}" for i in range(len(ops.GELU_BOUNDED_R))]
    consts = "\n".join(f"constexpr float {n} = {c_float(v)};" for n, v in zip(names, ops.GELU_BOUNDED_R))
    source = f"""#include <cmath>
#include <cstdio>
{consts}
static float poly(float v) {{ return {ops.gelu_bounded_code("v", names)}; }}
static float with_erff(float v) {{ return 0.5f * v * (1.0f + erff(v * 0.707106781186547524f)); }}
int main() {{
  const int n = 1 << 20;
  const double bound = {ops.GELU_BOUNDED_MAX!r};
  double worst[2][2] = {{{{0, 0}}, {{0, 0}}}};  // [form][relative, absolute]
  for (int i = 0; i <= n; ++i) {{
    const float x = static_cast<float>(-bound + 2.0 * bound * i / n);
    if (std::fabs(static_cast<double>(x)) > bound) continue;
    const double want = 0.5 * x * (1.0 + std::erf(x / std::sqrt(2.0)));
    const float got[2] = {{poly(x), with_erff(x)}};
    for (int f = 0; f < 2; ++f) {{
      const double err = std::fabs(got[f] - want);
      if (want != 0.0 && err / std::fabs(want) > worst[f][0]) worst[f][0] = err / std::fabs(want);
      if (err > worst[f][1]) worst[f][1] = err;
    }}
  }}
  std::printf("%.3e %.3e %.3e %.3e\\n", worst[0][0], worst[0][1], worst[1][0], worst[1][1]);
}}
"""
    (tmp_path / "gelu.cu").write_text(source)
    subprocess.run([find_nvcc(), "-O2", "-Xcompiler", "-ffp-contract=off", "gelu.cu", "-o", "gelu"], cwd=tmp_path,
                   check=True, capture_output=True, timeout=300)
    run = subprocess.run([str(tmp_path / "gelu")], check=True, capture_output=True, text=True, timeout=60)
    poly_rel, poly_abs, erff_rel, erff_abs = map(float, run.stdout.split())
    assert poly_rel <= 1e-6 and poly_abs <= 2 * erff_abs, run.stdout


@pytest.mark.nvcc
def test_comparisons_where_log1p_and_expm1_compile(tmp_path, monkeypatch):
    from specgen import pipeline
    from specgen.spec import validate

    monkeypatch.setenv("SPECGEN_CACHE_DIR", str(tmp_path / "cache"))
    spec = validate({"name": "where_expr", "input": {"channels": 8, "size": [12, 12]}, "conv": {"out_channels": 32, "kernel": 3},
                     "epilogue": [{"expr": "where(x > 0, x, 0.2 * x) * (x <= t) + log1p(abs(x)) - expm1(-abs(x))"}],
                     "precision": "tf32"})
    item = pipeline.specialize(spec, "sm_90", tuned=False)
    assert item.build.registers > 0 and item.build.spill_bytes == 0, item.build.log
    assert "? 1.0f : 0.0f" in item.source and "!= 0.0f ?" in item.source
    assert "log1pf(" in item.source and "expm1f(" in item.source
