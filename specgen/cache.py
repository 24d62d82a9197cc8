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

Protocol: a hit needs a manifest whose key and checksums match the files; the entry's directory
mtime records its last use. A miss takes the per-key lock `<cache>/locks/<key>.lock` (flock
through `filelock`, so the kernel releases it when the holder dies), checks the cache again, then
writes `kernel.cu`, the cubin and, last, `meta.json` into a private `<cache>/tmp.pid_<pid>_<hex>/`
and publishes it with one `os.replace` of the whole directory. The holder writes `pid host time`
into `<key>.holder`; a process that waits `LOCK_WARN_SECONDS` logs the lock path and that holder,
then keeps waiting. Leftover `tmp.*` directories whose process is gone (or older than a day) are
swept after builds and by `prune`/`clear`. An invalid entry is reported with one WARNING and
rebuilt. When the cache cannot be written (read-only, full) the kernel is built in a private
temporary directory outside the cache, removed at exit, with a WARNING.

Environment: `SPECGEN_ALWAYS_COMPILE=1` rebuilds and republishes every request;
`SPECGEN_DUMP_DIR=<dir>` receives `<name>-<key[:12]>.cu` and `.log` for each request.

Test hooks (diagnostics only, no effect when unset):
`SPECGEN_COMPILE_COUNTER=<file>` appends one JSON line `{"pid", "name", "key"}` per nvcc run,
so tests can count compiles across processes. `SPECGEN_TEST_PAUSE=<point>:<seconds>` prints
`specgen-test-pause <point>` to stderr and sleeps when a build reaches `<point>`, one of
`locked` (lock held, before staging), `compiled` (cubin staged, no manifest), `staged` (manifest
staged, not published) or `published` (published, lock still held).
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import re
import shutil
import socket
import stat
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

LOCK_WARN_SECONDS = 10.0
"""How long a build waits on another holder's lock before logging who holds it."""
STALE_TMP_SECONDS = 24 * 3600.0

_KEY_SCHEMA = 1
_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_KEY_RE = re.compile(r"[0-9a-f]{64}")
_TMP_RE = re.compile(r"tmp\.pid_(\d+)_[0-9a-f]+")
_CU, _CUBIN, _META = "kernel.cu", "kernel.cubin", "meta.json"
_MANIFEST_FIELDS = frozenset(
    ("name", "key", "arch", "registers", "spill_bytes", "smem_bytes", "stack_bytes", "log", "cu_sha256", "cubin_sha256")
)


class CacheDirError(ValueError):
    """The configured cache directory is unsafe or invalid (a bad setting, hence a ValueError)."""


class CacheEntryError(RuntimeError):
    """A cache entry asked for by key is missing or fails its checksums."""


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


