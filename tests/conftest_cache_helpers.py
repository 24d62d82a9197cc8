"""Helpers for the cache tests: an isolated cache fixture, tiny kernels, and a builder process.

Run as a script it is the builder process used by the multi-process tests:
`python conftest_cache_helpers.py '{"tags": [...], "go": "<file or null>"}'` waits for the go
file (if any), builds one request per tag and prints one JSON line per result.
"""

from __future__ import annotations

import hashlib
import json
import os
import select
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

REPO = Path(__file__).resolve().parent.parent
TEMPLATE_HASH = "templates-under-test"
SPECGEN_ENV = (
    "SPECGEN_CACHE_DIR",
    "SPECGEN_SHARED_CACHE",
    "SPECGEN_ALWAYS_COMPILE",
    "SPECGEN_DUMP_DIR",
    "SPECGEN_LOG_LEVEL",
    "SPECGEN_COMPILE_COUNTER",
    "SPECGEN_TEST_PAUSE",
    "SPECGEN_COMPILER",
    "XDG_CACHE_HOME",
    "SPECGEN_COMPILE_TIMEOUT",
    "SPECGEN_LOCK_TIMEOUT",
)


def kernel_source(tag: str) -> str:
    """A tiny kernel-only source; each tag gives a different source (and key)."""
    return f'// {tag}\nextern "C" __global__ void k(float* y){{ y[threadIdx.x] = 1.0f; }}\n'


def fake_nvcc(directory: Path, version: str) -> Path:
    """An `nvcc` in `directory` whose `--version` prints `version` and that compiles with the real one."""
    from specgen.compile import FALLBACK_NVCC

    directory.mkdir(parents=True, exist_ok=True)
    script = directory / "nvcc"
    script.write_text(f'#!/bin/sh\nif [ "$1" = --version ]; then echo "{version}"; exit 0; fi\nexec {FALLBACK_NVCC} "$@"\n')
    script.chmod(0o755)
    return script


def script_nvcc(directory: Path, body: str) -> Path:
    """An `nvcc` in `directory` that answers `--version` and otherwise runs the shell `body`
    (`$REAL` is the real nvcc)."""
    from specgen.compile import FALLBACK_NVCC

    directory.mkdir(parents=True, exist_ok=True)
    script = directory / "nvcc"
    script.write_text(
        f'#!/bin/sh\nREAL={FALLBACK_NVCC}\nif [ "$1" = --version ]; then echo "nvcc under test: {directory}"; exit 0; fi\n'
        + body
        + "\n"
    )
    script.chmod(0o755)
    return script


def make_request(tag: str = "base", **overrides):
    from specgen.cache import BuildRequest

    fields = {"name": "k", "source": kernel_source(tag), "canonical_spec": json.dumps({"tag": tag})}
    fields.update(overrides)
    return BuildRequest(**fields)


@dataclass
class CacheEnv:
    root: Path
    counter: Path
    tmp: Path

    def compiles(self) -> list[dict]:
        """One record per nvcc run, from every process that used this environment."""
        if not self.counter.exists():
            return []
        return [json.loads(line) for line in self.counter.read_text().splitlines()]

    def env(self, **extra: str) -> dict[str, str]:
        """Environment for a builder subprocess sharing this cache."""
        env = {k: v for k, v in os.environ.items() if k not in SPECGEN_ENV}
        env.update(
            SPECGEN_CACHE_DIR=str(self.root),
            SPECGEN_COMPILE_COUNTER=str(self.counter),
            PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        )
        env.update(extra)
        return env

    def tmp_dirs(self) -> list[Path]:
        return sorted(self.root.glob("tmp.*")) if self.root.exists() else []


def isolated_cache(tmp_path: Path, monkeypatch) -> Iterator[CacheEnv]:
    """Body of the `cache_env` fixtures: an empty private cache under tmp_path, no SPECGEN_*
    settings, a fixed template hash, and a compile counter file."""
    from specgen import log, paths

    for name in SPECGEN_ENV:
        monkeypatch.delenv(name, raising=False)
    env = CacheEnv(root=tmp_path / "cache", counter=tmp_path / "compiles.jsonl", tmp=tmp_path)
    monkeypatch.setenv("SPECGEN_CACHE_DIR", str(env.root))
    monkeypatch.setenv("SPECGEN_COMPILE_COUNTER", str(env.counter))
    monkeypatch.setattr(paths, "template_hash", lambda: TEMPLATE_HASH)
    log.configure()
    yield env
    monkeypatch.delenv("SPECGEN_LOG_LEVEL", raising=False)
    log.configure()


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "specgen" and r.levelname == "WARNING"]


def spawn_builder(env: CacheEnv, tags: list[str], go: Path | None = None, **extra_env: str) -> subprocess.Popen:
    """Start a builder process in its own session (so its nvcc can be killed with it)."""
    args = json.dumps({"tags": tags, "go": str(go) if go else None})
    return subprocess.Popen(
        [sys.executable, __file__, args],
        env=env.env(**extra_env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def wait_for_line(proc: subprocess.Popen, needle: str, timeout: float = 60.0) -> list[str]:
    """Read the process's stderr until a line contains `needle`; returns the lines read."""
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stderr], [], [], 0.1)
        if not ready:
            continue
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        if needle in line:
            return lines
    raise AssertionError(f"no {needle!r} from pid {proc.pid} within {timeout} s; stderr so far: {lines}")


def _republisher_main(args: dict) -> None:
    """Republish one request's entry over and over (SPECGEN_ALWAYS_COMPILE=1), alternating between
    two cubins, without running nvcc; prints the number of republishes."""
    from specgen import cache
    from specgen import compile as nvcc

    cubins = [Path(p).read_bytes() for p in args["cubins"]]
    turn = [0]

    def fake_compile_many(jobs, on_done=None):
        reports = []
        for job in jobs:
            Path(job.out_cubin).write_bytes(cubins[turn[0] % len(cubins)])
            turn[0] += 1
            reports.append(nvcc.CompileReport(seconds=0.0, registers=1, spill_bytes=0, smem_bytes=0, stack_bytes=0, log="fake"))
        return reports

    nvcc.compile_many = fake_compile_many
    deadline = time.monotonic() + args["seconds"]
    while time.monotonic() < deadline:
        cache.get_or_build(make_request(args["tag"]))
    print(turn[0])


def _builder_main(args: dict) -> None:
    from specgen import cache, paths

    paths.template_hash = lambda: TEMPLATE_HASH
    if args.get("republish"):
        _republisher_main(args)
        return
    if args["go"]:
        while not os.path.exists(args["go"]):
            time.sleep(0.005)
    results = cache.build_many([make_request(tag) for tag in args["tags"]])
    for result in results:
        cubin = cache.load_cubin_bytes(result)
        print(json.dumps({"key": result.key, "cache": result.cache, "sha256": hashlib.sha256(cubin).hexdigest()}))


if __name__ == "__main__":
    _builder_main(json.loads(sys.argv[1]))
