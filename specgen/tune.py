"""Autotuning: the tensor-core engines' tile shapes, measured on this GPU and kept per GPU.

The planner guesses one tile from sweeps of real layers (`tma.default_config` on Hopper,
`igemm.default_config` elsewhere, `plan._warp_tiles` for the slab engine). `specgen tune` tries a
handful of others (`candidates`: other tile shapes and pipeline depths of the same engine, and on
Hopper the other engine's tiles where both can run the layer; for the slab engine, other mma.sync
warp tiles, `slab_candidates`, and for a layer the box fold applies to, the layer with and without
the fold, `plan.SlabConfig.box_fold`): all of them compile in one parallel batch, the ones
that spill registers are dropped, each is timed on the GPU (`measured.time_graphed`: warm-up
first, then each candidate's calls captured in a CUDA graph and the replays timed between CUDA
events, the candidates interleaved rep by rep, the median of the reps, inputs rotated through
enough fresh random sets to exceed the L2 cache) and checked against the float64 reference; the
fastest correct one is kept. The graph takes the host's launch time out: at batch 1 a loop of
plain calls would time the host (the TMA engine's longer launch path), not the kernel. A launch
a graph cannot capture is timed as called.

Correct means within the mode's bar: fp32 mode, rel. L2 <= 1e-5 against float64; tf32 mode, at
most twice the heuristic plan's own error (plus 1e-7). The candidates differ in how K is chunked,
so their sums run in different orders: a tuned kernel's results may differ from the untuned one's
in the last bits, never by more than the bar.

The choice is kept in the specgen cache directory under `tuned/`, one JSON file per choice named
by a sha256 over the spec's `signature` (its canonical JSON without the names: the layer's own, and
its tensors' in order of first use), its precision, the GPU (name and SM count), the CUDA driver
version and the batch bucket (the next power of two at or above the batch). Layers that differ only
in names share one choice: a model's repeated blocks are tuned once, and a layer tuned from a YAML
file serves the same layer imported from a model. Layers are
contiguous float32 (NCDHW), so there is no memory format to key on. Written atomically (a
temporary file renamed into place, `measured.store`); an unreadable record, or one whose tile no
longer plans, counts as none.

Use: `pipeline.specialize` (so `FusedLayer` and `from_module`) takes the stored choice for the
first visible GPU when there is one, and for the largest batch bucket tuned, since the batch is
not known at construction (a call at another bucket tuned to another tile runs that bucket's
kernel: `pipeline.batch_variant`); `FusedLayer(spec, tune=True, tune_batch=N)` or `SPECGEN_AUTOTUNE=1`
tunes on the spot when no choice is stored for that bucket (default batch 64) and uses it.
Without either, the heuristic plan: construction never times anything.

The GPU identity is read through the CUDA driver (no torch), so `specgen show --plan` can name the
tuned choice without importing torch.
"""

from __future__ import annotations

import ctypes
import functools
import sys
import hashlib
import json
import math
import os
import time
from dataclasses import MISSING, asdict, dataclass, field, fields, replace

from specgen import boxfold, cache, igemm, measured, pipeline, target as targets, tma
from specgen.compile import CompileError
from specgen.igemm import IgemmConfig, _cip_and_bk
from specgen.tma import TmaConfig
from specgen.log import get_logger
from specgen.plan import PlanError, Settings, SlabConfig, build_plan
from specgen.spec import LayerSpec

SCHEMA = 2  # 2: keys over `signature` (1: over the canonical spec, names included)
SUBDIR = "tuned"
ENV_AUTOTUNE = "SPECGEN_AUTOTUNE"
DEFAULT_TUNE_BATCH = 64
MAX_BUCKET_LOG2 = 16  # buckets 1 .. 65536 are probed when the batch is not known
FP32_BAR = 1e-5
TF32_FACTOR = 2.0
TF32_SLACK = 1e-7
REPS = 15
WARMUP = 3
# candidates per layer: the planner's own, the TMA engine's tiles (up to about 10), then the implicit GEMM's
MAX_CANDIDATES = 16
MAX_INPUT_SETS = 64


# ---------------------------------------------------------------------------- candidates


