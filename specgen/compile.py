"""nvcc driver: find the compiler, compile kernel-only `.cu` files to cubins, parse ptxas reports.

Nothing here imports torch. Every compile adds `-Xptxas -v` so that the resource usage
(registers, spills, shared memory, stack) can be read back from the compiler's output.
`compile_many` runs independent compiles in parallel through a throwaway `build.ninja`
(one nvcc edge per job, each with its own log file) and falls back to one compile after
another when no ninja binary is found.

Backends: nvcc (this module) or NVRTC (`specgen/nvrtc.py`), chosen by `SPECGEN_COMPILER`
(`nvcc`, `nvrtc`, or `auto`: nvcc when it is found, else NVRTC) or a request's `compiler`.
`compile_cubin`, `compile_ptx` and `compile_many` dispatch on it; the resolved compiler's
identity (`compiler_id`) goes into the cache key.
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

# -diag-suppress=177: generated kernels declare every extent as a named constant, used or not.
DEFAULT_FLAGS: tuple[str, ...] = ("-O3", "-std=c++17", "-lineinfo", "-diag-suppress=177")
"""Default nvcc flags. No fast-math: fp32 results must match the reference closely."""

PTXAS_VERBOSE: tuple[str, ...] = ("-Xptxas", "-v")
DEFAULT_ARCH = "sm_90"
FALLBACK_NVCC = "/usr/local/cuda/bin/nvcc"
_ARCH_RE = re.compile(r"sm_[1-9][0-9]{1,2}a?")
_ERROR_CONTEXT_LINES = 3
_MAX_ERRORS_SHOWN = 10


ENV_COMPILER = "SPECGEN_COMPILER"
COMPILERS = ("nvcc", "nvrtc")
COMPILER_CHOICES = (*COMPILERS, "auto")


class CompileError(Exception):
    """nvcc failed. The message holds the command, the compiler log and the offending source lines."""

    def __init__(self, message: str, *, command: list[str], log: str, returncode: int) -> None:
        super().__init__(message)
        self.command = command
        self.log = log
        self.returncode = returncode


@dataclass(frozen=True)
class KernelResources:
    """What ptxas reports for one function."""

    registers: int = 0
    spill_bytes: int = 0
    smem_bytes: int = 0
    stack_bytes: int = 0


@dataclass(frozen=True)
class CompileReport:
    """The outcome of one successful compile; resource fields are the max over `kernels`."""

    seconds: float
    registers: int
    spill_bytes: int
    smem_bytes: int
    stack_bytes: int
    log: str
    kernels: dict[str, KernelResources] = field(default_factory=dict)


@dataclass(frozen=True)
class CompileJob:
    """One cubin to build with `compile_many`."""

    cu_path: Path
    out_cubin: Path
    arch: str
    flags: tuple[str, ...] = DEFAULT_FLAGS
    compiler: str = "nvcc"


# ---------------------------------------------------------------------------- toolchain


def _which(program: str) -> str | None:
    """`shutil.which` over the absolute PATH entries only: never a program in the working directory."""
    absolute = [d for d in os.environ.get("PATH", "").split(os.pathsep) if os.path.isabs(d)]
    return shutil.which(program, path=os.pathsep.join(absolute))


def find_nvcc() -> str:
    """`$CUDA_HOME/bin/nvcc`, else `nvcc` on PATH, else `/usr/local/cuda/bin/nvcc` (absolute paths only)."""
    candidates = []
    if (cuda_home := os.environ.get("CUDA_HOME", "")) and os.path.isabs(cuda_home):
        candidates.append(str(Path(cuda_home) / "bin" / "nvcc"))
    if on_path := _which("nvcc"):
        candidates.append(on_path)
    candidates.append(FALLBACK_NVCC)
    for candidate in candidates:
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    raise FileNotFoundError(
        "nvcc not found: looked in $CUDA_HOME/bin (CUDA_HOME="
        f"{os.environ.get('CUDA_HOME', 'unset')}), on PATH and at {FALLBACK_NVCC}. "
        "Install the CUDA toolkit or set CUDA_HOME to its directory."
    )


_TOOLCHAIN_IDS: dict[tuple[str, int], str] = {}


def toolchain_id(nvcc: str) -> str:
    """The compiler's identity for cache keys: the full `nvcc --version` text, without its path.

    Memoized per (path, mtime) so replacing the compiler in place is noticed.
    """
    memo_key = (os.path.realpath(nvcc), os.stat(nvcc).st_mtime_ns)
    if memo_key not in _TOOLCHAIN_IDS:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
        _TOOLCHAIN_IDS[memo_key] = "\n".join(line.rstrip() for line in out.strip().splitlines())
    return _TOOLCHAIN_IDS[memo_key]


def validate_compiler(value: object, field_name: str = "compiler") -> str:
    """`nvcc`, `nvrtc` or `auto` (any case, surrounding blanks ignored); ValueError naming the field otherwise."""
    choice = value.strip().lower() if isinstance(value, str) else value
    if choice not in COMPILER_CHOICES:
        raise ValueError(f"{field_name}: expected one of {', '.join(COMPILER_CHOICES)}, got {value!r}")
    return choice


def resolve_compiler(value: str | None = None) -> str:
    """The backend to use: `value`, else `$SPECGEN_COMPILER`, else auto (nvcc if found, else NVRTC).

    Raises ValueError for an unknown name and FileNotFoundError (saying how to fix it) when auto
    finds neither compiler.
    """
    if value is None:
        raw = os.environ.get(ENV_COMPILER, "")
        choice = validate_compiler(raw, ENV_COMPILER) if raw.strip() else "auto"
    else:
        choice = validate_compiler(value)
    if choice != "auto":
        return choice
    try:
        find_nvcc()
        return "nvcc"
    except FileNotFoundError as no_nvcc:
        from specgen import nvrtc

        try:
            nvrtc.version()
            return "nvrtc"
        except nvrtc.NvrtcUnavailable as no_nvrtc:
            raise FileNotFoundError(f"no CUDA compiler found.\n{no_nvcc}\n{no_nvrtc}") from None


def default_flags(compiler: str) -> tuple[str, ...]:
    """The default flags of a resolved backend."""
    if compiler == "nvrtc":
        from specgen import nvrtc

        return nvrtc.DEFAULT_FLAGS
    return DEFAULT_FLAGS


def compiler_id(compiler: str) -> str:
    """A resolved backend's identity for cache keys (version text, no paths)."""
    if compiler == "nvrtc":
        from specgen import nvrtc

        return nvrtc.toolchain_id()
    return toolchain_id(find_nvcc())


