"""spec -> plan -> .cu -> cubin, through the cache. No torch: this is what `specgen build` runs.

`specialize` and `specialize_many` look a request up in the request index first
(`specgen.planindex`): on a hit the stored plan and the cached build are returned without planning
or rendering; on a miss the spec is planned, rendered and built, and the index entry written.
"""

from __future__ import annotations

import functools
import math
import os
import threading
from dataclasses import dataclass, replace

from specgen import cache, planindex, target as targets, tma
from specgen.log import get_logger
from specgen.measured import batch_bucket
from specgen.ops import stage_kind
from specgen.plan import DEFAULT_SETTINGS, PlanError, Settings, SlabConfig, build_plan
from specgen.render import render_plan
from specgen.spec import LayerSpec


@dataclass(frozen=True)
class Specialized:
    """A spec, its plan and its compiled, cached kernel."""

    spec: LayerSpec
    plan: dict
    source: str
    build: cache.BuildResult
    arch: str | None = None  # the arch asked for (None: the current GPU's): a variant is planned for it too
    # planned with the stored tuned choice (of the largest batch bucket tuned): a call at a batch
    # bucket tuned apart takes that bucket's choice (`batch_variant`)
    follows_tuning: bool = False

    @property
    def key(self) -> str:
        return self.build.key

    @functools.cached_property
    def launch(self) -> planindex.LaunchSpec:
        """How the runtime launches the plan's kernel (grid, block, shared memory, cluster policy)."""
        return planindex.launch_spec(self.plan)


_memo: dict[tuple[str, str | None], Specialized] = {}
_memo_lock = threading.Lock()


def request(spec: LayerSpec, arch: str | None = None, runtime_dims: bool = False, igemm_config=None,
            settings: Settings = DEFAULT_SETTINGS) -> tuple[dict, str, cache.BuildRequest]:
    """Plan `spec` for `arch`'s target (None: this GPU's, else sm_90) and render it. The banner names
    the target and every limit of it the plan used, so they are part of the source and the cache key.
    A `target.TargetError` (an arch older than sm_80 or unknown, or a spec that cannot fit it) comes
    before anything is compiled. `igemm_config` is a planner setting for a tile: an
    `igemm.IgemmConfig`, a `tma.TmaConfig` or a `plan.SlabConfig` (each makes its engine run); `settings` the other
    planner settings (`plan.Settings`: never written into the spec). A plan on Hopper's
    wgmma (the TMA engine, the implicit GEMM's or the slab engine's wgmma tiles) is built for sm_90a (its
    instruction set)."""
    tma_config = igemm_config if isinstance(igemm_config, tma.TmaConfig) else None
    if isinstance(igemm_config, SlabConfig):  # the slab engine's candidate: a planner setting of its own
        settings, igemm_config = replace(settings, slab=igemm_config), None
    ig_config = None if tma_config is not None else igemm_config
    plan = build_plan(spec, ig_config, targets.resolve(arch), tma_config, settings)
    arch = build_arch(plan, arch)
    source = render_plan(plan, runtime_dims=runtime_dims)
    return plan, source, cache.BuildRequest(spec.name, source, spec.canonical_json(), arch)


def build_arch(plan: dict, arch: str | None) -> str | None:
    """The arch a plan builds for: `arch`, or sm_90a where the plan runs on Hopper's wgmma (the TMA
    engine, the implicit GEMM's or the slab engine's wgmma tiles, a sequence's body included), whose
    instructions exist only there. PlanError if `arch` names another GPU."""
    ig, slab = plan.get("igemm"), plan.get("mma")
    if plan["engine"] == "tma" or plan.get("tma") is not None or (ig is not None and ig.wgmma) \
            or (slab is not None and slab.wgmma):  # (a sequence's body too)
        if arch not in (None, "sm_90", "sm_90a"):
            raise PlanError([f"tile: the {plan['engine']} engine's wgmma plan runs on sm_90a (H100/H200) only, not {arch}"])
        return "sm_90a"
    return arch


def specialize_runtime_dims(spec: LayerSpec, arch: str | None = None) -> Specialized:
    """The same template rendered with run-time extents: for `specgen bench` only."""
    plan, source, req = request(spec, arch, runtime_dims=True)
    return Specialized(spec, plan, source, cache.get_or_build(req))


