"""`specgen cache ls|clear|prune`: look at and trim the kernel cache.

`register(subparsers)` adds the `cache` command to an argparse subparsers object. Each action
stores its handler as `run` (the convention of `specgen.cli`); a handler takes the parsed
namespace and returns an exit code: 0 ok, 2 bad input or an unusable cache dir.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time

from specgen import cache

_SIZE_RE = re.compile(r"(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?", re.IGNORECASE)
_UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}


def parse_size(text: str) -> int:
    """Bytes from `1024`, `500K`, `500M`, `2G`, `1.5GiB` (binary units). Raises ValueError."""
    m = _SIZE_RE.fullmatch(text.strip())
    if not m:
        raise ValueError(f"bad size {text!r}: expected bytes with an optional K, M, G or T suffix, like 500M or 2G")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _human_size(n: float) -> str:
    for unit in ("B", "K", "M", "G"):
        if n < 1024:
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}T"


def _human_age(seconds: float) -> str:
    for limit, divisor, unit in ((60, 1, "s"), (3600, 60, "m"), (86400, 3600, "h")):
        if seconds < limit:
            return f"{seconds / divisor:.0f}{unit}"
    return f"{seconds / 86400:.0f}d"


def _fail(message: str) -> int:
    print(f"specgen cache: {message}", file=sys.stderr)
    return 2


def _ls(args: argparse.Namespace) -> int:
    try:
        rows = cache.list_entries()
    except cache.CacheDirError as error:
        return _fail(str(error))
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    now = time.time()
    table = [("NAME", "KEY", "ARCH", "SIZE", "AGE", "LAST USE")]
    for r in rows:
        last_use = _human_age(max(0.0, now - r["last_use"])) + " ago"
        table.append((r["name"], r["key"][:16], r["arch"], _human_size(r["size"]), _human_age(r["age"]), last_use))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    total = sum(r["size"] for r in rows)
    indexed, index_bytes = cache.index_stats()
    index = f"; {indexed} {'request' if indexed == 1 else 'requests'} indexed, {_human_size(index_bytes)}" if indexed else ""
    print(f"{len(rows)} {'entry' if len(rows) == 1 else 'entries'}, {_human_size(total)} in {cache.cache_dir()}{index}")
    _ls_tuned()
    return 0


def _ls_tuned() -> None:
    """The tile choices `specgen tune` kept (spec, precision, GPU, batch bucket, tile)."""
    from specgen import tune

    choices = tune.list_choices()
    if not choices:
        return
    table = [("TUNED", "PRECISION", "GPU", "BUCKET", "TILE")]
    for r in choices:
        table.append((str(r.get("name")), str(r.get("precision")), str(r.get("gpu")), str(r.get("bucket")), str(r["label"])))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    print()
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())


def _clear(args: argparse.Namespace) -> int:
    try:
        count = cache.clear()
    except cache.CacheDirError as error:
        return _fail(str(error))
    print(f"removed {count} entries")
    return 0


def _prune(args: argparse.Namespace) -> int:
    try:
        max_bytes = parse_size(args.max_size)
    except ValueError as error:
        return _fail(f"--max-size: {error}")
    try:
        removed = cache.prune(max_bytes)
    except cache.CacheDirError as error:
        return _fail(str(error))
    freed = sum(r["size"] for r in removed)
    print(f"removed {len(removed)} entries, freed {_human_size(freed)}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `cache ls|clear|prune` to `subparsers`; returns the `cache` parser."""
    parser = subparsers.add_parser("cache", help="list, clear or prune the compiled-kernel cache")
    actions = parser.add_subparsers(dest="cache_action", metavar="ACTION", required=True)
    ls = actions.add_parser("ls", help="list cached kernels, most recently used first")
    ls.add_argument("--json", action="store_true", help="one JSON object per line")
    ls.set_defaults(run=_ls)
    clear = actions.add_parser("clear", help="remove every cached kernel")
    clear.set_defaults(run=_clear)
    prune = actions.add_parser("prune", help="remove least recently used kernels down to a size")
    prune.add_argument("--max-size", required=True, metavar="SIZE", help="e.g. 500M, 2G or 1024 (bytes)")
    prune.set_defaults(run=_prune)
    return parser