@functools.cache
def default_arch() -> str:
    """The first visible GPU's `sm_XY` through the CUDA driver bindings, else `sm_90`. Never raises."""
    try:
        from cuda.bindings import driver
    except Exception:
        return DEFAULT_ARCH
    try:
        ok = driver.CUresult.CUDA_SUCCESS
        if driver.cuInit(0)[0] != ok:
            return DEFAULT_ARCH
        err, count = driver.cuDeviceGetCount()
        if err != ok or count < 1:
            return DEFAULT_ARCH
        err, device = driver.cuDeviceGet(0)
        if err != ok:
            return DEFAULT_ARCH
        attr = driver.CUdevice_attribute
        err_major, major = driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device)
        err_minor, minor = driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device)
        if err_major != ok or err_minor != ok:
            return DEFAULT_ARCH
        return f"sm_{major}{minor}"
    except Exception:
        return DEFAULT_ARCH


def validate_arch(arch: object, field_name: str = "arch") -> str:
    """Return `arch` if it looks like `sm_90` or `sm_90a`; raise ValueError naming the field otherwise."""
    if not isinstance(arch, str) or not _ARCH_RE.fullmatch(arch):
        raise ValueError(f"{field_name}: expected an arch like 'sm_90' or 'sm_90a', got {arch!r}")
    return arch


# ---------------------------------------------------------------------------- ptxas report

_FUNC_RE = re.compile(r"(?:Compiling entry function '([^']+)'|Function properties for (\S+))")
_USED_RE = re.compile(r"Used (\d+) registers")
_SMEM_RE = re.compile(r"(\d+) bytes smem")
_FRAME_RE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def parse_ptxas(log: str) -> dict[str, KernelResources]:
    """Per-function resources from `-Xptxas -v` output (spill bytes = stores + loads)."""
    found: dict[str, dict[str, int]] = {}
    current: dict[str, int] | None = None
    for line in log.splitlines():
        if m := _FUNC_RE.search(line):
            current = found.setdefault(m.group(1) or m.group(2), {})
        elif current is None:
            continue
        elif m := _FRAME_RE.search(line):
            current["stack_bytes"] = int(m.group(1))
            current["spill_bytes"] = int(m.group(2)) + int(m.group(3))
        elif m := _USED_RE.search(line):
            current["registers"] = int(m.group(1))
            if smem := _SMEM_RE.search(line):
                current["smem_bytes"] = int(smem.group(1))
    return {name: KernelResources(**values) for name, values in found.items()}


def _report(seconds: float, log: str) -> CompileReport:
    kernels = parse_ptxas(log)

    def most(attr: str) -> int:
        return max((getattr(k, attr) for k in kernels.values()), default=0)

    return CompileReport(
        seconds=seconds,
        registers=most("registers"),
        spill_bytes=most("spill_bytes"),
        smem_bytes=most("smem_bytes"),
        stack_bytes=most("stack_bytes"),
        log=log,
        kernels=kernels,
    )


