"""On-disk cache of compiled kernels, one entry per key.

Where: `SPECGEN_CACHE_DIR`, else `$XDG_CACHE_HOME/specgen`, else `~/.cache/specgen`. A relative
`SPECGEN_CACHE_DIR` is refused (CacheDirError) and a relative `XDG_CACHE_HOME` is ignored, as the
XDG spec asks: cache paths are never resolved against the working directory. The directory is
created with mode 0700. One that is group- or world-writable, or owned by another user, is refused
unless `SPECGEN_SHARED_CACHE=1` opts in to a shared team cache (entries are then created with the
umask's permissions rather than private ones).

Layout: `<cache>/<key[:2]>/<key>/` holds `kernel.cu`, `kernel.cubin` and `meta.json`, the manifest
(name, key, arch, flags, toolchain, versions, canonical spec, ptxas report, compiler log, times and
the sha256 of both files). The key is a sha256 over the name, canonical spec, rendered source,
specgen's version, the template hash, the compiler identity (nvcc's version text, or NVRTC's
version and headers: see `compile.resolve_compiler`), the arch and the flags.

Protocol: a hit needs a manifest whose key and checksums match the files, a `kernel.cu` equal to
the source rendered for the request and a cubin that is a whole ELF file; every file is read
through one descriptor of the entry's directory, opened without following links, regular files
only (never a FIFO or device), the manifest capped in size and checked field by field. The
entry's directory mtime records its last use. A miss takes the per-key lock
`<cache>/locks/<key>.lock` (flock through `filelock`, so the kernel releases it when the holder
dies), checks the cache again, then writes `kernel.cu`, the cubin and, last, `meta.json` into a
private `<cache>/tmp.<host>_<pid>_<start>_<hex>/`, flushes them to disk, and publishes it in one
step: a rename, or an atomic swap (renameat2) with the entry it replaces, so a reader sees the old
entry or the new one, never none or a mix. The holder writes `pid host time` into a fresh
`<key>.holder` (never through a link); a process that waits `LOCK_WARN_SECONDS` logs the lock path
and that holder, and gives up after `SPECGEN_LOCK_TIMEOUT` (LockTimeoutError, naming the holder).
Leftover `tmp.*` directories whose process is gone (judged by host, PID and start time, so a build
in another PID namespace or on another host is never mistaken for a dead one) or that are older
than a day are swept after builds and by `prune`/`clear`, which never follow a linked shard. An
invalid entry is reported with one WARNING and rebuilt. When the cache cannot be written
(read-only, full) the kernel is built in a private temporary directory outside the cache, removed
at exit, with a WARNING.

Request index: `<cache>/requests/<k[:2]>/<k>`, one JSON file per request key of
`specgen.planindex` (what `pipeline.specialize` was asked for, known before planning): the build
key and checksums it compiled to, its plan and launch shape. Written by `write_index` (staged as a
`tmp.*` file, flushed, renamed over the old one), read by `read_index` (never through a link,
capped in size); `lookup` then checks the build entry as any hit does. `prune` removes the index
entries whose build entry it removed, `clear` the whole index.

Environment: `SPECGEN_ALWAYS_COMPILE=1` rebuilds and republishes every request;
`SPECGEN_DUMP_DIR=<dir>` receives `<name>-<key[:12]>.cu` and `.log` for each request (a private
dir only; files are replaced, never written through a link); `SPECGEN_LOCK_TIMEOUT` (seconds,
default 3600) bounds the wait for another builder's lock.

Test hooks (diagnostics only, no effect when unset):
`SPECGEN_COMPILE_COUNTER=<file>` appends one JSON line `{"pid", "name", "key"}` per nvcc run,
so tests can count compiles across processes. `SPECGEN_TEST_PAUSE=<point>:<seconds>` prints
`specgen-test-pause <point>` to stderr and sleeps when a build reaches `<point>`, one of
`locked` (lock held, before staging), `compiled` (cubin staged, no manifest), `staged` (manifest
staged, not published) or `published` (published, lock still held).
"""

from __future__ import annotations

import atexit
import ctypes
import errno
import hashlib
import json
import os
import re
import shutil
import socket
import stat
import struct
import sys
import tempfile
import time
import uuid
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, NamedTuple

from filelock import FileLock, Timeout

import specgen
from specgen import compile as nvcc
from specgen import paths, progress
from specgen.compile import CompileError, CompileJob, CompileReport
from specgen.log import get_logger

ENV_CACHE_DIR = "SPECGEN_CACHE_DIR"
ENV_SHARED = "SPECGEN_SHARED_CACHE"
ENV_ALWAYS_COMPILE = "SPECGEN_ALWAYS_COMPILE"
ENV_DUMP_DIR = "SPECGEN_DUMP_DIR"
ENV_COMPILE_COUNTER = "SPECGEN_COMPILE_COUNTER"
ENV_TEST_PAUSE = "SPECGEN_TEST_PAUSE"
ENV_LOCK_TIMEOUT = "SPECGEN_LOCK_TIMEOUT"

LOCK_WARN_SECONDS = 10.0
"""How long a build waits on another holder's lock before logging who holds it."""
DEFAULT_LOCK_TIMEOUT = 3600.0
"""How long a build waits on another holder's lock before giving up (`SPECGEN_LOCK_TIMEOUT`)."""
STALE_TMP_SECONDS = 24 * 3600.0
MAX_MANIFEST_BYTES = 8 * 1024 * 1024
MAX_CUBIN_BYTES = 1024 * 1024 * 1024
_PROBE_TRIES = 8
_SOURCE_MTIME = 315532800  # 1980-01-01, a fixed time for every staged kernel.cu

_KEY_SCHEMA = 1
_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_KEY_RE = re.compile(r"[0-9a-f]{64}")
_TMP_RE = re.compile(r"tmp\." + paths.OWNER_PATTERN + r"_[0-9a-f]+")
_LEGACY_TMP_RE = re.compile(r"tmp\.pid_(\d+)_[0-9a-f]+")  # made by specgen before owner tags: PID alone
_CU, _CUBIN, _META = "kernel.cu", "kernel.cubin", "meta.json"
_MANIFEST_TYPES = {
    "name": str,
    "key": str,
    "arch": str,
    "log": str,
    "cu_sha256": str,
    "cubin_sha256": str,
    "registers": int,
    "spill_bytes": int,
    "smem_bytes": int,
    "stack_bytes": int,
}
_MANIFEST_FIELDS = frozenset(_MANIFEST_TYPES)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class CacheDirError(ValueError):
    """The configured cache directory is unsafe or invalid (a bad setting, hence a ValueError)."""