def _without_spills(item: Specialized, arch: str | None, igemm_config=None,
                    settings: Settings | None = None) -> Specialized:
    """A build that spilled registers under the planner's occupancy hint (two blocks per SM caps a
    thread's registers) is built again with one block per SM (a planner setting: the spec, its
    banner and its cache key stay the user's), and kept if it spills less. A `tile.min_blocks` the
    user wrote is left alone. One that still spills with a tf32 layer's exact sums
    (`plan.Settings.exact_sums`) is built once more with the running sum (its accuracy is fp32
    mode's), and kept if it spills less. A wgmma slab that prefetches the next slab's rows (the
    planner's choice) and still spills is built once more without the prefetch.

    Then, where the planner chose the tile (no tuned config, no tile in the spec), a smaller tile
    of the same engine, kept if it spills less: a TMA tile of 128 positions instead of 256 (half
    the accumulators a consumer thread holds through the epilogue). The FFMA and slab engines keep
    the planner's tile (timed: their smaller tiles were mostly slower, SPILL_RETRY_ENGINES). A
    build that does not spill is never rebuilt."""
    spec = item.spec
    pinned = spec.tile is not None and spec.tile.min_blocks
    one_block = 1 if item.plan["min_blocks"] > 1 and not pinned else None
    settings = DEFAULT_SETTINGS if settings is None else settings
    retries = [replace(settings, min_blocks=one_block)] if one_block else []
    if getattr(item.plan.get("settings"), "exact_sums", False):
        retries.append(replace(settings, min_blocks=one_block, exact_sums=False))
    mma = item.plan.get("mma")
    if mma is not None and mma.wgmma and mma.prefetch and (settings.slab is None or not settings.slab.prefetch):
        # the wgmma slab's prefetched rows take registers: without them (the planner's prefetch only)
        retries.append(replace(settings, slab=replace(settings.slab or SlabConfig(1), wgmma=1, prefetch=2)))
    retries = [(retry, igemm_config) for retry in retries]
    if igemm_config is None and spec.tile is None and settings.slab is None:
        retries += _smaller_tiles(item.plan, replace(settings, min_blocks=one_block))
    for retry, config in retries:
        if item.build.spill_bytes == 0:
            break
        plan, source, req = request(spec, arch, igemm_config=config, settings=retry)
        build = cache.get_or_build(req)
        if build.spill_bytes < item.build.spill_bytes:
            item = Specialized(spec, plan, source, build)
    return item


# The spill retry's smaller tiles, timed (benchmarks/spill_retry.py, NOTES v50, on an H100): the
# TMA engine's 128-position tile beat its spilling 256-position one at batch 16 and 128 (1.08x to
# 1.37x); the FFMA engine's tile of half the channels lost in 3 of 4 (0.53x to 1.14x: a grouped
# 5x5 conv went from 1.10 to 2.08 ms at batch 128) and the mma.sync slab's half warp tile in 1 of
# 2 (0.76x at batch 16, 1.02x at 128). A small spill costs those engines less than the smaller
# tile: they keep the planner's (`specgen tune` times the slab's warp tiles; not the FFMA cap).
SPILL_RETRY_ENGINES = ("tma",)


def _smaller_tiles(plan, settings: Settings) -> list[tuple[Settings, object]]:
    """The spill retry's smaller tiles of the engine `plan` runs on, as (settings, tile config):
    the TMA engine's 128-position tile for its 256-position one (SPILL_RETRY_ENGINES)."""
    tp = plan.get("tma")
    if plan.get("engine") in SPILL_RETRY_ENGINES and tp is not None and tp.config.bm == 256 and tp.config.blocks_per_sm == 1:
        return [(settings, replace(tp.config, bm=128))]
    return []


def _tuned_config(spec: LayerSpec, arch: str | None):
    """The tile `specgen tune` stored for this GPU (largest batch bucket tuned), or None. With
    SPECGEN_AUTOTUNE=1 a layer without one is tuned first (batch 64). No GPU: None, no torch."""
    from specgen import tune

    if tune.current_gpu() is None:
        return None
    if tune.autotune_env():
        tune.ensure_tuned([spec], arch=arch)
    record = tune.stored_choice(spec, arch)
    return None if record is None else record["config"]


