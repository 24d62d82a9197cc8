"""The NVRTC backend (no GPU needed): selection, keys, cubins and resources against nvcc's,
headers, failures with source lines, PTX, and the GPU check that both compilers agree."""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path

import pytest

from specgen import cache, nvrtc, pipeline
from specgen import compile as c
from specgen.spec import load_specs, validate

from conftest_cache_helpers import isolated_cache, make_request

needs_nvrtc = pytest.mark.skipif(not nvrtc.available(), reason="NVRTC not installed: pip install '.[nvrtc]'")



EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
# A full reduction shared by a thread-block cluster: includes <cooperative_groups.h> and
# <math_constants.h> (CUDART_INF_F) -- both headers NVRTC must be given.
CLUSTERED = {
    "name": "lse_all",
    "input": {"channels": 8, "size": [32, 32]},
    "conv": {"out_channels": 32, "kernel": 3},
    "epilogue": [{"logsumexp": {"dims": [1, 2, 3]}}],
    "tile": {"wgmma": False},  # (the mma.sync slab's plan, whose blocks of a sample form a cluster)
}
EM_CUDA = 190
BAD = 'extern "C" __global__ void k(float* y){\n  float a = 1.0f;\n  y[threadIdx.x] = a\n}\n// tail 1\n'


@pytest.fixture
def cache_env(tmp_path, monkeypatch):
    monkeypatch.delenv(c.ENV_COMPILER, raising=False)
    yield from isolated_cache(tmp_path, monkeypatch)


