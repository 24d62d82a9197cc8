"""NVRTC backend: compile a kernel-only `.cu` to a cubin in process, without the CUDA toolkit.

A pip-installed PyTorch brings NVRTC (the `nvidia-cuda-nvrtc` wheel) and the CUDA runtime headers
(`nvidia-cuda-runtime`); the driver comes with the GPU. specgen reaches NVRTC through NVIDIA's
`cuda-bindings` package (`cuda.bindings.nvrtc`): it is the maintained, versioned binding of the C
API, finds the wheel's `libnvrtc` by itself, and releases the GIL while compiling, so several
kernels compile at once on threads.

What nvcc gives is kept: `--ptxas-options=-v` puts the ptxas report in the program log (parsed
like nvcc's, so registers, spills, stack and shared memory are recorded), PTX is available for
`specgen show --ptx`, any `sm_XY` or `sm_XYa` arch NVRTC supports is accepted, and a failure's
log comes with the numbered source lines it points at.

Headers: the templates include `<math_constants.h>` and, for thread-block clusters,
`<cooperative_groups.h>`, which includes `<nv/target>` (from CCCL). NVRTC has none of them built
in; they are looked up in the `nvidia` wheels' `include/` directories (`nvidia-cuda-runtime`,
`nvidia-cuda-cccl`) first, then `$CUDA_HOME/include` and `/usr/local/cuda/include`, each with its
`cccl/` subdirectory. When no libcu++ (`cuda/std/type_traits`) is found, cooperative groups is
told to use its own type traits (`-D_CG_LIMIT_INCLUDED_DEPENDENCIES`). The headers' digest is part
of the compiler's identity, hence of the cache key.

Nothing here imports torch.
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import importlib.util
import os
import re
import threading
import time
from pathlib import Path
from typing import Callable

from specgen import compile as _compile

DEFAULT_FLAGS: tuple[str, ...] = ("-std=c++17", "-lineinfo", "--diag-suppress=177")
"""NVRTC's counterpart of nvcc's defaults (device code is fully optimized by default; `-O3` is a
host-compiler flag NVRTC does not take). No fast-math."""

PTXAS_VERBOSE: tuple[str, ...] = ("--ptxas-options=-v",)
LIMIT_CG = "-D_CG_LIMIT_INCLUDED_DEPENDENCIES"
NEEDED_HEADERS = ("math_constants.h", "cooperative_groups.h", "nv/target")
LIBCUDACXX = "cuda/std/type_traits"  # optional: cooperative groups uses it where it is found
FIX = (
    "Fix: pip install 'specgen[nvrtc]' (cuda-bindings, nvidia-cuda-nvrtc, nvidia-cuda-runtime, "
    "nvidia-cuda-cccl), or install the CUDA toolkit and use nvcc."
)


class NvrtcUnavailable(FileNotFoundError):
    """NVRTC (the binding or its library) cannot be used here; the message says how to fix it."""


# ---------------------------------------------------------------------------- the library


@functools.cache
def _module():
    """`cuda.bindings.nvrtc`, once its library loaded; raises NvrtcUnavailable."""
    try:
        from cuda.bindings import nvrtc
    except ImportError as error:
        raise NvrtcUnavailable(f"NVRTC: the cuda-bindings package is not installed ({error}). {FIX}") from None
    try:
        result = nvrtc.nvrtcVersion()
    except Exception as error:  # the binding is there, libnvrtc is not
        raise NvrtcUnavailable(f"NVRTC: libnvrtc could not be loaded ({error}). {FIX}") from None
    if result[0] != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise NvrtcUnavailable(f"NVRTC: nvrtcVersion failed ({result[0].name}). {FIX}")
    return nvrtc


def available() -> bool:
    """True when NVRTC can be called."""
    try:
        _module()
    except NvrtcUnavailable:
        return False
    return True


def version() -> tuple[int, int]:
    """NVRTC's (major, minor). Raises NvrtcUnavailable."""
    _, major, minor = _module().nvrtcVersion()
    return major, minor


def binding_version() -> str:
    try:
        from importlib.metadata import version as dist_version

        return dist_version("cuda-bindings")
    except Exception:
        return "unknown"


def supported_archs() -> list[str]:
    nvrtc = _module()
    result, archs = nvrtc.nvrtcGetSupportedArchs()
    return [f"sm_{a}" for a in archs] if result == nvrtc.nvrtcResult.NVRTC_SUCCESS else []


# ---------------------------------------------------------------------------- headers


