"""Kernel cache, in one process: hits and misses, keys, corruption, permissions, no room, settings."""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import specgen
from specgen import cache, log, paths
from specgen.compile import DEFAULT_FLAGS, CompileError

from conftest_cache_helpers import (
    TEMPLATE_HASH,
    fake_nvcc,
    isolated_cache,
    kernel_source,
    make_request,
    spawn_builder,
    warnings_of,
)

BAD_SOURCE = 'extern "C" __global__ void k(float* y){\n  y[threadIdx.x] = 1.0f\n}\n'


@pytest.fixture
def cache_env(tmp_path, monkeypatch):
    yield from isolated_cache(tmp_path, monkeypatch)


def _entries_on_disk(root: Path) -> list[Path]:
    return sorted(p for p in root.glob("??/*") if p.is_dir()) if root.exists() else []


# ---------------------------------------------------------------------------- hits, misses, layout


def test_miss_then_hit_compiles_once(cache_env):
    req = make_request()
    first = cache.get_or_build(req)
    assert first.cache == "miss" and len(cache_env.compiles()) == 1
    assert first.entry_dir == cache_env.root / first.key[:2] / first.key
    assert sorted(p.name for p in first.entry_dir.iterdir()) == ["kernel.cu", "kernel.cubin", "meta.json"]
    assert first.cu.read_text() == req.source and first.cubin.read_bytes()[:4] == b"\x7fELF"
    assert first.registers > 0 and first.spill_bytes == 0 and first.arch == "sm_90" and first.compile_seconds > 0
    assert "ptxas info" in first.log

    old = first.entry_dir.stat().st_mtime - 1000
    os.utime(first.entry_dir, (old, old))
    second = cache.get_or_build(req)
    assert second.cache == "hit" and len(cache_env.compiles()) == 1, cache_env.compiles()
    assert second.compile_seconds == 0.0 and second.cubin == first.cubin and second.registers == first.registers
    assert second.log == first.log
    assert first.entry_dir.stat().st_mtime > old + 500, "a hit records its use"
    assert cache.load_cubin_bytes(second) == first.cubin.read_bytes() == cache.load_cubin_bytes(first.key)


def test_manifest_and_json(cache_env):
    req = make_request(flags=("-O2", "-std=c++17"), arch="sm_80")
    result = cache.get_or_build(req)
    meta = json.loads((result.entry_dir / "meta.json").read_text())
    assert meta["name"] == "k" and meta["key"] == result.key and meta["arch"] == "sm_80"
    assert meta["flags"] == ["-O2", "-std=c++17"] and meta["canonical_spec"] == req.canonical_spec
    assert meta["specgen_version"] == specgen.__version__ and meta["template_hash"] == TEMPLATE_HASH
    assert "Cuda compilation tools" in meta["toolchain"]
    assert meta["registers"] == result.registers and meta["kernels"]["k"]["registers"] == result.registers
    for field in ("spill_bytes", "smem_bytes", "stack_bytes", "compile_seconds", "created", "cu_sha256", "cubin_sha256"):
        assert field in meta, field
    doc = result.as_json()
    json.dumps(doc)
    for field in ("name", "key", "cache", "compile_seconds", "cu", "cubin", "registers", "spill_bytes", "smem_bytes", "arch"):
        assert field in doc, field
    assert doc["cubin"] == str(result.cubin) and doc["cache"] == "miss"


def test_build_many_compiles_misses_together(cache_env):
    cache.get_or_build(make_request("old"))
    reqs = [make_request(t) for t in ("a", "b", "old", "c", "a")]
    results = cache.build_many(reqs)
    assert [r.cache for r in results] == ["miss", "miss", "hit", "miss", "miss"]
    assert results[0] == results[4] and len({r.key for r in results}) == 4
    assert len(cache_env.compiles()) == 4, cache_env.compiles()
    assert [r.cache for r in cache.build_many(reqs)] == ["hit"] * 5 and len(cache_env.compiles()) == 4
    assert cache.build_many([]) == []


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"name": "not an identifier"}, r"^name: "),
        ({"name": "../evil"}, r"^name: "),
        ({"arch": "compute_90"}, r"^arch: "),
        ({"flags": "-O3"}, r"^flags: "),
        ({"flags": ("-O3", 3)}, r"^flags: "),
        ({"flags": 3}, r"^flags: "),
        ({"source": b"bytes"}, r"^source: "),
        ({"canonical_spec": {"a": 1}}, r"^canonical_spec: "),
    ],
)
def test_request_validation(fields, message):
    with pytest.raises(ValueError, match=message):
        make_request(**fields)


