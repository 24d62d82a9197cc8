"""spec -> plan -> .cu -> cubin, through the cache. No torch: this is what `specgen build` runs."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from specgen import cache, target as targets, tma
from specgen.plan import DEFAULT_SETTINGS, PlanError, Settings, build_plan
from specgen.render import render_plan
from specgen.spec import LayerSpec


@dataclass(frozen=True)
class Specialized:
    """A spec, its plan and its compiled, cached kernel."""

    spec: LayerSpec
    plan: dict
    source: str
    build: cache.BuildResult

    @property
    def key(self) -> str:
        return self.build.key


_memo: dict[tuple[str, str | None], Specialized] = {}
_memo_lock = threading.Lock()


def request(spec: LayerSpec, arch: str | None = None, runtime_dims: bool = False, igemm_config=None,
            settings: Settings = DEFAULT_SETTINGS) -> tuple[dict, str, cache.BuildRequest]:
    """Plan `spec` for `arch`'s target (None: this GPU's, else sm_90) and render it. The banner names
    the target and every limit of it the plan used, so they are part of the source and the cache key.
    A `target.TargetError` (an arch older than sm_80 or unknown, or a spec that cannot fit it) comes
    before anything is compiled. `igemm_config` is a planner setting for a tile: an
    `igemm.IgemmConfig` or a `tma.TmaConfig` (either makes its engine run); `settings` the other
    planner settings (`plan.Settings`: never written into the spec). A plan on Hopper's
    wgmma (the TMA engine, or the implicit GEMM's wgmma tiles) is built for sm_90a (its instruction set)."""
    tma_config = igemm_config if isinstance(igemm_config, tma.TmaConfig) else None
    ig_config = None if tma_config is not None else igemm_config
    plan = build_plan(spec, ig_config, targets.resolve(arch), tma_config, settings)
    ig = plan.get("igemm")
    if plan["engine"] == "tma" or plan.get("tma") is not None or (ig is not None and ig.wgmma):  # (a sequence's body too)
        if arch not in (None, "sm_90", "sm_90a"):
            raise PlanError([f"tile: the {plan['engine']} engine's wgmma plan runs on sm_90a (H100/H200) only, not {arch}"])
        arch = "sm_90a"
    source = render_plan(plan, runtime_dims=runtime_dims)
    return plan, source, cache.BuildRequest(spec.name, source, spec.canonical_json(), arch)


def specialize_runtime_dims(spec: LayerSpec, arch: str | None = None) -> Specialized:
    """The same template rendered with run-time extents: for `specgen bench` only."""
    plan, source, req = request(spec, arch, runtime_dims=True)
    return Specialized(spec, plan, source, cache.get_or_build(req))


def _without_spills(item: Specialized, arch: str | None, igemm_config=None) -> Specialized:
    """A build that spilled registers under the planner's occupancy hint (two blocks per SM caps a
    thread's registers) is built again with one block per SM (a planner setting: the spec, its
    banner and its cache key stay the user's), and kept if it spills less. A `tile.min_blocks` the
    user wrote is left alone. One that still spills with a tf32 layer's exact sums
    (`plan.Settings.exact_sums`) is built once more with the running sum (its accuracy is fp32
    mode's), and kept if it spills less."""
    spec = item.spec
    retries = []
    if item.plan["min_blocks"] > 1 and not (spec.tile is not None and spec.tile.min_blocks):
        retries.append(Settings(min_blocks=1))
    if getattr(item.plan.get("settings"), "exact_sums", False):
        retries.append(Settings(min_blocks=retries[0].min_blocks if retries else None, exact_sums=False))
    for settings in retries:
        if item.build.spill_bytes == 0:
            break
        plan, source, req = request(spec, arch, igemm_config=igemm_config, settings=settings)
        build = cache.get_or_build(req)
        if build.spill_bytes < item.build.spill_bytes:
            item = Specialized(spec, plan, source, build)
    return item


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


def forget(spec: LayerSpec) -> None:
    """Drop this spec's memoized kernels (a new tuned choice was stored)."""
    key = spec.canonical_json()
    with _memo_lock:
        for k in [k for k in _memo if k[0] == key]:
            del _memo[k]


def specialize(spec: LayerSpec, arch: str | None = None, igemm_config=None, tuned: bool = True) -> Specialized:
    """The compiled kernel of `spec`; repeated calls in one process cost a dict lookup.
    `igemm_config` overrides the implicit-GEMM engine's tile (a planner setting, not the spec);
    without one, the tile `specgen tune` stored for this GPU is used, unless `tuned` is False."""
    if igemm_config is not None:
        memo_key = (spec.canonical_json(), arch, igemm_config)
    else:
        memo_key = (spec.canonical_json(), arch) if tuned else (spec.canonical_json(), arch, None)
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
                plan, source, req = request(spec, arch, igemm_config=config)
                hit = _without_spills(Specialized(spec, plan, source, cache.get_or_build(req)), arch, config)
                _memo[memo_key] = hit
    return hit


def specialize_many(specs: list[LayerSpec], arch: str | None = None, tuned: bool = True) -> list[Specialized]:
    """Several specs at once; the misses compile in parallel. Stored tuned tiles apply as in
    `specialize` (with SPECGEN_AUTOTUNE=1 the untuned layers are tuned first, in one batch)."""
    configs = [None] * len(specs)
    if tuned:
        from specgen import tune

        if tune.current_gpu() is not None:
            if tune.autotune_env():
                tune.ensure_tuned(list(specs), arch=arch)
            records = [tune.stored_choice(s, arch) for s in specs]
            configs = [None if r is None else r["config"] for r in records]
    prepared = [request(s, arch, igemm_config=c) for s, c in zip(specs, configs)]
    builds = cache.build_many([req for _, _, req in prepared])
    out = []
    for spec, config, (plan, source, _), build in zip(specs, configs, prepared, builds):
        item = _without_spills(Specialized(spec, plan, source, build), arch, config)
        _memo.setdefault((spec.canonical_json(), arch) if tuned else (spec.canonical_json(), arch, None), item)
        out.append(item)
    return out
