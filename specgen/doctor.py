"""`specgen doctor`: what works on this machine, and how to fix what does not.

Reports the GPU (name, arch, SM count), the driver, torch and its CUDA, each compiler backend
(nvcc, NVRTC) with its version, which one builds use, and the kernel cache (directory,
permissions, size). Then it builds a tiny spec with every backend found and, with a GPU, runs
each build against the float64 reference. Exit code 0 only when the tiny spec builds with the
backend builds use and, where there is a GPU, runs correctly; every problem line carries a fix.

Importing this module is cheap: torch is imported only when the report runs.
"""

from __future__ import annotations

import ctypes
import os
import platform
import stat
import sys
import time
from dataclasses import dataclass, field

import specgen

TINY = {
    "name": "doctor_tiny",
    "input": {"channels": 3, "size": [12, 12]},
    "conv": {"out_channels": 8, "kernel": 3},
    "epilogue": ["relu", {"max_pool": {"kernel": 2}}],
}
REL_L2_BAR = 1e-5


@dataclass
class Report:
    lines: list[str] = field(default_factory=list)
    problems: int = 0
    failed: bool = False  # the tiny spec did not build (or run) with the backend builds use

    def ok(self, what: str, text: str) -> None:
        self.lines.append(f"  ok  {what:10} {text}")

    def note(self, what: str, text: str) -> None:
        self.lines.append(f"  --  {what:10} {text}")

    def problem(self, what: str, text: str, fix: str, fatal: bool = False) -> None:
        self.problems += 1
        self.failed |= fatal
        self.lines.append(f"  !!  {what:10} {text}")
        self.lines.append(f"      {'':10} fix: {fix}")