def test_flags_list_becomes_tuple():
    assert make_request(flags=["-O3"]).flags == ("-O3",)


# ---------------------------------------------------------------------------- keys


CHANGES = {
    "specgen version": lambda mp, tmp: mp.setattr(specgen, "__version__", specgen.__version__ + ".post1"),
    "template hash": lambda mp, tmp: mp.setattr(paths, "template_hash", lambda: "other-templates"),
    "compiler identity": lambda mp, tmp: mp.setenv("CUDA_HOME", str(fake_nvcc(tmp / "cuda" / "bin", "nvcc 99.9").parent.parent)),
    "arch": {"arch": "sm_80"},
    "flags": {"flags": ("-O2", "-std=c++17", "-lineinfo")},
    "flag order": {"flags": ("-std=c++17", "-O3", "-lineinfo")},
    "source": {"source": kernel_source("base").replace("1.0f", "2.0f")},
    "spec": {"canonical_spec": json.dumps({"tag": "base", "k": 3})},
    "name": {"name": "k2"},
}


def test_key_is_stable_and_defaults_resolve(cache_env):
    base = make_request()
    assert cache.compute_key(base) == cache.compute_key(make_request()) and re.fullmatch(r"[0-9a-f]{64}", cache.compute_key(base))
    assert cache.compute_key(base) == cache.compute_key(make_request(arch="sm_90", flags=DEFAULT_FLAGS))
    assert cache.compute_key(base) == cache.get_or_build(base).key


@pytest.mark.parametrize("change", list(CHANGES))
def test_key_changes(cache_env, monkeypatch, tmp_path, change):
    base_key = cache.compute_key(make_request())
    how = CHANGES[change]
    if callable(how):
        how(monkeypatch, tmp_path)
        req = make_request()
    else:
        req = make_request(**how)
    assert cache.compute_key(req) != base_key, change


def test_changed_key_rebuilds(cache_env, monkeypatch):
    req = make_request()
    cache.get_or_build(req)
    monkeypatch.setattr(specgen, "__version__", "99.0")
    again = cache.get_or_build(req)
    assert again.cache == "miss" and len(cache_env.compiles()) == 2


# ---------------------------------------------------------------------------- corruption