def _no_nvcc(monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "no-toolkit"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(c, "FALLBACK_NVCC", str(tmp_path / "missing" / "nvcc"))


def _elf(cubin: bytes, kernel: str) -> tuple[int, int]:
    """(e_machine, e_flags) of a 64-bit little-endian CUDA ELF that holds `kernel`'s code."""
    assert cubin[:4] == b"\x7fELF" and cubin[4] == 2 and cubin[5] == 1, cubin[:8]
    assert f".text.{kernel}\0".encode() in cubin, f"no code section for {kernel}"
    return struct.unpack_from("<H", cubin, 18)[0], struct.unpack_from("<I", cubin, 48)[0]


# ---------------------------------------------------------------------------- selection


def test_compiler_setting_is_validated_with_its_name(monkeypatch):
    monkeypatch.setenv(c.ENV_COMPILER, "clang")
    with pytest.raises(ValueError, match=r"SPECGEN_COMPILER: expected one of nvcc, nvrtc, auto, got 'clang'"):
        c.resolve_compiler()
    with pytest.raises(ValueError, match=r"compiler: expected one of nvcc, nvrtc, auto, got 'gcc'"):
        make_request(compiler="gcc")
    monkeypatch.setenv(c.ENV_COMPILER, " NVRTC ")
    assert c.resolve_compiler() == "nvrtc"
    assert c.resolve_compiler("nvcc") == "nvcc", "an explicit argument wins over the setting"
    assert make_request(compiler="Auto").compiler == "auto"


@pytest.mark.nvcc
def test_auto_prefers_nvcc(monkeypatch):
    monkeypatch.setenv(c.ENV_COMPILER, "auto")
    assert c.resolve_compiler() == "nvcc"
    monkeypatch.delenv(c.ENV_COMPILER)
    assert c.resolve_compiler() == "nvcc"


@needs_nvrtc
def test_auto_uses_nvrtc_without_nvcc(monkeypatch, tmp_path):
    _no_nvcc(monkeypatch, tmp_path)
    with pytest.raises(FileNotFoundError):
        c.find_nvcc()
    assert c.resolve_compiler("auto") == "nvrtc"


def test_auto_without_any_compiler_says_how_to_fix_it(monkeypatch, tmp_path):
    _no_nvcc(monkeypatch, tmp_path)

    def missing():
        raise nvrtc.NvrtcUnavailable(f"NVRTC: the cuda-bindings package is not installed. {nvrtc.FIX}")

    monkeypatch.setattr(nvrtc, "_module", missing)
    with pytest.raises(FileNotFoundError) as info:
        c.resolve_compiler("auto")
    text = str(info.value)
    assert "nvcc not found" in text and "Install the CUDA toolkit" in text
    assert "pip install 'specgen[nvrtc]'" in text


# ---------------------------------------------------------------------------- headers


@needs_nvrtc
def test_headers_found_and_in_the_identity(monkeypatch):
    dirs = nvrtc.include_dirs()
    assert nvrtc.missing_headers(dirs) == [], dirs
    ident = nvrtc.toolchain_id()
    major, minor = nvrtc.version()
    assert ident.startswith(f"NVRTC {major}.{minor} ") and "headers sha256" in ident
    assert not any(str(d) in ident for d in dirs), "the identity holds no paths"
    # Without libcu++ beside them, cooperative groups must use its own traits.
    monkeypatch.setattr(nvrtc, "include_dirs", lambda: [d for d in dirs if d.name != "cccl"])
    monkeypatch.setattr(nvrtc, "_has_libcudacxx", lambda _dirs: False)
    assert nvrtc.LIMIT_CG in nvrtc.header_options()


@needs_nvrtc
def test_missing_headers_say_where_they_were_looked_for(monkeypatch, tmp_path):
    monkeypatch.setattr(nvrtc, "include_dirs", lambda: [])
    _, source, _ = pipeline.request(validate(CLUSTERED))
    cu = tmp_path / "kernel.cu"
    cu.write_text(source)
    with pytest.raises(c.CompileError) as info:
        nvrtc.compile_cubin(cu, tmp_path / "k.cubin", "sm_90")
    text = str(info.value)
    assert "math_constants.h" in text and "pip install nvidia-cuda-runtime nvidia-cuda-cccl" in text
    assert "> " in text and "#include <math_constants.h>" in text, "the failing line is quoted"


@needs_nvrtc
def test_clustered_spec_builds_with_wheel_headers_only(cache_env, monkeypatch, tmp_path):
    """A pip-only install: no toolkit anywhere, the headers from the nvidia wheels."""
    _no_nvcc(monkeypatch, tmp_path)
    monkeypatch.setattr(nvrtc, "_toolkit_include_dirs", lambda: [])
    if nvrtc.missing_headers():
        pytest.skip(f"the nvidia wheels lack {nvrtc.missing_headers()}: pip install '.[nvrtc]'")
    assert all("site-packages" in str(d) or "dist-packages" in str(d) for d in nvrtc.include_dirs())
    monkeypatch.setattr(pipeline, "_memo", {})  # built here, not remembered from another test
    (item,) = pipeline.specialize_many([validate(CLUSTERED)], "sm_90")
    assert item.build.compiler == "nvrtc" and item.plan["cluster"] > 1
    _elf(item.build.cubin.read_bytes(), item.plan["kernel_name"])
    assert item.build.registers > 0


# ---------------------------------------------------------------------------- builds


@needs_nvrtc
def test_failure_shows_numbered_source_lines(tmp_path):
    cu = tmp_path / "bad.cu"
    cu.write_text(BAD)
    with pytest.raises(c.CompileError) as info:
        c.compile_cubin(cu, tmp_path / "bad.cubin", "sm_90", compiler="nvrtc")
    text = str(info.value)
    assert text.startswith("NVRTC failed: NVRTC_ERROR_COMPILATION")
    assert "bad.cu(4): error" in text  # the missing ';' is found at the next line, as nvcc does
    assert ">     4 | }" in text and "      3 |   y[threadIdx.x] = a" in text
    assert info.value.returncode != 0 and "expected a \";\"" in info.value.log


@needs_nvrtc
def test_ptx_and_arch_sm_90a(tmp_path):
    ptx = c.compile_ptx(BAD.replace("= a\n", "= a;\n"), "sm_90a", compiler="nvrtc")
    assert ".entry k(" in ptx and ".target sm_90a" in ptx
    with pytest.raises(ValueError, match="arch: expected an arch like 'sm_90'"):
        c.compile_ptx("", "sm90", compiler="nvrtc")


@needs_nvrtc
def test_many_jobs_on_threads_report_each_done(tmp_path):
    jobs, done = [], []
    for i, text in enumerate(["x = 1.0f", "x = 2.0f", "x = oops"]):
        cu = tmp_path / f"j{i}.cu"
        cu.write_text(f'extern "C" __global__ void k{i}(float* y){{ float x; {text}; y[threadIdx.x] = x; }}\n')
        jobs.append(c.CompileJob(cu, tmp_path / f"j{i}.cubin", "sm_90", nvrtc.DEFAULT_FLAGS, "nvrtc"))
    first, second, bad = c.compile_many(jobs, on_done=done.append)
    assert sorted(done) == [0, 1, 2]
    assert set(first.kernels) == {"k0"} and set(second.kernels) == {"k1"}
    assert first.registers > 0 and (tmp_path / "j1.cubin").read_bytes()[:4] == b"\x7fELF"
    assert isinstance(bad, c.CompileError) and "j2.cu(1): error" in str(bad)


@needs_nvrtc
def test_cached_build_records_the_compiler_and_keys_apart(cache_env):
    req = make_request(compiler="nvrtc")
    first = cache.get_or_build(req)
    assert first.cache == "miss" and first.compiler == "nvrtc" and first.as_json()["compiler"] == "nvrtc"
    meta = json.loads((first.entry_dir / "meta.json").read_text())
    assert meta["compiler"] == "nvrtc" and meta["toolchain"].startswith("NVRTC ")
    assert meta["flags"] == list(nvrtc.DEFAULT_FLAGS)
    assert first.registers > 0 and "ptxas info" in first.log
    again = cache.get_or_build(make_request(compiler="nvrtc"))
    assert again.cache == "hit" and again.key == first.key and again.compiler == "nvrtc"
    try:
        c.find_nvcc()
    except FileNotFoundError:
        return  # no nvcc here: the key apart from its build is not checked
    other = cache.get_or_build(make_request(compiler="nvcc"))
    assert other.key != first.key and other.compiler == "nvcc"


@needs_nvrtc
def test_setting_selects_nvrtc_for_builds(cache_env, monkeypatch):
    monkeypatch.setenv(c.ENV_COMPILER, "nvrtc")
    assert cache.get_or_build(make_request()).compiler == "nvrtc"


@needs_nvrtc
@pytest.mark.nvcc
def test_clustered_spec_same_kernel_through_both_compilers(cache_env):
    """A spec that needs both headers: the same entry point, a valid sm_90 cubin with the same ELF
    flags, and parsed resources from each compiler (equal when both are the same CUDA release)."""
    spec = validate(CLUSTERED)
    plan, source, _ = pipeline.request(spec)
    assert "#include <cooperative_groups.h>" in source and "CUDART_INF_F" in source
    builds = {}
    for compiler in ("nvcc", "nvrtc"):
        req = cache.BuildRequest(spec.name, source, spec.canonical_json(), "sm_90", compiler=compiler)
        builds[compiler] = cache.get_or_build(req)
    elf = {k: _elf(b.cubin.read_bytes(), plan["kernel_name"]) for k, b in builds.items()}
    assert elf["nvcc"] == elf["nvrtc"] and elf["nvcc"][0] == EM_CUDA
    for b in builds.values():
        assert b.registers > 0 and b.spill_bytes == 0 and b.stack_bytes >= 0
        assert plan["kernel_name"] in json.loads((b.entry_dir / "meta.json").read_text())["kernels"]
    nvcc_release = c.toolchain_id(c.find_nvcc()).splitlines()[-1]
    major, minor = nvrtc.version()
    if f"cuda_{major}.{minor}." in nvcc_release:
        assert builds["nvcc"].registers == builds["nvrtc"].registers


@needs_nvrtc
def test_a_wgmma_slab_kernel_builds_through_nvrtc_for_sm_90a(cache_env):
    """The slab engine on wgmma (a strided, prefetching stem: its rows in a register array, the
    W taps packed into K) through both compilers: sm_90a cubins with the same entry point and ELF
    flags, no spills."""
    spec = validate({"name": "stem_wgmma", "input": {"channels": 3, "size": [224, 224]},
                     "conv": {"out_channels": 64, "kernel": 7, "stride": 2, "padding": 3}, "epilogue": ["relu"],
                     "tile": {"wgmma": True}})
    from specgen.plan import SlabConfig

    plan, source, req = pipeline.request(spec, igemm_config=SlabConfig(1, prefetch=1))  # (a tuner's candidate)
    assert req.arch == "sm_90a" and plan["mma"].wgmma and plan["mma"].prefetch and plan["mma"].packed_w
    builds = {compiler: cache.get_or_build(cache.BuildRequest(spec.name, source, spec.canonical_json(), "sm_90a",
                                                               compiler=compiler)) for compiler in ("nvcc", "nvrtc")}
    elf = {k: _elf(b.cubin.read_bytes(), plan["kernel_name"]) for k, b in builds.items()}
    assert elf["nvcc"] == elf["nvrtc"] and elf["nvcc"][0] == EM_CUDA
    assert all(b.spill_bytes == 0 and b.registers > 0 for b in builds.values())


# ---------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@needs_nvrtc
@pytest.mark.nvcc
@pytest.mark.parametrize("example", ["kb90", "kb65"])
def test_gpu_both_compilers_give_the_same_result(example):
    import torch

    from specgen import reference, torchop

    data = load_specs(EXAMPLES / f"{example}.yaml")[0].model_dump()
    data["input"]["size"] = {"kb90": [8, 10, 12], "kb65": [40, 44]}[example]  # test sizes, same code path
    spec = validate(data)
    plan, source, req = pipeline.request(spec)  # (req: the arch the plan needs, sm_90a for a wgmma kernel)
    gen = torch.Generator(device="cuda").manual_seed(0)
    ref = reference.Reference(spec).cuda()
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, device="cuda") * (0.3 if p.dim() > 1 else 1.0))
    params = ref.named_spec_params()
    x = torch.randn((3, spec.input.channels, *spec.input.size), generator=gen, device="cuda")
    torch.backends.cudnn.allow_tf32 = False
    ref64 = reference.forward64(spec, x, ref.conv.weight, ref.conv.bias, params)
    outs = {}
    for compiler in ("nvcc", "nvrtc"):
        build = cache.get_or_build(dataclasses.replace(req, compiler=compiler))
        assert build.compiler == compiler
        sp = pipeline.Specialized(spec, plan, source, build)
        with torch.no_grad():
            outs[compiler] = torchop.launch(sp, x, ref.conv.weight, ref.conv.bias, params, None)
        torch.cuda.synchronize()
        rel = ((outs[compiler].double() - ref64).norm() / ref64.norm()).item()
        assert rel <= 1e-5, (compiler, rel)
    assert outs["nvcc"].shape == outs["nvrtc"].shape
    torch.testing.assert_close(outs["nvrtc"], outs["nvcc"], rtol=1e-5, atol=1e-5)


