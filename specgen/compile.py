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

Every compiler run is bounded and cleaned up: nvcc (or ninja with its nvcc jobs) runs in a session
of its own under a small watchdog that kills the whole session when specgen dies, even by
SIGKILL; `SPECGEN_COMPILE_TIMEOUT` (seconds, default 300; a parallel batch gets it once per wave
of `-j` jobs) kills it and fails the build with a clear error. Build dirs named
`specgen-ninja-<owner>-*` left in TMPDIR by a process that is gone are swept.

Reproducible cubins: nvcc runs in the source's directory with relative file names and
`PWD=/proc/self/cwd`, so `-lineinfo` records that constant name rather than the build directory:
the same source gives byte-identical cubins wherever it is built. Paths handed to nvcc (its
working directory, output, TMPDIR) may hold only letters, digits, spaces and `/ . _ - + , @ = : %`:
nvcc passes them through a shell, which would expand `$(...)` or backticks.
"""

from __future__ import annotations

import functools
import inspect
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from specgen import paths

# -diag-suppress=177: generated kernels declare every extent as a named constant, used or not.
DEFAULT_FLAGS: tuple[str, ...] = ("-O3", "-std=c++17", "-lineinfo", "-diag-suppress=177")
"""Default nvcc flags. No fast-math: fp32 results must match the reference closely."""

PTXAS_VERBOSE: tuple[str, ...] = ("-Xptxas", "-v")
DEFAULT_ARCH = "sm_90"
FALLBACK_NVCC = "/usr/local/cuda/bin/nvcc"
_ARCH_RE = re.compile(r"sm_[1-9][0-9]{1,2}a?")
ENV_COMPILE_TIMEOUT = "SPECGEN_COMPILE_TIMEOUT"
DEFAULT_COMPILE_TIMEOUT = 300.0
STALE_BUILD_DIR_SECONDS = 6 * 3600.0
"""A `specgen-ninja-*` dir this old whose owner cannot be checked (another host) is swept too."""
_NINJA_PREFIX = "specgen-ninja-"
_NINJA_DIR_RE = re.compile(re.escape(_NINJA_PREFIX) + paths.OWNER_PATTERN + r"-.*")
_CONSTANT_PWD = "/proc/self/cwd"
_SAFE_PATH_RE = re.compile(r"[\w /.+,@=:%-]*")
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


class UnsafePathError(ValueError):
    """A path handed to nvcc holds characters its shell would interpret."""


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
    from specgen import target  # the device query lives with the targets (lazily: no import cycle)

    found = target.device_attributes()
    return f"sm_{found['major']}{found['minor']}" if found else DEFAULT_ARCH


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


# ---------------------------------------------------------------------------- paths and limits


def check_path(path: str | os.PathLike, what: str) -> str:
    """Refuse a path that nvcc's own shell would expand (`$(...)`, backticks, quotes, `;`, newlines...)."""
    text = os.fspath(path)
    if not _SAFE_PATH_RE.fullmatch(text):
        bad = sorted({c for c in text if not _SAFE_PATH_RE.fullmatch(c)})
        raise UnsafePathError(
            f"{what}: {text!r} contains {', '.join(repr(c) for c in bad)}, which nvcc passes through a shell "
            "that would expand it; use a path made of letters, digits, spaces and / . _ - + , @ = : %"
        )
    return text


def _check_tmpdir() -> None:
    for name in ("TMPDIR", "TMP", "TEMP"):
        if value := os.environ.get(name):
            check_path(value, name)
    check_path(tempfile.gettempdir(), "temporary directory")


def compile_timeout() -> float:
    """Seconds one compile may take: `SPECGEN_COMPILE_TIMEOUT`, default 300. Raises ValueError."""
    raw = os.environ.get(ENV_COMPILE_TIMEOUT, "").strip()
    if not raw:
        return DEFAULT_COMPILE_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{ENV_COMPILE_TIMEOUT}: expected a number of seconds > 0, got {raw!r}")
    return value


def _nvcc_env() -> dict[str, str]:
    env = dict(os.environ)
    if os.path.isdir(_CONSTANT_PWD):
        env["PWD"] = _CONSTANT_PWD
    return env


# ---------------------------------------------------------------------------- running the compiler


def _kill_session(sid: int) -> None:
    """SIGKILL every process of session `sid` (every process group in it), the caller excepted."""
    me = os.getpid()
    for _ in range(5):
        found = False
        try:
            names = os.listdir("/proc")
        except OSError:
            names = []
        for name in names:
            if not name.isdigit() or int(name) == me:
                continue
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
                if int(fields[3]) == sid:
                    found = True
                    os.kill(int(name), signal.SIGKILL)
            except (OSError, IndexError, ValueError):
                continue
        if not found:
            break
    if sid != me:
        try:
            os.killpg(sid, signal.SIGKILL)
        except OSError:
            pass