def _wheel_include_dirs() -> list[Path]:
    """`include/` directories of the `nvidia` wheels (`nvidia/cu13/include`, `nvidia/cuda_runtime/include`, ...)."""
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        return []
    if spec is None or not spec.submodule_search_locations:
        return []
    found = []
    for root in spec.submodule_search_locations:
        found += sorted(p for p in Path(root).glob("*/include") if p.is_dir())
    # The newest CUDA first (cu13 before cu12), then the per-component dirs of older wheels.
    def order(path: Path) -> tuple:
        name = path.parent.name
        return (0, -int(name[2:]), "") if re.fullmatch(r"cu[0-9]+", name) else (1, 0, name)

    return sorted(found, key=order)


def _toolkit_include_dirs() -> list[Path]:
    dirs = []
    if (home := os.environ.get("CUDA_HOME", "")) and os.path.isabs(home):
        dirs.append(Path(home) / "include")
    dirs.append(Path(_compile.FALLBACK_NVCC).parent.parent / "include")
    return [d for d in dirs if d.is_dir()]


def include_dirs() -> list[Path]:
    """Where the templates' headers are found: for each needed header (and libcu++, if present) the
    first directory that has it, wheels first, then the toolkit, each with its `cccl/` beside it.
    Empty when none of the headers is found."""
    candidates = []
    for d in dict.fromkeys([*_wheel_include_dirs(), *_toolkit_include_dirs()]):
        candidates += [d, d / "cccl"]
    chosen: list[Path] = []
    for header in (*NEEDED_HEADERS, LIBCUDACXX):
        for d in candidates:
            if (d / header).is_file():
                if d not in chosen:
                    chosen.append(d)
                break
    return chosen


def missing_headers(dirs: list[Path] | None = None) -> list[str]:
    dirs = include_dirs() if dirs is None else dirs
    return [h for h in NEEDED_HEADERS if not any((d / h).is_file() for d in dirs)]


def _has_libcudacxx(dirs: list[Path]) -> bool:
    return any((d / LIBCUDACXX).is_file() for d in dirs)


def header_options() -> list[str]:
    """`-I` for each header directory, and the cooperative-groups switch when libcu++ is absent."""
    dirs = include_dirs()
    options = [f"-I{d}" for d in dirs]
    if not _has_libcudacxx(dirs):
        options.append(LIMIT_CG)
    return options


