"""spec -> plan -> .cu -> cubin, through the cache. No torch: this is what `specgen build` runs."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from specgen import cache, target as targets
from specgen.plan import build_plan
from specgen.render import render_plan
from specgen.spec import LayerSpec, TileSpec


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


def request(spec: LayerSpec, arch: str | None = None, runtime_dims: bool = False, igemm_config=None) -> tuple[dict, str, cache.BuildRequest]:
    """Plan `spec` for `arch`'s target (None: this GPU's, else sm_90) and render it. The banner names
    the target and every limit of it the plan used, so they are part of the source and the cache key.
    A `target.TargetError` (an arch older than sm_80 or unknown, or a spec that cannot fit it) comes
    before anything is compiled."""
    plan = build_plan(spec, igemm_config, targets.resolve(arch))
    source = render_plan(plan, runtime_dims=runtime_dims)
    return plan, source, cache.BuildRequest(spec.name, source, spec.canonical_json(), arch)


def specialize_runtime_dims(spec: LayerSpec, arch: str | None = None) -> Specialized:
    """The same template rendered with run-time extents: for `specgen bench` only."""
    plan, source, req = request(spec, arch, runtime_dims=True)
    return Specialized(spec, plan, source, cache.get_or_build(req))


def _without_spills(item: Specialized, arch: str | None, igemm_config=None) -> Specialized:
    """A build that spilled registers under the planner's occupancy hint (two blocks per SM caps a
    thread's registers) is built again with one block per SM, and kept if it spills less. A
    `tile.min_blocks` the user wrote is left alone."""
    spec = item.spec
    if item.build.spill_bytes == 0 or item.plan["min_blocks"] <= 1 or (spec.tile is not None and spec.tile.min_blocks):
        return item
    tile = (spec.tile or TileSpec()).model_copy(update={"min_blocks": 1})
    plan, source, req = request(spec.model_copy(update={"tile": tile}), arch, igemm_config=igemm_config)
    build = cache.get_or_build(req)
    return Specialized(spec, plan, source, build) if build.spill_bytes < item.build.spill_bytes else item


def specialize(spec: LayerSpec, arch: str | None = None, igemm_config=None) -> Specialized:
    """The compiled kernel of `spec`; repeated calls in one process cost a dict lookup.
    `igemm_config` overrides the implicit-GEMM engine's tile (a planner setting, not the spec)."""
    memo_key = (spec.canonical_json(), arch) if igemm_config is None else (spec.canonical_json(), arch, igemm_config)
    hit = _memo.get(memo_key)
    if hit is not None:
        return hit
    with _memo_lock:
        hit = _memo.get(memo_key)
        if hit is None:
            plan, source, req = request(spec, arch, igemm_config=igemm_config)
            hit = _without_spills(Specialized(spec, plan, source, cache.get_or_build(req)), arch, igemm_config)
            _memo[memo_key] = hit
    return hit


def specialize_many(specs: list[LayerSpec], arch: str | None = None) -> list[Specialized]:
    """Several specs at once; the misses compile in parallel."""
    prepared = [request(s, arch) for s in specs]
    builds = cache.build_many([req for _, _, req in prepared])
    out = []
    for spec, (plan, source, _), build in zip(specs, prepared, builds):
        item = _without_spills(Specialized(spec, plan, source, build), arch)
        _memo.setdefault((spec.canonical_json(), arch), item)
        out.append(item)
    return out