def _templates(split: bool, cout: int, wgmma_ok: bool = False) -> list[tuple[str, IgemmConfig]]:
    """Tile shapes that won somewhere in the v15 and v33 sweeps (benchmarks/NOTES.md), Hopper's
    warpgroup MMA first (the TMA engine's tiles come before them and the list is capped); K chunks
    are capped by the layer's own (see `candidates`)."""
    c = IgemmConfig
    out = []
    if wgmma_ok:  # Hopper's warpgroup MMA (sm_90a), where the channels tile its 32-wide K chunks
        max_bn = 128 if split else 256
        if not split:  # (in 3xTF32, twice the fragment registers: two blocks per SM are not offered)
            # two blocks of two warpgroups per SM, one block's loads and stores beside the other's
            # products: the fastest tile on 5 of 13 1x1 layers of ResNet-50 and MobileNetV2 at
            # batch 64, 1.07-1.34x the planner's (benchmarks/NOTES.md v33)
            out.append(("wgmma 2 warpgroups s3 2 blocks/SM", replace(igemm.wgmma_config(cout, 2, 3, 128), min_blocks=2)))
            out.append(("wgmma 2 warpgroups s4 2 blocks/SM, 64 channels", replace(igemm.wgmma_config(cout, 2, 4, 64), min_blocks=2)))
        out.append(("wgmma 2 warpgroups s4", igemm.wgmma_config(cout, 2, 4, max_bn)))
        out.append(("wgmma 3 warpgroups s4", igemm.wgmma_config(cout, 3, 4, max_bn)))
        out.append(("wgmma 3 warpgroups s3, 64 channels", igemm.wgmma_config(cout, 3, 3, 64)))
    out += [
        ("128x64 w32x32 k32 s3", c(4, 2, 2, 4, 32, 3)),
        ("256x64 w64x32 k32 s3", c(4, 2, 4, 4, 32, 3)),
        ("128x128 w32x32 16 warps k32 s3", c(4, 4, 2, 4, 32, 3)),
        ("128x128 w64x32 k32 s3", c(2, 4, 4, 4, 32, 3)),
    ]
    if cout <= 32:
        out.append(("256x32 w32x32 k32 s3", c(8, 1, 2, 4, 32, 3)))
    if not split:  # in 3xTF32 (twice the fragment registers) these spill
        out.append(("128x128 w64x32 k16 s4 2 blocks/SM", c(2, 4, 4, 4, 16, 4, min_blocks=2)))
        out.append(("128x256 w64x64 k32 s3", c(2, 4, 4, 8, 32, 3)))
    return out


def label(cfg) -> str:
    if isinstance(cfg, SlabConfig):
        return cfg.label()
    if isinstance(cfg, TmaConfig):
        split = {0: "", 1: " no split"}.get(cfg.split_k, f" split {cfg.split_k}")
        two = " 2 blocks/SM" if cfg.blocks_per_sm == 2 else ""
        return f"tma {cfg.bm}x{cfg.bn} s{cfg.stages} kb{cfg.kb_per_stage}{two}{split}"
    mb = f" {cfg.min_blocks} blocks/SM" if cfg.min_blocks else ""
    phases = {0: "", 1: " one phase per block", 2: " W pairs"}[cfg.phases_per_block]
    split = {0: "", 1: " no split"}.get(cfg.split_k, f" split {cfg.split_k}")
    return f"{cfg.bm}x{cfg.bn} w{16 * cfg.wm}x{8 * cfg.wn} {cfg.threads // 32} warps k{cfg.bk} s{cfg.stages}{mb}{phases}{split}"


def config_record(cfg) -> dict | None:
    """A tile config as JSON data (its engine named)."""
    if cfg is None:
        return None
    engine = "tma" if isinstance(cfg, TmaConfig) else "slab" if isinstance(cfg, SlabConfig) else "igemm"
    return {"engine": engine, **asdict(cfg)}


def config_from(data: dict):
    """The config a `config_record` describes; raises KeyError/TypeError/ValueError on a bad one."""
    cls = {"tma": TmaConfig, "slab": SlabConfig}.get(data.get("engine"), IgemmConfig)
    # (a field added since the record was written takes its default; one without a default is required)
    return cls(**{f.name: int(data[f.name] if f.default is MISSING else data.get(f.name, f.default)) for f in fields(cls)})


def plan_with(spec: LayerSpec, cfg, target=None) -> dict:
    """The plan for a tile config of any engine."""
    if isinstance(cfg, TmaConfig):
        return build_plan(spec, None, target, cfg)
    if isinstance(cfg, SlabConfig):
        return build_plan(spec, None, target, settings=Settings(slab=cfg))
    return build_plan(spec, cfg, target)