def _headers_digest(dirs: list[Path]) -> str:
    """sha256 over the headers the kernels include (and cooperative groups' own), by relative name."""
    digest = hashlib.sha256()
    for d in dirs:
        files = [d / h for h in (*NEEDED_HEADERS, LIBCUDACXX)] + sorted((d / "cooperative_groups").rglob("*.h"))
        for path in files:
            if path.is_file():
                digest.update(path.relative_to(d).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


_TOOLCHAIN_IDS: dict[tuple, str] = {}


def toolchain_id() -> str:
    """NVRTC's identity for cache keys: its version, the binding's, and a digest of the headers
    used (not their paths). Raises NvrtcUnavailable."""
    major, minor = version()
    dirs = include_dirs()
    memo = (major, minor, tuple((str(d), os.stat(d).st_mtime_ns) for d in dirs))
    if memo not in _TOOLCHAIN_IDS:
        cg = "libcu++" if _has_libcudacxx(dirs) else "own traits"
        _TOOLCHAIN_IDS[memo] = (
            f"NVRTC {major}.{minor} (cuda-bindings {binding_version()})\n"
            f"headers sha256 {_headers_digest(dirs)[:32]}, cooperative groups with {cg}"
        )
    return _TOOLCHAIN_IDS[memo]


# ---------------------------------------------------------------------------- compiling


def _options(arch: str, flags: tuple[str, ...], ptxas_verbose: bool) -> list[str]:
    _compile.validate_arch(arch)
    return [f"-arch={arch}", *flags, *(PTXAS_VERBOSE if ptxas_verbose else ()), *header_options()]


def _buffer(size: int) -> bytes:
    """A fresh bytes object of at least `size` bytes for NVRTC to write into. Never fewer than two:
    CPython keeps one object per one-byte value (b" " * 1 is b" " itself), and NVRTC writing an
    empty log's NUL into it would change that value for the whole process."""
    return b" " * max(size, 2)


def _log(nvrtc, prog) -> str:
    _, size = nvrtc.nvrtcGetProgramLogSize(prog)
    buf = _buffer(size)
    nvrtc.nvrtcGetProgramLog(prog, buf)
    return buf.rstrip(b"\0 \n").decode(errors="replace")


def _output(nvrtc, prog, what: str) -> bytes:
    _, size = getattr(nvrtc, f"nvrtcGet{what}Size")(prog)
    buf = _buffer(size)
    getattr(nvrtc, f"nvrtcGet{what}")(prog, buf)
    return buf[:size]


def _error(options: list[str], cwd: Path, name: str, log: str, result) -> _compile.CompileError:
    parts = [
        f"NVRTC failed: {getattr(result, 'name', result)}",
        f"program {name} (in {cwd}), options: {' '.join(options)}",
        "compiler output:",
        log.rstrip() or "(none)",
    ]
    if re.search(r"(?:cannot|could not) open source file", log) and (missing := missing_headers()):
        parts.append(
            f"NVRTC found no {', '.join(missing)}: looked in the nvidia wheels' include/ directories, "
            f"$CUDA_HOME/include and /usr/local/cuda/include. Fix: pip install nvidia-cuda-runtime nvidia-cuda-cccl, "
            "or set CUDA_HOME to a CUDA toolkit."
        )
    if excerpts := _compile._source_excerpts(log, cwd):
        parts += ["source:", excerpts]
    return _compile.CompileError("\n".join(parts), command=["nvrtc", *options, name], log=log, returncode=int(result))


def _run(source: str, name: str, options: list[str], cwd: Path, want: str) -> tuple[bytes, str]:
    """Compile `source` (named `name`, errors resolved against `cwd`); the `want` output and the log."""
    nvrtc = _module()
    ok = nvrtc.nvrtcResult.NVRTC_SUCCESS
    result, prog = nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], [])
    if result != ok:
        raise _error(options, cwd, name, "", result)
    try:
        (result,) = nvrtc.nvrtcCompileProgram(prog, len(options), [o.encode() for o in options])
        log = _log(nvrtc, prog)
        if result != ok:
            raise _error(options, cwd, name, log, result)
        return _output(nvrtc, prog, want), log
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def compile_cubin(
    cu_path: Path, out_cubin: Path, arch: str, flags: tuple[str, ...] = DEFAULT_FLAGS
) -> _compile.CompileReport:
    """Compile one `.cu` file to a cubin with NVRTC. Raises CompileError (or NvrtcUnavailable)."""
    cu_path = Path(cu_path).resolve()
    options = _options(arch, tuple(flags), ptxas_verbose=True)
    start = time.perf_counter()
    cubin, log = _run(cu_path.read_text(), cu_path.name, options, cu_path.parent, "CUBIN")
    seconds = time.perf_counter() - start
    Path(out_cubin).write_bytes(cubin)
    return _compile._report(seconds, log)


def compile_ptx(source_text: str, arch: str, flags: tuple[str, ...] = DEFAULT_FLAGS) -> str:
    """PTX for a `.cu` source text. Raises CompileError."""
    import tempfile

    options = _options(arch, tuple(flags), ptxas_verbose=False)
    with tempfile.TemporaryDirectory(prefix="specgen-ptx-") as tmp:
        (Path(tmp) / "kernel.cu").write_text(source_text)  # for the source lines of a failure
        ptx, _ = _run(source_text, "kernel.cu", options, Path(tmp), "PTX")
    return ptx.rstrip(b"\0").decode()


def compile_many(
    jobs: list[_compile.CompileJob], on_done: Callable[[int], None] | None = None
) -> list[_compile.CompileReport | _compile.CompileError]:
    """Compile jobs on threads (NVRTC releases the GIL), at most one per CPU; results in job order.

    A failed job yields its CompileError in place. `on_done(i)` is called as job i finishes.
    """
    if not jobs:
        return []
    _module()  # fail once, up front, when NVRTC is missing
    done_lock = threading.Lock()

    def one(i: int, job: _compile.CompileJob):
        try:
            return compile_cubin(job.cu_path, job.out_cubin, job.arch, tuple(job.flags))
        except _compile.CompileError as error:
            return error
        finally:
            if on_done is not None:
                with done_lock:
                    on_done(i)

    workers = max(1, min(len(jobs), os.cpu_count() or 1))
    if workers == 1:
        return [one(i, job) for i, job in enumerate(jobs)]
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="specgen-nvrtc") as pool:
        futures = [pool.submit(one, i, job) for i, job in enumerate(jobs)]
        return [f.result() for f in futures]