def _check_dir(path: Path) -> None:
    """Refuse a directory others can write to, unless a shared cache was asked for."""
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise CacheDirError(f"cache dir {path} is not a directory; set {ENV_CACHE_DIR} to a directory")
    if _env_flag(ENV_SHARED):
        return
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid != os.geteuid():
        raise CacheDirError(
            f"refusing cache dir {path}: it is owned by uid {st.st_uid}, not by you (uid {os.geteuid()}), "
            f"so its kernels cannot be trusted. Fix: set {ENV_CACHE_DIR} to a directory of your own, "
            f"or set {ENV_SHARED}=1 to use a shared team cache deliberately."
        )
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise CacheDirError(
            f"refusing cache dir {path}: mode {mode:04o} lets other users write to it, so its kernels "
            f"cannot be trusted. Fix: chmod 700 {path}, or set {ENV_SHARED}=1 to use a shared team "
            "cache deliberately."
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


def _write_file(path: Path, data: bytes) -> None:
    """Create `path` (which must not exist) holding `data`."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, _file_mode())
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def _new_tmp_dir(root: Path) -> Path:
    path = root / f"tmp.pid_{os.getpid()}_{uuid.uuid4().hex}"
    os.mkdir(path, _dir_mode())
    return path


def _remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def _discard_dir(root: Path, path: Path) -> bool:
    """Atomically take `path` out of view (rename into a tmp dir), then delete it."""
    trash = root / f"tmp.pid_{os.getpid()}_{uuid.uuid4().hex}"
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return False
    _remove_tree(trash)
    return True


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _sweep_tmp(root: Path) -> None:
    """Delete tmp dirs left by processes that are gone (or that are older than a day)."""
    now = time.time()
    for path in root.glob("tmp.pid_*"):
        m = _TMP_RE.fullmatch(path.name)
        if not m or int(m.group(1)) == os.getpid():
            continue
        try:
            old = now - path.lstat().st_mtime > STALE_TMP_SECONDS
        except FileNotFoundError:
            continue
        if old or not _process_alive(int(m.group(1))):
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


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _probe(entry: Path, key: str) -> _Probe:
    """Read and verify an entry: manifest present, parseable, for this key, checksums matching."""
    try:
        raw = (entry / _META).read_bytes()
    except FileNotFoundError:
        return _Probe(None, None, "its manifest is missing" if entry.is_dir() else None)
    try:
        meta = json.loads(raw)
        if not _MANIFEST_FIELDS <= meta.keys():
            return _Probe(None, None, "its manifest is incomplete")
    except (ValueError, AttributeError):
        return _Probe(None, None, "its manifest is unreadable")
    if meta["key"] != key:
        return _Probe(None, None, "its manifest belongs to another key")
    files = {_CU: meta["cu_sha256"], _CUBIN: meta["cubin_sha256"]}
    cubin = b""
    for name, digest in files.items():
        try:
            data = (entry / name).read_bytes()
        except FileNotFoundError:
            return _Probe(None, None, f"{name} is missing" if entry.is_dir() else None)
        if _sha256(data) != digest:
            return _Probe(None, None, f"{name} does not match its checksum")
        cubin = data
    return _Probe(meta, cubin, None)


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
    """Copy the source and compiler log to SPECGEN_DUMP_DIR, if set."""
    if not (dump := os.environ.get(ENV_DUMP_DIR)):
        return
    stem = Path(dump) / f"{plan.req.name}-{plan.key[:12]}"
    try:
        stem.parent.mkdir(parents=True, exist_ok=True)
        stem.with_suffix(".cu").write_text(plan.req.source)
        stem.with_suffix(".log").write_text(log)
    except OSError as error:
        get_logger().warning("could not write to %s=%s: %s", ENV_DUMP_DIR, dump, error)


# ---------------------------------------------------------------------------- locking


def _holder(lock_path: Path) -> str:
    try:
        return lock_path.with_suffix(".holder").read_text().strip() or "unknown"
    except OSError:
        return "unknown"


def _lock_path(root: Path, key: str) -> Path:
    locks = root / "locks"
    locks.mkdir(mode=_dir_mode(), exist_ok=True)
    return locks / f"{key}.lock"


@contextmanager
def _key_lock(root: Path, key: str) -> Iterator[None]:
    """Hold the per-key build lock, logging the holder once the wait exceeds LOCK_WARN_SECONDS."""
    path = _lock_path(root, key)
    lock = FileLock(path)
    try:
        lock.acquire(timeout=LOCK_WARN_SECONDS)
    except Timeout:
        get_logger().warning(
            "waited %.0f s for build lock %s, held by %s; still waiting", LOCK_WARN_SECONDS, path, _holder(path)
        )
        lock.acquire()
    holder = path.with_suffix(".holder")
    try:
        with suppress(OSError):
            holder.write_text(f"pid {os.getpid()} on {socket.gethostname()} since {time.ctime()}\n")
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
            plan.build_dir, plan.in_cache = staging, True
            return
        except OSError as error:
            if staging is not None:
                _remove_tree(staging)
            plan.build_dir = _fallback_dir(plan, root, error)
    assert plan.build_dir is not None
    (plan.build_dir / _CU).write_text(plan.req.source)


def _finish(plan: _Plan, root: Path | None, report: CompileReport) -> BuildResult:
    """Write the manifest last and publish the entry; a full cache moves it to a temporary dir."""
    assert plan.build_dir is not None
    cu = (plan.build_dir / _CU).read_bytes()
    cubin = (plan.build_dir / _CUBIN).read_bytes()
    meta = _manifest(plan, report, cu, cubin)
    blob = json.dumps(meta, indent=1).encode()
    _pause("compiled")
    if plan.in_cache and root is not None:
        entry = _entry_dir(root, plan.key)
        try:
            _write_file(plan.build_dir / _META, blob)
            _pause("staged")
            entry.parent.mkdir(mode=_dir_mode(), exist_ok=True)
            if entry.exists():
                _discard_dir(root, entry)
            os.replace(plan.build_dir, entry)
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
        probe = _probe(_entry_dir(root, plan.key), plan.key)
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
            outcomes[plan.key] = _finish(plan, root, report)
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
            probe = _probe(_entry_dir(root, plan.key), plan.key)
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


def _entries(root: Path) -> Iterator[Path]:
    for shard in root.glob("??"):
        for entry in shard.iterdir() if shard.is_dir() else ():
            if _KEY_RE.fullmatch(entry.name) and entry.name[:2] == shard.name:
                yield entry


def _row(entry: Path, now: float) -> dict:
    try:
        meta = json.loads((entry / _META).read_bytes())
        name, arch, created = meta["name"], meta["arch"], float(meta["created"])
    except (OSError, ValueError, TypeError, KeyError):
        name, arch, created = "?", "?", entry.stat().st_mtime
    size = sum(f.stat().st_size for f in entry.iterdir() if f.is_file())
    last_use = entry.stat().st_mtime
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
        except FileNotFoundError:
            continue  # removed meanwhile
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
    return removed


def clear() -> int:
    """Remove every entry not being built, dead builders' leftovers and idle lock files.

    Returns the number of entries removed.
    """
    root = cache_dir()
    _sweep_tmp(root)
    count = sum(_forget(root, entry.name, entry) for entry in list(_entries(root)))
    for lock in root.glob("locks/*.lock"):
        if _KEY_RE.fullmatch(lock.stem):
            _forget(root, lock.stem, None)
    for shard in root.glob("??"):
        with suppress(OSError):
            shard.rmdir()
    return count