def heuristic(spec: LayerSpec) -> dict:
    """The planner's own plan (no tuned choice); raises PlanError as build_plan does."""
    return build_plan(spec)


def tunable(spec: LayerSpec) -> bool:
    """Whether the heuristic plan runs a tensor-core engine with tile candidates (tma, igemm, or the
    slab engine on tensor cores, also as the body of a sequence: the stem's conv before its pool),
    or runs on FFMA a layer the slab engine can run too (`slab_instead`)."""
    plan = heuristic(spec)
    if plan["engine"] == "sequence" and gemm_engine(plan) is not None:
        return bool(candidates(spec))  # ([] for a fold's body, whose tile configs make a layer no GEMM engine runs)
    return gemm_engine(plan) is not None or slab_part(plan) is not None or slab_instead(spec, plan) is not None


def _body(plan: dict) -> dict:
    """The plan, or a sequence's body (its conv): the part a tile config sets (`tail.plan_sequence`,
    `tail._rest_settings`)."""
    return next(p["plan"] for p in plan["parts"] if p["role"] == "body") if plan["engine"] == "sequence" else plan


def gemm_engine(plan: dict) -> str | None:
    """The GEMM engine ("igemm", "tma") that runs the plan, or a sequence's body (the conv before a
    norm's statistics); None for the others."""
    engine = _body(plan).get("engine")
    return engine if engine in ("igemm", "tma") else None


def slab_instead(spec: LayerSpec, plan: dict) -> dict | None:
    """For a layer the planner puts on FFMA register tiles (alone or as a sequence's body) because
    its GEMM looked too small for tensor cores (`plan.MMA_MIN_K`, `plan.MMA_MIN_CHANNELS`: KernelBench
    24's 24 output channels, say), the slab engine's plan of it, whose candidates the tuner then
    times against the FFMA kernel; None where the layer is on another engine or the slab engine
    cannot run it (groups, a pool before the output, a transposed conv)."""
    if _body(plan).get("engine") != "ffma":
        return None
    try:
        slab = plan_with(spec, SlabConfig(0))
    except (PlanError, ValueError):
        return None
    return slab if slab_part(slab) is not None else None


def slab_part(plan: dict) -> dict | None:
    """The plan's slab engine on tensor cores: the plan itself, or a sequence's body (a
    `plan.SlabConfig` is the body's there: `tail._rest_settings`); None if neither runs it."""
    body = _body(plan)
    return body if body["engine"] == "slab" and body["mma"] is not None else None


def _tuning_target():
    return targets.current() or targets.DEFAULT


def candidates(spec: LayerSpec) -> list:
    """At most MAX_CANDIDATES tile configs that plan for this layer, the planner's own first; [] when the
    layer runs on neither tensor-core engine with tiles. On Hopper both engines' tiles are tried
    where both can run the layer. (Whether they compile without spills is decided by
    `build_candidates`.)"""
    plan = heuristic(spec)
    engine = gemm_engine(plan)
    if slab_part(plan) is not None:
        return slab_candidates(spec, plan)
    if (slab := slab_instead(spec, plan)) is not None:  # an FFMA layer: the slab engine's tiles against it
        return ([SlabConfig(0)] + slab_candidates(spec, slab))[:MAX_CANDIDATES]
    if engine is None:
        return []
    body = _body(plan)  # (the plan itself, or a sequence's body: the candidates are its tiles)
    own = body[engine].config
    out = [own]
    if engine == "igemm" and body["igemm"].w_pairs:  # a strided transposed conv: also one phase per block
        out.append(replace(own, phases_per_block=1))
    target = _tuning_target()
    if engine == "tma" and spec.conv.transposed:
        # the stride phases on the implicit GEMM too: its planner's tile (W pairs) and one phase per block
        ig = igemm.planner_config(spec, math.prod(spec.conv_geometry()["kernel"]), target)
        for cfg in (ig, replace(ig, phases_per_block=1)):
            try:
                if cfg not in out and gemm_engine(plan_with(spec, cfg)) == "igemm":
                    out.append(cfg)
            except (PlanError, ValueError):
                continue
    if tma.has_tma_engine(target):
        for cfg in tma.configs(spec, target):
            if cfg in out:
                continue
            try:
                if gemm_engine(plan_with(spec, cfg)) == "tma":
                    out.append(cfg)
            except (PlanError, ValueError):
                continue
    natural_bk = _cip_and_bk(spec.input.channels)[1]  # the largest K chunk the channels allow
    wgmma_ok = igemm.wgmma_fits(spec.input.channels)
    for _, cfg in _templates(spec.precision == "fp32", spec.conv.out_channels, wgmma_ok):
        if not cfg.wgmma:
            cfg = IgemmConfig(**{**asdict(cfg), "bk": min(cfg.bk, natural_bk)})
        if cfg in out:
            continue
        try:
            if gemm_engine(plan_with(spec, cfg)) == "igemm":
                out.append(cfg)
        except (PlanError, ValueError):
            continue
    if plan["engine"] == "sequence" and len(out) == 1:
        return []  # (the body's own tile alone: nothing to time it against)
    return out[:MAX_CANDIDATES]


