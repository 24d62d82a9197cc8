"""The `specgen` logger: WARNING by default, level from `SPECGEN_LOG_LEVEL`.

`SPECGEN_LOG_LEVEL` takes a level name (`info`, `DEBUG`, ...) or a number. A value that
is neither keeps WARNING and says so once. Records go to one stderr handler on the
`specgen` logger and also propagate, so `caplog` and application handlers see them.
"""

from __future__ import annotations

import logging
import os
import sys

LOGGER_NAME = "specgen"
ENV_LEVEL = "SPECGEN_LOG_LEVEL"
_FORMAT = "%(levelname)s %(name)s: %(message)s"


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is at emit time (pytest and tools swap it)."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter(_FORMAT))

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def _parse_level(text: str) -> int | None:
    """A logging level from a name or a number, or None when it is neither."""
    text = text.strip()
    if text.lstrip("-").isdigit():
        return int(text)
    level = logging.getLevelName(text.upper())
    return level if isinstance(level, int) else None


def configure() -> logging.Logger:
    """(Re)apply `SPECGEN_LOG_LEVEL` and make sure exactly one stderr handler is attached."""
    logger = logging.getLogger(LOGGER_NAME)
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        logger.addHandler(_StderrHandler())
    raw = os.environ.get(ENV_LEVEL, "")
    level = _parse_level(raw) if raw.strip() else logging.WARNING
    logger.setLevel(logging.WARNING if level is None else level)
    if level is None:
        logger.warning("%s=%r is not a log level name or number; using WARNING", ENV_LEVEL, raw)
    return logger


_configured = False


def get_logger() -> logging.Logger:
    """The `specgen` logger, configured from the environment on first use."""
    global _configured
    if not _configured:
        _configured = True
        return configure()
    return logging.getLogger(LOGGER_NAME)
