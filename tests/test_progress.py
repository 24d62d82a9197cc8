"""The build progress bar: drawn on a terminal only, fed by the cache, silent otherwise."""

from __future__ import annotations

import fcntl
import io
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from specgen import cache, log, progress

from conftest_cache_helpers import REPO, isolated_cache, make_request


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def cache_env(tmp_path, monkeypatch):
    yield from isolated_cache(tmp_path, monkeypatch)


def test_drawn_only_on_a_terminal_at_normal_log_levels(monkeypatch):
    monkeypatch.delenv("SPECGEN_LOG_LEVEL", raising=False)
    log.configure()
    assert progress.enabled(FakeTTY())
    assert not progress.enabled(io.StringIO()), "not a TTY"
    assert not progress.enabled(object()), "a stream without isatty"
    monkeypatch.setenv("SPECGEN_LOG_LEVEL", "INFO")
    log.configure()
    assert progress.enabled(FakeTTY())
    monkeypatch.setenv("SPECGEN_LOG_LEVEL", "ERROR")
    log.configure()
    assert not progress.enabled(FakeTTY()), "a quiet log level"
    monkeypatch.delenv("SPECGEN_LOG_LEVEL")
    log.configure()
    monkeypatch.setitem(sys.modules, "tqdm", None)
    assert not progress.enabled(FakeTTY()), "tqdm not installed"


def test_bar_counts_what_the_cache_reports(cache_env, monkeypatch):
    monkeypatch.setattr(progress, "SHOW_AFTER_SECONDS", 0)
    stream = FakeTTY()
    with progress.track("building", total=2, stream=stream) as tracker:
        assert tracker.bar is not None
        cache.build_many([make_request("a"), make_request("b")])
        assert (tracker.done, tracker.total) == (2, 2)
        cache.build_many([make_request("a"), make_request("c")])  # a hit and one more than announced
        assert (tracker.done, tracker.total) == (4, 4)
    assert "building" in stream.getvalue() and "4/4" in stream.getvalue()
    progress.advance()  # outside a block: nothing to count, no error


def test_nothing_is_drawn_off_a_terminal(cache_env):
    stream = io.StringIO()
    with progress.track("building", total=1, stream=stream) as tracker:
        cache.build_many([make_request("quiet")])
    assert tracker.bar is None and tracker.done == 1 and stream.getvalue() == ""


def _build_cli(env_root: Path, stderr_tty: bool, tmp_path: Path) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECGEN_")}
    env.update(SPECGEN_CACHE_DIR=str(env_root), PYTHONPATH=str(REPO), SPECGEN_ALWAYS_COMPILE="1")
    command = [sys.executable, "-m", "specgen", "build", str(REPO / "examples" / "kb65.yaml"), "--out", str(tmp_path)]
    if not stderr_tty:
        proc = subprocess.run(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr
        return proc.stderr
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a terminal's size
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=follower)
    os.close(follower)
    chunks = []
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        ready, _, _ = select.select([leader], [], [], 0.2)
        if ready:
            try:
                data = os.read(leader, 4096)
            except OSError:  # the child closed its end
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            break
    os.close(leader)
    assert proc.wait(timeout=60) == 0
    return b"".join(chunks).decode(errors="replace")


@pytest.mark.nvcc
def test_cli_build_shows_a_bar_on_a_terminal_and_nothing_in_a_pipe(tmp_path):
    """One real build each way (longer than the bar's half-second delay)."""
    root = tmp_path / "cache"
    piped = _build_cli(root, stderr_tty=False, tmp_path=tmp_path)
    assert piped == "", piped
    on_tty = _build_cli(root, stderr_tty=True, tmp_path=tmp_path)
    assert "building" in on_tty and "kernel" in on_tty, on_tty
