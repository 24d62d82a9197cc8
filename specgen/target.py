"""The GPU a kernel is planned and compiled for, as data.

A `Target` holds what the planner needs to know about an architecture: how much shared memory a
block may opt in to and an SM holds, the registers of an SM, the largest block, whether thread-block
clusters (and how large), cp.async, wgmma and TMA exist, and the SM count when a device was asked.
The planner takes one (`plan.build_plan(..., target=...)`) and adapts to it, or refuses with a
one-line reason (`TargetError`, a `SpecError`: exit code 2 on the command line).

Built-in targets, from the CUDA C++ Programming Guide's "Compute Capabilities" table (technical
specifications per compute capability) and the Hopper/Blackwell tuning guides:

  arch    shared memory per SM / per block (opt-in)   clusters (portable / non-portable)
  sm_80   164 KB / 163 KB                               none
  sm_86   100 KB /  99 KB                               none
  sm_89   100 KB /  99 KB                               none
  sm_90   228 KB / 227 KB                               8 / 16
  sm_100  228 KB / 227 KB                               8 / 16

Every one of them has 64 K 32-bit registers per SM, at most 1024 threads per block, cp.async
(compute capability 8.0 on) and mma.sync with TF32 inputs, which is all the tensor-core engines use.
wgmma and TMA need the arch-specific `sm_90a` (TMA also exists on sm_90 and sm_100, wgmma only on
sm_90a); specgen does not use them yet, the flags say where they could be. Each block also reserves
1 KB of an SM's shared memory (the difference between the two columns).

The non-portable cluster size (16) needs the kernel's opt-in and a device that grants it; the
runtime asks the driver how many such clusters fit and falls back to smaller ones.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, replace

from specgen.spec import SpecError

KB = 1024
BLOCK_RESERVED_SMEM = 1024  # shared memory the driver reserves per block on an SM (every target here)
MIN_CC = 80  # cp.async and TF32 mma.sync: compute capability 8.0 and newer
_ARCH_RE = re.compile(r"sm_([1-9][0-9]{1,2})(a?)")


class TargetError(SpecError):
    """An arch specgen cannot build for, or a spec that cannot be planned for it: one line."""

    def __init__(self, reason: str) -> None:
        super().__init__([reason])
        self.args = (reason,)

    def __str__(self) -> str:
        return self.args[0]


@dataclass(frozen=True)
class Target:
    """One GPU architecture (and, when read from a device, that device's SM count)."""

    arch: str  # sm_XY or sm_XYa, as nvcc's -arch takes it
    smem_per_block: int  # bytes of dynamic shared memory a block can opt in to
    smem_per_sm: int  # bytes of shared memory of one SM
    regs_per_sm: int = 64 * KB  # 32-bit registers of one SM
    max_threads: int = 1024  # threads per block
    max_cluster: int = 0  # blocks of a portable thread-block cluster (0 or 1: no clusters)
    max_cluster_nonportable: int = 0  # ... of a cluster the kernel opts in to (where the device grants it)
    has_cp_async: bool = True
    has_clusters: bool = False
    has_wgmma: bool = False
    has_tma: bool = False
    sm_count: int | None = None  # None: not known (a built-in target, no device asked)

    @property
    def cc(self) -> int:
        """The compute capability as 10 * major + minor (90 for sm_90 and sm_90a)."""
        return int(_ARCH_RE.fullmatch(self.arch).group(1))

    @property
    def cluster_limit(self) -> int:
        """The largest cluster of a fixed size (1 where there are no clusters)."""
        return max(1, self.max_cluster) if self.has_clusters else 1

    @property
    def cluster_limit_at_launch(self) -> int:
        """The largest cluster sized at launch (the non-portable size where the device may grant it)."""
        return max(self.cluster_limit, self.max_cluster_nonportable) if self.has_clusters else 1

    def summary(self) -> str:
        """One line naming the target and every field that changes a plan (it is in the banner,
        so the rendered source, and with it the cache key, changes when any of them does)."""
        clusters = (
            f"clusters of up to {self.max_cluster} ({self.max_cluster_nonportable} non-portable)"
            if self.has_clusters and self.cluster_limit > 1 else "no clusters"
        )
        features = ", ".join(name for name, has in (("cp.async", self.has_cp_async), ("wgmma", self.has_wgmma),
                                                     ("TMA", self.has_tma)) if has)
        return (
            f"{self.arch}: {self.smem_per_block} B shared memory per block, {self.smem_per_sm} B per SM, "
            f"{self.regs_per_sm} registers per SM, {self.max_threads} threads per block, {clusters}"
            + (f", {features}" if features else "")
        )


_HOPPER = dict(smem_per_block=227 * KB, smem_per_sm=228 * KB, max_cluster=8, max_cluster_nonportable=16,
               has_clusters=True, has_tma=True)
BUILTIN: dict[str, Target] = {
    t.arch: t
    for t in (
        Target("sm_80", smem_per_block=163 * KB, smem_per_sm=164 * KB),  # A100
        Target("sm_86", smem_per_block=99 * KB, smem_per_sm=100 * KB),  # RTX 30xx, A10, A40
        Target("sm_89", smem_per_block=99 * KB, smem_per_sm=100 * KB),  # RTX 40xx, L4, L40
        Target("sm_90", **_HOPPER),  # H100, H200
        Target("sm_90a", **_HOPPER, has_wgmma=True),
        Target("sm_100", **_HOPPER),  # B200
    )
}
DEFAULT = BUILTIN["sm_90"]  # the target of `specgen.render.render` and of a plan asked without one


def get(arch: object, field_name: str = "arch") -> Target:
    """The built-in target for `arch`; `TargetError` (one line) for an arch older than sm_80 or unknown."""
    m = _ARCH_RE.fullmatch(arch) if isinstance(arch, str) else None
    if m is None:
        raise TargetError(f"{field_name}: expected an arch like 'sm_90' or 'sm_90a', got {arch!r}")
    if int(m.group(1)) < MIN_CC:
        raise TargetError(
            f"{field_name}: {arch} is older than sm_80; specgen's kernels need cp.async and TF32 tensor cores (sm_80 and newer)"
        )
    if arch not in BUILTIN:
        raise TargetError(f"{field_name}: specgen has no target for {arch}; known: {', '.join(BUILTIN)}")
    return BUILTIN[arch]


def resolve(arch: str | None) -> Target:
    """`get(arch)`, or with no arch the current GPU's target (the built-in sm_90 without a GPU)."""
    if arch is not None:
        return get(arch)
    return current() or DEFAULT


@functools.cache
def current() -> Target | None:
    """The first visible GPU's target, read through the CUDA driver (no torch): its arch's built-in
    target with the device's SM count and shared-memory limits. None without a GPU or driver;
    `TargetError` for a GPU specgen has no target for."""
    props = device_attributes()
    if props is None:
        return None
    base = get(f"sm_{props['major']}{props['minor']}", "GPU 0")
    return from_attributes(base, props)


def from_attributes(base: Target, props: dict) -> Target:
    """`base` with what a device reports: SM count, shared memory per block (opt-in) and per SM,
    registers per SM, threads per block (each only where reported)."""
    updates = {"sm_count": props.get("sm_count")}
    for field in ("smem_per_block", "smem_per_sm", "regs_per_sm", "max_threads"):
        if props.get(field):
            updates[field] = int(props[field])
    return replace(base, **updates)


def device_attributes() -> dict | None:
    """GPU 0's compute capability and limits through the CUDA driver bindings (no torch); None
    without bindings, driver or GPU. Never raises."""
    try:
        from cuda.bindings import driver
    except Exception:
        return None
    try:
        ok = driver.CUresult.CUDA_SUCCESS
        if driver.cuInit(0)[0] != ok:
            return None
        err, count = driver.cuDeviceGetCount()
        if err != ok or count < 1:
            return None
        err, device = driver.cuDeviceGet(0)
        if err != ok:
            return None
        a = driver.CUdevice_attribute
        wanted = {
            "major": a.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
            "minor": a.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
            "sm_count": a.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            "smem_per_block": a.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            "smem_per_sm": a.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR,
            "regs_per_sm": a.CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR,
            "max_threads": a.CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK,
        }
        out = {}
        for name, attr in wanted.items():
            err, value = driver.cuDeviceGetAttribute(attr, device)
            if err != ok:
                if name in ("major", "minor"):
                    return None
                continue
            out[name] = int(value)
        return out
    except Exception:
        return None


__all__ = ["BUILTIN", "DEFAULT", "Target", "TargetError", "current", "from_attributes", "get", "resolve"]
