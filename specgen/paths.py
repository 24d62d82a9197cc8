"""Where specgen finds its templates, and a hash of them for the cache key."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


@functools.cache
def templates_dir() -> Path:
    """The Jinja2 templates: inside the installed wheel, else the source checkout's `templates/`."""
    for candidate in (_PACKAGE / "templates", _PACKAGE.parent / "templates"):
        if (candidate / "kernel.cu.j2").is_file():
            return candidate
    raise FileNotFoundError(f"specgen templates not found next to {_PACKAGE}")


@functools.cache
def template_hash() -> str:
    """sha256 over every template's name and bytes: any template edit changes cache keys."""
    digest = hashlib.sha256()
    for path in sorted(templates_dir().rglob("*.j2")):
        digest.update(path.relative_to(templates_dir()).as_posix().encode())
        digest.update(b"\0")
        digest.update(path.read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()
