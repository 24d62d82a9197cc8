"""Where specgen finds its templates, a hash of them for the cache key, and who owns a scratch dir."""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


@functools.cache
def templates_dir() -> Path:
    """The Jinja2 templates: inside the installed wheel, else the source checkout's `templates/`."""
    for candidate in (_PACKAGE / "templates", _PACKAGE.parent / "templates"):
        if (candidate / "box.cu.j2").is_file():
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


# ---------------------------------------------------------------------------- who owns a scratch dir
#
# Scratch directories (cache staging dirs, ninja build dirs) carry their creator in their name:
# `<host>_<pid>_<start>`. `host` hashes the boot id together with the PID namespace, so a process
# in another container, on another machine or before a reboot is never judged by a PID that means
# something else here; `start` (the process's start time in clock ticks since boot) tells a reused
# PID from the original owner.

OWNER_PATTERN = r"([0-9a-f]{12})_(\d+)_(\d+)"


def _read_text(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(4096).decode(errors="replace").strip()
    except OSError:
        return ""


@functools.cache
def host_id() -> str:
    """12 hex digits naming this kernel boot and PID namespace (hostname where /proc is missing)."""
    import socket

    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = ""
    boot = _read_text("/proc/sys/kernel/random/boot_id") or socket.gethostname()
    return hashlib.sha256(f"{boot}\0{namespace}".encode()).hexdigest()[:12]


def process_start(pid: int) -> int | None:
    """The start time of process `pid` (clock ticks since boot), None if it does not exist (or no /proc)."""
    stat = _read_text(f"/proc/{pid}/stat")
    fields = stat.rsplit(")", 1)[-1].split()
    try:
        return int(fields[19])  # field 22 of stat(5); fields[0] is field 3
    except (IndexError, ValueError):
        return None


def owner_tag() -> str:
    """`<host>_<pid>_<start>` for the calling process."""
    pid = os.getpid()
    return f"{host_id()}_{pid}_{process_start(pid) or 0}"


def owner_gone(host: str, pid: int, start: int) -> bool | None:
    """True if the process named by an owner tag has ended, False if it runs, None if unknowable here
    (another host or PID namespace: only the age of what it left can tell)."""
    if host != host_id():
        return None
    now = process_start(pid)
    if now is None and not os.path.isdir("/proc/self"):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False
    return now is None or (start != 0 and now != start)