def _request_key(spec: LayerSpec, arch: str | None, config, canonical: str | None = None,
                 settings: Settings | None = None) -> str | None:
    """The request index key of `specialize(spec, arch)` with tile `config` (`planindex.request_key`),
    or None where it cannot be had without planning (an arch specgen has no target for, no
    compiler): that request takes the planning path, which reports why."""
    try:
        canonical = spec.canonical_json() if canonical is None else canonical
        settings = DEFAULT_SETTINGS if settings is None else settings
        return planindex.request_key(canonical, arch, targets.resolve(arch), settings, config)
    except Exception as error:  # noqa: BLE001  (planning reports it, in its order)
        get_logger().debug("%s: no request key (%s); planning", spec.name, error)
        return None


def _indexed(spec: LayerSpec, rkey: str | None) -> Specialized | None:
    """The request's stored plan and cached build, or None (no entry, a damaged or mismatching one,
    a build entry gone): then it is planned, rendered and built as on a miss."""
    if rkey is None or cache.always_compile():
        return None
    record, problem = cache.read_index(rkey)
    if record is not None:
        problem = planindex.check_record(record, rkey)
    plan = None
    if record is not None and problem is None:
        try:
            plan = planindex.record_plan(record)
        except Exception as error:  # noqa: BLE001  (a damaged entry, whatever the damage)
            problem = f"its plan cannot be read ({error})"
    if problem is not None:
        get_logger().warning("request index entry %s for %s is invalid (%s); planning again", rkey[:12], spec.name,
                             problem)
    if plan is None:
        return None
    found = cache.lookup(record["build_key"], record["cu_sha256"], record["cubin_sha256"])
    if found is None:
        return None
    build, source = found
    return Specialized(spec, plan, source, build)


def _remember(rkey: str | None, item: Specialized) -> None:
    """Write the request's index entry, so that the next process finds it without planning."""
    if rkey is None:
        return
    try:
        record = planindex.entry_record(rkey, item.spec.name, item.plan, item.build)
    except Exception as error:  # noqa: BLE001  (a plan that cannot be stored is planned every time)
        get_logger().debug("%s: plan not stored in the request index (%s)", item.spec.name, error)
        return
    if record is not None:
        cache.write_index(rkey, record)


def forget(spec: LayerSpec) -> None:
    """Drop this spec's memoized kernels and batch variants."""
    key = spec.canonical_json()
    forget_where(lambda other: other.canonical_json() == key)


def forget_where(alike) -> None:
    """Drop the memoized kernels of every spec for which `alike(spec)` is true (a tuned choice
    stored for one layer serves all layers of its signature), and their batch variants."""
    with _memo_lock:
        for memo in (_memo, _batch_variants):
            for k in [k for k, item in memo.items() if alike(item.spec)]:
                del memo[k]


_batch_variants: dict[tuple, Specialized] = {}

# The small-batch rule, off unless SPECGEN_SMALL_BATCH=1: a call of a few samples on a layer the
# planner put on the TMA engine (whose tile is chosen for batches of 32 and more) runs on the
# implicit GEMM instead, with this tile: 128 positions x 64 channels, 8 warps of 32 x 32, K chunks
# of 32 in 3 stages, one launch that reads the NC(D)HW input where it lies. It came from
# `specgen tune --batch 1` (benchmarks/NOTES.md v56), which then timed loops of plain launches:
# at batch 1 that timed the host's launch path, longer on the TMA engine, not the kernels. Timed
# on the GPU alone (v57, H100) the TMA kernel of 3x3 512 -> 512 at 14^2, batch 1, took 13.3 us
# (tf32) and 19.3 us (fp32) against this tile's 28.8 and 40.3 us, and the host path was longer
# too (48.6 against 32.9 us per call). v59 timed 24 layer x batch rows (ResNet-18's, VGG's and
# ViT-S/16's layers at batch 1 and 4, `benchmarks/small_batch.py`, H100): the tile's GPU time was
# 1.08-2.74x the TMA kernel's on every one. Off by default, kept as an opt-in until a rule
# measured on the GPU says where the tile wins. It holds where the batch's output positions are
# at most SMALL_BATCH_MAX_POSITIONS (56^2 at batch 1).
SMALL_BATCH_MAX_POSITIONS = 56 * 56
SMALL_BATCH_TILE = dict(warps_m=4, warps_n=2, wm=2, wn=4, bk=32, stages=3)


def small_batch_on() -> bool:
    """Whether small batches leave the TMA plan for the implicit GEMM: only with
    `SPECGEN_SMALL_BATCH=1` (off by default: see SMALL_BATCH_TILE)."""
    return os.environ.get("SPECGEN_SMALL_BATCH", "0") == "1"


