"""The request index: a warm cache hit without planning or rendering.

The kernel cache keys a build by its rendered source, so finding it means planning and rendering
first. The request index keys what `pipeline.specialize` asked for instead: `request_key` is a
sha256 over the canonical spec, the arch asked for and the resolved target's fields, the planner
settings, a tuned tile (if any), the compiler identity, flags and default arch the cache uses, the
versions of specgen, Jinja2 and Pydantic, `code_digest()`, a digest of specgen's own modules
and templates (everything that shapes a plan or a source), and `planner_switches()`, the values the
planner's module-level constants hold now (a benchmark or test that turns one of them, e.g.
`tail.STRIDED_TEAMS`, gets the plan it asked for, not the one stored before). Its entry, `<cache>/requests/<k[:2]>/<k>`
(see `cache.write_index`), holds the plan the runtime reads, the `LaunchSpec` derived from it, and
the key and checksums of the cached build; a hit loads those and checks the build entry as any
cache hit does. Anything else (no entry, a corrupt one, one of another key or code digest, a build
entry gone or changed) is a miss: the spec is planned and rendered as before, and the entry is
written for next time.

The plan is stored pickled. It is read back only by `load_plan`, which takes nothing but plain
values and specgen's own dataclasses, Pydantic models and enums (a spec inside a plan is stored as
its JSON and validated again; no other class or function can be named in it), and only from an
entry whose key, code digest and plan checksum match.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import hashlib
import io
import json
import pickle
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import specgen
from specgen import paths
from specgen.kernelplan import SequencePlan

INDEX_SCHEMA = 1
_SPECGEN_DIR = Path(__file__).resolve().parent


@functools.cache
def code_digest() -> str:
    """sha256 over specgen's top-level modules and every file under templates/ (names and bytes):
    any edit to the code that plans or renders makes every request key new. Once per process."""
    digest = hashlib.sha256()
    files = [("specgen", p) for p in sorted(_SPECGEN_DIR.glob("*.py"))]
    tdir = paths.templates_dir()
    files += [("templates", p) for p in sorted(tdir.rglob("*")) if p.is_file()]
    for kind, path in files:
        base = _SPECGEN_DIR if kind == "specgen" else tdir
        digest.update(f"{kind}/{path.relative_to(base).as_posix()}".encode())
        digest.update(b"\0")
        digest.update(path.read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()


# The modules whose upper-case constants choose a plan or shape a source.
_PLANNER_MODULES = ("boxfold", "dwcl", "igemm", "literals", "ops", "pipeline", "plan", "poolfold", "render", "spec", "splitk",
                    "tail", "tapsum", "target", "tma", "upsample")


def planner_switches() -> dict:
    """Every upper-case module constant of the planner's modules that is a plain value (a switch
    such as `tma.ROW_NORM`, a limit such as `tail.STRIDED_TEAM_ITEMS`), as it is now: they are
    read when planning, so a request made with one turned is a different request."""
    import importlib

    out = {}
    for name in _PLANNER_MODULES:
        module = importlib.import_module(f"specgen.{name}")
        for key, value in vars(module).items():
            if key.isupper() and not key.startswith("_") and isinstance(value, (bool, int, float, str, tuple, frozenset)):
                out[f"{name}.{key}"] = sorted(map(repr, value)) if isinstance(value, frozenset) else repr(value)
    return out


def _describe(value: object) -> object:
    """A planner input as JSON values: a dataclass by its type and fields, other values as they are."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        kind = type(value)
        return {"type": f"{kind.__module__}.{kind.__qualname__}",
                "fields": {f.name: _describe(getattr(value, f.name)) for f in dataclasses.fields(value)}}
    if isinstance(value, (list, tuple)):
        return [_describe(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _describe(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def request_key(canonical_spec: str, arch: str | None, target, settings, tile_config) -> str:
    """The key of a `specialize` request, computed without planning (see the module docstring).
    Raises what resolving the compiler raises (none found): the caller then takes the planning path."""
    from specgen import compile as nvcc

    compiler = nvcc.resolve_compiler(None)
    material = {
        "schema": INDEX_SCHEMA,
        "canonical_spec": canonical_spec,
        "arch": arch,
        "default_arch": nvcc.default_arch() if arch is None else None,
        "target": _describe(target),
        "settings": _describe(settings),
        "tile_config": _describe(tile_config),
        "compiler": compiler,
        "toolchain": nvcc.compiler_id(compiler),
        "flags": list(nvcc.default_flags(compiler)),
        "specgen_version": specgen.__version__,
        "template_hash": paths.template_hash(),
        "code_digest": code_digest(),
        "switches": planner_switches(),
        "libraries": _library_versions(),
        "python": list(sys.version_info[:2]),
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


@functools.cache
def _library_versions() -> dict:
    """Jinja2 renders the source and Pydantic holds the spec: their versions are part of the key."""
    from importlib import metadata

    out = {}
    for name in ("jinja2", "pydantic"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


# ---------------------------------------------------------------------------- the launch


@dataclass(frozen=True)
class LaunchSpec:
    """How the runtime launches a plan's kernel, as it reads it from the plan: the function, the
    block (`threads`), the dynamic shared memory, the grid's x extent per sample (one row of y per
    sample; for a cluster sized at launch, the kept tiles per sample), the cluster policy
    (`cluster`, `r1_chunks`) when the cluster is sized at launch (None: none, or fixed in the
    kernel), and the other functions loaded beside it (the TMA engine's, the split kernel). The
    implicit-GEMM engine's grid is one flat axis: `igemm_grid` is (positions per sample, block tile
    BM, blocks along N, GEMMs). A sequence of kernels has one LaunchSpec per part (`parts`)."""

    kernel_name: str
    engine: str
    threads: int | None = None
    smem_bytes: int | None = None
    blocks_per_sample: int | None = None
    cluster_at_launch: tuple | None = None
    igemm_grid: tuple | None = None
    extra_functions: tuple = ()
    parts: tuple = ()

    def as_json(self) -> dict:
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}


def _plain(value: object) -> object:
    if isinstance(value, LaunchSpec):
        return value.as_json()
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


def launch_spec(plan: dict) -> LaunchSpec:
    """The plan's `LaunchSpec` (what `torchop.load_kernel` and `_launch_plan` read from it)."""
    engine = plan["engine"]
    if isinstance(plan, SequencePlan):  # a part that is not an engine's kernel (a fold's sum) is named by its role only
        parts = tuple(
            launch_spec(part.plan) if part.role in ("body", "rest")
            else LaunchSpec(part.plan.kernel_name if part.role in ("tapsum", "boxmean") else "", part.role)
            for part in plan.parts
        )
        return LaunchSpec(plan.kernel_name, engine, parts=parts)
    from specgen import splitk

    name = plan["kernel_name"]
    body = plan.get(engine) if engine in ("tma", "igemm") else None
    split = splitk.kernel_names(name) if body is not None and body.split_k > 1 else ()
    extra: tuple = split
    if engine == "tma":
        from specgen import tmarun

        extra = tuple(tmarun.extra_functions(plan))
    at_launch = bool(plan.get("cluster_at_launch"))
    ig = plan.get("igemm")
    return LaunchSpec(
        kernel_name=name,
        engine=engine,
        threads=plan["threads"],
        smem_bytes=plan["smem_bytes"],
        blocks_per_sample=plan["f_tiles"] if at_launch else plan["blocks_per_sample"],
        cluster_at_launch=(plan["cluster"], plan["r1_chunks"]) if at_launch else None,
        igemm_grid=None if ig is None else (ig.positions, ig.bm, ig.n_tiles, ig.grid_gemms),
        extra_functions=tuple(extra),
    )


# ---------------------------------------------------------------------------- the plan, stored


class _PlanUnpickler(pickle.Unpickler):
    """Names nothing but plain containers, specgen's own dataclasses, models and enums, and the two
    functions that rebuild a spec or a stage from its JSON."""

    _BUILTINS = frozenset({"set", "frozenset", "tuple", "list", "dict", "complex", "slice", "bytes", "bytearray"})

    def find_class(self, module: str, name: str):
        if module == "builtins" and name in self._BUILTINS:
            return super().find_class(module, name)
        if module == __name__ and name in _REBUILDERS:
            return _REBUILDERS[name]
        if (module == "specgen" or module.startswith("specgen.")) and "." not in name and module in sys.modules:
            found = getattr(sys.modules[module], name, None)
            if isinstance(found, type) and (dataclasses.is_dataclass(found) or issubclass(found, Enum)
                                            or _is_model(found)):
                return found
        raise pickle.UnpicklingError(f"a stored plan may not name {module}.{name}")


def _is_model(kind: type) -> bool:
    try:
        from pydantic import BaseModel
    except ImportError:
        return False
    return issubclass(kind, BaseModel)


def _spec_from_json(text: str):
    from specgen.spec import LayerSpec

    return LayerSpec.model_validate_json(text)


def _stage_from_json(op: str, text: str):
    from specgen.spec import STAGE_MODELS

    return STAGE_MODELS[op].model_validate_json(text)


_REBUILDERS = {"_spec_from_json": _spec_from_json, "_stage_from_json": _stage_from_json}


class _PlanPickler(pickle.Pickler):
    """A spec in a plan (a sequence's parts, a rewrite's) is stored as its JSON: its epilogue's stage
    models are made from the op tables at import, so they cannot be named."""

    def reducer_override(self, obj):
        from specgen.spec import LayerSpec, StageBase

        if isinstance(obj, LayerSpec):
            return _spec_from_json, (obj.model_dump_json(),)
        if isinstance(obj, StageBase):
            return _stage_from_json, (obj.op, obj.model_dump_json())
        return NotImplemented


def dump_plan(plan: dict) -> bytes:
    out = io.BytesIO()
    _PlanPickler(out, protocol=pickle.HIGHEST_PROTOCOL).dump(plan)
    return out.getvalue()


def load_plan(blob: bytes) -> dict:
    """A plan `dump_plan` stored. Raises pickle.UnpicklingError (or another error) when it is not one."""
    import specgen.plan  # noqa: F401  (every module a plan's values come from, imported)
    import specgen.tail  # noqa: F401
    import specgen.tapsum  # noqa: F401
    import specgen.poolfold  # noqa: F401
    import specgen.boxfold  # noqa: F401

    plan = _PlanUnpickler(io.BytesIO(blob)).load()
    if not isinstance(plan, Mapping) or not isinstance(plan.get("engine"), str):
        raise pickle.UnpicklingError("a stored plan is a mapping with an engine")
    return plan


def entry_record(request_key_: str, name: str, plan: dict, build) -> dict | None:
    """The index entry for a request: the plan, its LaunchSpec and the build it compiled to; None
    for a build that is not a published cache entry (nothing to find next time)."""
    from specgen import cache

    sums = cache.entry_checksums(build)
    if sums is None:
        return None
    cu_sha, cubin_sha = sums
    blob = dump_plan(plan)
    return {
        "schema": INDEX_SCHEMA,
        "request_key": request_key_,
        "code_digest": code_digest(),
        "switches": planner_switches(),
        "name": name,
        "build_key": build.key,
        "arch": build.arch,
        "cu_sha256": cu_sha,
        "cubin_sha256": cubin_sha,
        "launch": launch_spec(plan).as_json(),
        "plan_sha256": hashlib.sha256(blob).hexdigest(),
        "plan": base64.b64encode(blob).decode("ascii"),
    }


def check_record(record: object, request_key_: str) -> str | None:
    """Why an index entry cannot serve this request, or None."""
    if not isinstance(record, dict):
        return "it is not a JSON object"
    kinds = {"schema": int, "request_key": str, "code_digest": str, "name": str, "build_key": str, "arch": str,
             "cu_sha256": str, "cubin_sha256": str, "plan_sha256": str, "plan": str}
    for field_name, kind in kinds.items():
        if not isinstance(record.get(field_name), kind):
            return f"it has no {field_name}"
    if record["schema"] != INDEX_SCHEMA:
        return f"it is of schema {record['schema']}, not {INDEX_SCHEMA}"
    if record["request_key"] != request_key_:
        return "it belongs to another request"
    if record["code_digest"] != code_digest():
        return "it was written by other specgen code"
    return None


def record_plan(record: dict) -> dict:
    """The plan of a checked index entry. Raises ValueError (or an unpickling error) when it is damaged."""
    blob = base64.b64decode(record["plan"].encode("ascii"), validate=True)
    if hashlib.sha256(blob).hexdigest() != record["plan_sha256"]:
        raise ValueError("its plan does not match its checksum")
    return load_plan(blob)