_WATCHDOG = (
    "import os, shutil, signal, subprocess, sys, threading\n"
    + inspect.getsource(_kill_session)
    + """
cleanup, command = sys.argv[1], sys.argv[2:]
child = subprocess.Popen(command, stdin=subprocess.DEVNULL)

killing = threading.Event()

def watch():
    while os.read(0, 4096):
        pass
    killing.set()
    _kill_session(os.getsid(0))
    if cleanup:
        shutil.rmtree(cleanup, ignore_errors=True)
    os._exit(137)

threading.Thread(target=watch, daemon=True).start()
returncode = child.wait()
if killing.is_set():
    threading.Event().wait()  # the watcher is still killing the rest: it ends this process
sys.exit(returncode)
"""
)
"""Runs a command in the caller's new session; when specgen (holding the other end of its stdin)
dies, kills the session and removes `cleanup`."""


class _Run:
    def __init__(self, returncode: int, output: str, timed_out: bool) -> None:
        self.returncode, self.output, self.timed_out = returncode, output, timed_out


def _run(command: list[str], cwd: Path | str, timeout: float, cleanup: Path | None = None) -> _Run:
    """Run `command` in a session of its own under the watchdog; kill the session on timeout or error."""
    read_end, write_end = os.pipe()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", _WATCHDOG, str(cleanup or ""), *command],
            cwd=cwd,
            env=_nvcc_env(),
            stdin=read_end,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    finally:
        os.close(read_end)
    try:
        try:
            out, _ = proc.communicate(timeout=timeout)
            return _Run(proc.returncode, out.decode(errors="replace"), False)
        except subprocess.TimeoutExpired:
            _kill_session(proc.pid)
            out, _ = proc.communicate()
            return _Run(proc.returncode, out.decode(errors="replace"), True)
    except BaseException:
        _kill_session(proc.pid)
        proc.wait()
        raise
    finally:
        os.close(write_end)


def _timeout_error(command: list[str], cwd: Path, log: str, timeout: float) -> CompileError:
    return CompileError(
        f"nvcc did not finish within {timeout:g} s and was stopped ({ENV_COMPILE_TIMEOUT}={timeout:g}; "
        f"raise it for a very large kernel)\ncommand (in {cwd}): {shlex.join(command)}\n"
        f"compiler output:\n{log.rstrip() or '(none)'}",
        command=command,
        log=log,
        returncode=-signal.SIGKILL,
    )


# ---------------------------------------------------------------------------- compiling


def _cubin_command(nvcc: str, cu_name: str, out_cubin: Path | str, arch: str, flags: tuple[str, ...]) -> list[str]:
    validate_arch(arch)
    return [nvcc, "-cubin", f"-arch={arch}", *flags, *PTXAS_VERBOSE, "-o", str(out_cubin), cu_name]


def _out_name(cu_path: Path, out_cubin: Path) -> str:
    """The output as nvcc should see it: a bare name beside the source (nothing path-dependent), else absolute."""
    return out_cubin.name if out_cubin.parent == cu_path.parent else check_path(out_cubin, "output path")


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
    timeout = compile_timeout()
    check_path(cu_path.parent, "build directory")
    _check_tmpdir()
    command = _cubin_command(find_nvcc(), cu_path.name, _out_name(cu_path, Path(out_cubin).resolve()), arch, tuple(flags))
    start = time.perf_counter()
    run = _run(command, cu_path.parent, timeout)
    seconds = time.perf_counter() - start
    if run.timed_out:
        raise _timeout_error(command, cu_path.parent, run.output, timeout)
    if run.returncode != 0:
        raise _compile_error(command, cu_path.parent, run.output, run.returncode)
    return _report(seconds, run.output)


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
    timeout = compile_timeout()
    _check_tmpdir()
    with tempfile.TemporaryDirectory(prefix="specgen-ptx-") as tmp:
        cu = Path(tmp) / "kernel.cu"
        cu.write_text(source_text)
        command = [find_nvcc(), "-ptx", f"-arch={arch}", *flags, "-o", "kernel.ptx", cu.name]
        run = _run(command, tmp, timeout)
        if run.timed_out:
            raise _timeout_error(command, Path(tmp), run.output, timeout)
        if run.returncode != 0:
            raise _compile_error(command, Path(tmp), run.output, run.returncode)
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


