"""`specgen doctor`: a real build of the tiny spec here; each problem with its fix and the exit code."""

from __future__ import annotations

import os

import pytest

from specgen import cache, cli, doctor, nvrtc
from specgen import compile as c

from conftest_cache_helpers import isolated_cache


@pytest.fixture
def cache_env(tmp_path, monkeypatch):
    yield from isolated_cache(tmp_path, monkeypatch)


def _gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _lines(capsys) -> list[str]:
    return capsys.readouterr().out.splitlines()


def _row(lines: list[str], what: str) -> str:
    rows = [line for line in lines if line[6:].split(" ", 1)[0] == what]
    assert rows, (what, lines)
    return rows[0]


def test_reports_and_builds_the_tiny_spec(cache_env, capsys):
    assert cli.main(["doctor"]) == 0
    lines = _lines(capsys)
    assert lines[0] == "specgen doctor" and lines[-1].startswith("OK")
    assert _row(lines, "cache").startswith("  ok") and str(cache_env.root) in _row(lines, "cache")
    assert "mode 0700" in _row(lines, "cache")
    assert "builds use" in _row(lines, "compiler")
    built = [line for line in lines if line[6:].startswith("build/")]
    assert built and all(line.startswith("  ok") and "registers" in line for line in built), built
    assert len(cache_env.compiles()) == len(built), "one real compile per backend found"
    if nvrtc.available():
        assert _row(lines, "NVRTC").startswith("  ok") and "build/nvrtc" in "".join(built)
    if not _gpu():
        assert "none visible" in _row(lines, "GPU") or _row(lines, "torch").startswith("  !!")
        assert not any(line[6:].startswith("run/") for line in lines)


@pytest.mark.gpu
def test_gpu_runs_the_tiny_spec_with_each_backend(cache_env, capsys):
    assert cli.main(["doctor"]) == 0
    lines = _lines(capsys)
    assert "SMs" in _row(lines, "GPU") and _row(lines, "driver").startswith("  ok")
    runs = [line for line in lines if line[6:].startswith("run/")]
    assert runs and all(line.startswith("  ok") and "rel. L2" in line for line in runs), lines


def test_a_bad_compiler_setting_fails_with_a_fix(cache_env, monkeypatch, capsys):
    monkeypatch.setenv(c.ENV_COMPILER, "clang")
    assert doctor.run() == 1
    out = "\n".join(_lines(capsys))
    assert "SPECGEN_COMPILER: expected one of nvcc, nvrtc, auto, got 'clang'" in out
    assert "fix: set SPECGEN_COMPILER to nvcc, nvrtc or auto" in out and "NOT OK" in out
    assert cache_env.compiles() == []


def test_no_compiler_at_all(cache_env, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "none"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(c, "FALLBACK_NVCC", str(tmp_path / "missing" / "nvcc"))

    def missing():
        raise nvrtc.NvrtcUnavailable("NVRTC: the cuda-bindings package is not installed.")

    monkeypatch.setattr(nvrtc, "_module", missing)
    assert doctor.run() == 1
    out = "\n".join(_lines(capsys))
    assert "neither nvcc nor NVRTC is usable" in out and "fix: pip install 'specgen[nvrtc]'" in out


def test_a_failed_build_fails_the_doctor(cache_env, monkeypatch, capsys):
    def broken(req):
        raise c.CompileError("nvcc failed with exit code 1\nkernel.cu(3): error: boom", command=[], log="", returncode=1)

    monkeypatch.setattr(cache, "get_or_build", broken)
    assert doctor.run() == 1
    lines = _lines(capsys)
    first = [line for line in lines if line[6:].startswith("build/")][0]
    assert first.startswith("  !!") and "kernel.cu(3): error: boom" in first
    assert lines[lines.index(first) + 1].strip().startswith("fix:")


def test_an_unsafe_cache_is_a_problem_with_its_fix(cache_env, capsys):
    cache_env.root.mkdir(mode=0o700)
    os.chmod(cache_env.root, 0o777)
    doctor.run()
    lines = _lines(capsys)
    row = _row(lines, "cache")
    assert row.startswith("  !!") and "lets other users write" in row
    assert f"chmod 700 {cache_env.root}" in lines[lines.index(row) + 1]