def small_batch_config(spec: LayerSpec, plan: dict, arch: str | None, bucket: int):
    """The implicit GEMM's tile for calls of `bucket` samples of the layer `spec` planned as `plan`
    for `arch` (`SMALL_BATCH_MAX_POSITIONS`), or None where that plan serves them: a plan on
    another engine (or a sequence), a transposed conv, a tile in the spec, more positions than
    measured, a 16-bit layer, a pool, reduction or norm after the conv or an upsampled input (none
    of these was measured), a layer the implicit GEMM does not run as one kernel, or the rule
    off (`small_batch_on`: the default)."""
    if not small_batch_on() or plan.get("engine") != "tma" or spec.tile is not None or spec.conv.transposed \
            or spec.precision not in ("fp32", "tf32") or spec.upsampled() \
            or any(stage_kind(stage.op, stage.args) != "pointwise" for stage in spec.epilogue):
        return None
    if bucket * _out_positions(spec) > SMALL_BATCH_MAX_POSITIONS:
        return None
    from specgen.igemm import IgemmConfig, _cip_and_bk

    tile = dict(SMALL_BATCH_TILE)
    tile["bk"] = min(tile["bk"], _cip_and_bk(spec.input.channels)[1])
    config = IgemmConfig(**tile)
    try:
        planned = build_plan(spec, config, targets.resolve(arch))
    except (PlanError, ValueError, targets.TargetError):
        return None
    return config if planned["engine"] == "igemm" else None


def small_batch_largest(spec: LayerSpec, plan: dict, arch: str | None) -> int:
    """The largest batch whose calls take the small-batch tile (`small_batch_config`; batches 1 to
    it), 0 where none does."""
    if small_batch_config(spec, plan, arch, 1) is None:
        return 0
    bucket = 1
    while 2 * bucket * _out_positions(spec) <= SMALL_BATCH_MAX_POSITIONS:  # (the one limit a bucket moves)
        bucket *= 2
    return bucket


def _out_positions(spec: LayerSpec) -> int:
    """The conv's output positions per sample."""
    return math.prod(spec.conv_output().sizes[1:])


# The small-batch box: on the FFMA engine a depthwise conv's box (one input channel per group, a
# conv and pointwise stages) stacks four register tiles on each thread, which suits batches of many
# samples; a call whose batch bucket makes at most half as many blocks as the GPU has SMs runs one
# tile a thread instead (`plan.Settings.stacked_tiles`), about four times the blocks. Measured
# (benchmarks/depthwise_stacking.py, H100, NOTES v65), GPU time of MobileNetV2's depthwise shapes
# and a 5x5: at batch 1 (9-56 stacked blocks) one tile a thread ran 1.47-2.23x faster on all 11;
# at batch 8 (72-448 blocks) and 64 it was 0.55-1.17x, slower on most. False turns the rule off.
SMALL_BATCH_SPREAD = True


def small_batch_settings(spec: LayerSpec, plan: dict, arch: str | None, bucket: int) -> Settings | None:
    """The planner settings of calls of `bucket` samples of the layer `spec` planned as `plan` for
    `arch` (SMALL_BATCH_SPREAD), or None where `plan` serves them: a depthwise conv with pointwise
    stages alone on the FFMA engine whose stacked box gives a call of `bucket` samples at most
    half as many blocks as SMs, a tile in the spec excepted."""
    if not SMALL_BATCH_SPREAD or plan.get("engine") != "ffma" or spec.tile is not None or spec.conv.transposed \
            or spec.conv.groups == 1 or spec.input.channels != spec.conv.groups or spec.upsampled() \
            or any(stage_kind(stage.op, stage.args) != "pointwise" for stage in spec.epilogue):
        return None
    sms = targets.resolve(arch).sm_count or 132
    return Settings(stacked_tiles=False) if 2 * bucket * plan["blocks_per_sample"] <= sms else None


def small_batch_spread_largest(spec: LayerSpec, plan: dict, arch: str | None) -> int:
    """The largest batch bucket whose calls take the box of one tile a thread
    (`small_batch_settings`; batches 1 to it), 0 where none does."""
    bucket = 0
    while small_batch_settings(spec, plan, arch, 2 * bucket or 1) is not None:
        bucket = 2 * bucket or 1
    return bucket