# The slab engine's candidates: mma.sync warp tiles that won or came close in the v40 sweeps (kb90's
# 2 x 4, kb65's 2 x 4 against the planner's 3 x 2) and their neighbours; on Hopper the same layer on
# wgmma, with the planner's slab and with taller slabs (one block per SM, more positions per wgmma),
# and with the next slab's rows prefetched into registers or not (the planner's slab).
SLAB_WARP_TILES = ((2, 4), (4, 2), (3, 2), (2, 2), (1, 4), (4, 1))
SLAB_WGMMA_ROWS = (0, 4, 8)
# wgmma boxes of 4 and 8 slabs, and blocks walking the batch's boxes or not (NOTES v47: on kb90 8
# slabs won at batch 128; walking lost on kb90 in fp32 and won a little on it as a tf32 layer)
SLAB_WGMMA_BOX_SLABS = (4, 8)
# The wgmma slab among the slab engine's candidates on Hopper (its GPU tests, tests/test_slab_wgmma.py,
# passed on an H200: benchmarks/NOTES.md, v43).
SLAB_WGMMA_CANDIDATES = True


def slab_candidates(spec: LayerSpec, plan: dict) -> list:
    """The slab engine's candidates that plan for this layer (the heuristic plan is measured as
    well, first): mma.sync with the planner's and other warp tiles, and wgmma where the target has
    it and the layer allows it (`plan.wgmma_why_not`). Plans that come out the same as one already listed are left out."""
    seen = {_slab_shape(slab_part(plan)["mma"], _box_folded(plan))}
    out = []
    wgmma = [SlabConfig(1, slab_h=h) for h in SLAB_WGMMA_ROWS] + [SlabConfig(1, prefetch=p) for p in (1, 2)] \
        + [SlabConfig(1, box_slabs=n) for n in SLAB_WGMMA_BOX_SLABS] + [SlabConfig(1, walk=w) for w in (1, 2)] \
        if SLAB_WGMMA_CANDIDATES and igemm.has_wgmma(_tuning_target()) else []
    # (SlabConfig(0): mma.sync with the planner's warp tile, where the heuristic runs wgmma)
    cfgs = [SlabConfig(0)] + [SlabConfig(0, wm, wn) for wm, wn in SLAB_WARP_TILES] + wgmma
    if boxfold.find(spec, enabled=True) is not None:
        # the layer the other way too: without its box fold (the avg-pool fold in one kernel) where the
        # planner takes the fold, with it where the planner does not (`boxfold.ENABLED`), on the best
        # tiles of the seeds' sweeps, so a stored choice takes the fold only where it measured faster
        other = 2 if _box_folded(plan) else 1
        # (and on wgmma, with the planner's slab and prefetching: the planner's choice for a folded
        # layer's 1x1 conv since v46)
        cfgs[1:1] = [SlabConfig(0, box_fold=other)] + [SlabConfig(0, wm, wn, box_fold=other) for wm, wn in SLAB_WARP_TILES[:2]] \
            + ([SlabConfig(1, box_fold=other), SlabConfig(1, prefetch=1, box_fold=other)] if wgmma else [])
    for cfg in cfgs:
        try:
            got = plan_with(spec, cfg)
        except (PlanError, ValueError):
            continue
        part = slab_part(got)
        shape = None if part is None else _slab_shape(part["mma"], _box_folded(got))
        if shape is None or shape in seen:
            continue
        seen.add(shape)
        out.append(cfg)
    return out[:MAX_CANDIDATES]


def _slab_shape(mma, folded: bool = False) -> tuple:
    return (mma.wgmma, mma.wm, mma.wn, tuple(mma.slab), tuple(mma.box), mma.nb, mma.prefetch, mma.walk, folded)


