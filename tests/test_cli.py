"""The CLI end to end with the real nvcc: build (miss, then hit), show, exit codes (no GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def specgen(*args, env=None, cwd=None):
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "specgen", *map(str, args)], capture_output=True, text=True, env=full_env, cwd=cwd or ROOT
    )


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    path = tmp_path / "cache"
    monkeypatch.setenv("SPECGEN_CACHE_DIR", str(path))
    return path


@pytest.mark.nvcc
def test_build_json_miss_then_hit(cache, tmp_path):
    out = tmp_path / "gen"
    first = specgen("build", "examples/kb90.yaml", "--json", "--out", out)
    assert first.returncode == 0, first.stderr
    record = json.loads(first.stdout)
    for field in ("name", "key", "cache", "compile_seconds", "cu", "cubin", "registers", "spill_bytes", "smem_bytes"):
        assert field in record, field
    assert record["name"] == "kb90" and record["cache"] == "miss"
    assert record["spill_bytes"] == 0 and record["registers"] > 0 and record["smem_bytes"] > 48 * 1024
    assert Path(record["cubin"]).is_file() and Path(record["cu"]) == out / "kb90.cu"
    assert (out / "kb90.cu").read_text() == (ROOT / "generated" / "kb90.cu").read_text()
    second = specgen("build", "examples/kb90.yaml", "--json", "--out", out)
    again = json.loads(second.stdout)
    assert again["cache"] == "hit" and again["key"] == record["key"] and again["compile_seconds"] == 0.0


@pytest.mark.nvcc
def test_every_example_builds_for_sm_90_without_spills(cache, tmp_path):
    result = specgen("build", "examples/zoo.yaml", "examples/kb90.yaml", "examples/kb65.yaml", "--arch", "sm_90",
                     "--json", "--out", tmp_path / "gen")
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(records) >= 14 and len({r["key"] for r in records}) == len(records)
    assert all(r["arch"] in ("sm_90", "sm_90a") for r in records)  # sm_90a: plans on Hopper's wgmma
    assert any(r["arch"] == "sm_90" for r in records)
    assert all(r["spill_bytes"] == 0 for r in records), [(r["name"], r["spill_bytes"]) for r in records]


@pytest.mark.nvcc
def test_build_path_never_imports_torch(cache, tmp_path):
    code = (
        "import sys; from specgen.cli import main; "
        f"rc = main(['build', 'examples/kb65.yaml', '--out', {str(tmp_path)!r}]); "
        "assert 'torch' not in sys.modules, 'torch was imported'; sys.exit(rc)"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    "text,expected",
    [
        ("name: [oops\n", "malformed YAML"),
        ("name: a\ninput: {channels: 2, size: [4]}\nconv: {out_channels: 2, kernel: 9}\n", "the kernel spans 9"),
        ("name: a\ninput: {channels: 2, size: [4]}\nconv: {out_channels: 2, kernel: 1}\nepilogue: [frobnicate]\n", "known ops"),
    ],
)
def test_bad_input_exits_2_with_the_reason(cache, tmp_path, text, expected):
    spec = tmp_path / "bad.yaml"
    spec.write_text(text)
    result = specgen("build", spec, "--out", tmp_path)
    assert result.returncode == 2
    assert expected in result.stderr and "Traceback" not in result.stderr


def test_missing_file_and_bad_arch_exit_2(cache, tmp_path):
    assert specgen("build", tmp_path / "nope.yaml").returncode == 2
    result = specgen("build", "examples/kb90.yaml", "--arch", "sm90;rm", "--out", tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr


def test_a_failed_compile_exits_1_with_the_log_and_caches_nothing(cache, tmp_path):
    fake = tmp_path / "cuda" / "bin"
    fake.mkdir(parents=True)
    nvcc = fake / "nvcc"
    nvcc.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "--version" ]; then echo "Cuda compilation tools, release 99.0, fake"; exit 0; fi\n'
        'for a in "$@"; do case "$a" in *.cu) src="$a";; esac; done\n'
        'echo "$src(3): error: identifier \\"boom\\" is undefined" >&2; exit 1\n'
    )
    nvcc.chmod(0o755)
    result = specgen("build", "examples/kb65.yaml", "--out", tmp_path, env={"CUDA_HOME": str(tmp_path / "cuda")})
    assert result.returncode == 1, result.stderr
    assert 'identifier "boom" is undefined' in result.stderr
    assert not list(cache.rglob("meta.json"))


@pytest.mark.nvcc
def test_show_prints_source_plan_and_ptx(cache):
    source = specgen("show", "examples/zoo.yaml", "--name", "depthwise_mish")
    assert source.returncode == 0 and source.stdout == (ROOT / "generated" / "depthwise_mish.cu").read_text()
    plan = specgen("show", "examples/kb65.yaml", "--plan")
    assert "avg-pool fold" in plan.stdout and "cluster" in plan.stdout
    ptx = specgen("show", "examples/zoo.yaml", "--name", "depthwise_mish", "--ptx")
    assert ptx.returncode == 0 and ".entry specgen_depthwise_mish" in ptx.stdout
    assert specgen("show", "examples/zoo.yaml", "--name", "nope").returncode == 2


def test_show_channels_last_prints_the_kernel_a_channels_last_input_runs(tmp_path):
    spec = tmp_path / "block.yaml"
    spec.write_text("name: convnext_block\ninput: {channels: 96, size: [56, 56]}\n"
                    "conv: {out_channels: 96, kernel: 7, padding: 3, groups: 96}\n"
                    "epilogue: [{layer_norm_channels: {eps: 1.0e-6}}]\nprecision: tf32\n")
    contiguous = specgen("show", spec)
    assert contiguous.returncode == 0 and "specgen_convnext_block_body" in contiguous.stdout
    shown = specgen("show", spec, "--channels-last")
    assert shown.returncode == 0 and "specgen_convnext_block_dwcl(" in shown.stdout and "_body" not in shown.stdout
    plan = specgen("show", spec, "--channels-last", "--plan")
    assert "on channels-last tensors" in plan.stdout
    none = specgen("show", "examples/kb65.yaml", "--channels-last", "--plan")
    assert none.returncode == 0 and "no channels-last kernel" in none.stderr


@pytest.mark.small_batch
def test_show_plan_says_which_batches_take_the_small_batch_tile(tmp_path, monkeypatch):
    """A layer planned for the TMA engine: `show --plan` names the batches whose calls run the
    implicit GEMM's small-batch tile (16 samples of 14^2 positions); the switch off, and a layer
    on another engine, print no such line."""
    spec = tmp_path / "deep.yaml"
    spec.write_text("name: deep\ninput: {channels: 256, size: [14, 14]}\n"
                    "conv: {out_channels: 256, kernel: 3, padding: 1}\nepilogue: [relu]\nprecision: tf32\n")
    plan = specgen("show", spec, "--plan", "--arch", "sm_90")
    assert plan.returncode == 0 and "small batches: a call of up to 16 sample(s)" in plan.stdout, plan.stdout
    assert "small batches: a call" not in specgen("show", "examples/kb65.yaml", "--plan").stdout
    monkeypatch.setenv("SPECGEN_SMALL_BATCH", "0")
    assert "small batches: a call" not in specgen("show", spec, "--plan", "--arch", "sm_90").stdout


@pytest.mark.small_batch
def test_show_plan_says_which_batches_take_the_spread_depthwise_box(tmp_path):
    """A depthwise conv on the FFMA engine: `show --plan` names the batches whose calls run its box
    with one register tile a thread (9 stacked blocks a sample: up to 4 samples); a dense conv
    prints no such line."""
    spec = tmp_path / "dw.yaml"
    spec.write_text("name: dw\ninput: {channels: 576, size: [14, 14]}\n"
                    "conv: {out_channels: 576, kernel: 3, stride: 2, padding: 1, groups: 576}\nepilogue: [relu]\n")
    plan = specgen("show", spec, "--plan", "--arch", "sm_90")
    assert plan.returncode == 0 and "small batches: a call of up to 4 sample(s) on an NC(D)HW input runs this box " \
        "with one register tile a thread" in plan.stdout, plan.stdout
    assert "one register tile a thread" not in specgen("show", "examples/kb65.yaml", "--plan").stdout


def test_version_and_module_entry_point():
    result = specgen("--version")
    assert result.returncode == 0 and result.stdout.startswith("specgen ")


# ---- packaging: what the tests need is declared; CI installs into a fresh venv -------------------

def _third_party_needs_of_the_tests() -> set[str]:
    """Distributions the test files need: every top-level import that is neither the standard
    library, specgen nor a test module, plus numpy wherever a test calls Tensor.numpy()."""
    import ast

    local = {p.stem for p in (ROOT / "tests").glob("*.py")} | {"specgen", "conftest"}
    needs = set()
    for path in (ROOT / "tests").glob("*.py"):
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in local:
                    needs.add(top)
        if ".numpy()" in text:
            needs.add("numpy")
    return needs


def _declared(group: str | None) -> set[str]:
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = project["dependencies"] + (project["optional-dependencies"][group] if group else [])
    import re

    return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].strip().lower() for r in reqs}


def test_the_test_extra_declares_every_package_the_tests_need():
    distribution = {"yaml": "pyyaml"}  # import name -> the name pip installs
    missing = {distribution.get(n, n) for n in _third_party_needs_of_the_tests()} - _declared("test")
    assert not missing, f"add to [project.optional-dependencies] test in pyproject.toml: {sorted(missing)}"


def test_ci_installs_into_a_fresh_venv_and_runs_the_readme_test_command():
    script = (ROOT / ".ci" / "run").read_text()
    commands = [line.strip() for line in script.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    venv = next((i for i, c in enumerate(commands) if "-m venv" in c), None)
    assert venv is not None, "CI must create a fresh virtual environment"
    installs = [i for i, c in enumerate(commands) if "pip install" in c]
    assert installs and all(i > venv for i in installs), "every install must go into the fresh venv"
    assert any("activate" in c for c in commands[venv:installs[0]]), "the venv must be activated before installing"
    readme = (ROOT / "README.md").read_text()
    assert "python -m pytest -q" in readme and commands[-1] == "python -m pytest -q"
    assert not any("|| true" in c or "set +e" in c for c in commands), "pytest's exit status must be the script's"


# ---- messages, not tracebacks ----------------------------------------------------------------------

def _with_closed_stdout(*args):
    """Run specgen with a stdout pipe whose reader has already gone (`... | head` once head exits)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run([sys.executable, "-m", "specgen", *map(str, args)], stdout=write_end,
                              stderr=subprocess.PIPE, text=True, cwd=ROOT)
    finally:
        os.close(write_end)
    return proc