def build_batch_variants(items: list[Specialized], batch: int) -> None:
    """Build the small-batch kernels (`small_batch_config`, `small_batch_settings`) that calls of
    `batch` samples of `items` will take, in one parallel build per kind, so that their first
    calls find them (from_module: the example's batch; a model's layers would otherwise compile
    one by one while being timed)."""
    if batch < 1:
        return
    bucket = batch_bucket(batch)
    from specgen import tune

    wanted: dict = {}  # arch -> {spec: (spec, tile)}
    spread: dict = {}  # (arch, settings) -> {spec: spec}
    for sp in items:
        if not sp.follows_tuning or _variant_key(sp, bucket) in _batch_variants:
            continue
        config = small_batch_config(sp.spec, sp.plan, sp.arch, bucket)
        settings = small_batch_settings(sp.spec, sp.plan, sp.arch, bucket) if config is None else None
        # (the tuning store is read only for a layer a rule applies to: a stored choice wins)
        if (config is None and settings is None) or tune.stored_choice(sp.spec, sp.arch, bucket) is not None:
            continue
        if config is not None:
            wanted.setdefault(sp.arch, {})[sp.spec.canonical_json()] = (sp.spec, config)
        else:
            spread.setdefault((sp.arch, settings), {})[sp.spec.canonical_json()] = sp.spec
    try:
        for arch, todo in wanted.items():
            specialize_many([spec for spec, _ in todo.values()], arch, igemm_configs=[c for _, c in todo.values()])
        for (arch, settings), todo in spread.items():
            specialize_many(list(todo.values()), arch, tuned=False, settings=settings)
    except Exception as error:  # noqa: BLE001  (each is then built, or given up, on its first call)
        get_logger().warning("small-batch kernels not prebuilt (%s: %s)", type(error).__name__, error)


def small_batch_state(engine: str) -> bool | None:
    """The switch a layer planned for `engine` picks its small-batch kernels by, as it stands:
    the implicit GEMM's tile for the TMA engine (`small_batch_on`), the box of one tile a thread
    for the FFMA engine (SMALL_BATCH_SPREAD); None for the others."""
    return small_batch_on() if engine == "tma" else SMALL_BATCH_SPREAD if engine == "ffma" else None


def _variant_key(sp: Specialized, bucket: int) -> tuple:
    """`_batch_variants`' key: the layer's kernel, arch and batch bucket, and both small-batch rules'
    switches as they stand (a switch turned reaches a layer already called)."""
    return sp.key, sp.arch, bucket, small_batch_on(), SMALL_BATCH_SPREAD


def batch_variant(sp: Specialized, batch: int) -> Specialized:
    """The kernel for a call of `batch` samples. `sp`, planned with the stored tuned choice of the
    largest batch bucket tuned (the batch is not known at construction), serves every batch,
    except a batch whose own bucket was tuned to another tile (`specgen tune --batch 1` and
    `--batch 64` of a small-M layer: at batch 1 the implicit GEMM's mma.sync tile, at 64 the TMA
    engine's): that bucket's kernel; and, where its bucket has no tuned choice, a batch of few
    samples on a layer planned for the TMA engine (`small_batch_config`): the implicit GEMM's
    kernel; and for a depthwise conv on the FFMA engine at a batch too small to fill the SMs
    (`small_batch_settings`), its box of one tile a thread. Looked up (and built) on the first
    call per layer and bucket, then kept per process; `sp` itself where it does not follow the tuned choices (a tile given, a candidate
    being tuned)."""
    if not sp.follows_tuning or batch < 1:
        return sp
    key = _variant_key(sp, batch_bucket(batch))
    hit = _batch_variants.get(key)
    if hit is not None:
        return hit
    from specgen import tune

    hit = sp
    record = tune.stored_choice(sp.spec, sp.arch, key[2])
    # (a stored choice of None: the heuristic plan won at that bucket)
    config = record["config"] if record is not None else small_batch_config(sp.spec, sp.plan, sp.arch, key[2])
    settings = small_batch_settings(sp.spec, sp.plan, sp.arch, key[2]) if record is None and config is None else None
    if record is not None or config is not None or settings is not None:
        how = "the tuned choice" if record is not None else "the small-batch tile" if config is not None \
            else "the small-batch box"
        try:
            variant = specialize(sp.spec, sp.arch, igemm_config=config, tuned=False, settings=settings)
        except Exception as error:  # noqa: BLE001  (the layer's own kernel serves every batch: never worse than before)
            get_logger().warning("%s: %s for batch bucket %d does not build (%s: %s); the layer's "
                                 "kernel serves it", sp.spec.name, how, key[2], type(error).__name__, error)
        else:
            hit = sp if variant.key == sp.key else variant
    with _memo_lock:
        _batch_variants[key] = hit
    return hit


