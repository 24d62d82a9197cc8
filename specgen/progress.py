"""A progress bar for long builds, on a terminal only.

`with progress.track("building", total=n):` around work that builds kernels shows one bar on
stderr; the cache reports to it (`expect` as requests come in, `advance` as each is found or
compiled), so every caller that builds through the cache -- `specgen build`, the model importer,
a user's loop -- gets the bar by wrapping its work, without passing anything down. Outside a
`track` block, `expect` and `advance` do nothing.

The bar is drawn only when stderr is a TTY, the log level is not quieter than WARNING
(`SPECGEN_LOG_LEVEL=ERROR` silences it) and tqdm is importable; otherwise nothing extra is
written. It appears after half a second, so fast (cached) runs stay silent. tqdm is used because
it is small, dependency-free, thread-safe and redraws correctly alongside log lines.
"""

from __future__ import annotations

import logging
import sys
import threading
from contextlib import contextmanager
from typing import Iterator, TextIO

from specgen.log import get_logger

SHOW_AFTER_SECONDS = 0.5


def enabled(stream: TextIO | None = None) -> bool:
    """Whether a bar would be drawn on `stream` (default: stderr)."""
    stream = sys.stderr if stream is None else stream
    try:
        tty = bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        tty = False
    if not tty or get_logger().getEffectiveLevel() > logging.WARNING:
        return False
    try:
        import tqdm  # noqa: F401
    except ImportError:
        return False
    return True


class Tracker:
    """Counts kernels done against kernels expected; draws through tqdm when `bar` is given."""

    def __init__(self, total: int | None, bar=None) -> None:
        self.total = total or 0
        self.done = 0
        self.outstanding = 0
        self.bar = bar
        self._lock = threading.Lock()

    def expect(self, n: int) -> None:
        """`n` more kernels are on their way: the total grows if they do not fit in it."""
        with self._lock:
            self.outstanding += n
            if self.done + self.outstanding > self.total:
                self.total = self.done + self.outstanding
                if self.bar is not None:
                    self.bar.total = self.total
                    self.bar.refresh()

    def advance(self, n: int = 1) -> None:
        with self._lock:
            self.done += n
            self.outstanding = max(0, self.outstanding - n)
            if self.bar is not None:
                self.bar.update(n)  # (drawn at most every tenth of a second ...)
                if self.done >= self.total:
                    self.bar.refresh()  # ... but the last count always


_active: list[Tracker] = []
_active_lock = threading.Lock()


@contextmanager
def track(desc: str, total: int | None = None, stream: TextIO | None = None) -> Iterator[Tracker]:
    """Count (and, on a terminal, draw) the kernels built inside the block. Nested blocks count
    into the innermost one."""
    stream = sys.stderr if stream is None else stream
    bar = None
    if enabled(stream):
        from tqdm import tqdm

        bar = tqdm(total=total, desc=desc, unit="kernel", file=stream, delay=SHOW_AFTER_SECONDS, leave=False)
    tracker = Tracker(total, bar)
    with _active_lock:
        _active.append(tracker)
    try:
        yield tracker
    finally:
        with _active_lock:
            _active.remove(tracker)
        if bar is not None:
            bar.close()


def _current() -> Tracker | None:
    with _active_lock:
        return _active[-1] if _active else None


def expect(n: int) -> None:
    """Called by the cache as requests come in."""
    if (tracker := _current()) is not None:
        tracker.expect(n)


def advance(n: int = 1) -> None:
    """Called by the cache as each request is found or compiled."""
    if (tracker := _current()) is not None:
        tracker.advance(n)