@pytest.mark.parametrize("flags", [["--plan"], []], ids=["plan", "source"])
def test_a_closed_pipe_is_no_traceback(cache, flags):
    result = _with_closed_stdout("show", "examples/kb65.yaml", *flags)
    assert result.returncode == 0 and result.stderr == "", result.stderr


@pytest.mark.nvcc
def test_a_closed_pipe_after_ptx_is_no_traceback(cache):
    result = _with_closed_stdout("show", "examples/zoo.yaml", "--name", "depthwise_mish", "--ptx")
    assert result.returncode == 0 and result.stderr == "", result.stderr


def test_bench_and_check_without_a_gpu_say_so(cache):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    for command in ("bench", "check"):
        result = specgen(command, "examples/kb65.yaml")
        assert result.returncode == 2 and "Traceback" not in result.stderr
        assert f"{command} needs a CUDA GPU" in result.stderr


def test_build_out_that_is_a_file_is_bad_input(cache, tmp_path):
    target = tmp_path / "a-file"
    target.write_text("")
    result = specgen("build", "examples/kb65.yaml", "--out", target)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"--out {target}: exists and is not a directory" in result.stderr
    assert not cache.exists() or not list(cache.rglob("*.cubin")), "nothing is compiled for a bad --out"


def test_a_non_utf8_spec_file_is_named(cache, tmp_path):
    spec = tmp_path / "latin1.yaml"
    spec.write_bytes(b"name: caf\xe9\n")
    result = specgen("build", spec, "--out", tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert str(spec) in result.stderr and "not UTF-8 text" in result.stderr


def test_an_alias_bomb_is_refused_in_a_short_message(cache, tmp_path):
    lines = ["a0: &a0 [" + ", ".join(["lol"] * 9) + "]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 9)]
    spec = tmp_path / "bomb.yaml"
    spec.write_text("\n".join(lines + ["name: *a8"]) + "\n")
    result = specgen("build", spec, "--out", tmp_path)
    assert result.returncode == 2 and len(result.stderr) < 1000 and "expands to more than" in result.stderr


# ---- one kernel, ids that agree -------------------------------------------------------------------

@pytest.mark.nvcc
def test_build_and_cache_ls_print_the_same_key_prefix_and_count_one_entry(cache, tmp_path):
    from specgen.cli import KEY_DIGITS

    built = specgen("build", "examples/kb65.yaml", "--out", tmp_path)
    assert built.returncode == 0, built.stderr
    key = built.stdout.split()[2]
    assert len(key) == KEY_DIGITS
    listed = specgen("cache", "ls").stdout.splitlines()
    assert listed[1].split()[:2] == ["kb65", key], listed
    assert listed[-1].startswith("1 entry, ")


def test_show_plan_explains_the_axis_roles(cache):
    plan = specgen("show", "examples/kb65.yaml", "--plan").stdout
    assert "=R1" in plan and "R1 = reduced by the first reduction" in plan and "F = kept" in plan


def test_the_readme_gives_the_light_install_paths():
    readme = (ROOT / "README.md").read_text()
    install = readme.split("## Two commands", 1)[1].split("## A spec", 1)[0]
    assert "`pip install -e .`" in install and "no torch" in install
    assert "download.pytorch.org/whl/cpu" in install and "CUDA build" in install
    assert "torch" not in " ".join(_declared(None)), "the build path must install without torch"
