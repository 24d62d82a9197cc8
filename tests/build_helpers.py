"""Building a spec's kernels with nvcc on the CPU (the `nvcc` tests): ptxas's report of each kernel."""

from __future__ import annotations

from specgen import compile as nvcc
from specgen import pipeline


def build_report(spec, tmp_path, arch: str = "sm_90", settings=None) -> dict:
    """{kernel: ptxas's resources} of the spec's rendered source, built by nvcc for `arch`
    (`settings`: planner settings, `plan.Settings`)."""
    _, source, request = pipeline.request(spec, arch, **({"settings": settings} if settings is not None else {}))
    cu = tmp_path / f"{spec.name}.cu"
    cu.write_text(source)
    return nvcc.compile_cubin(cu, tmp_path / f"{spec.name}.cubin", request.arch, compiler="nvcc").kernels


def spilled(kernels: dict) -> dict:
    """{kernel: bytes} of the kernels that spill registers."""
    return {k: r.spill_bytes for k, r in kernels.items() if r.spill_bytes}