def _driver_version() -> int | None:
    """cuDriverGetVersion through libcuda (no context needed), or None without a driver."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    version = ctypes.c_int()
    return version.value if lib.cuDriverGetVersion(ctypes.byref(version)) == 0 else None


def _gpu(report: Report):
    """Report the GPU, driver and torch; return torch when a GPU can be used, else None."""
    driver = _driver_version()
    try:
        import torch
    except ImportError:
        torch = None
    if torch is None:
        report.problem(
            "torch", "not installed: kernels can be built, not run",
            "pip install torch (a CUDA build, e.g. from https://pytorch.org/get-started/)",
        )
    else:
        report.ok("torch", f"{torch.__version__}, built with CUDA {torch.version.cuda or 'none (a CPU build)'}")
    if driver is None:
        report.note("driver", "no CUDA driver (libcuda.so.1) on this machine")
    else:
        report.ok("driver", f"CUDA {driver // 1000}.{driver % 1000 // 10} (libcuda)")
    if torch is None:
        return None
    if not torch.cuda.is_available():
        if driver is not None and not torch.version.cuda:
            report.problem(
                "GPU", "this torch is a CPU build, the driver is there",
                "install a CUDA build of torch (pip install torch --index-url https://download.pytorch.org/whl/cu130)",
            )
        else:
            report.note("GPU", "none visible: specgen builds kernels here but cannot run or check them")
        return None
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        report.ok("GPU", f"{i}: {props.name}, sm_{props.major}{props.minor}, {props.multi_processor_count} SMs, "
                  f"{props.total_memory / 2**30:.0f} GiB")
        if props.major < 8:
            report.problem(
                "GPU", f"{props.name} is sm_{props.major}{props.minor}; specgen's kernels need sm_80 or newer",
                "run on an Ampere (sm_80) or newer GPU",
            )
    return torch


def _compilers(report: Report) -> list[str]:
    """Report each backend; return those found, the one builds use first."""
    from specgen import compile as nvcc
    from specgen import nvrtc

    found = []
    try:
        path = nvcc.find_nvcc()
        report.ok("nvcc", f"{path}: {nvcc.toolchain_id(path).splitlines()[-1]}")
        found.append("nvcc")
    except FileNotFoundError as error:
        report.note("nvcc", f"not found ({error})".replace("\n", " "))
    except (OSError, Exception) as error:  # found but does not run
        report.problem("nvcc", f"does not run: {error}", "reinstall the CUDA toolkit, or set CUDA_HOME to a working one")
    try:
        major, minor = nvrtc.version()
        dirs = nvrtc.include_dirs()
        missing = nvrtc.missing_headers(dirs)
        text = f"{major}.{minor} through cuda-bindings {nvrtc.binding_version()}; headers from {', '.join(map(str, dirs)) or 'nowhere'}"
        if missing:
            report.problem(
                "NVRTC", f"{text}; missing {', '.join(missing)}",
                "pip install nvidia-cuda-runtime nvidia-cuda-cccl (or set CUDA_HOME to a CUDA toolkit)",
            )
        else:
            report.ok("NVRTC", text)
        found.append("nvrtc")
    except nvrtc.NvrtcUnavailable as error:
        report.note("NVRTC", str(error))
    try:
        chosen = nvcc.resolve_compiler()
    except ValueError as error:
        report.problem("compiler", str(error), f"set {nvcc.ENV_COMPILER} to nvcc, nvrtc or auto", fatal=True)
        return found
    except FileNotFoundError:
        report.problem("compiler", "neither nvcc nor NVRTC is usable", "pip install 'specgen[nvrtc]' (no toolkit needed), "
                       "or install the CUDA toolkit", fatal=True)
        return found
    setting = os.environ.get(nvcc.ENV_COMPILER, "").strip() or "unset, auto"
    report.ok("compiler", f"builds use {chosen} ({nvcc.ENV_COMPILER}: {setting})")
    if chosen not in found:  # an explicit setting naming a missing backend
        report.problem("compiler", f"{nvcc.ENV_COMPILER} asks for {chosen}, which is not usable here",
                       f"unset {nvcc.ENV_COMPILER} (auto), or install {chosen}", fatal=True)
    return sorted(found, key=lambda c: c != chosen)


def _size(root) -> tuple[int, int]:
    entries, total = 0, 0
    for dirpath, _dirs, files in os.walk(root):
        if os.path.basename(os.path.dirname(dirpath)) != "locks" and "meta.json" in files:
            entries += 1
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return entries, total


def _cache(report: Report) -> None:
    from specgen import cache

    try:
        root = cache.cache_dir()
    except cache.CacheDirError as error:
        report.problem("cache", str(error).split(" Fix: ")[0], (str(error).split(" Fix: ") + ["see the message"])[1])
        return
    except OSError as error:
        report.problem("cache", f"cannot create {cache._configured_dir()}: {error}",
                       f"set {cache.ENV_CACHE_DIR} to a directory you can write")
        return
    st = os.stat(root)
    writable = os.access(root, os.W_OK | os.X_OK)
    entries, total = _size(root)
    text = f"{root}: mode {stat.S_IMODE(st.st_mode):04o}, owner uid {st.st_uid}, {entries} kernels, {total / 2**20:.1f} MiB"
    if not writable:
        report.problem("cache", f"{text}, not writable: kernels are rebuilt in every process",
                       f"chmod u+w {root}, or set {cache.ENV_CACHE_DIR} to a directory you can write")
    else:
        report.ok("cache", text)


def _tiny(report: Report, compilers: list[str], torch) -> None:
    """Build the tiny spec with each backend (the one builds use first) and, with a GPU, run it."""
    from specgen import cache, pipeline
    from specgen.compile import CompileError
    from specgen.spec import validate

    spec = validate(TINY)
    plan, source, _ = pipeline.request(spec)
    for i, compiler in enumerate(compilers):
        used = i == 0
        what = f"build/{compiler}"
        start = time.perf_counter()
        try:
            build = cache.get_or_build(cache.BuildRequest(spec.name, source, spec.canonical_json(), compiler=compiler))
        except (CompileError, OSError, ValueError) as error:
            head = str(error).strip().splitlines()
            report.problem(what, f"the tiny spec does not build: {' | '.join(head[:6])}",
                           "run `specgen doctor` with SPECGEN_LOG_LEVEL=DEBUG and see the compiler output above; "
                           + ("" if compiler == "nvcc" else "pip install -U 'specgen[nvrtc]'"), fatal=used)
            continue
        report.ok(what, f"{spec.name} {build.arch}: {build.cache} in {time.perf_counter() - start:.2f} s, "
                  f"{build.registers} registers, {build.spill_bytes} spill bytes")
        if torch is None:
            continue
        what = f"run/{compiler}"
        try:
            rel = _run(torch, spec, plan, source, build)
        except Exception as error:  # a driver or launch failure: report it, do not crash
            report.problem(what, f"{type(error).__name__}: {error}",
                           "update the NVIDIA driver to one that supports this CUDA version (see `driver` above)", fatal=used)
            continue
        if rel <= REL_L2_BAR:
            report.ok(what, f"rel. L2 error against float64 {rel:.1e}")
        else:
            report.problem(what, f"rel. L2 error against float64 {rel:.1e} > {REL_L2_BAR:.0e}: wrong results",
                           "report this as a bug with the `specgen doctor` output", fatal=used)


def _run(torch, spec, plan, source, build) -> float:
    from specgen import pipeline, reference, torchop

    gen = torch.Generator(device="cuda").manual_seed(0)
    ref = reference.Reference(spec).cuda()
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, device="cuda"))
        x = torch.randn((2, spec.input.channels, *spec.input.size), generator=gen, device="cuda")
        sp = pipeline.Specialized(spec, plan, source, build)
        out = torchop.launch(sp, x, ref.conv.weight, ref.conv.bias, ref.named_spec_params(), None)
        torch.cuda.synchronize()
        ref64 = reference.forward64(spec, x, ref.conv.weight, ref.conv.bias, ref.named_spec_params())
    if not bool(torch.isfinite(out).all()):
        return float("inf")
    return ((out.double() - ref64).norm() / ref64.norm().clamp_min(1e-30)).item()


def diagnose() -> Report:
    report = Report()
    report.note("specgen", f"{specgen.__version__}, Python {platform.python_version()}, {platform.system()} {platform.machine()}")
    torch = _gpu(report)
    compilers = _compilers(report)
    _cache(report)
    if compilers and not report.failed:
        _tiny(report, compilers, torch)
    return report


def run(args=None) -> int:
    report = diagnose()
    print("specgen doctor")
    print("\n".join(report.lines))
    if report.failed:
        print(f"NOT OK: the tiny spec did not build{' or run' if 'run/' in ''.join(report.lines) else ''} "
              f"({report.problems} problem(s) above, each with its fix)")
        return 1
    print(f"OK{f', with {report.problems} problem(s) above' if report.problems else ''}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run())
