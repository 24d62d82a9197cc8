"""Hardening of the kernel cache and the compiler driver: what a hostile or unlucky environment does.

Each test here reproduces one way the cache or the compiler used to fail (a full disk, planted
links, another PID namespace, damaged entries, a republish under readers, a planted entry, shell
characters in paths, a stuck compiler or lock holder, a killed builder, build-dir dependent cubins).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specgen import cache, paths
from specgen import compile as nvcc
from specgen.compile import CompileError

from conftest_cache_helpers import (
    REPO,
    isolated_cache,
    kernel_source,
    make_request,
    script_nvcc,
    spawn_builder,
    wait_for_line,
    warnings_of,
)


@pytest.fixture
def cache_env(tmp_path, monkeypatch):
    yield from isolated_cache(tmp_path, monkeypatch)


def _rewrite_manifest(entry: Path, **changes) -> None:
    meta = json.loads((entry / "meta.json").read_text())
    meta.update(changes)
    (entry / "meta.json").write_text(json.dumps(meta))


def _sha(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


def _alive(pid: int) -> bool:
    """Running (a zombie, killed but not yet reaped, counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


# ---------------------------------------------------------------------------- 1. whole cubins


def test_elf_check_accepts_a_cubin_and_refuses_every_truncation(cache_env):
    cubin = cache.get_or_build(make_request()).cubin.read_bytes()
    assert cache.elf_problem(cubin) is None
    refused = [n for n in range(0, len(cubin), max(1, len(cubin) // 64)) if cache.elf_problem(cubin[:n])]
    assert len(refused) == len(range(0, len(cubin), max(1, len(cubin) // 64))), "a truncated cubin passed"
    assert "past the end" in cache.elf_problem(cubin[: len(cubin) // 2])
    assert cache.elf_problem(b"\x7fELF" + b"\0" * 100) is not None and cache.elf_problem(b"") == "no ELF header"


def test_truncated_cubin_with_a_matching_checksum_is_not_a_hit(cache_env, caplog):
    """What a full disk leaves: a short cubin, and a manifest that hashed what was there."""
    req = make_request()
    good = cache.get_or_build(req)
    short = good.cubin.read_bytes()[: good.cubin.stat().st_size // 3]
    good.cubin.write_bytes(short)
    _rewrite_manifest(good.entry_dir, cubin_sha256=_sha(short))
    with pytest.raises(cache.CacheEntryError, match="not a whole cubin"):
        cache.load_cubin_bytes(good.key)
    caplog.clear()
    again = cache.get_or_build(req)
    warnings = warnings_of(caplog)
    assert again.cache == "miss" and len(warnings) == 1 and "not a whole cubin" in warnings[0], warnings
    assert cache.elf_problem(cache.load_cubin_bytes(again)) is None


def test_a_compiler_that_leaves_a_short_cubin_fails_the_build(cache_env, monkeypatch, tmp_path):
    """nvcc/ptxas exit 0 on ENOSPC: the short cubin must not be published."""
    body = '"$REAL" "$@" || exit $?\nout=""; prev=""\nfor a in "$@"; do [ "$prev" = -o ] && out="$a"; prev="$a"; done\n'
    body += 'head -c 4000 "$out" > "$out.part" && mv "$out.part" "$out"'
    monkeypatch.setenv("CUDA_HOME", str(script_nvcc(tmp_path / "cuda" / "bin", body).parent.parent))
    with pytest.raises(CompileError, match="not a whole cubin.*disk"):
        cache.get_or_build(make_request())
    assert list(cache_env.root.glob("??/*")) == [] and cache_env.tmp_dirs() == []


def test_files_are_flushed_before_the_entry_is_published(cache_env, monkeypatch):
    req = make_request()
    entry = cache_env.root / (key := cache.compute_key(req))[:2] / key
    synced = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append((os.readlink(f"/proc/self/fd/{fd}"), entry.exists()))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    cache.get_or_build(req)
    before = {Path(path).name for path, published in synced if not published}
    assert {"kernel.cu", "kernel.cubin", "meta.json"} <= before, synced
    assert any(Path(path).name.startswith("tmp.") for path, published in synced if not published), synced
    assert any(path == str(entry.parent) for path, published in synced if published), synced


# ---------------------------------------------------------------------------- 2. links


def test_holder_file_is_never_written_through_a_link(cache_env, tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    req = make_request()
    locks = cache.cache_dir() / "locks"
    locks.mkdir(mode=0o700)
    (locks / f"{cache.compute_key(req)}.holder").symlink_to(victim)
    assert cache.get_or_build(req).cache == "miss"
    assert victim.read_text() == "precious\n"


def test_dump_files_are_never_written_through_a_link(cache_env, monkeypatch, tmp_path):
    dump, victim = tmp_path / "dump", tmp_path / "victim"
    dump.mkdir(mode=0o700)
    victim.write_text("precious\n")
    req = make_request()
    stem = f"k-{cache.compute_key(req)[:12]}"
    (dump / f"{stem}.cu").symlink_to(victim)
    (dump / f"{stem}.log").symlink_to(victim)
    monkeypatch.setenv("SPECGEN_DUMP_DIR", str(dump))
    cache.get_or_build(req)
    assert victim.read_text() == "precious\n"
    assert not (dump / f"{stem}.cu").is_symlink() and (dump / f"{stem}.cu").read_text() == req.source
    assert sorted(p.name for p in dump.iterdir()) == [f"{stem}.cu", f"{stem}.log"]


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o1777])
def test_dump_dir_others_can_write_is_refused(cache_env, monkeypatch, tmp_path, caplog, mode):
    dump = tmp_path / "dump"
    dump.mkdir()
    os.chmod(dump, mode)
    monkeypatch.setenv("SPECGEN_DUMP_DIR", str(dump))
    assert cache.get_or_build(make_request()).cache == "miss"
    warnings = warnings_of(caplog)
    assert list(dump.iterdir()) == []
    assert len(warnings) == 1 and "refusing SPECGEN_DUMP_DIR" in warnings[0] and f"{mode:04o}" in warnings[0], warnings


def test_clear_does_not_follow_a_linked_shard(cache_env, tmp_path):
    cache.get_or_build(make_request())
    outside = tmp_path / "outside"
    key = "ab" + "c" * 62
    (outside / key).mkdir(parents=True)
    (outside / key / "meta.json").write_text("keep me")
    (cache_env.root / "ab").symlink_to(outside)
    assert cache.clear() == 1
    assert (outside / key / "meta.json").read_text() == "keep me"
    assert not (cache_env.root / "ab").exists() and not (cache_env.root / "ab").is_symlink()


def test_publish_does_not_follow_a_linked_shard(cache_env, tmp_path):
    req = make_request()
    key = cache.compute_key(req)
    outside = tmp_path / "outside"
    outside.mkdir()
    cache.cache_dir()
    (cache_env.root / key[:2]).symlink_to(outside)
    result = cache.get_or_build(req)
    assert list(outside.iterdir()) == [] and result.entry_dir.parent.is_dir() and not result.entry_dir.parent.is_symlink()
    assert cache.get_or_build(req).cache == "hit"


# ---------------------------------------------------------------------------- 3. other PID namespaces


def _free_pid() -> int:
    taken = {int(n) for n in os.listdir("/proc") if n.isdigit()}
    return next(p for p in range(3, 1 << 22) if p not in taken)


def test_a_build_in_another_pid_namespace_keeps_its_staging_dir(cache_env):
    """A builder in its own PID namespace (a container sharing the cache volume) gets a PID that
    means nothing, or another process, here: a sweep here must leave its staging dir alone."""
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a PID namespace here: {probe.stderr.decode().strip()}")
    pid = _free_pid()  # what the builder's PID will be inside its namespace: no process here has it
    trues = "; ".join(["/bin/true"] * (pid - 2))
    args = json.dumps({"tags": ["namespaced"], "go": None})
    script = f"{trues}; {sys.executable} {REPO / 'tests' / 'conftest_cache_helpers.py'} '{args}'"
    proc = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c", script],
        env=cache_env.env(SPECGEN_TEST_PAUSE="compiled:4"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for_line(proc, "specgen-test-pause compiled")
    staging = cache_env.tmp_dirs()
    assert len(staging) == 1, staging
    assert cache.get_or_build(make_request("here")).cache == "miss"  # builds, so it sweeps
    assert staging[0].exists(), "a live build's staging dir was swept"
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert json.loads(out)["cache"] == "miss" and "WARNING" not in err, err
    assert cache.get_or_build(make_request("namespaced")).cache == "hit"


def test_foreign_staging_dirs_go_only_with_age(cache_env):
    cache.cache_dir()
    fresh = cache_env.root / f"tmp.{'0' * 12}_{_free_pid()}_1_0123abcd"
    old = cache_env.root / f"tmp.{'0' * 12}_{_free_pid()}_1_4567abcd"
    for d in (fresh, old):
        d.mkdir()
    os.utime(old, (1, 1))
    cache.get_or_build(make_request())
    assert fresh.exists() and not old.exists()


# ---------------------------------------------------------------------------- 4. damaged entries


def _fifo(name):
    def damage(entry: Path) -> None:
        (entry / name).unlink()
        os.mkfifo(entry / name)

    return damage


def _dir_instead(name):
    def damage(entry: Path) -> None:
        (entry / name).unlink()
        (entry / name).mkdir()
        (entry / name / "x").write_text("x")

    return damage


def _manifest_link_to_dev_zero(entry: Path) -> None:
    (entry / "meta.json").unlink()
    (entry / "meta.json").symlink_to("/dev/zero")


def _deep_manifest(entry: Path) -> None:
    (entry / "meta.json").write_text("[" * 200_000 + "]" * 200_000)


def _wrong_type(field, value):
    return lambda entry: _rewrite_manifest(entry, **{field: value})


def _entry_is_a_file(entry: Path) -> None:
    import shutil

    shutil.rmtree(entry)
    entry.write_text("not a directory")


def _unreadable(name):
    def damage(entry: Path) -> None:
        os.chmod(entry / name, 0)

    return damage


DAMAGE = {
    "cubin is a FIFO": (_fifo("kernel.cubin"), "kernel.cubin is not a regular file"),
    "manifest is a FIFO": (_fifo("meta.json"), "manifest is not a regular file"),
    "manifest links to /dev/zero": (_manifest_link_to_dev_zero, "manifest is a symbolic link"),
    "cubin is a directory": (_dir_instead("kernel.cubin"), "kernel.cubin is not a regular file"),
    "manifest is a directory": (_dir_instead("meta.json"), "manifest is not a regular file"),
    "deeply nested manifest": (_deep_manifest, "manifest is unreadable"),
    "registers is a string": (_wrong_type("registers", "many"), "wrong registers"),
    "log is a number": (_wrong_type("log", 3), "wrong log"),
    "checksum is a list": (_wrong_type("cubin_sha256", [1]), "wrong cubin_sha256"),
    "key is null": (_wrong_type("key", None), "wrong key"),
    "entry is a file": (_entry_is_a_file, "entry is not a directory"),
    "cubin unreadable": (_unreadable("kernel.cubin"), "kernel.cubin cannot be opened"),
    "manifest unreadable": (_unreadable("meta.json"), "manifest cannot be opened"),
}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_damaged_entry_is_one_warning_and_a_rebuild(cache_env, kind):
    """In a separate process, bounded in time and memory: the old code hung or ate memory here."""
    damage, problem = DAMAGE[kind]
    if "unreadable" in kind and os.geteuid() == 0:
        pytest.skip("root reads files whatever their mode")
    good = cache.get_or_build(make_request("damaged"))
    damage(good.entry_dir)
    import resource

    def limit_memory():
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    proc = subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "conftest_cache_helpers.py"), json.dumps({"tags": ["damaged"], "go": None})],
        env=cache_env.env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=limit_memory,
    )
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"{kind}: the build hung")
    assert proc.returncode == 0, f"{kind}: {err[-3000:]}"
    warnings = [line for line in err.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1 and problem in warnings[0] and "rebuilding" in warnings[0], (kind, err)
    assert json.loads(out)["cache"] == "miss"
    assert cache.get_or_build(make_request("damaged")).cache == "hit"
    assert cache_env.tmp_dirs() == []


class _Blocked(Exception):
    """Raised by the alarm: deliberately no OSError, which the code under test may catch."""


def _fail_after(seconds: int):
    def expired(*_):
        raise _Blocked(f"still blocked after {seconds} s")

    signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)


def test_ls_and_clear_survive_damaged_entries(cache_env):
    results = cache.build_many([make_request(t) for t in ("a", "b", "c")])
    _fifo("meta.json")(results[0].entry_dir)
    _dir_instead("meta.json")(results[1].entry_dir)
    previous = signal.getsignal(signal.SIGALRM)
    try:
        _fail_after(10)  # the old code blocked for good opening the FIFO
        rows = cache.list_entries()
        assert sorted(r["name"] for r in rows) == ["?", "?", "k"]
        assert cache.clear() == 3 and cache.list_entries() == []
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


# ---------------------------------------------------------------------------- 5. republish under readers


def test_readers_never_see_a_half_replaced_entry(cache_env, tmp_path):
    """One process republishes the entry as fast as it can (alternating two valid cubins); this
    process loads it meanwhile: every load must verify."""
    cubins = []
    for i, flags in enumerate((None, ("-O1", "-std=c++17"))):
        result = cache.get_or_build(make_request("swap-src", flags=flags))
        cubins.append(tmp_path / f"cubin{i}")
        cubins[-1].write_bytes(result.cubin.read_bytes())
    assert cubins[0].read_bytes() != cubins[1].read_bytes()
    key = cache.get_or_build(make_request("swap")).key
    args = json.dumps({"republish": True, "tag": "swap", "cubins": [str(c) for c in cubins], "seconds": 4})
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "conftest_cache_helpers.py"), args],
        env=cache_env.env(SPECGEN_ALWAYS_COMPILE="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    loads, failures, seen = 0, [], set()
    while proc.poll() is None:
        try:
            seen.add(_sha(cache.load_cubin_bytes(key)))
        except cache.CacheEntryError as error:
            failures.append(str(error))
        loads += 1
    out, err = proc.communicate()
    assert proc.returncode == 0, err
    republished = int(out)
    print(f"{loads} loads during {republished} republishes: {len(failures)} failed")
    assert republished > 50 and loads > 200, (republished, loads)
    assert {_sha(c.read_bytes()) for c in cubins} <= seen, "the reader never saw the entry change"
    assert failures == [], f"{len(failures)} of {loads} loads failed: {failures[:3]}"


# ---------------------------------------------------------------------------- 6. planted entries


def test_an_entry_with_another_source_is_not_a_hit(cache_env, caplog):
    """A planted entry: another kernel, its cubin, checksums recomputed to match."""
    req = make_request()
    genuine = cache.get_or_build(req)
    genuine_cubin = genuine.cubin.read_bytes()
    evil = cache.get_or_build(make_request("evil"))
    evil_cu, evil_cubin = evil.cu.read_bytes(), evil.cubin.read_bytes()
    genuine.cu.write_bytes(evil_cu)
    genuine.cubin.write_bytes(evil_cubin)
    _rewrite_manifest(genuine.entry_dir, cu_sha256=_sha(evil_cu), cubin_sha256=_sha(evil_cubin))
    caplog.clear()
    again = cache.get_or_build(req)
    warnings = warnings_of(caplog)
    assert again.cache == "miss" and len(warnings) == 1 and "not the source rendered" in warnings[0], warnings
    assert cache.load_cubin_bytes(again) == genuine_cubin


# ---------------------------------------------------------------------------- 7. shell characters


@pytest.mark.parametrize("trick", ["$(touch {m})", "`touch {m}`", "x;touch {m}", "a'b", 'a"b', "a\\b"])
def test_tmpdir_with_shell_characters_is_refused(cache_env, monkeypatch, tmp_path, trick):
    marker = tmp_path / "ran"
    tmpdir = tmp_path / trick.format(m=marker).replace("/", "_")
    tmpdir.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmpdir))
    monkeypatch.setattr("tempfile.tempdir", None)
    with pytest.raises(nvcc.UnsafePathError, match="TMPDIR.*nvcc passes them through a shell|TMPDIR.*shell"):
        cache.get_or_build(make_request())
    assert not marker.exists() and not (tmpdir / "ran").exists()
    assert list(cache_env.root.glob("??/*")) == [] and cache_env.tmp_dirs() == []


def test_cache_dir_with_shell_characters_is_refused(cache_env, monkeypatch, tmp_path):
    marker = tmp_path / "ran"
    root = tmp_path / f"c$(touch {marker.name})"
    monkeypatch.setenv("SPECGEN_CACHE_DIR", str(root))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(cache.CacheDirError, match="SPECGEN_CACHE_DIR.*'\\$'"):
        cache.get_or_build(make_request())
    assert not marker.exists()


@pytest.mark.nvcc
def test_build_dir_with_shell_characters_is_refused(tmp_path):
    build = tmp_path / "b`id`"
    build.mkdir()
    (build / "kernel.cu").write_text(kernel_source("x"))
    with pytest.raises(nvcc.UnsafePathError, match="build directory"):
        nvcc.compile_cubin(build / "kernel.cu", build / "kernel.cubin", "sm_90")


# ---------------------------------------------------------------------------- 9. bounded waits


SLEEPY = 'sleep 30 & echo $! >> "$PIDS"\necho $$ >> "$PIDS"\nwait'


@pytest.mark.parametrize("use_ninja", [True, False])
def test_compile_timeout_stops_the_compiler(cache_env, monkeypatch, tmp_path, use_ninja):
    pids = tmp_path / "pids"
    monkeypatch.setenv("PIDS", str(pids))
    monkeypatch.setenv("CUDA_HOME", str(script_nvcc(tmp_path / "cuda" / "bin", SLEEPY).parent.parent))
    monkeypatch.setenv("SPECGEN_COMPILE_TIMEOUT", "1.5")
    if not use_ninja:
        monkeypatch.setattr(nvcc, "find_ninja", lambda: None)
    start = time.monotonic()
    with pytest.raises(CompileError, match=r"did not finish within 1\.5 s.*SPECGEN_COMPILE_TIMEOUT=1\.5"):
        cache.get_or_build(make_request())
    assert time.monotonic() - start < 15
    started = [int(p) for p in pids.read_text().split()]
    assert len(started) == 2
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in started) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in started), "the compiler's processes outlived the timeout"
    assert list(cache_env.root.glob("??/*")) == [] and cache_env.tmp_dirs() == []


@pytest.mark.parametrize("value", ["soon", "0", "-3", "nan", "inf"])
def test_bad_timeouts_are_refused_naming_the_variable(cache_env, monkeypatch, value):
    for name in ("SPECGEN_COMPILE_TIMEOUT", "SPECGEN_LOCK_TIMEOUT"):
        with monkeypatch.context() as mp:
            mp.setenv(name, value)
            with pytest.raises(ValueError, match=f"^{name}: expected a number of seconds > 0, got '{value}'"):
                cache.build_many([make_request(), make_request("other")])


def test_lock_wait_is_bounded_and_names_the_holder(cache_env, monkeypatch, caplog):
    monkeypatch.setattr(cache, "LOCK_WARN_SECONDS", 0.5)
    monkeypatch.setenv("SPECGEN_LOCK_TIMEOUT", "2")
    holder = spawn_builder(cache_env, ["held"], SPECGEN_TEST_PAUSE="locked:8")
    try:
        wait_for_line(holder, "specgen-test-pause locked")
        start = time.monotonic()
        with pytest.raises(cache.LockTimeoutError) as info:
            cache.get_or_build(make_request("held"))
        waited = time.monotonic() - start
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
        holder.communicate()
    message = str(info.value)
    assert 1.9 <= waited < 6, waited
    assert f"pid {holder.pid} on " in message and "SPECGEN_LOCK_TIMEOUT=2" in message, message
    assert len(warnings_of(caplog)) == 1 and isinstance(info.value, CompileError)


# ---------------------------------------------------------------------------- 12. killed builders


def test_killed_builder_leaves_no_compiler_and_no_build_dir(cache_env, tmp_path):
    pids, tmpdir = tmp_path / "pids", tmp_path / "tmpdir"
    tmpdir.mkdir()
    cuda = script_nvcc(tmp_path / "cuda" / "bin", SLEEPY).parent.parent
    proc = spawn_builder(cache_env, ["killed"], PIDS=str(pids), CUDA_HOME=str(cuda), TMPDIR=str(tmpdir))
    deadline = time.monotonic() + 30
    while not (pids.exists() and len(pids.read_text().split()) == 2) and time.monotonic() < deadline:
        time.sleep(0.05)
    started = [int(p) for p in pids.read_text().split()]
    assert list(tmpdir.glob("specgen-ninja-*")), "the build dir should exist while compiling"
    os.kill(proc.pid, signal.SIGKILL)  # the builder alone, as the OOM killer or a user would
    proc.communicate()
    deadline = time.monotonic() + 10
    while (any(_alive(p) for p in started) or list(tmpdir.glob("specgen-ninja-*"))) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in started if _alive(p)], "the compiler outlived its builder"
    assert list(tmpdir.glob("specgen-ninja-*")) == []