def _truncate(entry: Path) -> None:
    cubin = entry / "kernel.cubin"
    cubin.write_bytes(cubin.read_bytes()[: cubin.stat().st_size // 2])


def _flip_bit(entry: Path) -> None:
    cubin = entry / "kernel.cubin"
    data = bytearray(cubin.read_bytes())
    data[len(data) // 2] ^= 0x10
    cubin.write_bytes(bytes(data))


def _drop_manifest(entry: Path) -> None:
    (entry / "meta.json").unlink()


def _garble_manifest(entry: Path) -> None:
    (entry / "meta.json").write_bytes(b'{"name": "k", "key": ')


def _incomplete_manifest(entry: Path) -> None:
    meta = json.loads((entry / "meta.json").read_text())
    del meta["registers"]
    (entry / "meta.json").write_text(json.dumps(meta))


def _manifest_not_an_object(entry: Path) -> None:
    (entry / "meta.json").write_text("[1, 2]")


def _wrong_checksum(entry: Path) -> None:
    meta = json.loads((entry / "meta.json").read_text())
    meta["cubin_sha256"] = "0" * 64
    (entry / "meta.json").write_text(json.dumps(meta))


def _edit_source(entry: Path) -> None:
    (entry / "kernel.cu").write_text("// edited\n")


CORRUPTIONS = {
    "truncated cubin": (_truncate, "kernel.cubin does not match its checksum"),
    "bit-flipped cubin": (_flip_bit, "kernel.cubin does not match its checksum"),
    "missing manifest": (_drop_manifest, "manifest is missing"),
    "garbled manifest": (_garble_manifest, "manifest is unreadable"),
    "manifest not an object": (_manifest_not_an_object, "manifest is unreadable"),
    "incomplete manifest": (_incomplete_manifest, "manifest is incomplete"),
    "checksum mismatch": (_wrong_checksum, "kernel.cubin does not match its checksum"),
    "edited source": (_edit_source, "kernel.cu does not match its checksum"),
}


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_corruption_is_detected_rebuilt_and_warned_once(cache_env, caplog, kind):
    corrupt, problem = CORRUPTIONS[kind]
    req = make_request()
    good = cache.get_or_build(req)
    good_cubin = good.cubin.read_bytes()
    corrupt(good.entry_dir)
    with pytest.raises(cache.CacheEntryError, match=re.escape(problem)):
        cache.load_cubin_bytes(good.key)
    caplog.clear()
    rebuilt = cache.get_or_build(req)
    warnings = warnings_of(caplog)
    assert rebuilt.cache == "miss" and len(cache_env.compiles()) == 2, (kind, cache_env.compiles())
    assert len(warnings) == 1 and problem in warnings[0] and str(good.entry_dir) in warnings[0], (kind, warnings)
    assert len(cache.load_cubin_bytes(rebuilt)) == len(good_cubin)
    caplog.clear()
    assert cache.get_or_build(req).cache == "hit" and warnings_of(caplog) == []
    assert cache_env.tmp_dirs() == []


# ---------------------------------------------------------------------------- permissions and location


def test_created_private_even_with_a_loose_umask(cache_env, monkeypatch, tmp_path):
    for umask, where in ((0o022, "a/b/cache"), (0o277, "c/cache")):
        target = tmp_path / where
        monkeypatch.setenv("SPECGEN_CACHE_DIR", str(target))
        previous = os.umask(umask)
        try:
            assert cache.cache_dir() == target
        finally:
            os.umask(previous)
        assert stat.S_IMODE(target.stat().st_mode) == 0o700, (umask, oct(target.stat().st_mode))
    monkeypatch.setenv("SPECGEN_CACHE_DIR", str(cache_env.root))
    result = cache.get_or_build(make_request())
    for path in (cache_env.root, result.entry_dir, result.entry_dir.parent, cache_env.root / "locks"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700, (path, oct(path.stat().st_mode))


@pytest.mark.parametrize("mode", [0o770, 0o720, 0o707, 0o777, 0o1777])
def test_writable_by_others_is_refused(cache_env, mode):
    cache_env.root.mkdir(mode=0o700)
    os.chmod(cache_env.root, mode)
    with pytest.raises(cache.CacheDirError) as info:
        cache.cache_dir()
    message = str(info.value)
    assert str(cache_env.root) in message and f"{stat.S_IMODE(mode):04o}" in message, message
    assert f"chmod 700 {cache_env.root}" in message and "SPECGEN_SHARED_CACHE=1" in message, message
    with pytest.raises(cache.CacheDirError):
        cache.get_or_build(make_request())
    assert len(cache_env.compiles()) == 0 and not _entries_on_disk(cache_env.root)


def _make_foreign(path: Path, monkeypatch) -> int:
    """Make `path` owned by another user: really when root, else by changing who we are."""
    if os.geteuid() == 0:
        os.chown(path, 65534, 65534)
        return 65534
    me = os.geteuid()
    monkeypatch.setattr(os, "geteuid", lambda: me + 1)
    return me


def test_other_owner_is_refused(cache_env, monkeypatch):
    cache_env.root.mkdir(mode=0o700)
    owner = _make_foreign(cache_env.root, monkeypatch)
    with pytest.raises(cache.CacheDirError) as info:
        cache.cache_dir()
    message = str(info.value)
    assert str(cache_env.root) in message and f"owned by uid {owner}" in message and "SPECGEN_SHARED_CACHE" in message


def test_shared_cache_opt_in(cache_env, monkeypatch):
    cache_env.root.mkdir(mode=0o700)
    os.chmod(cache_env.root, 0o777)
    _make_foreign(cache_env.root, monkeypatch)
    monkeypatch.setenv("SPECGEN_SHARED_CACHE", "1")
    assert cache.cache_dir() == cache_env.root
    assert cache.get_or_build(make_request()).cache == "miss"
    assert cache.get_or_build(make_request()).cache == "hit"


def test_location_defaults(monkeypatch, tmp_path, cache_env):
    monkeypatch.delenv("SPECGEN_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache.cache_dir() == tmp_path / "home" / ".cache" / "specgen"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_dir() == tmp_path / "xdg" / "specgen"
    monkeypatch.setenv("SPECGEN_CACHE_DIR", str(tmp_path / "explicit"))
    assert cache.cache_dir() == tmp_path / "explicit"


def test_nothing_from_the_working_directory(cache_env, monkeypatch, tmp_path):
    # A complete, valid-looking entry for the very key we will ask for, planted in the cwd.
    req = make_request()
    planted = cache.get_or_build(req)
    workdir = tmp_path / "work"
    (workdir / planted.key[:2]).mkdir(parents=True)
    os.rename(planted.entry_dir, workdir / planted.key[:2] / planted.key)
    for sub in ("specgen", ".cache/specgen"):
        (workdir / sub).mkdir(parents=True)
    monkeypatch.chdir(workdir)
    before = sorted(str(p) for p in workdir.rglob("*"))

    monkeypatch.setenv("SPECGEN_CACHE_DIR", ".")
    with pytest.raises(cache.CacheDirError, match="relative path"):
        cache.get_or_build(req)
    monkeypatch.setenv("SPECGEN_CACHE_DIR", "cache")
    with pytest.raises(cache.CacheDirError, match="relative path"):
        cache.cache_dir()
    monkeypatch.delenv("SPECGEN_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", ".")  # relative: ignored, as the XDG spec says
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    result = cache.get_or_build(req)
    assert result.cache == "miss" and result.entry_dir.is_relative_to(tmp_path / "home" / ".cache" / "specgen")
    assert sorted(str(p) for p in workdir.rglob("*")) == before, "the working directory was touched"


# ---------------------------------------------------------------------------- no room


def _under(path, root: Path) -> bool:
    try:
        return Path(os.fsdecode(path)).resolve().is_relative_to(root)
    except (TypeError, ValueError):
        return False


def _deny(monkeypatch, root: Path, kind: str) -> None:
    """Make writes under `root` fail like a read-only or a full file system would."""
    code = errno.EROFS if kind in ("missing read-only", "read-only") else errno.ENOSPC
    real = {name: getattr(os, name) for name in ("mkdir", "open", "replace", "rename", "utime", "write")}

    def fail(path):
        raise OSError(code, os.strerror(code), os.fsdecode(path))

    def guard(name, writes=lambda *a, **k: True):
        def wrapper(path, *args, **kwargs):
            if _under(path, root) and writes(*args, **kwargs):
                fail(path)
            return real[name](path, *args, **kwargs)

        monkeypatch.setattr(os, name, wrapper)

    def fd_path(fd: int) -> str:
        try:
            return os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return ""

    def write(fd, data):
        target = fd_path(fd)
        if _under(target, root) and (kind != "full manifest" or target.endswith("meta.json")):
            fail(target)
        return real["write"](fd, data)

    if kind in ("missing read-only", "read-only"):
        guard("mkdir")
        guard("open", lambda flags, *a, **k: bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)))
        guard("replace")
        guard("rename")
        guard("utime")
    elif kind == "full publish":
        guard("replace")
    else:
        monkeypatch.setattr(os, "write", write)


def _half_written(root: Path) -> list[Path]:
    """Anything in the cache that is not a lock: files, tmp dirs, entry dirs."""
    if not root.exists():
        return []
    found = [p for p in root.rglob("*") if p.is_file() and p.parent.name != "locks"]
    return sorted(found + list(root.glob("tmp.*")) + _entries_on_disk(root))


@pytest.mark.parametrize("kind", ["missing read-only", "read-only", "full", "full manifest", "full publish"])
def test_no_room_still_builds(cache_env, caplog, kind):
    if kind != "missing read-only":
        cache.cache_dir()
    req = make_request()
    with pytest.MonkeyPatch.context() as mp:
        _deny(mp, cache_env.root.resolve(), kind)
        result = cache.get_or_build(req)
    warnings = warnings_of(caplog)
    assert result.cache == "miss" and not result.cubin.is_relative_to(cache_env.root), (kind, result)
    assert cache.load_cubin_bytes(result)[:4] == b"\x7fELF"
    assert len(warnings) == 1 and "temporary directory" in warnings[0] and str(cache_env.root) in warnings[0], warnings
    assert _half_written(cache_env.root) == [], f"{kind}: half-written things left in the cache"
    assert cache.get_or_build(req).cache == "miss", "nothing was published by the failed attempt"
    assert cache.get_or_build(req).cache == "hit"
    cache._remove_fallback_dirs()
    assert not result.entry_dir.exists(), "fallback build dirs go away at exit"


def test_read_only_cache_still_serves_hits(cache_env, monkeypatch, caplog):
    req = make_request()
    built = cache.get_or_build(req)
    _deny(monkeypatch, cache_env.root.resolve(), "read-only")
    hit = cache.get_or_build(req)
    assert hit.cache == "hit" and hit.cubin == built.cubin and warnings_of(caplog) == []


# ---------------------------------------------------------------------------- failures


def test_compile_failure_is_reported_and_never_cached(cache_env, monkeypatch, tmp_path):
    monkeypatch.setenv("SPECGEN_DUMP_DIR", str(tmp_path / "dump"))
    bad = make_request(source=BAD_SOURCE)
    with pytest.raises(CompileError) as info:
        cache.get_or_build(bad)
    message = str(info.value)
    assert 'kernel.cu(3): error: expected a ";"' in message and "-arch=sm_90" in message, message
    assert ">     3 | }" in message and "      2 |   y[threadIdx.x] = 1.0f" in message, message
    assert _entries_on_disk(cache_env.root) == [] and cache_env.tmp_dirs() == []
    key12 = cache.compute_key(bad)[:12]
    assert "expected a" in (tmp_path / "dump" / f"k-{key12}.log").read_text()
    with pytest.raises(CompileError):
        cache.get_or_build(bad)
    assert len(cache_env.compiles()) == 2, "a failure is not cached"
    assert cache.get_or_build(make_request()).cache == "miss"


def test_build_many_publishes_successes_before_raising(cache_env):
    good, bad, other = make_request("good"), make_request(source=BAD_SOURCE), make_request("other")
    with pytest.raises(CompileError):
        cache.build_many([good, bad, other])
    assert len(cache_env.compiles()) == 3
    assert [r.cache for r in cache.build_many([good, other])] == ["hit", "hit"]
    assert len(_entries_on_disk(cache_env.root)) == 2 and cache_env.tmp_dirs() == []


# ---------------------------------------------------------------------------- settings


def test_always_compile_rebuilds_and_republishes(cache_env, monkeypatch):
    req = make_request()
    first = cache.get_or_build(req)
    created = json.loads((first.entry_dir / "meta.json").read_text())["created"]
    monkeypatch.setenv("SPECGEN_ALWAYS_COMPILE", "1")
    again = cache.get_or_build(req)
    assert again.cache == "miss" and again.key == first.key and len(cache_env.compiles()) == 2
    assert json.loads((again.entry_dir / "meta.json").read_text())["created"] > created
    monkeypatch.setenv("SPECGEN_ALWAYS_COMPILE", "0")
    assert cache.get_or_build(req).cache == "hit" and len(cache_env.compiles()) == 2
    assert len(_entries_on_disk(cache_env.root)) == 1 and cache_env.tmp_dirs() == []


def test_dump_dir(cache_env, monkeypatch, tmp_path):
    dump = tmp_path / "dump" / "nested"
    monkeypatch.setenv("SPECGEN_DUMP_DIR", str(dump))
    req = make_request()
    result = cache.get_or_build(req)
    stem = f"k-{result.key[:12]}"
    assert sorted(p.name for p in dump.iterdir()) == [f"{stem}.cu", f"{stem}.log"]
    assert (dump / f"{stem}.cu").read_text() == req.source
    assert "ptxas info" in (dump / f"{stem}.log").read_text() and (dump / f"{stem}.log").read_text() == result.log
    (dump / f"{stem}.cu").unlink()
    assert cache.get_or_build(req).cache == "hit" and (dump / f"{stem}.cu").exists(), "hits are dumped too"


def test_info_log_lines(cache_env, monkeypatch, caplog):
    monkeypatch.setenv("SPECGEN_LOG_LEVEL", "info")
    log.configure()
    result = cache.get_or_build(make_request())
    infos = [r.getMessage() for r in caplog.records if r.name == "specgen" and r.levelno == logging.INFO]
    assert f"compiling k ({result.key[:12]})" in infos, infos
    assert any(re.fullmatch(r"compiled k in \d+\.\d\d s", m) for m in infos), infos


@pytest.mark.parametrize(
    "value, level, warned",
    [("", logging.WARNING, False), ("INFO", logging.INFO, False), ("debug", logging.DEBUG, False),
     ("10", 10, False), (" error ", logging.ERROR, False), ("loud", logging.WARNING, True), ("1.5", logging.WARNING, True)],
)
def test_log_level_setting(cache_env, monkeypatch, caplog, value, level, warned):
    monkeypatch.setenv("SPECGEN_LOG_LEVEL", value)
    logger = log.configure()
    log.configure()
    assert logger is log.get_logger() and logger.name == "specgen" and logger.level == level
    assert sum(isinstance(h, logging.StreamHandler) for h in logger.handlers) == 1, logger.handlers
    warnings = warnings_of(caplog)
    assert len(warnings) == (2 if warned else 0) and all(repr(value) in w for w in warnings), warnings


def test_log_level_reaches_stderr_of_a_real_process(cache_env):
    proc = spawn_builder(cache_env, ["logged"], SPECGEN_LOG_LEVEL="INFO")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    key = json.loads(out)["key"]
    assert f"INFO specgen: compiling k ({key[:12]})" in err and re.search(r"compiled k in \d+\.\d\d s", err), err
    quiet = spawn_builder(cache_env, ["logged"])
    out, err = quiet.communicate(timeout=120)
    assert quiet.returncode == 0 and json.loads(out)["cache"] == "hit" and err == "", err


def test_dead_builders_leftovers_are_swept(cache_env):
    cache.cache_dir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host, parent = paths.host_id(), os.getppid()
    started = paths.process_start(parent)
    gone = cache_env.root / f"tmp.{host}_{dead.pid}_{started}_0123abcd"
    alive = cache_env.root / f"tmp.{host}_{parent}_{started}_0123abcd"
    reused = cache_env.root / f"tmp.{host}_{parent}_{started + 1}_0123abcd"  # same pid, another process
    stale = cache_env.root / f"tmp.{host}_{parent}_{started}_4567abcd"
    mine = cache_env.root / f"tmp.{paths.owner_tag()}_89abcdef"
    for d in (gone, alive, reused, stale, mine):
        d.mkdir()
        (d / "kernel.cubin").write_bytes(b"partial")
    os.utime(stale, (1, 1))
    cache.get_or_build(make_request())
    assert [p.exists() for p in (gone, alive, reused, stale, mine)] == [False, True, False, False, True]
