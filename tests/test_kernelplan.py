"""The typed kernel plan: every template value a field, checked when the plan is built."""

from __future__ import annotations

import dataclasses

import pytest

from specgen.kernelplan import KernelPlan, with_changes
from specgen.plan import build_plan
from specgen.render import render_plan
from specgen.spec import validate


def _spec(**extra):
    return validate({"name": "kp", "input": {"channels": 8, "size": [16, 16]}, "conv": {"out_channels": 16, "kernel": 3},
                     "epilogue": ["relu"], **extra})


def test_a_whole_kernel_plan_is_a_frozen_kernel_plan():
    plan = build_plan(_spec())
    assert isinstance(plan, KernelPlan)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.threads = 1
    with pytest.raises(TypeError):
        plan["threads"] = 1  # (a mapping, but read-only)


def test_the_template_names_read_as_a_mapping():
    plan = build_plan(_spec())
    assert plan["in"] == plan.in_ == (1, 16, 16) and "in" in plan and "in_" not in plan
    assert plan["box"] is plan.box and plan.get("no_such_value") is None
    with pytest.raises(KeyError):
        plan["no_such_value"]
    assert set(plan) == {f.name for f in dataclasses.fields(KernelPlan)} - {"in_"} | {"in"}
    assert dict(**plan)["engine"] == plan.engine  # what the renderer hands Jinja


def test_a_missing_or_misspelt_value_fails_when_the_plan_is_built():
    plan = build_plan(_spec())
    values = {f.name: getattr(plan, f.name) for f in dataclasses.fields(KernelPlan)}
    del values["smem_bytes"]
    with pytest.raises(TypeError, match="smem_bytes"):
        KernelPlan(**values)
    with pytest.raises(TypeError, match="smem_byte"):
        KernelPlan(**{**values, "smem_bytes": 1, "smem_byte": 1})


def test_changes_make_a_new_plan_that_renders_the_change():
    plan = build_plan(_spec())
    renamed = with_changes(plan, kernel_name="specgen_other")
    assert renamed is not plan and plan.kernel_name == "specgen_kp" and renamed["kernel_name"] == "specgen_other"
    assert "specgen_other(" in render_plan(renamed) and "specgen_other(" not in render_plan(plan)
    assert with_changes({"a": 1}, a=2) == {"a": 2}  # a sequence's plan is still a dict


def test_the_slab_engines_tiling_is_typed_too():
    from pathlib import Path

    from specgen.kernelplan import SlabTiling
    from specgen.spec import load_specs

    spec = load_specs(Path(__file__).resolve().parent.parent / "examples" / "kb90.yaml")[0]
    plan = build_plan(spec)
    assert plan["engine"] == "slab" and isinstance(plan["mma"], SlabTiling)
    assert plan["mma"]["cip"] == plan["mma"].cip and plan["mma"].threads == plan["threads"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan["mma"].wm = 1
