"""`specgen cache ls|clear|prune` and the list/prune/clear API behind it."""

from __future__ import annotations

import argparse
import json
import os
import time

import pytest

from specgen import cache, cachecli

from conftest_cache_helpers import isolated_cache, make_request


@pytest.fixture
def cache_env(tmp_path, monkeypatch):
    yield from isolated_cache(tmp_path, monkeypatch)


@pytest.fixture
def three(cache_env):
    """Three entries last used 3 h, 2 h and 1 h ago (oldest first)."""
    results = cache.build_many([make_request(tag, name=f"k_{tag}") for tag in ("old", "mid", "new")])
    now = time.time()
    for hours, result in zip((3, 2, 1), results):
        os.utime(result.entry_dir, (now - hours * 3600, now - hours * 3600))
    return results


def _cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="specgen")
    cachecli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(list(argv))
    return args.run(args)


def _size(result) -> int:
    return sum(p.stat().st_size for p in result.entry_dir.iterdir())


def test_list_entries_rows(three):
    rows = cache.list_entries()
    assert [r["name"] for r in rows] == ["k_new", "k_mid", "k_old"], "most recently used first"
    for row, result in zip(rows, three[::-1]):
        assert row["key"] == result.key and row["arch"] == "sm_90" and row["size"] == _size(result)
        assert 0 <= row["age"] < 600 and row["path"] == str(result.entry_dir)
    assert 3600 - 60 < time.time() - rows[0]["last_use"] < 3600 + 60


def test_ls_table_and_json(three, capsys):
    assert _cli("cache", "ls") == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["NAME", "KEY", "ARCH", "SIZE", "AGE", "LAST", "USE"]
    assert [line.split()[0] for line in out[1:4]] == ["k_new", "k_mid", "k_old"]
    assert three[2].key[:12] in out[1] and "1h ago" in out[1] and "3h ago" in out[3]
    assert out[4].startswith("3 entries")
    assert _cli("cache", "ls", "--json") == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["key"] for r in rows] == [r.key for r in three[::-1]]
    assert set(rows[0]) >= {"name", "key", "arch", "size", "age", "last_use"}


def test_prune_removes_least_recently_used_first(three, capsys):
    keep = _size(three[1]) + _size(three[2])
    assert _cli("cache", "prune", "--max-size", str(keep)) == 0
    assert "removed 1 entries" in capsys.readouterr().out
    assert [r["name"] for r in cache.list_entries()] == ["k_new", "k_mid"]
    assert [r["name"] for r in cache.prune(_size(three[2]))] == ["k_mid"]
    assert cache.prune(10**9) == [] and len(cache.list_entries()) == 1
    assert cache.get_or_build(make_request("old", name="k_old")).cache == "miss", "pruned entries are rebuilt"


def test_prune_skips_an_entry_being_built(three):
    from filelock import FileLock

    lock = FileLock(cache.cache_dir() / "locks" / f"{three[0].key}.lock")
    with lock:
        removed = cache.prune(0)
    assert sorted(r["name"] for r in removed) == ["k_mid", "k_new"]
    assert [r["name"] for r in cache.list_entries()] == ["k_old"]


def test_clear(three, capsys, cache_env):
    (cache_env.root / "tmp.pid_999999999_dead").mkdir()
    assert _cli("cache", "clear") == 0
    assert capsys.readouterr().out.strip() == "removed 3 entries"
    assert cache.list_entries() == [] and cache_env.tmp_dirs() == []
    assert list((cache_env.root / "locks").iterdir()) == []
    assert cache.clear() == 0
    assert cache.get_or_build(make_request("old", name="k_old")).cache == "miss"


@pytest.mark.parametrize("text", ["lots", "5X", "-1", "", "1.2.3", "M"])
def test_prune_bad_size_exit_code_2(cache_env, three, capsys, text):
    assert _cli("cache", "prune", "--max-size", text) == 2
    err = capsys.readouterr().err
    assert "--max-size" in err and repr(text) in err and "500M" in err, err
    assert len(cache.list_entries()) == 3


@pytest.mark.parametrize(
    "text, size",
    [("1024", 1024), ("500M", 500 * 2**20), ("2G", 2 * 2**30), ("2g", 2 * 2**30), ("1.5K", 1536), ("10MiB", 10 * 2**20),
     ("3 GB", 3 * 2**30), ("0", 0), ("1T", 2**40)],
)
def test_parse_size(text, size):
    assert cachecli.parse_size(text) == size


def test_unsafe_cache_dir_exit_code_2(cache_env, capsys):
    cache_env.root.mkdir(mode=0o700)
    os.chmod(cache_env.root, 0o777)
    for argv in (("ls",), ("clear",), ("prune", "--max-size", "1G")):
        assert _cli("cache", *argv) == 2, argv
        assert "refusing cache dir" in capsys.readouterr().err


def test_action_is_required(cache_env):
    with pytest.raises(SystemExit) as info:
        _cli("cache")
    assert info.value.code == 2
