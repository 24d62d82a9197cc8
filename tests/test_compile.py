"""nvcc driver: toolchain discovery, arch handling, ptxas report parsing, failures, parallel builds."""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest

from specgen import compile as c

from conftest_cache_helpers import fake_nvcc

GOOD = 'extern "C" __global__ void k(float* y){ y[threadIdx.x] = 1.0f; }\n'
BAD = 'extern "C" __global__ void k(float* y){\n  float a = 1.0f;\n  y[threadIdx.x] = a\n}\n// tail 1\n// tail 2\n'

CAPTURED_PTXAS = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'big' for 'sm_90'
ptxas info    : Function properties for big
    48 bytes stack frame, 40 bytes spill stores, 36 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 49152 bytes smem, 400 bytes cmem[0]
ptxas info    : Compile time = 42.643 ms
ptxas info    : Compiling entry function 'small' for 'sm_90'
ptxas info    : Function properties for small
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 10 registers, used 0 barriers
ptxas info    : Compile time = 1.698 ms
ptxas info    : Function properties for _Z6helperv
    16 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads
"""


# ---------------------------------------------------------------------------- toolchain


def test_find_nvcc_prefers_cuda_home_then_path_then_fallback(tmp_path, monkeypatch):
    home_nvcc = fake_nvcc(tmp_path / "cuda" / "bin", "home")
    path_nvcc = fake_nvcc(tmp_path / "onpath", "path")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda"))
    monkeypatch.setenv("PATH", str(path_nvcc.parent))
    assert c.find_nvcc() == str(home_nvcc)
    monkeypatch.delenv("CUDA_HOME")
    assert c.find_nvcc() == str(path_nvcc)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert c.find_nvcc() == c.FALLBACK_NVCC
    fake_nvcc(tmp_path / "bin", "in the working directory")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CUDA_HOME", ".")
    monkeypatch.setenv("PATH", os.pathsep.join(["bin", ".", ""]))
    assert c.find_nvcc() == c.FALLBACK_NVCC, "relative CUDA_HOME and PATH entries are ignored"
    monkeypatch.setattr(c, "FALLBACK_NVCC", str(tmp_path / "missing" / "nvcc"))
    with pytest.raises(FileNotFoundError, match="nvcc not found.*CUDA_HOME"):
        c.find_nvcc()


@pytest.mark.nvcc
def test_toolchain_id_is_the_version_text_and_follows_the_file(tmp_path):
    real = c.toolchain_id(c.find_nvcc())
    assert "Cuda compilation tools, release" in real and real.startswith("nvcc:")
    assert c.find_nvcc() not in real  # path independent
    fake = fake_nvcc(tmp_path, "fake nvcc 1")
    assert c.toolchain_id(str(fake)) == "fake nvcc 1"
    fake.write_text(fake.read_text().replace("fake nvcc 1", "fake nvcc 2"))
    os.utime(fake, ns=(fake.stat().st_atime_ns, fake.stat().st_mtime_ns + 10**9))
    assert c.toolchain_id(str(fake)) == "fake nvcc 2"


def _fake_driver(major: int, minor: int, fail: bool = False) -> types.ModuleType:
    driver = types.ModuleType("cuda.bindings.driver")
    ok = object()
    driver.CUresult = types.SimpleNamespace(CUDA_SUCCESS=ok)
    other = ("MULTIPROCESSOR_COUNT", "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN", "MAX_SHARED_MEMORY_PER_MULTIPROCESSOR",
             "MAX_REGISTERS_PER_MULTIPROCESSOR", "MAX_THREADS_PER_BLOCK")
    driver.CUdevice_attribute = types.SimpleNamespace(
        CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR="major", CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR="minor",
        **{f"CU_DEVICE_ATTRIBUTE_{name}": name for name in other},
    )

    def cu_init(flags):
        if fail:
            raise RuntimeError("driver exploded")
        return (ok,)

    driver.cuInit = cu_init
    driver.cuDeviceGetCount = lambda: (ok, 1)
    driver.cuDeviceGet = lambda i: (ok, i)
    driver.cuDeviceGetAttribute = lambda attr, dev: (ok, {"major": major, "minor": minor}.get(attr, 1))
    return driver


@pytest.mark.parametrize(
    "driver, expected",
    [(None, "sm_90"), (_fake_driver(8, 9), "sm_89"), (_fake_driver(10, 0), "sm_100"), (_fake_driver(9, 0, True), "sm_90")],
    ids=["no-bindings", "sm_89", "sm_100", "driver-raises"],
)
def test_default_arch(monkeypatch, driver, expected):
    package = types.ModuleType("cuda.bindings")
    package.driver = driver
    monkeypatch.setitem(sys.modules, "cuda", types.ModuleType("cuda"))
    monkeypatch.setitem(sys.modules, "cuda.bindings", package if driver else None)
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", driver)
    c.default_arch.cache_clear()
    try:
        assert c.default_arch() == expected
    finally:
        c.default_arch.cache_clear()


def test_no_torch_import():
    code = "import sys, specgen.compile, specgen.cache, specgen.cachecli; specgen.compile.default_arch(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


@pytest.mark.parametrize("arch", ["sm_90", "sm_90a", "sm_80", "sm_100a", "sm_120"])
def test_validate_arch_accepts(arch):
    assert c.validate_arch(arch) == arch


@pytest.mark.parametrize("arch", ["sm90", "compute_90", "sm_9", "SM_90", "sm_90b", "sm_1000", "", None, 90, "sm_90 "])
def test_validate_arch_rejects_naming_the_field(arch):
    with pytest.raises(ValueError, match=r"^arch: "):
        c.validate_arch(arch)
    with pytest.raises(ValueError, match=r"^target\.arch: "):
        c.validate_arch(arch, "target.arch")


def test_default_flags_have_no_fast_math():
    assert c.DEFAULT_FLAGS[:3] == ("-O3", "-std=c++17", "-lineinfo")
    assert not any("fast" in flag or "ftz" in flag or "prec" in flag for flag in c.DEFAULT_FLAGS)


# ---------------------------------------------------------------------------- ptxas report


def test_parse_ptxas_captured_text():
    kernels = c.parse_ptxas(CAPTURED_PTXAS)
    assert kernels["big"] == c.KernelResources(registers=255, spill_bytes=76, smem_bytes=49152, stack_bytes=48)
    assert kernels["small"] == c.KernelResources(registers=10, spill_bytes=0, smem_bytes=0, stack_bytes=0)
    assert kernels["_Z6helperv"] == c.KernelResources(registers=0, spill_bytes=16, smem_bytes=0, stack_bytes=16)
    report = c._report(1.5, CAPTURED_PTXAS)
    assert (report.registers, report.spill_bytes, report.smem_bytes, report.stack_bytes) == (255, 76, 49152, 48)
    assert report.log == CAPTURED_PTXAS and report.kernels == kernels


def test_parse_ptxas_older_format_and_empty():
    old = (
        "ptxas info    : Compiling entry function 'k' for 'sm_80'\n"
        "ptxas info    : Function properties for k\n"
        "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
        "ptxas info    : Used 32 registers, 1024 bytes smem, 352 bytes cmem[0]\n"
    )
    assert c.parse_ptxas(old) == {"k": c.KernelResources(registers=32, smem_bytes=1024)}
    assert c.parse_ptxas("") == {}
    assert c._report(0.0, "").registers == 0


@pytest.mark.nvcc
def test_compile_cubin_real_report(tmp_path):
    src = tmp_path / "kernel.cu"
    src.write_text(
        GOOD + 'extern "C" __global__ void s(float* y){ __shared__ float t[64]; t[threadIdx.x] = y[threadIdx.x];'
        " __syncthreads(); y[threadIdx.x] = t[63 - threadIdx.x]; }\n"
    )
    report = c.compile_cubin(src, tmp_path / "out.cubin", "sm_90")
    assert (tmp_path / "out.cubin").read_bytes()[:4] == b"\x7fELF"
    assert set(report.kernels) == {"k", "s"}, report.log
    assert report.registers > 0 and report.spill_bytes == 0 and report.stack_bytes == 0, report
    assert report.smem_bytes == 256 and report.kernels["s"].smem_bytes == 256
    assert report.seconds > 0 and "ptxas info" in report.log


@pytest.mark.nvcc
def test_compile_error_shows_command_log_and_source(tmp_path):
    src = tmp_path / "kernel.cu"
    src.write_text(BAD)
    with pytest.raises(c.CompileError) as info:
        c.compile_cubin(src, tmp_path / "out.cubin", "sm_90")
    message = str(info.value)
    assert "nvcc failed with exit code" in message
    assert "-cubin -arch=sm_90" in message and "-Xptxas -v" in message, message
    assert 'kernel.cu(4): error: expected a ";"' in message, message  # the compiler's log
    assert ">     4 | }" in message and "      3 |   y[threadIdx.x] = a" in message, message  # the source lines
    assert "      1 | extern" in message and "      6 | // tail 2" in message, message  # context
    assert info.value.returncode != 0 and "error" in info.value.log and info.value.command[0].endswith("nvcc")
    assert not (tmp_path / "out.cubin").exists()


@pytest.mark.nvcc
def test_compile_ptx():
    ptx = c.compile_ptx(GOOD, "sm_90")
    assert ".target sm_90" in ptx and ".entry k(" in ptx
    with pytest.raises(c.CompileError, match=r"(?s)error.*>     4 \| }"):
        c.compile_ptx(BAD, "sm_90")


@pytest.mark.nvcc
@pytest.mark.parametrize("use_ninja", [True, False], ids=["ninja", "sequential"])
def test_compile_many_keeps_each_job_apart(tmp_path, monkeypatch, use_ninja):
    if not use_ninja:
        monkeypatch.setattr(c, "find_ninja", lambda: None)
    else:
        assert c.find_ninja(), "ninja is expected to be installed"
    jobs = []
    for i, text in enumerate([GOOD.replace("void k", "void first"), BAD, GOOD.replace("void k", "void third")]):
        d = tmp_path / f"job {i}"  # a space in the path on purpose
        d.mkdir()
        (d / "kernel.cu").write_text(text)
        jobs.append(c.CompileJob(d / "kernel.cu", d / "kernel.cubin", "sm_90" if i != 2 else "sm_80"))
    first, bad, third = c.compile_many(jobs)
    assert isinstance(first, c.CompileReport) and set(first.kernels) == {"first"}, first
    assert isinstance(third, c.CompileReport) and set(third.kernels) == {"third"}, third
    assert "sm_80" in third.log and "sm_90" not in third.log
    assert first.seconds > 0 and third.seconds > 0
    assert isinstance(bad, c.CompileError) and ">     4 | }" in str(bad) and "first" not in bad.log
    assert (tmp_path / "job 0" / "kernel.cubin").exists() and not (tmp_path / "job 1" / "kernel.cubin").exists()
    assert c.compile_many([]) == []
