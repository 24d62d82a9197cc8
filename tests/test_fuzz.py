"""Fuzz: malformed specs get a short message and exit 2, never a traceback; valid random specs
plan and render within the source cap (no compile, no GPU)."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings

from specgen.cli import main
from specgen.plan import build_plan
from specgen.render import MAX_SOURCE_BYTES, render_plan
from specgen.spec import SpecError, validate
from strategies import malformed_specs
from strategies import specs as valid_specs

ROOT = Path(__file__).resolve().parent.parent
MAX_MESSAGE = 10 * 1024
SECONDS = 1.0
FUZZ = settings(max_examples=1000, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example])


def _yaml_text(data) -> str | None:
    try:
        return yaml.safe_dump(data, allow_unicode=True)
    except (yaml.YAMLError, RecursionError, OverflowError, ValueError):
        return None  # not representable in YAML (e.g. nesting past the dumper's stack): nothing to feed


@pytest.fixture(scope="module")
def spec_file(tmp_path_factory):
    from specgen.cli import parser

    parser()  # imports what the CLI imports once, before any example is timed
    return tmp_path_factory.mktemp("fuzz") / "spec.yaml"


@FUZZ
@given(malformed_specs())
def test_malformed_specs_get_a_short_message_and_exit_2(spec_file, data):
    text = _yaml_text(data)
    start = time.perf_counter()
    try:
        spec = validate(data)
    except SpecError as err:
        spec = None
        assert err.problems and len(str(err).encode()) <= MAX_MESSAGE
    if text is not None:
        spec_file.write_text(text, encoding="utf-8")
        stderr, stdout = io.StringIO(), io.StringIO()
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(stdout):
            code = main(["show", str(spec_file), "--plan"])
        message = stderr.getvalue()
        assert "Traceback" not in message
        if code != 0 or spec is None:  # a valid spec may still be refused by the plan, with a message
            assert code == 2 and message.startswith("specgen: ") and len(message.encode()) <= MAX_MESSAGE, message[:500]
    assert time.perf_counter() - start < SECONDS


def _build(path: Path, tmp_path: Path):
    env = {**os.environ, "SPECGEN_CACHE_DIR": str(tmp_path / "cache")}
    return subprocess.run([sys.executable, "-m", "specgen", "build", str(path), "--out", str(tmp_path / "out")],
                          capture_output=True, env=env, cwd=ROOT, timeout=60)


NASTY_FILES = {
    "alias_bomb": "a0: &a0 [" + ", ".join(["lol"] * 9) + "]\n"
    + "".join(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]\n" for i in range(1, 9)) + "name: *a8\n",
    "deep": "[" * 10000 + "]" * 10000,
    "not_utf8": b"name: \xff\xfe\n",
    "nan": "name: a\ninput: {channels: 2, size: [8]}\nconv: {out_channels: 2, kernel: .nan}\n",
    "huge_list": "name: a\ninput: {channels: 2, size: [" + ", ".join(["8"] * 50000) + "]}\n",
    "unicode_name": "name: \u202egnp.exe\ninput: {channels: 2, size: [8]}\nconv: {out_channels: 2, kernel: 1}\n",
}


@pytest.mark.parametrize("name", sorted(NASTY_FILES))
def test_nasty_files_through_the_real_cli(tmp_path, name):
    content = NASTY_FILES[name]
    path = tmp_path / f"{name}.yaml"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    start = time.perf_counter()
    result = _build(path, tmp_path)
    assert result.returncode == 2 and b"Traceback" not in result.stderr
    assert 0 < len(result.stderr) <= MAX_MESSAGE and not result.stdout
    assert time.perf_counter() - start < 15  # the interpreter's start included; the work itself is bounded


@FUZZ
@given(valid_specs())
def test_valid_random_specs_plan_and_render_within_the_cap(data):
    try:
        spec = validate(data)
    except SpecError as err:  # the strategy can draw an empty pooled output: a clean rejection
        assert "spans" in str(err)
        return
    try:
        plan = build_plan(spec)
    except SpecError as err:  # a plan can refuse (e.g. shared memory), with a message
        assert err.problems
        return
    source = render_plan(plan)
    assert len(source.encode()) <= MAX_SOURCE_BYTES and f"specgen_{spec.name}" in source