def specialize(spec: LayerSpec, arch: str | None = None, igemm_config=None, tuned: bool = True,
               settings: Settings | None = None) -> Specialized:
    """The compiled kernel of `spec`; repeated calls in one process cost a dict lookup.
    `igemm_config` overrides the implicit-GEMM engine's tile (a planner setting, not the spec);
    without one, the tile `specgen tune` stored for this GPU is used, unless `tuned` is False.
    `settings`: other planner settings (`plan.Settings`), e.g. the plan for channels-last inputs."""
    if igemm_config is not None:
        memo_key = (spec.canonical_json(), arch, igemm_config)
    else:
        memo_key = (spec.canonical_json(), arch) if tuned else (spec.canonical_json(), arch, None)
    follows = tuned and igemm_config is None and settings is None
    if settings is not None:
        memo_key += (settings,)
    else:
        settings = DEFAULT_SETTINGS
    hit = _memo.get(memo_key)
    if hit is not None:
        return hit
    with _memo_lock:
        hit = _memo.get(memo_key)
    if hit is None:
        config = igemm_config if igemm_config is not None or not tuned else _tuned_config(spec, arch)
        with _memo_lock:
            hit = _memo.get(memo_key)
            if hit is None:
                rkey = _request_key(spec, arch, config, memo_key[0], settings)
                hit = _indexed(spec, rkey)
                if hit is None:
                    plan, source, req = request(spec, arch, igemm_config=config, settings=settings)
                    hit = _without_spills(Specialized(spec, plan, source, cache.get_or_build(req)), arch, config, settings)
                    _remember(rkey, hit)
                _memo[memo_key] = hit = replace(hit, arch=arch, follows_tuning=follows)
    return hit


def specialize_many(specs: list[LayerSpec], arch: str | None = None, tuned: bool = True,
                    settings: Settings | None = None, igemm_configs: list | None = None) -> list[Specialized]:
    """Several specs at once; the misses compile in parallel. Stored tuned tiles apply as in
    `specialize` (with SPECGEN_AUTOTUNE=1 the untuned layers are tuned first, in one batch).
    `settings` as in `specialize` (the same memo: a later `specialize` with them is a lookup);
    `igemm_configs`: one tile per spec, as `specialize(spec, igemm_config=...)` takes it (then
    no stored choice applies)."""
    configs = [None] * len(specs) if igemm_configs is None else list(igemm_configs)
    if igemm_configs is not None:
        tuned = False
    elif tuned:
        from specgen import tune

        if tune.current_gpu() is not None:
            if tune.autotune_env():
                tune.ensure_tuned(list(specs), arch=arch)
            records = [tune.stored_choice(s, arch) for s in specs]
            configs = [None if r is None else r["config"] for r in records]
    canonical = [s.canonical_json() for s in specs]
    rkeys = [_request_key(s, arch, c, j, settings) for s, c, j in zip(specs, configs, canonical)]
    found: dict[str, Specialized | None] = {}
    for spec, rkey in zip(specs, rkeys):
        if rkey is not None and rkey not in found:
            found[rkey] = _indexed(spec, rkey)
    missing = [i for i, rkey in enumerate(rkeys) if rkey is None or found[rkey] is None]
    prepared = {i: request(specs[i], arch, igemm_config=configs[i], settings=settings or DEFAULT_SETTINGS) for i in missing}
    builds = dict(zip(missing, cache.build_many([prepared[i][2] for i in missing])))
    out = []
    for i, (spec, config, rkey, canon) in enumerate(zip(specs, configs, rkeys, canonical)):
        item = found.get(rkey) if rkey is not None else None
        if item is None:
            plan, source, _ = prepared[i]
            item = _without_spills(Specialized(spec, plan, source, builds[i]), arch, config, settings)
            if rkey is not None and found.get(rkey) is None:
                _remember(rkey, item)
                found[rkey] = item
        elif item.spec is not spec:
            item = Specialized(spec, item.plan, item.source, item.build)
        item = replace(item, arch=arch, follows_tuning=tuned and settings is None)
        memo_key = (canon, arch) if tuned else (canon, arch, config)  # (as `specialize` keys it)
        _memo.setdefault(memo_key if settings is None else memo_key + (settings,), item)
        out.append(item)
    return out