def _box_folded(plan: dict) -> bool:
    """Whether the plan is a box fold's sequence (specgen.boxfold)."""
    return plan["engine"] == "sequence" and any(p["role"] == "boxmean" for p in plan["parts"])


@dataclass
class Candidate:
    config: IgemmConfig | TmaConfig | None  # None: the heuristic plan as the pipeline builds it
    item: pipeline.Specialized | None = None
    error: str = ""
    ms: float = math.nan
    rel_l2: float = math.nan
    ok: bool = False

    @property
    def name(self) -> str:
        if self.config is None:
            plan = self.item.plan
            if (part := slab_part(plan)) is not None:
                mma = part["mma"]
                fold = ", box fold" if _box_folded(plan) else ""
                box = f", {mma.slabs[0] * mma.slabs[1]} slabs a box" + (", walking" if mma.walk else "") if mma.wgmma else ""
                return "heuristic (" + label(SlabConfig(1, slab_h=mma.slab[1], prefetch=1 if mma.prefetch else 2) if mma.wgmma
                                             else SlabConfig(0, mma.wm, mma.wn)) + box + fold + ")"
            engine = gemm_engine(plan)
            if engine is None:  # (FFMA register tiles: `slab_instead`)
                return "heuristic (fp32 FFMA)"
            return "heuristic (" + label(_body(plan)[engine].config) + ")"
        return label(self.config)


def build_candidates(specs: list[LayerSpec], arch: str | None = None) -> list[list[Candidate]]:
    """Every spec's heuristic plan and candidates, compiled in one parallel batch. A candidate that
    fails to compile or spills registers comes back with `error` set; the planner's own tile is
    the first entry (as the pipeline builds it), not repeated."""
    jobs = []  # (spec index, config, plan, source, request)
    for i, spec in enumerate(specs):
        for cfg in candidates(spec):
            plan, source, req = pipeline.request(spec, arch, igemm_config=cfg)
            jobs.append((i, cfg, plan, source, req))
    builds = _build_all([j[4] for j in jobs])
    out: list[list[Candidate]] = []
    for spec in specs:
        base = pipeline.specialize(spec, arch, tuned=False) if tunable(spec) else None
        out.append([Candidate(None, base)] if base is not None else [])
    for (i, cfg, plan, source, _), build in zip(jobs, builds):
        cand = Candidate(cfg)
        if isinstance(build, CompileError):
            cand.error = "does not compile"
        elif build.spill_bytes:
            cand.error = f"spills {build.spill_bytes} bytes"
        else:
            cand.item = pipeline.Specialized(specs[i], plan, source, build)
            if cand.item.key == out[i][0].item.key:
                continue  # the heuristic's own kernel, already first
        out[i].append(cand)
    return out


def _build_all(reqs: list) -> list:
    """build_many, but a request that fails to compile yields its CompileError instead of
    aborting the batch (the others were published by then: building them again is a hit)."""
    try:
        return cache.build_many(reqs)
    except CompileError:
        results = []
        for req in reqs:
            try:
                results.append(cache.get_or_build(req))
            except CompileError as err:
                results.append(err)
        return results


# ---------------------------------------------------------------------------- GPU identity