def test_stale_ninja_dirs_are_swept(cache_env, monkeypatch, tmp_path):
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmpdir))
    monkeypatch.setattr("tempfile.tempdir", None)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host, parent = paths.host_id(), os.getppid()
    names = {
        "dead owner": (f"specgen-ninja-{host}_{dead.pid}_{paths.process_start(parent)}-x1", False),
        "live owner": (f"specgen-ninja-{host}_{parent}_{paths.process_start(parent)}-x2", True),
        "old, owner unknown": ("specgen-ninja-abcd1234", False),
        "new, owner unknown": ("specgen-ninja-efgh5678", True),
        "other host, new": (f"specgen-ninja-{'0' * 12}_{dead.pid}_1-x3", True),
    }
    for name, _ in names.values():
        (tmpdir / name).mkdir()
        (tmpdir / name / "build.ninja").write_text("")
    os.utime(tmpdir / names["old, owner unknown"][0], (1, 1))
    cache.get_or_build(make_request())
    kept = {what: (tmpdir / name).exists() for what, (name, _) in names.items()}
    assert kept == {what: keep for what, (_, keep) in names.items()}


# ---------------------------------------------------------------------------- 16. reproducible cubins


def test_same_request_in_two_cache_dirs_gives_identical_cubins(cache_env, monkeypatch, tmp_path):
    assert "-lineinfo" in nvcc.DEFAULT_FLAGS
    cubins = []
    for where in ("one", "a/much/longer/second/cache"):
        monkeypatch.setenv("SPECGEN_CACHE_DIR", str(tmp_path / where))
        cubins.append(cache.get_or_build(make_request()).cubin.read_bytes())
        time.sleep(1.1)  # the source files' mtimes differ too (`-lineinfo` records them)
    assert cubins[0] == cubins[1], f"{sum(a != b for a, b in zip(*cubins))} bytes differ"
    assert str(tmp_path).encode() not in cubins[0]