class CacheEntryError(RuntimeError):
    """A cache entry asked for by key is missing or fails its checksums."""


class LockTimeoutError(CompileError):
    """Another process held the build lock longer than `SPECGEN_LOCK_TIMEOUT` (the build did not run)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, command=[], log="", returncode=-1)


@dataclass(frozen=True)
class BuildRequest:
    """One kernel to build: the rendered source plus what identifies it."""

    name: str
    source: str
    canonical_spec: str
    arch: str | None = None
    flags: tuple[str, ...] | None = None
    compiler: str | None = None  # nvcc, nvrtc or auto; None: $SPECGEN_COMPILER, else auto

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME_RE.fullmatch(self.name):
            raise ValueError(f"name: expected a C identifier, got {self.name!r}")
        for field_name in ("source", "canonical_spec"):
            if not isinstance(getattr(self, field_name), str):
                raise ValueError(f"{field_name}: expected a string, got {type(getattr(self, field_name)).__name__}")
        if self.arch is not None:
            nvcc.validate_arch(self.arch)
        if self.flags is not None:
            if not isinstance(self.flags, (tuple, list)) or not all(isinstance(f, str) for f in self.flags):
                raise ValueError(f"flags: expected a tuple of strings, got {self.flags!r}")
            object.__setattr__(self, "flags", tuple(self.flags))
        if self.compiler is not None:
            object.__setattr__(self, "compiler", nvcc.validate_compiler(self.compiler))


@dataclass(frozen=True)
class BuildResult:
    """A built (or cached) kernel; `compile_seconds` is 0.0 on a hit."""

    name: str
    key: str
    cache: str
    compile_seconds: float
    cu: Path
    cubin: Path
    entry_dir: Path
    registers: int
    spill_bytes: int
    smem_bytes: int
    stack_bytes: int
    arch: str
    log: str = field(repr=False)
    compiler: str = "nvcc"

    def as_json(self) -> dict:
        """Every field but the compiler log, paths as strings."""
        return {
            "name": self.name,
            "key": self.key,
            "cache": self.cache,
            "compile_seconds": round(self.compile_seconds, 4),
            "cu": str(self.cu),
            "cubin": str(self.cubin),
            "entry_dir": str(self.entry_dir),
            "registers": self.registers,
            "spill_bytes": self.spill_bytes,
            "smem_bytes": self.smem_bytes,
            "stack_bytes": self.stack_bytes,
            "arch": self.arch,
            "compiler": self.compiler,
        }


# ---------------------------------------------------------------------------- cache dir


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


def _configured_dir() -> Path:
    if explicit := os.environ.get(ENV_CACHE_DIR, "").strip():
        path = Path(explicit).expanduser()
        if not path.is_absolute():
            raise CacheDirError(
                f"{ENV_CACHE_DIR}={explicit!r} is a relative path; specgen never uses the working "
                "directory for its cache. Set it to an absolute path."
            )
        return path
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".cache"
    return base / "specgen"


def _not_private(st: os.stat_result) -> str | None:
    """Why a directory with this stat is not private to us, or None."""
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid != os.geteuid():
        return f"it is owned by uid {st.st_uid}, not by you (uid {os.geteuid()})"
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"mode {mode:04o} lets other users write to it"
    return None


def _check_dir(path: Path) -> None:
    """Refuse a directory others can write to, unless a shared cache was asked for."""
    try:
        nvcc.check_path(path, ENV_CACHE_DIR)
    except nvcc.UnsafePathError as error:
        raise CacheDirError(str(error)) from None
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise CacheDirError(f"cache dir {path} is not a directory; set {ENV_CACHE_DIR} to a directory")
    if _env_flag(ENV_SHARED) or not (why := _not_private(st)):
        return
    if st.st_uid != os.geteuid():
        raise CacheDirError(
            f"refusing cache dir {path}: {why}, so its kernels cannot be trusted. Fix: set {ENV_CACHE_DIR} "
            f"to a directory of your own, or set {ENV_SHARED}=1 to use a shared team cache deliberately."
        )
    raise CacheDirError(
        f"refusing cache dir {path}: {why}, so its kernels cannot be trusted. Fix: chmod 700 {path}, "
        f"or set {ENV_SHARED}=1 to use a shared team cache deliberately."
    )


def cache_dir() -> Path:
    """The cache directory, created 0700 if missing and checked for safety.

    Raises CacheDirError for an unsafe or relative directory, OSError when it cannot be created.
    """
    path = _configured_dir()
    if not path.exists():
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(path, 0o700)
    _check_dir(path)
    return path


def _dir_mode() -> int:
    return 0o777 if _env_flag(ENV_SHARED) else 0o700


def _file_mode() -> int:
    return 0o666 if _env_flag(ENV_SHARED) else 0o600


def _write_fd(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _write_file(path: Path, data: bytes, *, dir_fd: int | None = None, mode: int | None = None) -> None:
    """Create `path` (which must not exist, not even as a link) holding `data`, flushed to disk."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC
    fd = os.open(path, flags, _file_mode() if mode is None else mode, dir_fd=dir_fd)
    try:
        _write_fd(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_path(path: Path, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | _O_NOFOLLOW | _O_CLOEXEC | (_O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _tmp_name() -> str:
    """`tmp.<owner>_<hex>`: the owner tag lets a sweeper in any PID namespace judge it safely."""
    return f"tmp.{paths.owner_tag()}_{uuid.uuid4().hex}"


def _new_tmp_dir(root: Path) -> Path:
    path = root / _tmp_name()
    os.mkdir(path, _dir_mode())
    return path


def _remove_tree(path: Path) -> None:
    """Remove a file, link or directory tree, never following links; unreadable dirs of ours are opened up."""

    def retry(func, name, _exc) -> None:
        with suppress(OSError):
            os.chmod(os.path.dirname(name), 0o700)
            if os.path.isdir(name) and not os.path.islink(name):
                os.chmod(name, 0o700)
                shutil.rmtree(name, ignore_errors=True)
            else:
                func(name)

    try:
        st = os.lstat(path)
    except OSError:
        return
    if not stat.S_ISDIR(st.st_mode):
        with suppress(OSError):
            os.unlink(path)
        return
    if stat.S_IMODE(st.st_mode) & 0o700 != 0o700:
        with suppress(OSError):
            os.chmod(path, 0o700)
    shutil.rmtree(path, onerror=retry)


def _discard_dir(root: Path, path: Path) -> bool:
    """Atomically take `path` out of view (rename into a tmp dir), then delete it."""
    trash = root / _tmp_name()
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return False
    _remove_tree(trash)
    return True


def _sweep_tmp(root: Path) -> None:
    """Delete tmp dirs left by processes that are gone, and any older than a day.

    A dir whose owner ran in another PID namespace or on another host cannot be judged by its
    PID here: it goes only with age.
    """
    now = time.time()
    for path in root.glob("tmp.*"):
        m = _TMP_RE.fullmatch(path.name)
        gone = paths.owner_gone(m.group(1), int(m.group(2)), int(m.group(3))) if m else None
        if legacy := _LEGACY_TMP_RE.fullmatch(path.name):
            gone = paths.owner_gone(paths.host_id(), int(legacy.group(1)), 0)
        if m and int(m.group(2)) == os.getpid() and gone is False:
            continue
        try:
            old = now - path.lstat().st_mtime > STALE_TMP_SECONDS
        except FileNotFoundError:
            continue
        if old or gone:
            _remove_tree(path)


# ---------------------------------------------------------------------------- keys


@dataclass
class _Plan:
    """A request with its resolved arch, flags and key, and where it is being built."""

    req: BuildRequest
    arch: str
    flags: tuple[str, ...]
    toolchain: str
    template_hash: str
    version: str
    key: str
    build_dir: Path | None = None
    in_cache: bool = False
    compiler: str = "nvcc"


def _plan(req: BuildRequest) -> _Plan:
    arch = nvcc.validate_arch(req.arch if req.arch is not None else nvcc.default_arch())
    compiler = nvcc.resolve_compiler(req.compiler)
    flags = tuple(req.flags) if req.flags is not None else nvcc.default_flags(compiler)
    toolchain = nvcc.compiler_id(compiler)
    template_hash, version = paths.template_hash(), specgen.__version__
    material = {
        "schema": _KEY_SCHEMA,
        "name": req.name,
        "canonical_spec": req.canonical_spec,
        "source": req.source,
        "specgen_version": version,
        "template_hash": template_hash,
        "toolchain": toolchain,
        "arch": arch,
        "flags": list(flags),
    }
    key = hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()
    return _Plan(req, arch, flags, toolchain, template_hash, version, key, compiler=compiler)


def compute_key(req: BuildRequest) -> str:
    """The request's cache key (sha256 hex)."""
    return _plan(req).key


def _entry_dir(root: Path, key: str) -> Path:
    return root / key[:2] / key


# ---------------------------------------------------------------------------- entries


class _Probe(NamedTuple):
    meta: dict | None
    cubin: bytes | None
    problem: str | None  # None with meta None: no entry at all
    cu: bytes | None = None


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _read_regular(name: str, dir_fd: int, limit: int) -> tuple[bytes | None, str | None]:
    """The bytes of regular file `name` in `dir_fd`, or why not: never follows a link, never blocks
    on a FIFO or device, never reads more than `limit` bytes."""
    try:
        fd = os.open(name, os.O_RDONLY | _O_NOFOLLOW | _O_NONBLOCK | _O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        return None, "is missing"
    except OSError as error:
        if error.errno == errno.ELOOP:
            return None, "is a symbolic link"
        return None, f"cannot be opened ({error.strerror})"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None, "is not a regular file"
        if st.st_size > limit:
            return None, f"is larger than {limit} bytes"
        chunks, size = [], 0
        while chunk := os.read(fd, min(1 << 20, limit + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                return None, f"is larger than {limit} bytes"
        return b"".join(chunks), None
    except OSError as error:
        return None, f"cannot be read ({error.strerror})"
    finally:
        os.close(fd)


def _open_dir(path: Path) -> int:
    """A descriptor of directory `path` itself, not of what a link there points to."""
    return os.open(path, os.O_RDONLY | _O_DIRECTORY | _O_NOFOLLOW | _O_CLOEXEC)


def _manifest_problem(meta: object) -> str | None:
    if not isinstance(meta, dict):
        return "its manifest is unreadable"
    if not _MANIFEST_FIELDS <= meta.keys():
        return "its manifest is incomplete"
    for name, kind in _MANIFEST_TYPES.items():
        value = meta[name]
        if not isinstance(value, kind) or isinstance(value, bool) or (kind is int and value < 0):
            return f"its manifest has a wrong {name} (expected {'an integer >= 0' if kind is int else 'a string'})"
    for name in ("cu_sha256", "cubin_sha256"):
        if not _KEY_RE.fullmatch(meta[name]):
            return f"its manifest has a wrong {name} (expected 64 hex digits)"
    return None


def elf_problem(data: bytes) -> str | None:
    """Why `data` is not a whole cubin (a 64-bit little-endian CUDA ELF whose section and program
    header tables and sections lie inside it), or None. A truncated file (a full disk) fails here."""
    if len(data) < 64 or data[:4] != b"\x7fELF":
        return "no ELF header"
    if data[4] != 2 or data[5] != 1:
        return "not a 64-bit little-endian ELF file"
    machine = int.from_bytes(data[18:20], "little")
    if machine != 190:  # EM_CUDA
        return f"ELF machine {machine} is not CUDA (190)"
    phoff, shoff = struct.unpack_from("<QQ", data, 32)
    phentsize, phnum, shentsize, shnum, shstrndx = struct.unpack_from("<HHHHH", data, 54)
    size = len(data)
    if shnum == 0 or shentsize != 64:
        return "no section header table"
    for what, offset, count, entsize in (("section", shoff, shnum, shentsize), ("program", phoff, phnum, phentsize)):
        if count and (entsize < (64 if what == "section" else 56) or offset + count * entsize > size):
            return f"its {what} header table ends at byte {offset + count * entsize}, past the end of the {size}-byte file"
    if shstrndx >= shnum:
        return "its section name table index is out of range"
    for i in range(shnum):
        sh_type, _flags, _addr, sh_offset, sh_size = struct.unpack_from("<IQQQQ", data, shoff + i * 64 + 4)
        if sh_type != 8 and sh_offset + sh_size > size:  # SHT_NOBITS takes no room in the file
            return f"section {i} ends at byte {sh_offset + sh_size}, past the end of the {size}-byte file"
    return None


def _read_entry(dir_fd: int, key: str, source: str | None) -> _Probe:
    raw, why = _read_regular(_META, dir_fd, MAX_MANIFEST_BYTES)
    if raw is None:
        return _Probe(None, None, f"its manifest {why}")
    try:
        meta = json.loads(raw)
    except (ValueError, RecursionError):
        return _Probe(None, None, "its manifest is unreadable")
    if problem := _manifest_problem(meta):
        return _Probe(None, None, problem)
    if meta["key"] != key:
        return _Probe(None, None, "its manifest belongs to another key")
    data = {}
    for name, digest, limit in ((_CU, meta["cu_sha256"], MAX_CUBIN_BYTES), (_CUBIN, meta["cubin_sha256"], MAX_CUBIN_BYTES)):
        data[name], why = _read_regular(name, dir_fd, limit)
        if data[name] is None:
            return _Probe(None, None, f"{name} {why}")
        if _sha256(data[name]) != digest:
            return _Probe(None, None, f"{name} does not match its checksum")
    if source is not None and data[_CU] != source.encode():
        return _Probe(None, None, f"{_CU} is not the source rendered for this request")
    if problem := elf_problem(data[_CUBIN]):
        return _Probe(None, None, f"{_CUBIN} is not a whole cubin ({problem})")
    return _Probe(meta, data[_CUBIN], None, data[_CU])


def _still_published(entry: Path, dir_fd: int) -> bool:
    """Whether the directory read through `dir_fd` is still the one at `entry`."""
    try:
        here, now = os.fstat(dir_fd), os.lstat(entry)
    except OSError:
        return False
    return here.st_nlink > 0 and (here.st_dev, here.st_ino) == (now.st_dev, now.st_ino)


def _probe(entry: Path, key: str, source: str | None = None) -> _Probe:
    """Read and verify an entry: manifest present, well-formed, for this key, checksums matching, the
    source the one rendered for the request (when given), the cubin a whole ELF file.

    Everything is read through one descriptor of the entry's directory. A problem counts only if
    that directory is still the published one: a republish swapping the entry meanwhile means
    reading again (a reader never mixes two versions).
    """
    probe = _Probe(None, None, None)
    for _ in range(_PROBE_TRIES):
        try:
            dir_fd = _open_dir(entry)
        except FileNotFoundError:
            return _Probe(None, None, None)
        except OSError as error:
            why = "is a symbolic link" if error.errno == errno.ELOOP else f"cannot be opened ({error.strerror})"
            if error.errno == errno.ENOTDIR:
                why = "is not a directory"
            return _Probe(None, None, f"the entry {why}")
        try:
            probe = _read_entry(dir_fd, key, source)
            if probe.problem is None or _still_published(entry, dir_fd):
                return probe
        finally:
            os.close(dir_fd)
    return probe


def _result(meta: dict, entry: Path, cache: str, seconds: float) -> BuildResult:
    return BuildResult(
        name=meta["name"],
        key=meta["key"],
        cache=cache,
        compile_seconds=seconds,
        cu=entry / _CU,
        cubin=entry / _CUBIN,
        entry_dir=entry,
        registers=meta["registers"],
        spill_bytes=meta["spill_bytes"],
        smem_bytes=meta["smem_bytes"],
        stack_bytes=meta["stack_bytes"],
        arch=meta["arch"],
        log=meta["log"],
        compiler=meta.get("compiler", "nvcc"),
    )


def _manifest(plan: _Plan, report: CompileReport, cu: bytes, cubin: bytes) -> dict:
    return {
        "name": plan.req.name,
        "key": plan.key,
        "arch": plan.arch,
        "flags": list(plan.flags),
        "compiler": plan.compiler,
        "toolchain": plan.toolchain,
        "specgen_version": plan.version,
        "template_hash": plan.template_hash,
        "canonical_spec": plan.req.canonical_spec,
        "registers": report.registers,
        "spill_bytes": report.spill_bytes,
        "smem_bytes": report.smem_bytes,
        "stack_bytes": report.stack_bytes,
        "kernels": {name: vars(k) for name, k in report.kernels.items()},
        "compile_seconds": report.seconds,
        "created": time.time(),
        "cu_sha256": _sha256(cu),
        "cubin_sha256": _sha256(cubin),
        "log": report.log,
    }


def _touch(entry: Path) -> None:
    """Record a use (the entry dir's mtime); a read-only cache just does not record it."""
    with suppress(OSError):
        os.utime(entry)


# ---------------------------------------------------------------------------- hooks


def _pause(point: str) -> None:
    """Test hook, see the module docstring."""
    wanted, _, seconds = os.environ.get(ENV_TEST_PAUSE, "").partition(":")
    if wanted == point:
        print(f"specgen-test-pause {point}", file=sys.stderr, flush=True)
        time.sleep(float(seconds or 0))


def _count_compile(plan: _Plan) -> None:
    """Test hook, see the module docstring."""
    if counter := os.environ.get(ENV_COMPILE_COUNTER):
        line = json.dumps({"pid": os.getpid(), "name": plan.req.name, "key": plan.key}) + "\n"
        fd = os.open(counter, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)


def _dump(plan: _Plan, log: str) -> None:
    """Copy the source and compiler log to SPECGEN_DUMP_DIR, if set (see `_dump_files`)."""
    _dump_files(plan.req.name, plan.key, plan.req.source, log)


def _dump_files(name: str, key: str, source: str, log: str) -> None:
    """Copy the source and compiler log to SPECGEN_DUMP_DIR, if set.

    The dir must be private (ours, not group- or world-writable); each file is written under a new
    name and renamed over the old, so a link planted there is replaced, never written through.
    """
    if not (dump := os.environ.get(ENV_DUMP_DIR)):
        return
    stem = f"{name}-{key[:12]}"
    try:
        Path(dump).mkdir(mode=0o700, parents=True, exist_ok=True)
        dir_fd = os.open(dump, os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC)
    except OSError as error:
        get_logger().warning("could not write to %s=%s: %s", ENV_DUMP_DIR, dump, error)
        return
    try:
        if why := _not_private(os.fstat(dir_fd)):
            get_logger().warning(
                "refusing %s=%s: %s, so files written there could be redirected; use a private directory "
                "(chmod 700)", ENV_DUMP_DIR, dump, why
            )
            return
        for file_name, text in ((f"{stem}.cu", source), (f"{stem}.log", log)):
            part = f".{file_name}.{uuid.uuid4().hex}"
            try:
                fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC, 0o600, dir_fd=dir_fd)
                try:
                    _write_fd(fd, text.encode())
                finally:
                    os.close(fd)
                os.replace(part, file_name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            except OSError:
                with suppress(OSError):
                    os.unlink(part, dir_fd=dir_fd)
                raise
    except OSError as error:
        get_logger().warning("could not write to %s=%s: %s", ENV_DUMP_DIR, dump, error)
    finally:
        os.close(dir_fd)


# ---------------------------------------------------------------------------- locking


def _holder(lock_path: Path) -> str:
    """Who holds the lock, as its holder file says (read safely, printable characters only)."""
    try:
        dir_fd = _open_dir(lock_path.parent)
    except OSError:
        return "unknown"
    try:
        raw, _ = _read_regular(lock_path.with_suffix(".holder").name, dir_fd, 512)
    finally:
        os.close(dir_fd)
    text = "".join(c for c in (raw or b"").decode(errors="replace") if c.isprintable()).strip()
    return text or "unknown"


def _write_holder(holder: Path) -> None:
    """Create the holder file afresh: a stale one or a planted link is removed, never written through."""
    with suppress(FileNotFoundError):
        os.unlink(holder)
    fd = os.open(holder, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC, _file_mode())
    try:
        _write_fd(fd, f"pid {os.getpid()} on {socket.gethostname()} since {time.ctime()}\n".encode())
    finally:
        os.close(fd)


def _lock_path(root: Path, key: str) -> Path:
    locks = root / "locks"
    locks.mkdir(mode=_dir_mode(), exist_ok=True)
    return locks / f"{key}.lock"


def lock_timeout() -> float:
    """Seconds a build waits for another process's build lock: `SPECGEN_LOCK_TIMEOUT`, default 3600."""
    raw = os.environ.get(ENV_LOCK_TIMEOUT, "").strip()
    if not raw:
        return DEFAULT_LOCK_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not (value > 0 and value != float("inf")):
        raise ValueError(f"{ENV_LOCK_TIMEOUT}: expected a number of seconds > 0, got {raw!r}")
    return value


@contextmanager
def _key_lock(root: Path, key: str) -> Iterator[None]:
    """Hold the per-key build lock, logging the holder once the wait exceeds LOCK_WARN_SECONDS and
    giving up (LockTimeoutError, naming the holder) after `lock_timeout()`."""
    limit = lock_timeout()
    path = _lock_path(root, key)
    lock = FileLock(path)
    try:
        lock.acquire(timeout=min(LOCK_WARN_SECONDS, limit))
    except Timeout:
        if limit > LOCK_WARN_SECONDS:
            get_logger().warning(
                "waited %.0f s for build lock %s, held by %s; still waiting (up to %s=%g s)",
                LOCK_WARN_SECONDS, path, _holder(path), ENV_LOCK_TIMEOUT, limit,
            )
        try:
            lock.acquire(timeout=max(0.0, limit - LOCK_WARN_SECONDS))
        except Timeout:
            raise LockTimeoutError(
                f"gave up after waiting {limit:g} s ({ENV_LOCK_TIMEOUT}={limit:g}) for build lock {path}, held by "
                f"{_holder(path)}. If that process is stuck, stop it; otherwise raise {ENV_LOCK_TIMEOUT}."
            ) from None
    holder = path.with_suffix(".holder")
    try:
        with suppress(OSError):
            _write_holder(holder)
        yield
    finally:
        with suppress(OSError):
            holder.unlink()
        lock.release()


# ---------------------------------------------------------------------------- building

_fallback_dirs: list[Path] = []


@atexit.register
def _remove_fallback_dirs() -> None:
    for path in _fallback_dirs:
        _remove_tree(path)


def _fallback_dir(plan: _Plan, where: Path | None, error: OSError) -> Path:
    """A private temporary build dir outside the cache, with the WARNING that says why."""
    get_logger().warning(
        "cannot write to the kernel cache %s (%s); building %s in a temporary directory, it will not be cached",
        where if where is not None else _configured_dir(),
        error,
        plan.req.name,
    )
    path = Path(tempfile.mkdtemp(prefix="specgen-build-"))
    _fallback_dirs.append(path)
    return path


def _stage(plan: _Plan, root: Path | None) -> None:
    """Create the build dir with kernel.cu: a tmp dir in the cache, else a temporary one."""
    if root is not None:
        staging = None
        try:
            staging = _new_tmp_dir(root)
            _write_file(staging / _CU, plan.req.source.encode())
            _pin_mtime(staging / _CU)
            plan.build_dir, plan.in_cache = staging, True
            return
        except OSError as error:
            if staging is not None:
                _remove_tree(staging)
            plan.build_dir = _fallback_dir(plan, root, error)
    assert plan.build_dir is not None
    (plan.build_dir / _CU).write_text(plan.req.source)
    _pin_mtime(plan.build_dir / _CU)


def _pin_mtime(cu: Path) -> None:
    """`-lineinfo` records the source's mtime: a fixed one keeps cubins byte-identical across builds."""
    os.utime(cu, (_SOURCE_MTIME, _SOURCE_MTIME))


_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux renameat2); False where the system or file system cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    at_fdcwd = -100
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), os.fspath(b))


def _shard(root: Path, key: str) -> Path:
    """The entry's shard dir, a real directory: anything else there (a planted link) is removed first."""
    shard = root / key[:2]
    with suppress(FileNotFoundError):
        if not stat.S_ISDIR(os.lstat(shard).st_mode):
            _discard_dir(root, shard)
    with suppress(FileExistsError):
        os.mkdir(shard, _dir_mode())
    return shard


def _publish(root: Path, staging: Path, entry: Path) -> None:
    """Make `staging` the entry in one step: a rename, or an atomic swap with the entry it replaces,
    so readers see the old entry or the new one, never none or a mix."""
    shard = _shard(root, entry.name)
    try:
        os.replace(staging, entry)  # fails on an existing (non-empty) entry: then swap
    except OSError as error:
        if error.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            raise
        if _exchange(staging, entry):
            _remove_tree(staging)  # the old entry, now out of view
        else:
            _discard_dir(root, entry)
            os.replace(staging, entry)
    _fsync_path(shard, directory=True)


def _finish(plan: _Plan, root: Path | None, report: CompileReport) -> BuildResult:
    """Check the cubin, write the manifest last, flush everything and publish the entry; a full
    cache moves it to a temporary dir. Raises CompileError for a cubin that is not whole."""
    assert plan.build_dir is not None
    cu = (plan.build_dir / _CU).read_bytes()
    cubin = (plan.build_dir / _CUBIN).read_bytes()
    if problem := elf_problem(cubin):
        raise CompileError(
            f"nvcc reported success but {plan.build_dir / _CUBIN} is not a whole cubin ({problem}); "
            "is the disk (or TMPDIR) full?",
            command=[],
            log=report.log,
            returncode=0,
        )
    meta = _manifest(plan, report, cu, cubin)
    blob = json.dumps(meta, indent=1).encode()
    _pause("compiled")
    if plan.in_cache and root is not None:
        entry = _entry_dir(root, plan.key)
        try:
            _fsync_path(plan.build_dir / _CUBIN)
            _write_file(plan.build_dir / _META, blob)
            _fsync_path(plan.build_dir, directory=True)
            _pause("staged")
            _publish(root, plan.build_dir, entry)
            _pause("published")
            return _result(meta, entry, "miss", report.seconds)
        except OSError as error:
            _remove_tree(plan.build_dir)
            plan.build_dir, plan.in_cache = _fallback_dir(plan, root, error), False
            (plan.build_dir / _CU).write_bytes(cu)
            (plan.build_dir / _CUBIN).write_bytes(cubin)
    (plan.build_dir / _META).write_bytes(blob)
    return _result(meta, plan.build_dir, "miss", report.seconds)


def _cache_root(plans: list[_Plan]) -> Path | None:
    """The cache dir, or None (with a WARNING per request) when it cannot be created."""
    try:
        return cache_dir()
    except OSError as error:
        for plan in plans:
            plan.build_dir = _fallback_dir(plan, None, error)
        return None


def _hit(root: Path, plan: _Plan, probe: _Probe) -> BuildResult:
    assert probe.meta is not None
    entry = _entry_dir(root, plan.key)
    _touch(entry)
    _dump(plan, probe.meta["log"])
    progress.advance()
    return _result(probe.meta, entry, "hit", 0.0)


def _claim(plan: _Plan, root: Path | None, always: bool, held: ExitStack) -> BuildResult | None:
    """Take the key's lock and look again: a hit if another process built it meanwhile, else None.

    Without a usable cache the plan gets a temporary build dir instead.
    """
    if root is None or plan.build_dir is not None:
        return None
    try:
        held.enter_context(_key_lock(root, plan.key))
    except OSError as error:
        plan.build_dir = _fallback_dir(plan, root, error)
        return None
    if not always:
        probe = _probe(_entry_dir(root, plan.key), plan.key, plan.req.source)
        if probe.meta is not None:
            return _hit(root, plan, probe)
        if probe.problem:
            get_logger().warning(
                "cache entry %s for %s is invalid (%s); rebuilding it",
                _entry_dir(root, plan.key),
                plan.req.name,
                probe.problem,
            )
    _pause("locked")
    return None


def _compile(building: list[_Plan], root: Path | None) -> dict[str, BuildResult | CompileError]:
    """Stage, compile (in parallel) and publish; outcomes by key."""
    log = get_logger()
    for plan in building:
        _stage(plan, root if plan.build_dir is None else None)
        _count_compile(plan)
        log.info("compiling %s (%s)", plan.req.name, plan.key[:12])
    jobs = [CompileJob(p.build_dir / _CU, p.build_dir / _CUBIN, p.arch, p.flags, p.compiler) for p in building]
    outcomes: dict[str, BuildResult | CompileError] = {}
    for plan, report in zip(building, nvcc.compile_many(jobs, on_done=lambda _i: progress.advance())):
        _dump(plan, report.log)
        if isinstance(report, CompileError):
            outcomes[plan.key] = report
        else:
            log.info("compiled %s in %.2f s", plan.req.name, report.seconds)
            try:
                outcomes[plan.key] = _finish(plan, root, report)
            except CompileError as error:
                outcomes[plan.key] = error
    return outcomes


def get_or_build(req: BuildRequest) -> BuildResult:
    """The cached kernel for `req`, compiling and publishing it on a miss. Raises CompileError."""
    return build_many([req])[0]


def build_many(reqs: list[BuildRequest]) -> list[BuildResult]:
    """Like get_or_build for each request, compiling the misses in parallel.

    Locks are taken in key order, so overlapping batches cannot deadlock. Successes are published
    before the first CompileError (in request order) is raised.
    """
    keys = []
    plans: dict[str, _Plan] = {}
    for req in reqs:
        plan = _plan(req)
        plans.setdefault(plan.key, plan)
        keys.append(plan.key)
    ordered = sorted(plans.values(), key=lambda p: p.key)
    progress.expect(len(ordered))
    root = _cache_root(ordered)
    always = _env_flag(ENV_ALWAYS_COMPILE)
    outcomes: dict[str, BuildResult | CompileError] = {}
    if root is not None and not always:
        for plan in ordered:
            probe = _probe(_entry_dir(root, plan.key), plan.key, plan.req.source)
            if probe.meta is not None:
                outcomes[plan.key] = _hit(root, plan, probe)
    building = []
    with ExitStack() as held:
        for plan in ordered:
            if plan.key not in outcomes:
                if (found := _claim(plan, root, always, held)) is not None:
                    outcomes[plan.key] = found
                else:
                    building.append(plan)
        try:
            outcomes.update(_compile(building, root))
        finally:
            for plan in building:
                if not isinstance(outcomes.get(plan.key), BuildResult) and plan.build_dir is not None:
                    _remove_tree(plan.build_dir)
    if root is not None and building:
        _sweep_tmp(root)
    for key in keys:
        if isinstance(outcomes[key], CompileError):
            raise outcomes[key]
    return [outcomes[key] for key in keys]


# ---------------------------------------------------------------------------- reading and upkeep


def load_cubin_bytes(result_or_key: BuildResult | str) -> bytes:
    """The cubin of a build result (or of a cached key), verified against its manifest.

    Raises CacheEntryError when the entry is missing or fails its checksums; building the request
    again with get_or_build repairs it.
    """
    if isinstance(result_or_key, BuildResult):
        key, entry = result_or_key.key, result_or_key.entry_dir
    else:
        key = result_or_key
        if not _KEY_RE.fullmatch(key):
            raise ValueError(f"key: expected 64 lowercase hex digits, got {key!r}")
        entry = _entry_dir(cache_dir(), key)
    probe = _probe(entry, key)
    if probe.cubin is None:
        raise CacheEntryError(
            f"cache entry {entry} is unusable: {probe.problem or 'it does not exist'}; build it again"
        )
    return probe.cubin


# ---------------------------------------------------------------------------- the request index
#
# `<cache>/requests/<k[:2]>/<k>`: one JSON file per request key (`specgen.planindex`), naming the
# build entry a request compiled to and holding its plan. It is staged as a `tmp.*` file in the
# cache dir (swept like a staging dir when its writer is gone), flushed, and published by a rename
# over the old one, so a reader sees the old file or the new one. It holds no cubin: a hit still
# reads and checks the build entry (`lookup`).

_INDEX = "requests"
MAX_INDEX_BYTES = 64 * 1024 * 1024


def always_compile() -> bool:
    """Whether `SPECGEN_ALWAYS_COMPILE` asks for every request to be built again."""
    return _env_flag(ENV_ALWAYS_COMPILE)


def _index_shard_fd(root: Path, key: str) -> int:
    """A descriptor of the index shard of `key`, reached without following a link."""
    index_fd = _open_dir(root / _INDEX)
    try:
        return os.open(key[:2], os.O_RDONLY | _O_DIRECTORY | _O_NOFOLLOW | _O_CLOEXEC, dir_fd=index_fd)
    finally:
        os.close(index_fd)


def read_index(key: str) -> tuple[object | None, str | None]:
    """The index entry of request key `key` as parsed JSON, or (None, why not); (None, None) when
    there is none. Never raises for a missing, unreadable or malformed entry, nor for an unusable
    cache dir."""
    if not _KEY_RE.fullmatch(key):
        raise ValueError(f"key: expected 64 lowercase hex digits, got {key!r}")
    try:
        root = cache_dir()
        shard_fd = _index_shard_fd(root, key)
    except (OSError, CacheDirError):
        return None, None
    try:
        raw, why = _read_regular(key, shard_fd, MAX_INDEX_BYTES)
    finally:
        os.close(shard_fd)
    if raw is None:
        return None, None if why == "is missing" else f"the index entry {why}"
    try:
        return json.loads(raw), None
    except (ValueError, RecursionError):
        return None, "the index entry is unreadable"


def _real_subdir(root: Path, parent: Path, name: str) -> Path:
    """`parent/name` as a real directory: anything else there (a planted link) is removed first."""
    path = parent / name
    with suppress(FileNotFoundError):
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            _discard_dir(root, path)
    with suppress(FileExistsError):
        os.mkdir(path, _dir_mode())
    return path


def write_index(key: str, record: dict) -> bool:
    """Publish the index entry of request key `key` (staged, flushed, renamed into place). False,
    with nothing written, when the cache cannot be written; never raises for that."""
    if not _KEY_RE.fullmatch(key):
        raise ValueError(f"key: expected 64 lowercase hex digits, got {key!r}")
    staged = None
    try:
        root = cache_dir()
        shard = _real_subdir(root, _real_subdir(root, root, _INDEX), key[:2])
        staged = root / _tmp_name()
        _write_file(staged, json.dumps(record).encode())
        os.replace(staged, shard / key)
        staged = None
        _fsync_path(shard, directory=True)
        return True
    except (OSError, CacheDirError) as error:
        get_logger().debug("could not write the request index entry %s: %s", key[:12], error)
        return False
    finally:
        if staged is not None:
            with suppress(OSError):
                os.unlink(staged)


def entry_checksums(result: BuildResult) -> tuple[str, str] | None:
    """The (kernel.cu, cubin) sha256 of a published cache entry, from its manifest; None for a build
    outside the cache (a temporary dir) or an entry that is not whole."""
    try:
        root = cache_dir()
    except (OSError, CacheDirError):
        return None
    entry = _entry_dir(root, result.key)
    if result.entry_dir != entry:
        return None
    probe = _probe(entry, result.key)
    if probe.meta is None:
        return None
    return probe.meta["cu_sha256"], probe.meta["cubin_sha256"]


def lookup(key: str, cu_sha256: str, cubin_sha256: str) -> tuple[BuildResult, str] | None:
    """The cached build of `key` and its source, checked as any hit is (manifest, checksums, a
    whole cubin) and against the checksums an index entry recorded; None otherwise (no entry, an
    invalid one, another build), so that the caller plans and builds as on a miss."""
    if not _KEY_RE.fullmatch(key) or always_compile():
        return None
    try:
        root = cache_dir()
    except (OSError, CacheDirError):
        return None
    entry = _entry_dir(root, key)
    probe = _probe(entry, key)
    if probe.meta is None or probe.cu is None:
        return None
    if (probe.meta["cu_sha256"], probe.meta["cubin_sha256"]) != (cu_sha256, cubin_sha256):
        return None
    try:
        source = probe.cu.decode()
    except UnicodeDecodeError:
        return None
    _touch(entry)
    _dump_files(probe.meta["name"], key, source, probe.meta["log"])
    progress.expect(1)
    progress.advance()
    return _result(probe.meta, entry, "hit", 0.0), source


def _index_files(root: Path) -> Iterator[Path]:
    for shard in _real_dirs(root / _INDEX):
        if len(shard.name) != 2:
            continue
        with suppress(OSError), os.scandir(shard.path) as it:
            for item in list(it):
                if _KEY_RE.fullmatch(item.name) and item.is_file(follow_symlinks=False):
                    yield Path(item.path)


def index_stats() -> tuple[int, int]:
    """The request index's (entries, bytes)."""
    count = size = 0
    for path in _index_files(cache_dir()):
        with suppress(OSError):
            size += path.lstat().st_size
            count += 1
    return count, size


def _prune_index(root: Path) -> None:
    """Remove the index entries whose build entry is gone."""
    for path in list(_index_files(root)):
        with suppress(OSError):
            raw = path.read_bytes() if path.lstat().st_size <= MAX_INDEX_BYTES else b""
            try:
                build_key = json.loads(raw).get("build_key", "")
            except (ValueError, AttributeError, RecursionError):
                build_key = ""
            if not (isinstance(build_key, str) and _KEY_RE.fullmatch(build_key)
                    and _entry_dir(root, build_key).is_dir()):
                path.unlink()


def _real_dirs(path: Path) -> Iterator[os.DirEntry]:
    """The directories in `path` that are directories themselves, not links to one."""
    try:
        with os.scandir(path) as it:
            found = list(it)
    except OSError:
        return
    for item in found:
        with suppress(OSError):
            if item.is_dir(follow_symlinks=False):
                yield item


def _entries(root: Path) -> Iterator[Path]:
    for shard in _real_dirs(root):
        if len(shard.name) != 2:
            continue
        for entry in _real_dirs(Path(shard.path)):
            if _KEY_RE.fullmatch(entry.name) and entry.name[:2] == shard.name:
                yield Path(entry.path)


def _row(entry: Path, now: float) -> dict:
    dir_fd = _open_dir(entry)
    try:
        raw, _ = _read_regular(_META, dir_fd, MAX_MANIFEST_BYTES)
        try:
            meta = json.loads(raw or b"")
            name, arch, created = meta["name"], meta["arch"], float(meta["created"])
            if not (isinstance(name, str) and isinstance(arch, str)):
                raise TypeError
        except (ValueError, TypeError, KeyError, RecursionError):
            name, arch, created = "?", "?", os.fstat(dir_fd).st_mtime
        size = 0
        for name_ in os.listdir(dir_fd):
            with suppress(OSError):
                st = os.stat(name_, dir_fd=dir_fd, follow_symlinks=False)
                size += st.st_size if stat.S_ISREG(st.st_mode) else 0
        last_use = os.fstat(dir_fd).st_mtime
    finally:
        os.close(dir_fd)
    return {
        "name": name,
        "key": entry.name,
        "arch": arch,
        "size": size,
        "age": max(0.0, now - created),
        "last_use": last_use,
        "path": str(entry),
    }


def list_entries() -> list[dict]:
    """One row per entry: name, key, arch, size (bytes), age (s), last_use (epoch s), path."""
    root = cache_dir()
    now = time.time()
    rows = []
    for entry in _entries(root):
        try:
            rows.append(_row(entry, now))
        except OSError:
            continue  # removed meanwhile, or unreadable
    return sorted(rows, key=lambda r: r["last_use"], reverse=True)


@contextmanager
def _unless_building(root: Path, key: str) -> Iterator[bool]:
    """Yield True while holding the key's lock, False at once if a build holds it.

    Holding it, the lock file may be unlinked: filelock retries a lock whose file went away.
    """
    try:
        lock = FileLock(_lock_path(root, key))
        lock.acquire(timeout=0)
    except (Timeout, OSError):
        yield False
        return
    try:
        yield True
    finally:
        lock.release()


def _forget(root: Path, key: str, entry: Path | None) -> bool:
    """Remove the entry (if given) and the key's lock file, unless a build holds the lock."""
    with _unless_building(root, key) as free:
        if not free:
            return False
        removed = entry is not None and _discard_dir(root, entry)
        lock = _lock_path(root, key)
        for path in (lock.with_suffix(".holder"), lock):
            with suppress(OSError):
                path.unlink()
        return removed


def prune(max_bytes: int) -> list[dict]:
    """Remove least recently used entries until the total size is at most `max_bytes`.

    Entries being built right now are skipped. Returns the removed rows, oldest use first.
    """
    if max_bytes < 0:
        raise ValueError(f"max_bytes: expected a size >= 0, got {max_bytes}")
    root = cache_dir()
    _sweep_tmp(root)
    rows = sorted(list_entries(), key=lambda r: r["last_use"])
    total = sum(r["size"] for r in rows)
    removed = []
    for row in rows:
        if total <= max_bytes:
            break
        if _forget(root, row["key"], Path(row["path"])):
            total -= row["size"]
            removed.append(row)
    if removed:
        _prune_index(root)
    return removed


def clear() -> int:
    """Remove every entry not being built, dead builders' leftovers and idle lock files.

    Returns the number of entries removed.
    """
    root = cache_dir()
    _sweep_tmp(root)
    count = sum(_forget(root, entry.name, entry) for entry in list(_entries(root)))
    index = root / _INDEX
    with suppress(OSError):
        if os.path.islink(index):
            index.unlink()
        elif index.is_dir():
            _discard_dir(root, index)
    for lock in root.glob("locks/*.lock"):
        if _KEY_RE.fullmatch(lock.stem):
            _forget(root, lock.stem, None)
    for shard in root.glob("??"):
        with suppress(OSError):
            if os.path.islink(shard):
                shard.unlink()  # a planted link: removed itself, never followed
            else:
                shard.rmdir()
    return count