@functools.lru_cache(maxsize=None)
def current_gpu() -> dict | None:
    """The first visible GPU: {"gpu": "NAME (N SMs)", "arch": "sm_XY", "driver": int}, read
    through the CUDA driver; None without a driver or a GPU."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    dev, count, version = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    if lib.cuInit(0) or lib.cuDeviceGetCount(ctypes.byref(count)) or count.value < 1:
        return None
    if lib.cuDeviceGet(ctypes.byref(dev), 0) or lib.cuDriverGetVersion(ctypes.byref(version)):
        return None
    name = ctypes.create_string_buffer(256)
    attrs = {}
    for what, attr in (("sms", 16), ("major", 75), ("minor", 76)):
        value = ctypes.c_int()
        if lib.cuDeviceGetAttribute(ctypes.byref(value), attr, dev):
            return None
        attrs[what] = value.value
    if lib.cuDeviceGetName(name, 256, dev):
        return None
    return {
        "gpu": f"{name.value.decode(errors='replace')} ({attrs['sms']} SMs)",
        "arch": f"sm_{attrs['major']}{attrs['minor']}",
        "driver": version.value,
    }


# ---------------------------------------------------------------------------- the choice store


def signature(spec: LayerSpec) -> str:
    """The spec as far as a tile's speed depends on it: its canonical JSON without the layer's name,
    the names of its tensors (parameters, extra inputs, saved values) replaced by their order of
    first use. Two layers of one shape and epilogue, named apart, have one signature."""
    data = spec.canonical()
    del data["name"]
    names = set(spec.params()) | set(spec.inputs())
    names.update(stage.args.name for stage in spec.epilogue if stage.op == "save")
    renamed: dict[str, str] = {}

    def walk(value):  # (dicts in canonical()'s field order: the same order for specs of one structure)
        if isinstance(value, dict):
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v) for v in value]
        if isinstance(value, str) and value in names:
            return renamed.setdefault(value, f"t{len(renamed)}")
        return value

    return json.dumps(walk(data), sort_keys=True, separators=(",", ":"))


def choice_key(spec: LayerSpec, gpu: str, driver: int, bucket: int, sig: str | None = None) -> str:
    """sha256 hex over everything a tuned choice depends on (`sig`: the spec's `signature`, when
    the caller has it)."""
    material = {
        "schema": SCHEMA, "kind": "tensor_core_tile", "spec": sig or signature(spec), "precision": spec.precision,
        "gpu": gpu, "driver": driver, "bucket": bucket,
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


def _store_dir():
    return cache.cache_dir() / SUBDIR


def store_choice(spec: LayerSpec, gpu: dict, bucket: int, chosen, table: list[dict],
                 batch: int) -> bool:
    """Keep a tuned choice (None: the heuristic plan won) atomically."""
    key = choice_key(spec, gpu["gpu"], gpu["driver"], bucket)
    record = {
        "schema": SCHEMA, "name": spec.name, "precision": spec.precision, "gpu": gpu["gpu"], "driver": gpu["driver"],
        "bucket": bucket, "batch": batch, "config": config_record(chosen),
        "label": "heuristic" if chosen is None else label(chosen), "candidates": table, "created": time.time(),
    }
    ok = measured.store(key, record, subdir=SUBDIR)
    sig = signature(spec)
    pipeline.forget_where(lambda other: signature(other) == sig)  # (every layer the choice serves)
    return ok


def load_choice(spec: LayerSpec, gpu: str, driver: int, bucket: int, sig: str | None = None) -> dict | None:
    """The stored record, or None (missing, unreadable, or a config that no longer plans)."""
    key = choice_key(spec, gpu, driver, bucket, sig)
    try:
        record = json.loads((_store_dir() / f"{key}.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("key") != key or "config" not in record:
        return None
    cfg = record["config"]
    if cfg is not None:
        try:
            cfg = config_from(cfg)
            plan_with(spec, cfg)
        except (KeyError, TypeError, ValueError, PlanError):
            get_logger().info("ignoring a stored tuned choice for %s: it no longer plans", spec.name)
            return None
    return {**record, "config": cfg}


def stored_choice(spec: LayerSpec, arch: str | None = None, bucket: int | None = None) -> dict | None:
    """The stored record for this GPU (and `arch`, when given, must be its arch): of `bucket`, or
    when None, of the largest bucket tuned. None without a GPU or a record."""
    gpu = current_gpu()
    if gpu is None or (arch is not None and arch != gpu["arch"]):
        return None
    buckets = [bucket] if bucket is not None else [1 << b for b in range(MAX_BUCKET_LOG2, -1, -1)]
    sig = signature(spec)
    for b in buckets:
        record = load_choice(spec, gpu["gpu"], gpu["driver"], b, sig)
        if record is not None:
            return record
    return None


def list_choices() -> list[dict]:
    """Every stored tuned choice (name, precision, gpu, driver, bucket, label, times), newest first."""
    rows = []
    for path in sorted(_store_dir().glob("*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and record.get("schema") == SCHEMA and "label" in record:
            rows.append(record)
    return sorted(rows, key=lambda r: r.get("created", 0), reverse=True)


def autotune_env() -> bool:
    return os.environ.get(ENV_AUTOTUNE, "").strip().lower() in ("1", "true", "yes", "on")


# ---------------------------------------------------------------------------- measuring


@dataclass
class Result:
    spec: LayerSpec
    batch: int
    bucket: int
    gpu: str
    candidates: list[Candidate] = field(default_factory=list)
    chosen: Candidate | None = None
    stored: bool = False
    alike: list[str] = field(default_factory=list)  # the other layers of its signature, served by its choice

    def table(self) -> str:
        base = self.candidates[0].ms
        also = f" (its choice also serves {', '.join(self.alike)})" if self.alike else ""
        lines = [f"{self.spec.name} ({self.spec.precision}, batch {self.batch}, bucket {self.bucket}) on {self.gpu}{also}:"]
        for c in self.candidates:
            mark = "*" if c is self.chosen else " "
            if c.item is None or math.isnan(c.ms):
                lines.append(f" {mark} {c.name:44}  skipped: {c.error}")
                continue
            verdict = "ok" if c.ok else "WRONG"
            lines.append(
                f" {mark} {c.name:44} {c.ms:9.4f} ms  {base / c.ms:5.2f}x  rel L2 {c.rel_l2:.2e} {verdict}"
                f"  {c.item.build.registers} regs"
            )
        return "\n".join(lines)

    def rows(self) -> list[dict]:
        return [
            {"label": c.name, "ms": None if math.isnan(c.ms) else round(c.ms, 5),
             "rel_l2": None if math.isnan(c.rel_l2) else c.rel_l2, "ok": c.ok, "error": c.error}
            for c in self.candidates
        ]


def _inputs(spec: LayerSpec, batch: int, torch, device) -> list:
    """Fresh normal random inputs, enough sets that together they exceed twice the L2 cache."""
    from specgen.torchop import PRECISION_DTYPE

    shape = (batch, spec.input.channels, *spec.input.size)
    dtype = PRECISION_DTYPE[spec.precision]
    nbytes = torch.empty((), dtype=dtype).element_size() * math.prod(shape)
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 << 20)
    sets = max(2, min(MAX_INPUT_SETS, math.ceil(2 * l2 / max(1, nbytes))))
    return [torch.randn(shape, device=device).to(dtype) for _ in range(sets)]


def _tensors(spec: LayerSpec, torch, device) -> tuple:
    from specgen import reference

    from specgen.torchop import PRECISION_DTYPE

    module = reference.Reference(spec).to(device=device, dtype=PRECISION_DTYPE[spec.precision])
    conv = module.conv
    with torch.no_grad():
        fan_in = conv.weight[0].numel()
        conv.weight.copy_(torch.randn_like(conv.weight) / math.sqrt(fan_in))
        if conv.bias is not None:
            conv.bias.copy_(torch.randn_like(conv.bias) * 0.1)
    return conv.weight.detach(), None if conv.bias is None else conv.bias.detach(), {
        k: v.detach() for k, v in module.named_spec_params().items()
    }


def _rel_l2(out, ref64) -> float:
    diff = out.double() - ref64
    return (diff.norm() / ref64.norm().clamp_min(1e-30)).item()


def measure(spec: LayerSpec, cands: list[Candidate], batch: int, reps: int = REPS) -> None:
    """Time and check each built candidate in place (`ms`, `rel_l2`, `ok`)."""
    import torch

    from specgen import reference, torchop

    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    xs = _inputs(spec, batch, torch, device)
    weight, bias, params = _tensors(spec, torch, device)
    # the spec's extra inputs: random, of the output's shape (the launch reads them among the tensors)
    params.update({name: torch.randn((batch, *shape), device=device, dtype=xs[0].dtype) for name, shape in spec.inputs().items()})
    live = [c for c in cands if c.item is not None]
    outs = [torch.empty(spec.output_shape(batch), device=device, dtype=xs[0].dtype) for _ in live]
    with torch.no_grad():
        ref64 = reference.forward64(spec, xs[0], weight, bias, params)
        for c, out in zip(live, outs):
            out.fill_(float("nan"))
            torchop.launch(c.item, xs[0], weight, bias, params, out)
            torch.cuda.synchronize()
            c.rel_l2 = _rel_l2(out, ref64) if bool(torch.isfinite(out).all()) else math.inf
        base = cands[0].rel_l2
        bar = FP32_BAR if spec.precision == "fp32" else TF32_FACTOR * base + TF32_SLACK
        for c in live:
            c.ok = c.rel_l2 <= bar
        fns = [functools.partial(lambda item, out, x: torchop.launch(item, x, weight, bias, params, out), c.item, out)
               for c, out in zip(live, outs)]
        try:  # the GPU's time per call: a batch-1 layer's host time would otherwise decide
            times = measured.time_graphed(fns, xs, reps, WARMUP)
        except Exception as error:  # noqa: BLE001  (a launch a CUDA graph cannot capture: timed as called)
            get_logger().info("tuning %s: timed outside CUDA graphs (%s: %s)", spec.name, type(error).__name__, error)
            torch.cuda.synchronize()
            times = measured.time_loops(fns, xs, reps, WARMUP)
    for c, t in zip(live, times):
        c.ms = t


def tune(specs: list[LayerSpec], batch: int = DEFAULT_TUNE_BATCH, reps: int = REPS, arch: str | None = None,
         store: bool = True) -> list[Result]:
    """Build, time and check every tunable spec's candidates; keep each spec's fastest correct one.
    Needs a CUDA GPU (torch). Specs that do not run on the implicit-GEMM engine are left out."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("tuning times kernels on a CUDA GPU; none is available")
    bucket = measured.batch_bucket(batch)
    gpu = current_gpu()
    if gpu is None:
        raise RuntimeError("the CUDA driver does not report a GPU")
    # layers of one signature share a choice: tuned once, as the first of them
    first: dict[str, LayerSpec] = {}
    alike: dict[str, list[str]] = {}
    for spec in specs:
        if tunable(spec):
            sig = signature(spec)
            first.setdefault(sig, spec)
            alike.setdefault(sig, []).append(spec.name)
    todo = list(first.values())
    results = []
    for (sig, spec), cands in zip(first.items(), build_candidates(todo, arch)):
        measure(spec, cands, batch, reps)
        result = Result(spec, batch, bucket, gpu["gpu"], cands, alike=alike[sig][1:])
        correct = [c for c in cands if c.ok and not math.isnan(c.ms)]
        result.chosen = min(correct, key=lambda c: c.ms) if correct else cands[0]
        if store and correct:
            result.stored = store_choice(spec, gpu, bucket, result.chosen.config, result.rows(), batch)
        results.append(result)
    return results


