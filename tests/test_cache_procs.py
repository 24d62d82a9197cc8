"""Kernel cache across processes: concurrent builders, killed builders, waiting on a lock."""

from __future__ import annotations

import json
import os
import random
import signal
import time

import pytest

from specgen import cache

from conftest_cache_helpers import isolated_cache, make_request, spawn_builder, wait_for_line, warnings_of

N_PROCS = 16
KILL_TRIALS = 24
KILL_POINTS = ("compiling", "locked", "compiled", "staged", "published")


@pytest.fixture
def cache_env(tmp_path, monkeypatch):
    yield from isolated_cache(tmp_path, monkeypatch)


def _run_together(cache_env, tag_lists: list[list[str]]) -> list[list[dict]]:
    """Start one builder per tag list, release them at once, return each one's results."""
    go = cache_env.tmp / "go"
    procs = [spawn_builder(cache_env, tags, go=go) for tags in tag_lists]
    time.sleep(0.5)
    go.touch()
    outputs = []
    failures = []
    for proc in procs:
        out, err = proc.communicate(timeout=180)
        if proc.returncode != 0:
            failures.append((proc.pid, proc.returncode, err[-2000:]))
        outputs.append([json.loads(line) for line in out.splitlines()])
    assert not failures, f"{len(failures)} of {len(procs)} builders failed: {failures}"
    return outputs


def test_sixteen_processes_one_request_compile_once(cache_env):
    outputs = _run_together(cache_env, [["same"]] * N_PROCS)
    compiles = cache_env.compiles()
    shas = {out[0]["sha256"] for out in outputs}
    misses = sum(out[0]["cache"] == "miss" for out in outputs)
    assert len(compiles) == 1, f"{N_PROCS} processes, expected 1 compile, got {len(compiles)}: {compiles}"
    assert len(shas) == 1, f"{N_PROCS} processes got {len(shas)} different cubins"
    assert misses == 1, f"{misses} of {N_PROCS} processes report a miss"
    assert cache_env.tmp_dirs() == []


def test_sixteen_processes_eight_requests_compile_eight_times(cache_env):
    outputs = _run_together(cache_env, [[f"req{i % 8}"] for i in range(N_PROCS)])
    compiles = cache_env.compiles()
    per_key = {}
    for out in outputs:
        per_key.setdefault(out[0]["key"], set()).add(out[0]["sha256"])
    assert len(compiles) == 8, f"{N_PROCS} processes on 8 requests: expected 8 compiles, got {len(compiles)}"
    assert len({c["key"] for c in compiles}) == 8
    assert len(per_key) == 8 and all(len(s) == 1 for s in per_key.values()), per_key


def test_overlapping_batches_do_not_deadlock(cache_env):
    """build_many takes its locks in key order, so crossing batches cannot wait on each other forever."""
    tags = [f"b{i}" for i in range(6)]
    outputs = _run_together(cache_env, [tags, tags[::-1], tags[::2] + tags[1::2], tags[3:] + tags[:3]])
    assert len(cache_env.compiles()) == 6, cache_env.compiles()
    assert all(len(out) == 6 for out in outputs)


def _kill(proc) -> None:
    os.killpg(proc.pid, signal.SIGKILL)  # the builder leads its own session, nvcc included
    proc.wait(timeout=30)
    proc.stdout.close()
    proc.stderr.close()


def test_killed_builders_leave_no_partial_entry_and_no_wait(cache_env, monkeypatch, caplog):
    """SIGKILL a builder at a seeded random point; the next build must not wait and must not see a partial entry.

    Waiting on the dead builder's lock for LOCK_WARN_SECONDS would log a warning, which counts as a failure.
    """
    monkeypatch.setattr(cache, "LOCK_WARN_SECONDS", 2.0)
    rng = random.Random(20240611)
    failures = []
    slowest = 0.0
    seen_points = {}
    finished_before_kill = 0
    for trial in range(KILL_TRIALS):
        point = KILL_POINTS[trial % len(KILL_POINTS)] if trial < len(KILL_POINTS) else rng.choice(KILL_POINTS)
        seen_points[point] = seen_points.get(point, 0) + 1
        tag = f"kill{trial}"
        pause = "locked:0" if point == "compiling" else f"{point}:600"
        proc = spawn_builder(cache_env, [tag], SPECGEN_TEST_PAUSE=pause)
        wait_for_line(proc, f"specgen-test-pause {pause.split(':')[0]}")
        if point == "compiling":
            time.sleep(rng.uniform(0.0, 0.3))
        _kill(proc)

        req = make_request(tag)
        key = cache.compute_key(req)
        entry = cache_env.root / key[:2] / key
        published = entry.exists()
        if published:  # visible means complete: it must load and verify
            try:
                cache.load_cubin_bytes(key)
            except cache.CacheEntryError as error:
                failures.append((trial, point, f"partial entry visible after the kill: {error}"))
        if published != (point == "published") and point != "compiling":
            failures.append((trial, point, f"entry {'visible' if published else 'missing'} after a kill at {point}"))
        finished_before_kill += point == "compiling" and published
        caplog.clear()
        start = time.monotonic()
        result = cache.get_or_build(req)
        slowest = max(slowest, time.monotonic() - start)
        expected = "hit" if published else "miss"
        if result.cache != expected:
            failures.append((trial, point, f"{result.cache} instead of {expected}"))
        if warnings_of(caplog):
            failures.append((trial, point, f"warnings: {warnings_of(caplog)}"))
        if cache.load_cubin_bytes(result)[:4] != b"\x7fELF":
            failures.append((trial, point, "cubin is not an ELF file"))
        if cache_env.tmp_dirs():
            failures.append((trial, point, f"leftovers not swept: {cache_env.tmp_dirs()}"))
    summary = (
        f"{KILL_TRIALS} kills ({seen_points}; {finished_before_kill} builds finished before their kill): "
        f"{len(failures)} failed; slowest rebuild {slowest:.2f} s"
    )
    print(summary)
    assert not failures, f"{summary}: {failures}"
    assert set(seen_points) == set(KILL_POINTS), summary


def test_waiter_logs_lock_and_holder_then_keeps_waiting(cache_env, monkeypatch, caplog):
    monkeypatch.setattr(cache, "LOCK_WARN_SECONDS", 0.5)
    holder = spawn_builder(cache_env, ["waited"], SPECGEN_TEST_PAUSE="locked:2.5")
    wait_for_line(holder, "specgen-test-pause locked")
    start = time.monotonic()
    result = cache.get_or_build(make_request("waited"))
    waited = time.monotonic() - start
    out, err = holder.communicate(timeout=60)
    assert holder.returncode == 0, err
    warnings = warnings_of(caplog)
    lock_path = cache_env.root / "locks" / f"{result.key}.lock"
    assert len(warnings) == 1, warnings
    assert str(lock_path) in warnings[0] and f"pid {holder.pid} on " in warnings[0], warnings
    assert result.cache == "hit" and json.loads(out)["cache"] == "miss" and len(cache_env.compiles()) == 1
    assert 0.5 <= waited < 30, waited