# ---------------------------------------------------------------------------- failures

_ERROR_RE = re.compile(r"^(?P<file>[^\s(][^(\n]*)\((?P<line>\d+)\): (?:catastrophic )?error", re.MULTILINE)


def _source_excerpts(log: str, cwd: Path) -> str:
    """For each `file(line): error` in the log, the lines around it, numbered, the culprit marked."""
    excerpts = []
    seen = set()
    for m in _ERROR_RE.finditer(log):
        where = (m.group("file"), int(m.group("line")))
        if where in seen:
            continue
        seen.add(where)
        if len(seen) > _MAX_ERRORS_SHOWN:
            excerpts.append("... (more errors: see the compiler output above)")
            break
        try:
            lines = (cwd / where[0]).read_text(errors="replace").splitlines()
        except OSError:
            continue
        first = max(1, where[1] - _ERROR_CONTEXT_LINES)
        last = min(len(lines), where[1] + _ERROR_CONTEXT_LINES)
        header = log[m.start() :].split("\n", 1)[0]
        body = [
            f"{'>' if n == where[1] else ' '} {n:5d} | {lines[n - 1]}" for n in range(first, last + 1)
        ]
        excerpts.append("\n".join([header, *body]))
    return "\n\n".join(excerpts)


def _compile_error(command: list[str], cwd: Path, log: str, returncode: int) -> CompileError:
    parts = [
        f"nvcc failed with exit code {returncode}",
        f"command (in {cwd}): {shlex.join(command)}",
        "compiler output:",
        log.rstrip() or "(none)",
    ]
    if excerpts := _source_excerpts(log, cwd):
        parts += ["source:", excerpts]
    return CompileError("\n".join(parts), command=command, log=log, returncode=returncode)


# ---------------------------------------------------------------------------- compiling


def _cubin_command(nvcc: str, cu_name: str, out_cubin: Path, arch: str, flags: tuple[str, ...]) -> list[str]:
    validate_arch(arch)
    return [nvcc, "-cubin", f"-arch={arch}", *flags, *PTXAS_VERBOSE, "-o", str(out_cubin), cu_name]


def compile_cubin(
    cu_path: Path, out_cubin: Path, arch: str, flags: tuple[str, ...] | None = None, compiler: str | None = None
) -> CompileReport:
    """Compile one `.cu` to a cubin (nvcc runs in the source's directory). Raises CompileError.

    `flags` default to the backend's; `compiler` as in resolve_compiler."""
    compiler = resolve_compiler(compiler)
    flags = default_flags(compiler) if flags is None else flags
    if compiler == "nvrtc":
        from specgen import nvrtc

        return nvrtc.compile_cubin(cu_path, out_cubin, arch, tuple(flags))
    cu_path = Path(cu_path).resolve()
    command = _cubin_command(find_nvcc(), cu_path.name, Path(out_cubin).resolve(), arch, tuple(flags))
    start = time.perf_counter()
    proc = subprocess.run(
        command, cwd=cu_path.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace"
    )
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise _compile_error(command, cu_path.parent, proc.stdout, proc.returncode)
    return _report(seconds, proc.stdout)


def compile_ptx(
    source_text: str, arch: str, flags: tuple[str, ...] | None = None, compiler: str | None = None
) -> str:
    """PTX for a `.cu` source text, built in a temporary directory. Raises CompileError."""
    compiler = resolve_compiler(compiler)
    flags = default_flags(compiler) if flags is None else flags
    if compiler == "nvrtc":
        from specgen import nvrtc

        return nvrtc.compile_ptx(source_text, arch, tuple(flags))
    validate_arch(arch)
    with tempfile.TemporaryDirectory(prefix="specgen-ptx-") as tmp:
        cu = Path(tmp) / "kernel.cu"
        cu.write_text(source_text)
        command = [find_nvcc(), "-ptx", f"-arch={arch}", *flags, "-o", "kernel.ptx", cu.name]
        proc = subprocess.run(
            command, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace"
        )
        if proc.returncode != 0:
            raise _compile_error(command, Path(tmp), proc.stdout, proc.returncode)
        return (Path(tmp) / "kernel.ptx").read_text()


def find_ninja() -> str | None:
    """The `ninja` PyPI package's binary, else `ninja` on PATH, else None."""
    try:
        import ninja

        bundled = Path(ninja.BIN_DIR) / "ninja"
        if bundled.is_file() and os.access(bundled, os.X_OK):
            return str(bundled)
    except ImportError:
        pass
    return _which("ninja")