@needs_nvrtc
def test_bench_records_the_compiler_builds_use(monkeypatch, tmp_path):
    """A bench record names NVRTC when builds use it (and needs no nvcc to be written)."""
    bench = pytest.importorskip("specgen.bench")
    monkeypatch.setattr(bench.torch.cuda, "get_device_name", lambda *a: "a GPU")
    _no_nvcc(monkeypatch, tmp_path)
    env = bench.environment()
    assert env["nvrtc"].startswith("NVRTC ") and "nvcc" not in env


def test_an_empty_log_does_not_overwrite_a_shared_bytes_object():
    """NVRTC writes its log (for an empty one, a single NUL) into the buffer it is handed; a one-byte
    b" " * 1 is CPython's shared b" ", which every later b" " of the process would then be."""
    import ctypes

    from specgen import nvrtc

    class Fake:
        def nvrtcGetProgramLogSize(self, prog):
            return 0, 1

        def nvrtcGetProgramLog(self, prog, buf):
            ctypes.memmove(buf, b"\0", 1)  # what the C library does with the buffer's memory

        def nvrtcGetPTXSize(self, prog):
            return 0, 1

        def nvrtcGetPTX(self, prog, buf):
            ctypes.memmove(buf, b"\0", 1)

    assert nvrtc._log(Fake(), None) == ""
    assert nvrtc._output(Fake(), None, "PTX") == b"\0"
    assert b" " == bytes([32]) and b" ".decode() == " "
