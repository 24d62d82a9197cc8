"""The request index: a warm hit neither plans nor renders; anything that could change the plan or
the source is a miss that plans again; a damaged entry is planned past and repaired."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import logging
import pickle
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import pytest

from specgen import cache, pipeline, planindex, plan as planner, render, target as targets
from specgen.plan import Settings
from specgen.spec import validate

from conftest_cache_helpers import isolated_cache, warnings_of

pytestmark = pytest.mark.nvcc

SPEC = {"name": "indexed", "input": {"channels": 4, "size": [8, 8]}, "conv": {"out_channels": 8, "kernel": 3},
        "epilogue": ["relu"]}


@pytest.fixture
def cache_env(tmp_path, monkeypatch):
    monkeypatch.setattr(pipeline, "_memo", {})
    yield from isolated_cache(tmp_path, monkeypatch)


@pytest.fixture
def plans(monkeypatch):
    """Counts the plans and renders the pipeline makes."""
    calls = {"plan": 0, "render": 0}
    real_plan, real_render = pipeline.build_plan, pipeline.render_plan

    def counted_plan(*args, **kwargs):
        calls["plan"] += 1
        return real_plan(*args, **kwargs)

    def counted_render(*args, **kwargs):
        calls["render"] += 1
        return real_render(*args, **kwargs)

    monkeypatch.setattr(pipeline, "build_plan", counted_plan)
    monkeypatch.setattr(pipeline, "render_plan", counted_render)
    return calls


def _forbid_planning(monkeypatch) -> None:
    def refuse(*_args, **_kwargs):
        raise AssertionError("a warm hit planned or rendered")

    for module, name in ((pipeline, "build_plan"), (pipeline, "render_plan"), (planner, "build_plan"),
                         (render, "render_plan")):
        monkeypatch.setattr(module, name, refuse)


def _index_files(root: Path) -> list[Path]:
    return sorted(p for p in (root / "requests").glob("??/*") if p.is_file())


def _values(value: object) -> object:
    """A plan as plain values, its dataclasses and models by type and fields (a KernelPlan compares by identity)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (type(value).__qualname__, {f.name: _values(getattr(value, f.name)) for f in dataclasses.fields(value)})
    if isinstance(value, Mapping):
        return {k: _values(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [_values(v) for v in value])
    if hasattr(value, "model_dump_json"):
        return (type(value).__qualname__, value.model_dump_json())
    return value


def _same(a: pipeline.Specialized, b: pipeline.Specialized) -> None:
    assert a.key == b.key and a.source == b.source and a.build.cubin == b.build.cubin
    assert _values(a.plan) == _values(b.plan)
    assert render.render_plan(b.plan) == a.source  # the stored plan renders the cached source
    assert a.launch == b.launch


def test_a_warm_hit_neither_plans_nor_renders(cache_env, monkeypatch):
    spec = validate(SPEC)
    first = pipeline.specialize(spec, "sm_90")
    assert first.build.cache == "miss" and len(_index_files(cache_env.root)) == 1
    pipeline._memo.clear()
    with monkeypatch.context() as m:
        _forbid_planning(m)
        second = pipeline.specialize(spec, "sm_90")
    assert second.build.cache == "hit" and len(cache_env.compiles()) == 1
    _same(first, second)
    assert second.launch.kernel_name == first.plan["kernel_name"] and second.launch.threads == first.plan["threads"]
    record = json.loads(_index_files(cache_env.root)[0].read_text())
    assert record["build_key"] == first.key and record["launch"] == first.launch.as_json()


def test_specialize_many_hits_without_planning(cache_env, monkeypatch):
    specs = [validate(SPEC), validate({**SPEC, "name": "other", "epilogue": ["silu"]}), validate(SPEC)]
    first = pipeline.specialize_many(specs, "sm_90", tuned=False)
    assert len(_index_files(cache_env.root)) == 2
    pipeline._memo.clear()
    with monkeypatch.context() as m:
        _forbid_planning(m)
        second = pipeline.specialize_many(specs, "sm_90", tuned=False)
    assert [s.build.cache for s in second] == ["hit"] * 3 and len(cache_env.compiles()) == 2
    for a, b, spec in zip(first, second, specs):
        _same(a, b)
        assert b.spec is spec


def _change_settings(monkeypatch):
    monkeypatch.setattr(pipeline, "DEFAULT_SETTINGS", Settings(min_blocks=1))


def _change_target(monkeypatch):
    monkeypatch.setitem(targets.BUILTIN, "sm_90", replace(targets.BUILTIN["sm_90"], smem_per_block=200 * 1024))


def _change_code(monkeypatch):
    monkeypatch.setattr(planindex, "code_digest", lambda: "0" * 64)


def _turn_a_switch(monkeypatch):
    from specgen import tail

    monkeypatch.setattr(tail, "STRIDED_TEAMS", not tail.STRIDED_TEAMS)


@pytest.mark.parametrize("change", [_change_settings, _change_target, _change_code, _turn_a_switch],
                         ids=["settings", "target", "code", "switch"])
def test_what_could_change_the_plan_is_a_miss_that_plans_again(cache_env, plans, monkeypatch, change):
    spec = validate(SPEC)
    pipeline.specialize(spec, "sm_90")
    pipeline._memo.clear()
    pipeline.specialize(spec, "sm_90")
    assert plans == {"plan": 1, "render": 1}
    change(monkeypatch)
    pipeline._memo.clear()
    pipeline.specialize(spec, "sm_90")
    assert plans == {"plan": 2, "render": 2}
    assert len(_index_files(cache_env.root)) == 2  # one entry per request key
    pipeline._memo.clear()
    pipeline.specialize(spec, "sm_90")  # the changed request now hits its own entry
    assert plans == {"plan": 2, "render": 2}


def test_the_request_key_covers_settings_target_tile_and_code(monkeypatch):
    spec = validate(SPEC).canonical_json()
    sm90 = targets.get("sm_90")
    base = planindex.request_key(spec, "sm_90", sm90, Settings(), None)
    assert base == planindex.request_key(spec, "sm_90", sm90, Settings(), None)
    others = [
        planindex.request_key(spec, "sm_90", sm90, Settings(exact_sums=False), None),
        planindex.request_key(spec, "sm_90", replace(sm90, sm_count=132), Settings(), None),
        planindex.request_key(spec, "sm_90a", targets.get("sm_90a"), Settings(), None),
        planindex.request_key(validate({**SPEC, "epilogue": ["gelu"]}).canonical_json(), "sm_90", sm90, Settings(), None),
    ]
    from specgen.igemm import IgemmConfig

    fields = {f.name: f.default for f in dataclasses.fields(IgemmConfig)}
    if all(v is not dataclasses.MISSING for v in fields.values()):
        others.append(planindex.request_key(spec, "sm_90", sm90, Settings(), IgemmConfig()))
    monkeypatch.setattr(planindex, "code_digest", lambda: "1" * 64)
    others.append(planindex.request_key(spec, "sm_90", sm90, Settings(), None))
    from specgen import tma

    monkeypatch.setattr(tma, "ROW_NORM_ROWS", (16, 32))  # a planner constant turned
    others.append(planindex.request_key(spec, "sm_90", sm90, Settings(), None))
    assert len({base, *others}) == len(others) + 1


def test_the_switches_are_the_planners_plain_constants(monkeypatch):
    from specgen import tail, tma

    switches = planindex.planner_switches()
    assert switches["tail.STRIDED_TEAMS"] == repr(tail.STRIDED_TEAMS) and "tma.ROW_NORM" in switches
    assert all(name.split(".")[1].isupper() for name in switches)
    monkeypatch.setattr(tma, "ROW_NORM", not tma.ROW_NORM)
    assert planindex.planner_switches()["tma.ROW_NORM"] == repr(tma.ROW_NORM) != switches["tma.ROW_NORM"]


def test_the_code_digest_covers_modules_and_templates():
    planindex.code_digest.cache_clear()
    digest = planindex.code_digest()
    assert len(digest) == 64 and digest == planindex.code_digest()


@pytest.mark.parametrize("damage", ["garbage", "truncated", "plan", "key", "link"])
def test_a_damaged_index_entry_is_planned_past_and_repaired(cache_env, plans, monkeypatch, caplog, damage, tmp_path):
    spec = validate(SPEC)
    first = pipeline.specialize(spec, "sm_90")
    (path,) = _index_files(cache_env.root)
    good = path.read_text()
    record = json.loads(good)
    if damage == "garbage":
        path.write_bytes(b"\x00not json")
    elif damage == "truncated":
        path.write_text(good[: len(good) // 2])
    elif damage == "plan":
        blob = base64.b64decode(record["plan"])
        record["plan"] = base64.b64encode(blob[:-8] + b"\x00" * 8).decode()
        path.write_text(json.dumps(record))
    elif damage == "key":
        record["request_key"] = "f" * 64
        path.write_text(json.dumps(record))
    else:
        elsewhere = tmp_path / "elsewhere.json"
        elsewhere.write_text(good)
        path.unlink()
        path.symlink_to(elsewhere)
    pipeline._memo.clear()
    with caplog.at_level(logging.WARNING, logger="specgen"):
        again = pipeline.specialize(spec, "sm_90")
    assert plans["plan"] == 2 and again.key == first.key and again.build.cache == "hit"
    assert any("request index entry" in w for w in warnings_of(caplog)), warnings_of(caplog)
    repaired = json.loads(path.read_text())
    assert not path.is_symlink() and repaired == json.loads(good)
    pipeline._memo.clear()
    with monkeypatch.context() as m:
        _forbid_planning(m)
        hit = pipeline.specialize(spec, "sm_90")
    _same(first, hit)


def test_a_stored_plan_may_name_nothing_but_specgens_values(cache_env, plans, monkeypatch, tmp_path):
    """An entry whose checksums match but whose plan names another callable is refused unread."""
    spec = validate(SPEC)
    pipeline.specialize(spec, "sm_90")
    (path,) = _index_files(cache_env.root)
    record = json.loads(path.read_text())
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (Path.touch, (marker,))

    blob = pickle.dumps({"engine": "ffma", "x": Evil()})
    record.update(plan=base64.b64encode(blob).decode(), plan_sha256=hashlib.sha256(blob).hexdigest())
    path.write_text(json.dumps(record))
    pipeline._memo.clear()
    pipeline.specialize(spec, "sm_90")
    assert not marker.exists() and plans["plan"] == 2
    with pytest.raises(pickle.UnpicklingError):
        planindex.load_plan(blob)


def test_a_build_entry_gone_is_built_again(cache_env, plans):
    spec = validate(SPEC)
    first = pipeline.specialize(spec, "sm_90")
    cache._remove_tree(first.build.entry_dir)
    pipeline._memo.clear()
    again = pipeline.specialize(spec, "sm_90")
    assert plans["plan"] == 2 and again.build.cache == "miss" and again.key == first.key
    assert len(cache_env.compiles()) == 2


def test_always_compile_plans_and_builds(cache_env, plans, monkeypatch):
    spec = validate(SPEC)
    pipeline.specialize(spec, "sm_90")
    monkeypatch.setenv("SPECGEN_ALWAYS_COMPILE", "1")
    pipeline._memo.clear()
    assert pipeline.specialize(spec, "sm_90").build.cache == "miss" and plans["plan"] == 2


def test_clear_and_prune_take_the_index_along(cache_env):
    spec = validate(SPEC)
    first = pipeline.specialize(spec, "sm_90")
    other = pipeline.specialize(validate({**SPEC, "name": "other"}), "sm_90")
    assert cache.index_stats()[0] == 2
    cache._remove_tree(other.build.entry_dir)
    cache.prune(10**12)  # removes nothing: the index keeps its entries
    assert cache.index_stats()[0] == 2
    oldest = min(cache.list_entries(), key=lambda r: r["last_use"])
    cache.prune(sum(r["size"] for r in cache.list_entries()) - 1)  # one entry goes, and the index entries left dangling
    assert oldest["key"] == first.key and cache.index_stats()[0] == 0
    cache.clear()
    assert cache.index_stats() == (0, 0) and not (cache_env.root / "requests").exists()


def test_stored_plans_render_the_same_source():
    """Every engine's plan, a sequence's parts (specs inside) included, comes back whole."""
    import conv_family_specs

    from specgen.plan import build_plan

    specs = [validate({"name": name, **data}) for name, data in conv_family_specs.TRANSPOSED.items()]
    specs += [validate({**SPEC, "tile": {"engine": engine}}) for engine in ("igemm", "slab", "ffma")]
    specs.append(validate({"name": "wide", "input": {"channels": 64, "size": [16, 16]},
                           "conv": {"out_channels": 128, "kernel": 3, "padding": 1}, "epilogue": ["relu"]}))
    engines = set()
    for spec in specs:
        for arch in ("sm_80", "sm_90a"):
            plan = build_plan(spec, target=targets.get(arch))
            back = planindex.load_plan(planindex.dump_plan(plan))
            assert render.render_plan(back) == render.render_plan(plan), (spec.name, arch)
            assert planindex.launch_spec(back) == planindex.launch_spec(plan)
            engines.add(plan["engine"])
    assert {"sequence", "igemm", "tma", "ffma"} <= engines, engines


def test_cache_ls_counts_the_indexed_requests(cache_env, capsys):
    import argparse

    from specgen import cachecli

    def ls() -> list[str]:
        parser = argparse.ArgumentParser(prog="specgen")
        cachecli.register(parser.add_subparsers(dest="command", required=True))
        args = parser.parse_args(["cache", "ls"])
        assert args.run(args) == 0
        return capsys.readouterr().out.splitlines()

    pipeline.specialize(validate(SPEC), "sm_90")
    out = ls()
    assert out[1].split()[0] == "indexed" and out[2].startswith("1 entry, ") and "; 1 request indexed, " in out[2]
    cache.clear()
    assert not any("indexed" in line for line in ls())