# The engines whose plan for a contiguous input may have a channels-last twin (a sequence's body
# parts are launched, and so varied, one by one).
_VARIED_ENGINES = ("igemm", "slab", "ffma", "tma")
_variants: dict[tuple[str, str | None], Specialized | None] = {}
_CHANNELS_LAST = Settings(channels_last=True)


def _variant_plan(sp: Specialized) -> dict | None:
    """The plan of `sp`'s channels-last kernel where it has one (see `channels_last_variant`)."""
    sequence = sp.plan["engine"] == "sequence"
    if sequence:
        # a sequence has one such plan: a depthwise conv and a LayerNorm over the channels (specgen.dwcl)
        from specgen import dwcl

        if dwcl.why_not(sp.spec) is not None or sp.plan.channels_last_io:
            return None
    elif sp.plan["engine"] not in _VARIED_ENGINES or getattr(sp.plan.get("settings"), "channels_last", False):
        return None
    try:
        plan = build_plan(sp.spec, None, targets.resolve(sp.arch), None, _CHANNELS_LAST)
    except (PlanError, targets.TargetError) as error:
        get_logger().debug("%s: no channels-last plan (%s)", sp.spec.name, error)
        return None
    if sequence:
        return plan if plan["engine"] == "sequence" and plan.channels_last_io else None
    if plan["engine"] == "tma" and (sp.plan["engine"] != "tma" or plan["tma"].channels_last_out):
        return plan
    return None


def channels_last_request(spec: LayerSpec, arch: str | None = None):
    """`request(spec, arch)` for the layer's channels-last kernel (`channels_last_variant`'s, without
    building it: `specgen show --channels-last`), or None where a channels-last input takes the
    contiguous kernel (laid out as NC(D)HW first)."""
    plan = build_plan(spec, None, targets.resolve(arch), None, DEFAULT_SETTINGS)
    if _variant_plan(Specialized(spec, plan, "", None, arch)) is None:
        return None
    return request(spec, arch, settings=_CHANNELS_LAST)


def build_channels_last_variants(items: list[Specialized]) -> None:
    """Build the channels-last kernels of `items` (where they have one) in one parallel build, so
    that their first channels-last calls find them (a model imported to run channels-last)."""
    wanted = [sp for sp in items if (sp.key, sp.arch) not in _variants and _variant_plan(sp) is not None]
    by_arch: dict = {}
    for sp in wanted:
        by_arch.setdefault(sp.arch, []).append(sp.spec)
    for arch, specs in by_arch.items():
        try:
            specialize_many(specs, arch, tuned=False, settings=_CHANNELS_LAST)
        except Exception as error:  # noqa: BLE001  (each variant is then built, or given up, on its first call)
            get_logger().warning("channels-last kernels not prebuilt (%s: %s)", type(error).__name__, error)


def channels_last_variant(sp: Specialized) -> Specialized | None:
    """The kernel for channels-last inputs of `sp`'s layer, where it is not `sp` itself: the TMA
    engine's plan for them (`plan.Settings.channels_last`; for a depthwise conv and a LayerNorm over
    the channels, `specgen.dwcl`'s one kernel), which reads such an input where it lies
    (no layout pass to pay for; a layer whose contiguous plan runs on an engine that reads NC(D)HW
    would copy it first) and writes a channels-last output, as PyTorch's conv does. None where no
    such plan differs from `sp` (a 1-D conv or a reduction over the channels on the TMA engine
    already, or a layer the TMA engine cannot run). Planned, and built, on the first channels-last
    call, then kept per process (the cache keeps the build)."""
    key = (sp.key, sp.arch)
    if key in _variants:
        return _variants[key]
    variant = None
    if _variant_plan(sp) is not None:
        try:
            variant = specialize(sp.spec, sp.arch, tuned=False, settings=_CHANNELS_LAST)
        except Exception as error:  # noqa: BLE001  (the contiguous kernel serves every input: never worse than before)
            get_logger().warning("%s: no channels-last kernel (%s: %s); channels-last inputs take the contiguous one",
                                 sp.spec.name, type(error).__name__, error)
    with _memo_lock:
        _variants[key] = variant
    return variant
