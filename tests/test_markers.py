"""The `gpu` and `nvcc` markers (tests/conftest.py) skip with the reason when the GPU or nvcc is missing."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ("pytester",)

CONFTEST = (Path(__file__).resolve().parent / "conftest.py").read_text()
MARKED = """
import pytest

@pytest.mark.nvcc
def test_needs_nvcc():
    pass

@pytest.mark.gpu
def test_needs_gpu():
    pass

def test_plain():
    pass
"""


def _run(pytester):
    pytester.makeconftest(CONFTEST)
    pytester.makeini("[pytest]\nmarkers =\n    gpu: gpu\n    nvcc: nvcc\n")
    pytester.makepyfile(test_marked=MARKED)
    return pytester.runpytest_subprocess("-rs", "-p", "no:cacheprovider")


def test_without_nvcc_and_gpu_the_marked_tests_skip_with_the_reason(pytester, monkeypatch, tmp_path):
    from specgen import compile as c

    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "no-cuda"))
    monkeypatch.setenv("PATH", "/bin:/usr/bin")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU, also on a machine that has one
    fallback = tmp_path / "sitecustomize.py"  # the subprocess hides the fallback nvcc as well
    fallback.write_text(f"import specgen.compile as c\nc.FALLBACK_NVCC = {str(tmp_path / 'none' / 'nvcc')!r}\n")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{Path(c.__file__).resolve().parent.parent}")
    result = _run(pytester)
    result.assert_outcomes(passed=1, skipped=2)
    result.stdout.fnmatch_lines(["*needs nvcc: nvcc not found*", "*needs a CUDA GPU*"], consecutive=False)


@pytest.mark.nvcc
def test_with_nvcc_the_nvcc_test_runs(pytester, monkeypatch):
    from specgen import compile as c

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("PYTHONPATH", str(Path(c.__file__).resolve().parent.parent))
    result = _run(pytester)
    result.assert_outcomes(passed=2, skipped=1)
