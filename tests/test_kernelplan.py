"""The typed plans: every template value a field, checked when the plan is built; a sequence's
parts and steps typed likewise."""

from __future__ import annotations

import dataclasses

import pytest

from specgen.kernelplan import KernelPlan, KernelStep, LayerStep, SequencePart, SequencePlan, TemplateValues, with_changes
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


def _sequence():
    """A group norm, then a pool: the body, the norm's tail, the pool over an identity conv."""
    return build_plan(_spec(epilogue=[{"group_norm": 4}, {"max_pool": 2}]))


def test_a_sequence_plan_is_frozen_and_typed_all_the_way_down():
    from specgen.tail import OnePassTail, TailKernel

    plan = _sequence()
    assert isinstance(plan, SequencePlan) and plan.engine == plan["engine"] == "sequence"
    assert [(p.role, type(p.plan)) for p in plan.parts] == [("body", KernelPlan), ("tail", OnePassTail), ("rest", KernelPlan)]
    assert [type(s) for s in plan.steps] == [LayerStep, KernelStep, LayerStep]
    assert all(isinstance(k, TailKernel) for k in plan.parts[1].plan.kernels)
    assert isinstance(plan.parts, tuple) and isinstance(plan.steps, tuple)  # no part or step is added after it is built
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.stats_floats = 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.parts[0].namespace = "other"
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.steps[0].out = "t1"
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.parts[1].plan.team = 1
    with pytest.raises(TypeError):
        plan["why"] = []
    marked = with_changes(plan, spec_hash="0123456789abcdef")
    assert type(marked) is SequencePlan and marked.parts is plan.parts and plan.spec_hash != marked.spec_hash
    assert "// spec hash: 0123456789abcdef " in render_plan(marked) and "0123456789abcdef" not in render_plan(plan)


def test_a_sequence_reads_as_the_mappings_its_templates_and_tests_read():
    plan = _sequence()
    assert set(plan) == {f.name for f in dataclasses.fields(SequencePlan)}
    step = plan.steps[0]
    assert step["in"] == step.in_ == "x" and "in" in step and "in_" not in step and step["kind"] == "layer"
    assert plan.steps[1]["kind"] == "kernel" and plan["parts"][1]["plan"]["kernels"][0]["name"] == plan.steps[1].name
    tail = plan.parts[1].plan
    # "items" is a template value and a method of the mapping: the field is items_, the method stays
    assert tail["items"] == tail.items_ and "items" in tail and dict(tail.items())["items"] == tail.items_
    assert dict(**tail)["mode"] == "one_pass" and dict(**tail)["family"] == "runs"  # what the renderer hands Jinja


def test_a_sequence_missing_or_misspelling_a_value_fails_when_it_is_built():
    plan = _sequence()
    body, tail = plan.parts[0], plan.parts[1]
    with pytest.raises(TypeError, match="a body part needs its spec"):
        SequencePart(role="body", namespace="body", plan=body.plan)
    with pytest.raises(TypeError, match="a tail part needs its segment"):
        SequencePart(role="tail", namespace="e0", plan=tail.plan)
    with pytest.raises(TypeError, match="a rest part needs its spec and segment"):
        SequencePart(role="rest", namespace="e0_rest", plan=body.plan)
    with pytest.raises(TypeError, match="role 'tails'"):
        SequencePart(role="tails", namespace="e0", plan=tail.plan, segment=tail.segment)
    values = {f.name: getattr(plan, f.name) for f in dataclasses.fields(SequencePlan) if f.init}
    with pytest.raises(TypeError, match="buffers"):
        SequencePlan(**{k: v for k, v in values.items() if k != "buffers"})
    with pytest.raises(TypeError, match="stat_floats"):
        SequencePlan(**values, stat_floats=0)
    assert SequencePlan(**values).steps is plan.steps
    with pytest.raises(TypeError, match="step 1 is a layer step of a tail part"):
        SequencePlan(**{**values, "steps": (plan.steps[0], dataclasses.replace(plan.steps[2], part=1), plan.steps[2])})
    with pytest.raises(TypeError, match="step 2 names part 3 of 3"):
        SequencePlan(**{**values, "steps": (*plan.steps[:2], dataclasses.replace(plan.steps[2], part=3))})
    tail_values = {f.name: getattr(tail.plan, f.name) for f in dataclasses.fields(tail.plan) if f.init}
    with pytest.raises(TypeError, match="team"):
        type(tail.plan)(**{k: v for k, v in tail_values.items() if k != "team"})
    with pytest.raises(TypeError, match="mode"):  # the kind of tail is its class's
        type(tail.plan)(**tail_values, mode="split")
    with pytest.raises(TypeError, match="grid"):
        KernelStep(part=1, name="k", threads=256, grid=1, once=False, args=["t0", "out"])
    with pytest.raises(TypeError, match="kind"):
        LayerStep(part=0, in_="x", out="t0", out_shape=[8], kind="kernel")


def test_a_field_may_not_hide_the_mappings_methods():
    with pytest.raises(TypeError, match="items"):
        @dataclasses.dataclass(frozen=True, eq=False)
        class Bad(TemplateValues):
            items: int
