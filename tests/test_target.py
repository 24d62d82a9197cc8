"""The target GPU as data: built-in targets, refusals, how plans adapt, and `build --arch` per arch.

The plan checks run every example on every built-in target without a compiler; the nvcc tests
compile a few specs per arch (one per engine and feature that depends on the target) and check
the refusals exit 2 without compiling anything.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from specgen import pipeline, target as targets
from specgen.plan import build_plan
from specgen.render import render, render_plan
from specgen.spec import SpecError, load_specs
from specgen.target import TargetError

ROOT = Path(__file__).resolve().parent.parent
SPECS = {s.name: s for path in sorted((ROOT / "examples").glob("*.yaml")) for s in load_specs(path)}
ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90", "sm_100")
NO_CLUSTERS = ("sm_80", "sm_86", "sm_89")
CLUSTER_CODE = ("cooperative_groups", "cg::", "__cluster_dims__", "cluster.sync", "map_shared_rank")


def one_kernel(spec):
    """`spec` pinned to the slab engine: kb65 as one kernel (the avg-pool fold), not the box fold's sequence."""
    from specgen.spec import TileSpec

    return spec.model_copy(update={"tile": TileSpec(engine="slab")})


# ---- the built-in targets ---------------------------------------------------------------------


def test_builtin_targets_hold_the_documented_limits():
    kb = 1024
    expected = {  # arch: (per block, per SM, portable cluster, clusters)
        "sm_80": (163 * kb, 164 * kb, 0, False),
        "sm_86": (99 * kb, 100 * kb, 0, False),
        "sm_89": (99 * kb, 100 * kb, 0, False),
        "sm_90": (227 * kb, 228 * kb, 8, True),
        "sm_90a": (227 * kb, 228 * kb, 8, True),
        "sm_100": (227 * kb, 228 * kb, 8, True),
    }
    assert set(targets.BUILTIN) == set(expected)
    for arch, (block, sm, cluster, has_clusters) in expected.items():
        t = targets.get(arch)
        assert (t.arch, t.smem_per_block, t.smem_per_sm, t.max_cluster, t.has_clusters) == (arch, block, sm, cluster, has_clusters)
        assert t.regs_per_sm == 65536 and t.max_threads == 1024 and t.has_cp_async and t.sm_count is None
    assert targets.get("sm_90a").has_wgmma and not targets.get("sm_90").has_wgmma
    assert targets.get("sm_90").cluster_limit_at_launch == 16 and targets.get("sm_80").cluster_limit_at_launch == 1
    assert targets.DEFAULT is targets.get("sm_90")


@pytest.mark.parametrize("arch, words", [
    ("sm_75", "older than sm_80"), ("sm_70", "older than sm_80"), ("sm_120", "no target for sm_120"),
    ("sm90", "expected an arch like"), (90, "expected an arch like"),
])
def test_unusable_archs_are_refused_in_one_line(arch, words):
    with pytest.raises(TargetError) as err:
        targets.get(arch)
    assert words in str(err.value) and "\n" not in str(err.value)
    assert isinstance(err.value, SpecError)  # callers that fall back on bad specs fall back here too


def test_the_current_gpu_target_takes_the_device_limits(monkeypatch):
    reported = {"major": 8, "minor": 6, "sm_count": 84, "smem_per_block": 99 * 1024, "smem_per_sm": 100 * 1024}
    monkeypatch.setattr(targets, "device_attributes", lambda: reported)
    targets.current.cache_clear()
    try:
        t = targets.resolve(None)
        assert (t.arch, t.sm_count, t.has_clusters) == ("sm_86", 84, False)
        reported.update(major=7, minor=5)
        targets.current.cache_clear()
        with pytest.raises(TargetError, match="GPU 0: sm_75 is older than sm_80"):
            targets.resolve(None)
        monkeypatch.setattr(targets, "device_attributes", lambda: None)
        targets.current.cache_clear()
        assert targets.resolve(None) is targets.DEFAULT  # no GPU: the built-in sm_90
    finally:
        targets.current.cache_clear()


# ---- plans adapt to the target -----------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_every_example_plans_within_the_target(arch):
    t = targets.get(arch)
    for spec in SPECS.values():
        plan = build_plan(spec, target=t)
        assert plan["smem_bytes"] <= t.smem_per_block, spec.name
        assert plan["cluster"] <= t.cluster_limit_at_launch, spec.name
        source = render_plan(plan)
        assert f"// target: {t.summary()}\n" in source.split("#include")[0], spec.name
        if arch in NO_CLUSTERS:
            assert plan["cluster"] == 1 and not plan["cluster_at_launch"], spec.name
            assert not any(code in source for code in CLUSTER_CODE), spec.name


def test_clusters_are_used_where_the_target_has_them():
    # the same specs join partials in clusters on sm_90: the no-cluster path above is the target's doing
    kb65_90 = build_plan(one_kernel(SPECS["kb65"]), target=targets.get("sm_90"))
    assert kb65_90["cluster_at_launch"] and kb65_90["cluster"] == 16
    lse_90 = build_plan(SPECS["conv2d_leaky_scale_lse_all"], target=targets.get("sm_90"))
    assert lse_90["cluster"] == 8 and "__cluster_dims__" in render_plan(lse_90)
    lse_80 = build_plan(SPECS["conv2d_leaky_scale_lse_all"], target=targets.get("sm_80"))
    assert lse_80["chunk_iters"] == lse_90["chunk_iters"] * 8  # one block walks the cluster's boxes