def sweep_build_dirs(where: Path | None = None) -> None:
    """Remove `specgen-ninja-*` dirs of ours whose process is gone (or, owner unknowable, older than
    STALE_BUILD_DIR_SECONDS). Never follows a link, never touches another user's dir."""
    where = Path(where or tempfile.gettempdir())
    now = time.time()
    try:
        names = [n for n in os.listdir(where) if n.startswith(_NINJA_PREFIX)]
    except OSError:
        return
    for name in names:
        path = where / name
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not path.is_dir() or path.is_symlink() or st.st_uid != os.geteuid():
            continue
        m = _NINJA_DIR_RE.fullmatch(name)
        gone = paths.owner_gone(m.group(1), int(m.group(2)), int(m.group(3))) if m else None
        if m and int(m.group(2)) == os.getpid() and gone is False:
            continue
        if gone or (gone is None and now - st.st_mtime > STALE_BUILD_DIR_SECONDS):
            shutil.rmtree(path, ignore_errors=True)


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
    timeout = compile_timeout()
    _check_tmpdir()
    nvcc = find_nvcc()
    sweep_build_dirs()
    parallel = os.cpu_count() or 1
    with tempfile.TemporaryDirectory(prefix=f"{_NINJA_PREFIX}{paths.owner_tag()}-") as tmp:
        build_dir = Path(tmp)
        commands = []
        lines = [
            "ninja_required_version = 1.3",
            "rule nvcc",
            f"  command = (cd $dir && PWD={_CONSTANT_PWD} $cmd) > $log 2>&1; echo $$? > $rc"
            if os.path.isdir(_CONSTANT_PWD)
            else "  command = (cd $dir && $cmd) > $log 2>&1; echo $$? > $rc",
            "",
        ]
        for i, job in enumerate(jobs):
            cu = Path(job.cu_path).resolve()
            check_path(cu.parent, "build directory")
            out = _out_name(cu, Path(job.out_cubin).resolve())
            command = _cubin_command(nvcc, cu.name, out, job.arch, tuple(job.flags))
            commands.append((command, cu.parent))
            lines += [
                f"build job{i}.rc: nvcc",
                f"  dir = {_ninja_escape(shlex.quote(str(cu.parent)))}",
                f"  cmd = {_ninja_escape(shlex.join(command))}",
                f"  log = {_ninja_escape(shlex.quote(str(build_dir / f'job{i}.log')))}",
                f"  rc = {_ninja_escape(shlex.quote(str(build_dir / f'job{i}.rc')))}",
            ]
        (build_dir / "build.ninja").write_text("\n".join(lines) + "\n")
        limit = timeout * math.ceil(len(jobs) / parallel)
        run = _run_reporting([ninja, "-C", str(build_dir), "-j", str(parallel), "-k", "0"], build_dir, limit, len(jobs), on_done)
        seconds = _ninja_durations(build_dir / ".ninja_log")
        results: list[CompileReport | CompileError] = []
        for i, (command, cwd) in enumerate(commands):
            try:
                returncode = int((build_dir / f"job{i}.rc").read_text())
                log = (build_dir / f"job{i}.log").read_text(errors="replace")
            except (OSError, ValueError):
                if run.timed_out:
                    try:
                        log = (build_dir / f"job{i}.log").read_text(errors="replace")
                    except OSError:
                        log = ""
                    results.append(_timeout_error(command, cwd, log, timeout))
                else:
                    results.append(_compile_error(command, cwd, f"ninja did not run this job:\n{run.output}", -1))
                continue
            if returncode != 0:
                results.append(_compile_error(command, cwd, log, returncode))
            else:
                results.append(_report(seconds.get(f"job{i}.rc", 0.0), log))
        return results


def _run_reporting(command: list[str], build_dir: Path, limit: float, count: int, on_done) -> _Run:
    """Run ninja under the watchdog (`_run`); with `on_done`, report each job as its `.rc` file appears."""
    if on_done is None:
        return _run(command, build_dir, limit, cleanup=build_dir)
    outcome: dict = {}

    def target():
        try:
            outcome["run"] = _run(command, build_dir, limit, cleanup=build_dir)
        except BaseException as error:  # re-raised in the caller's thread
            outcome["error"] = error

    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    pending = set(range(count))
    while worker.is_alive():
        for i in sorted(pending):
            if (build_dir / f"job{i}.rc").exists():
                pending.discard(i)
                on_done(i)
        worker.join(0.05)
    for i in sorted(pending):
        on_done(i)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["run"]


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