def compile_many(
    jobs: list[CompileJob], on_done: Callable[[int], None] | None = None
) -> list[CompileReport | CompileError]:
    """Compile independent jobs in parallel with ninja (`-j` cpu count); results in job order.

    A failed job yields its CompileError in place, it does not stop the others. Jobs whose
    `compiler` is `nvrtc` compile in process (specgen/nvrtc.py). `on_done(i)`, if given, is
    called as job i finishes (for progress bars).
    """
    if not jobs:
        return []
    if any(job.compiler == "nvrtc" for job in jobs):
        from specgen import nvrtc

        picked = [i for i, job in enumerate(jobs) if job.compiler == "nvrtc"]
        rest = [i for i, job in enumerate(jobs) if job.compiler != "nvrtc"]
        results: list = [None] * len(jobs)
        for indices, run in ((picked, nvrtc.compile_many), (rest, compile_many)):
            done = None if on_done is None else (lambda k, indices=indices: on_done(indices[k]))
            for i, outcome in zip(indices, run([jobs[i] for i in indices], done)):
                results[i] = outcome
        return results
    ninja = find_ninja()
    if ninja is None:
        outcomes = []
        for i, job in enumerate(jobs):
            outcomes.append(_compile_job(job))
            if on_done is not None:
                on_done(i)
        return outcomes
    nvcc = find_nvcc()
    with tempfile.TemporaryDirectory(prefix="specgen-ninja-") as tmp:
        build_dir = Path(tmp)
        commands = []
        lines = ["ninja_required_version = 1.3", "rule nvcc", "  command = (cd $dir && $cmd) > $log 2>&1; echo $$? > $rc", ""]
        for i, job in enumerate(jobs):
            cu = Path(job.cu_path).resolve()
            command = _cubin_command(nvcc, cu.name, Path(job.out_cubin).resolve(), job.arch, tuple(job.flags))
            commands.append((command, cu.parent))
            lines += [
                f"build job{i}.rc: nvcc",
                f"  dir = {_ninja_escape(shlex.quote(str(cu.parent)))}",
                f"  cmd = {_ninja_escape(shlex.join(command))}",
                f"  log = {_ninja_escape(shlex.quote(str(build_dir / f'job{i}.log')))}",
                f"  rc = {_ninja_escape(shlex.quote(str(build_dir / f'job{i}.rc')))}",
            ]
        (build_dir / "build.ninja").write_text("\n".join(lines) + "\n")
        proc = _run_ninja([ninja, "-C", str(build_dir), "-j", str(os.cpu_count() or 1), "-k", "0"], build_dir, len(jobs), on_done)
        seconds = _ninja_durations(build_dir / ".ninja_log")
        results: list[CompileReport | CompileError] = []
        for i, (command, cwd) in enumerate(commands):
            try:
                returncode = int((build_dir / f"job{i}.rc").read_text())
                log = (build_dir / f"job{i}.log").read_text(errors="replace")
            except (OSError, ValueError):
                results.append(_compile_error(command, cwd, f"ninja did not run this job:\n{proc.stdout}", -1))
                continue
            if returncode != 0:
                results.append(_compile_error(command, cwd, log, returncode))
            else:
                results.append(_report(seconds.get(f"job{i}.rc", 0.0), log))
        return results


def _run_ninja(command: list[str], build_dir: Path, count: int, on_done) -> subprocess.CompletedProcess:
    """Run ninja; with `on_done`, report each job as its `.rc` file appears."""
    if on_done is None:
        return subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
    with tempfile.TemporaryFile("w+", errors="replace") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, text=True)
        pending = set(range(count))
        while True:
            finished = proc.poll() is not None
            for i in sorted(pending):
                if (build_dir / f"job{i}.rc").exists() or finished:
                    pending.discard(i)
                    on_done(i)
            if finished:
                break
            time.sleep(0.05)
        out.seek(0)
        return subprocess.CompletedProcess(command, proc.returncode, out.read())


def _compile_job(job: CompileJob) -> CompileReport | CompileError:
    try:
        return compile_cubin(job.cu_path, job.out_cubin, job.arch, tuple(job.flags), "nvcc")
    except CompileError as error:
        return error


def _ninja_escape(text: str) -> str:
    """Escape a value for a build.ninja variable (`$` is ninja's escape character)."""
    if "\n" in text:
        raise ValueError(f"newline in a compile command argument: {text!r}")
    return text.replace("$", "$$")


def _ninja_durations(ninja_log: Path) -> dict[str, float]:
    """Seconds per output from ninja's `.ninja_log` (start and end in ms are its first two columns)."""
    durations = {}
    try:
        text = ninja_log.read_text()
    except OSError:
        return durations
    for line in text.splitlines():
        cols = line.split("\t")
        if len(cols) >= 4 and not line.startswith("#"):
            durations[cols[3]] = (int(cols[1]) - int(cols[0])) / 1000.0
    return durations
