"""Plots of bench records: the numbers each point is drawn from, bad records, the image, the CLI."""

from __future__ import annotations

import copy
import json

import pytest

from specgen import cli, plot

CEIL = {"copy_bytes_per_s": 4e12, "fp32_flops_per_s": 50e12, "tf32_flops_per_s": 400e12}


def record() -> dict:
    rows = [
        {"name": "eager", "ms": 10.0},
        {"name": "eager (TF32 off)", "ms": 11.0},
        {"name": "torch.compile", "ms": 5.0},
        {"name": "specgen", "ms": 2.5},
    ]
    return {
        "meta": {"gpu": "Test GPU", "date": "2026-01-01", "torch": "2.x"},
        "results": [
            {"spec": "a", "batch": 4, "flops": 1e11, "fewest_bytes": 1e9, "ceilings": CEIL, "rows": rows},
            {"spec": "b", "batch": 4, "flops": 4e10, "fewest_bytes": 2e9, "ceilings": CEIL, "rows": rows[:1] + rows[3:]},
        ],
    }


def test_points_and_speedups_come_from_the_record():
    pts = {(p["spec"], p["contender"]): p for p in plot.points(record())}
    assert set(pts) == {("a", "eager"), ("a", "torch.compile"), ("a", "specgen"), ("b", "eager"), ("b", "specgen")}
    assert pts[("a", "specgen")]["intensity"] == pytest.approx(100.0)
    assert pts[("a", "specgen")]["flops_per_s"] == pytest.approx(1e11 / 2.5e-3)
    assert pts[("b", "eager")]["intensity"] == pytest.approx(20.0)
    ups = {u["spec"]: u for u in plot.speedups(record())}
    assert ups["a"]["vs_eager"] == pytest.approx(4.0) and ups["a"]["vs_compile"] == pytest.approx(2.0)
    assert ups["b"]["vs_compile"] is None


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda r: r.pop("results"), "results: expected a non-empty list"),
        (lambda r: r["results"][1].update(flops=-1), r"results\[1\]\.flops: expected a positive number, got -1"),
        (lambda r: r["results"][0]["ceilings"].pop("tf32_flops_per_s"), r"results\[0\]\.ceilings\.tf32_flops_per_s"),
        (lambda r: r["results"][0]["rows"][2].update(ms="fast"), r"results\[0\]\.rows\[2\]\.ms: expected a positive number, got 'fast'"),
        (lambda r: r["results"][1].update(rows=[{"name": "eager", "ms": 1.0}]), r"results\[1\]\.rows: no 'specgen' row"),
    ],
)
def test_bad_records_name_the_field(edit, message):
    bad = copy.deepcopy(record())
    bad["results"][0]["ceilings"] = dict(CEIL)
    edit(bad)
    with pytest.raises(plot.RecordError, match=message):
        plot.points(bad)


def test_png_written_and_cli(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = plot.plot_record(record(), tmp_path / "r.png")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    src = tmp_path / "rec.json"
    src.write_text(json.dumps(record()))
    assert cli.main(["plot", str(src), "-o", str(tmp_path / "cli.png")]) == 0
    assert (tmp_path / "cli.png").read_bytes()[:4] == b"\x89PNG"
    assert plot.main([str(src), "-o", str(tmp_path / "mod.svg")]) == 0
    assert b"<svg" in (tmp_path / "mod.svg").read_bytes()[:500]
    src.write_text("{not json")
    assert cli.main(["plot", str(src), "-o", str(tmp_path / "x.png")]) == 2
    assert "not JSON" in capsys.readouterr().err


def test_missing_matplotlib_says_how_to_fix_it(monkeypatch, tmp_path, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(plot.PlotUnavailable, match=r"pip install 'specgen\[plot\]'"):
        plot.require_matplotlib()
    src = tmp_path / "rec.json"
    src.write_text(json.dumps(record()))
    assert cli.main(["plot", str(src), "-o", str(tmp_path / "x.png")]) == 2
    assert "specgen[plot]" in capsys.readouterr().err
    # bench --plot refuses before measuring anything (no GPU needed to see it)
    assert cli.main(["bench", "examples/kb90.yaml", "--plot", str(tmp_path / "b.png")]) == 2