def test_less_shared_memory_gives_smaller_boxes_and_pipelines():
    kb65_86 = build_plan(one_kernel(SPECS["kb65"]), target=targets.get("sm_86"))
    kb65_90 = build_plan(one_kernel(SPECS["kb65"]), target=targets.get("sm_90"))
    assert kb65_90["smem_bytes"] > targets.get("sm_86").smem_per_block >= kb65_86["smem_bytes"]
    # the implicit GEMM keeps its tile with fewer cp.async stages (on sm_90 Hopper's TMA engine takes
    # this layer: sm_80 has the implicit GEMM's full pipeline)
    ig_80 = build_plan(SPECS["conv3x3_128_112_relu"], target=targets.get("sm_80"))["igemm"]
    ig_86 = build_plan(SPECS["conv3x3_128_112_relu"], target=targets.get("sm_86"))["igemm"]
    assert ig_80.smem_bytes > 99 * 1024 >= ig_86.smem_bytes
    assert (ig_86.bm, ig_86.bn, ig_86.bk) == (ig_80.bm, ig_80.bn, ig_80.bk) and ig_86.stages < ig_80.stages
    assert build_plan(SPECS["conv3x3_128_112_relu"], target=targets.get("sm_90"))["engine"] == "tma"


def test_a_spec_that_cannot_fit_the_target_is_refused_in_one_line():
    tiny = replace(targets.get("sm_80"), smem_per_block=4 * 1024, smem_per_sm=5 * 1024)
    with pytest.raises(TargetError) as err:
        build_plan(SPECS["conv2d_leaky_scale_lse_all"], target=tiny)
    assert "sm_80" in str(err.value) and "shared memory" in str(err.value) and "\n" not in str(err.value)


def test_a_target_without_cp_async_is_refused():
    old = replace(targets.get("sm_80"), has_cp_async=False)
    with pytest.raises(TargetError, match="no cp.async"):
        build_plan(SPECS["kb90"], target=old)


def test_the_target_is_part_of_the_source_and_so_of_the_cache_key():
    spec = SPECS["kb65"]
    base = targets.get("sm_80")
    more_smem = replace(base, smem_per_sm=base.smem_per_sm + 1024)  # same arch, another limit
    a, b = render_plan(build_plan(spec, target=base)), render_plan(build_plan(spec, target=more_smem))
    assert a != b and f"{more_smem.smem_per_sm} B per SM" in b
    _, src80, req80 = pipeline.request(spec, "sm_80")
    _, src90, req90 = pipeline.request(spec, "sm_90")
    assert "// target: sm_80:" in src80 and req80.source == src80 and req90.source == src90 != src80


def test_the_default_rendering_is_the_sm_90_one():
    spec = SPECS["kb90"]
    assert render(spec) == render_plan(build_plan(spec, target=targets.get("sm_90")))


# ---- `specgen build --arch` with the real compiler ---------------------------------------------


def _specgen(*args, cache: Path):
    env = {**os.environ, "SPECGEN_CACHE_DIR": str(cache), "SPECGEN_COMPILER": "nvcc"}
    return subprocess.run([sys.executable, "-m", "specgen", *map(str, args)], capture_output=True, text=True, env=env, cwd=ROOT)


# One spec per target-dependent path: clusters sized at launch on sm_90 (slab, tensor cores),
# a fixed cluster on sm_90 (FFMA), the implicit GEMM whose pipeline shrinks under 100 KB.
REPRESENTATIVE = ("kb65", "conv2d_leaky_scale_lse_all", "conv3x3s2_128_256_relu")


@pytest.mark.nvcc
@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "sm_90"])  # sm_90: test_cli builds every example
def test_build_arch_compiles_the_target_dependent_paths(arch, tmp_path):
    subset = tmp_path / "subset.yaml"  # the representative specs of examples/, as their canonical YAML
    subset.write_text(yaml.safe_dump([SPECS[name].canonical() for name in REPRESENTATIVE], sort_keys=False))
    args = ["build", subset, "--arch", arch, "--json", "--out", tmp_path / "gen"]
    result = _specgen(*args, cache=tmp_path / "cache")
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert sorted(r["name"] for r in records) == sorted(REPRESENTATIVE)
    t = targets.get(arch)
    for r in records:
        assert r["arch"] == arch and r["smem_bytes"] <= t.smem_per_block, r
        head = Path(r["cu"]).read_text().split("#include")[0]
        assert f"// target: {t.summary()}" in head


@pytest.mark.nvcc
@pytest.mark.parametrize("arch", ["sm_75", "sm_52", "sm_120"])
def test_build_refuses_unusable_archs_before_compiling(arch, tmp_path):
    result = _specgen("build", ROOT / "examples" / "kb90.yaml", "--arch", arch, "--out", tmp_path / "gen", cache=tmp_path / "cache")
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and arch in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "gen").exists() and not list((tmp_path / "cache").rglob("*.cubin"))


@pytest.mark.gpu
def test_the_gpu_target_matches_its_builtin_limits():
    targets.current.cache_clear()
    t = targets.current()
    if t is None:
        pytest.skip("needs a CUDA GPU and its driver")
    builtin = targets.get(t.arch)
    assert t.sm_count and t.sm_count > 0
    # the built-in numbers are what the device reports (an H200: 227 KB per block, 228 KB per SM)
    assert (t.smem_per_block, t.smem_per_sm, t.regs_per_sm, t.max_threads) == (
        builtin.smem_per_block, builtin.smem_per_sm, builtin.regs_per_sm, builtin.max_threads)
    assert targets.resolve(None) == t