def ensure_tuned(specs: list[LayerSpec], batch: int = DEFAULT_TUNE_BATCH, arch: str | None = None) -> None:
    """Tune the tunable specs that have no stored choice for this GPU and batch bucket (on the
    spot: `tune=True` or SPECGEN_AUTOTUNE=1). Nothing without a GPU."""
    gpu = current_gpu()
    if gpu is None or (arch is not None and arch != gpu["arch"]):
        return
    bucket = measured.batch_bucket(batch)
    missing = [s for s in specs if stored_choice(s, arch, bucket) is None and tunable(s)]
    if missing:
        get_logger().info("tuning %d layer(s) for batch bucket %d", len(missing), bucket)
        tune(missing, batch, arch=arch)


# ---------------------------------------------------------------------------- `specgen tune`


def main(specs: list[LayerSpec], batch: int = DEFAULT_TUNE_BATCH, reps: int = REPS) -> int:
    """`specgen tune`: 0 when every tunable spec got a choice (or none is tunable); 1 when a
    layer's kernels were all wrong; 2 on bad arguments or without a CUDA GPU (as `specgen check`:
    nothing was measured, so nothing can be kept)."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"--batch: expected a positive int, got {batch!r}")
    if isinstance(reps, bool) or not isinstance(reps, int) or reps < 1:
        raise ValueError(f"--reps: expected a positive int, got {reps!r}")
    todo = []
    for spec in specs:
        if tunable(spec):
            todo.append(spec)
        else:
            engine = heuristic(spec)["engine"]
            print(f"{spec.name}: runs on the {engine} engine{' off tensor cores' if engine == 'slab' else ''}, "
                  "which has no tile candidates: nothing to tune")
    if not todo:
        return 0
    try:
        import torch

        gpu_ok = torch.cuda.is_available()
    except ImportError:
        gpu_ok = False
    if not gpu_ok or current_gpu() is None:
        print("specgen tune: needs a CUDA GPU to time the candidates, and none is available "
              f"({len(todo)} layer(s) left untuned)", file=sys.stderr)
        return 2
    failed = 0
    for result in tune(todo, batch, reps):
        print(result.table(), flush=True)
        chosen = result.chosen
        if not chosen.ok:
            failed += 1
            print(f"  no candidate is within the {result.spec.precision} bar: nothing kept")
        else:
            where = "kept" if result.stored else "NOT kept (the cache cannot be written)"
            print(f"  chosen: {chosen.name}, {result.candidates[0].ms / chosen.ms:.2f}x the heuristic; {where}")
    return 1 if failed else 0
