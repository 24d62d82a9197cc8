"""A model of the tap-sum kernel (templates/tapsum.cu.j2) in Python: every thread of every block, as
the .cu computes it from the plan's constants (the same coordinate splits, the same C conditions,
evaluated here), in float64. It counts the reads and writes, so a plan that misses or repeats an
element, or writes a sum twice, is caught; the sums it returns are what the kernel writes."""

from __future__ import annotations

import re

import numpy as np


def _condition(text: str):
    """A plan's C condition over d, h, w (and `active`) as a Python function of those names."""
    py = re.sub(r"\btrue\b", "True", re.sub(r"\bfalse\b", "False", text.replace("&&", " and ")))
    code = compile(py, "<condition>", "eval")
    return lambda **names: bool(eval(code, {}, names))  # noqa: S307  (the plan's own text, in a test)


def run(tp: dict, x: np.ndarray) -> np.ndarray:
    """S for x ([batch, C_IN * D * H * W] float64), launched as the plan says: grid (grid_x, batch)."""
    batch = x.shape[0]
    dims = {d["name"]: d for d in tp["dims"]}
    size = {n: d["size"] for n, d in dims.items()}
    kept = [d for d in tp["dims"] if not d["reduced"]]
    red = [d for d in tp["dims"] if d["reduced"]]
    reads = np.zeros(x.shape, dtype=np.int64)
    writes = np.zeros((batch, tp["s_per_sample"]), dtype=np.int64)
    s = np.full((batch, tp["s_per_sample"]), np.nan)
    kept_total, taps, threads = tp["kept_positions"], tp["tap_count"], tp["threads"]

    def coords(index, group, which):
        return {d["name"]: index // d[group] % d["size"] for d in which}

    def x_offset(ci, c):
        return ci * tp["plane"] + sum(c[n] * dims[n]["x_stride"] for n in c)

    def s_offset(ci, c):
        return ci * taps * kept_total + sum(c[d["name"]] * d["s_stride"] for d in kept)

    if tp["rows_mode"]:
        rest = [_condition(c) for c in tp["rest_conds"]]
        wconds = [_condition(c) for c in tp["w_conds"]]
        rows_red = [d for d in red if d["name"] != "w"]
        team_w, team, items_total = tp["team_w"], tp["team"], tp["cin"] * kept_total
        for n in range(batch):
            for block in range(tp["grid_x"]):
                totals = {}
                for tx in range(threads):
                    item, lt = block * tp["items"] + tx // team, tx % team
                    w0, row0 = lt % team_w, lt // team_w
                    active = lt < team_w * tp["rows_par"] and item < items_total
                    ci, kc = item // kept_total, coords(item % kept_total, "kept_div", kept)
                    acc = np.zeros((tp["w_slots"], tp["rest_taps"]))
                    if active:
                        for j in range(tp["row_iters"]):
                            row = row0 + j * tp["rows_par"]
                            if row >= tp["rows"]:
                                assert not tp["rows_exact"]
                                break
                            rc = coords(row, "row_div", rows_red)
                            for slot in range(tp["w_slots"]):
                                w = w0 + slot * team_w
                                if w >= size["w"]:
                                    assert not tp["w_exact"]
                                    break
                                i = x_offset(ci, {**kc, **rc, "w": w})
                                reads[n, i] += 1
                                for t, cond in enumerate(rest):
                                    if cond(**{**kc, **rc, "w": w}):
                                        acc[slot, t] += x[n, i]
                    total = totals.setdefault(item, np.zeros(taps))
                    for slot in range(tp["w_slots"]):
                        w = w0 + slot * team_w
                        for tr in range(tp["rest_taps"]):
                            for kw in range(tp["taps_w"]):
                                if active and w < size["w"] and wconds[kw](w=w):
                                    total[tr * tp["taps_w"] + kw] += acc[slot, tr]
                for item, total in totals.items():
                    if item >= items_total:
                        continue
                    ci, kc = item // kept_total, coords(item % kept_total, "kept_div", kept)
                    base = s_offset(ci, kc)
                    for t in range(taps):
                        s[n, base + t * tp["s_tap_stride"]] = total[t]
                        writes[n, base + t * tp["s_tap_stride"]] += 1
    else:
        conds = [_condition(c) for c in tp["tap_conds"]]
        for n in range(batch):
            for block in range(tp["grid_x"]):
                for tx in range(threads):
                    item = block * threads + tx
                    if item >= tp["cin"] * kept_total:
                        continue
                    ci, kc = item // kept_total, coords(item % kept_total, "kept_div", kept)
                    acc = np.zeros(taps)
                    for r in range(tp["reduced_positions"]):
                        rc = coords(r, "red_div", red)
                        i = x_offset(ci, {**kc, **rc})
                        reads[n, i] += 1
                        for t, cond in enumerate(conds):
                            if cond(**kc, **rc):
                                acc[t] += x[n, i]
                    base = s_offset(ci, kc)
                    for t in range(taps):
                        s[n, base + t * tp["s_tap_stride"]] = acc[t]
                        writes[n, base + t * tp["s_tap_stride"]] += 1
    assert (reads == 1).all(), "every input float is read exactly once"
    assert (writes == 1).all(), "every sum is written exactly once"
    return s
