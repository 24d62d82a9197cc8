"""A model of the tail kernels in Python: the index math of templates/tail.cu.j2, run on the CPU.

Every thread of every block of every kernel is enumerated with the plan's constants, as the .cu
computes its addresses: which floats it reads, which partial it writes, which chunks a finalize
thread folds, where it stores, and the channel (c_el) and normalized-shape place (e_el) it gives
each value. The model counts every read and write, so a plan that misses or repeats an element is
caught, and computes the statistics from what the threads read (in float64: the model checks the
indexing, the GPU tests the rounding). `run_sequence` runs a whole layer: its body and rests with
the PyTorch reference of their part specs (the rests over an identity conv), its tails with this
model, in the plan's steps and buffers.
"""

from __future__ import annotations

import numpy as np
import torch

from specgen import ops, reference


def _channel_of(tp: dict, q: np.ndarray) -> np.ndarray:
    return q // tp["c_stride"]


def _normalize(tp: dict, x, a, b):
    """The row's normalization of x with the group's raw statistic (a, b) (mean, variance or max, sum)."""
    if tp["op"] == "center":
        return x - a
    if tp["statistic"] == "moments":
        eps = float(next(c.value for c in tp["constants"] if c.name == tp["eps"]).rstrip("f"))
        return (x - a) / np.sqrt(b + eps)
    if tp["op"] == "softmax":
        return np.exp(x - a) / b
    return x - a - np.log(b)


def _stat(tp: dict, values: np.ndarray) -> tuple[float, float]:
    if tp["statistic"] == "moments":
        return values.mean(), values.var()
    m = values.max()
    return m, np.exp(values - m).sum()


class Coverage:
    """How often each element of a [batch, per_sample] tensor was read and written."""

    def __init__(self, batch: int, per_sample: int):
        self.reads = np.zeros((batch, per_sample), dtype=np.int64)
        self.writes = np.zeros((batch, per_sample), dtype=np.int64)


def run_tail(tp: dict, x: np.ndarray, params: dict, coverage: Coverage | None = None) -> np.ndarray:
    """The tail kernels of one statistic stage on x [batch, per_sample] (float64), params flat by name.
    Returns the normalized tensor with the norm's weight and bias and the following pointwise ops
    (applied by the PyTorch reference of those ops, per element, with the model's channel index)."""
    batch, per_sample = x.shape
    assert per_sample == tp["per_sample"]
    cov = coverage or Coverage(batch, per_sample)
    out = np.full_like(x, np.nan)
    channel = np.full((batch, per_sample), -1, dtype=np.int64)
    element = np.full((batch, per_sample), -1, dtype=np.int64)
    if tp["mode"] == "one_pass":
        team, teams, items, vec, groups, glen = tp["team"], tp["teams"], tp["items"], tp["vec"], tp["groups"], tp["group_len"]
        (kernel,) = tp["kernels"]
        for n in range(batch):
            for block in range(kernel["grid_x"]):
                for tid in range(kernel["threads"]):
                    g, lane = block * teams + tid // team, tid % team
                    if g >= groups:
                        continue
                    base = g * glen
                    offsets = [base + (it * team + lane) * vec + k for it in range(items) for k in range(vec)
                               if (it * team + lane) * vec < glen]
                    for q in offsets:
                        cov.reads[n, q] += 1
            for g in range(groups):  # the team's statistic: of the values its threads read
                a, b = _stat(tp, x[n, g * glen:(g + 1) * glen])
                for block in range(kernel["grid_x"]):
                    for tid in range(kernel["threads"]):
                        if block * teams + tid // team != g:
                            continue
                        lane = tid % team
                        for it in range(items):
                            e = (it * team + lane) * vec
                            if e >= glen:
                                continue
                            for k in range(vec):
                                q = g * glen + e + k
                                out[n, q] = _normalize(tp, x[n, q], a, b)
                                channel[n, q] = q // tp["c_stride"]
                                element[n, q] = e + k
                                cov.writes[n, q] += 1
    elif tp["mode"] == "split":
        groups, glen, chunk, chunks, vec, items = tp["groups"], tp["group_len"], tp["chunk"], tp["chunks"], tp["vec"], tp["items"]
        threads = tp["threads"]
        partials = np.full((batch, tp["partials"]), np.nan)
        counts = {}
        stats_k, fin_k, apply_k = tp["kernels"]
        assert stats_k["grid_x"] == apply_k["grid_x"] == groups * chunks
        for n in range(batch):  # stats: blockIdx.x = g * CHUNKS + j
            for block in range(stats_k["grid_x"]):
                g, j = block // chunks, block % chunks
                count = min(chunk, glen - j * chunk)
                assert count > 0, "a chunk past its group's end"
                base = g * glen + j * chunk
                read = [base + (it * threads + tid) * vec + k for tid in range(threads) for it in range(items) for k in range(vec)
                        if (it * threads + tid) * vec < count]
                assert len(read) == count
                for q in read:
                    cov.reads[n, q] += 1
                a, b = _stat(tp, x[n, read])
                if tp["statistic"] == "moments":
                    b = b * count  # the partial keeps M2, not the variance
                partials[n, g * chunks + j] = a
                partials[n, groups * chunks + g * chunks + j] = b
                counts[j] = count
        assert not np.isnan(partials).any(), "a partial nobody wrote"
        # finalize: thread t folds its chunks in order, then a fixed tree; the model checks which it takes
        fin = tp["fin_threads"]
        samples = [None] if tp["across_batch"] else range(batch)
        final = {}
        for n in samples:
            for g in range(groups):
                folded = []
                for t in range(fin):
                    if tp["across_batch"]:
                        total = batch * chunks
                        qs = [q0 + t for q0 in range(0, total, fin) if q0 + t < total]
                        folded += [(q // chunks, q % chunks) for q in qs]
                    else:
                        js = [it * fin + t for it in range(tp["fin_iters"]) if it * fin + t < chunks]
                        folded += [(n, j) for j in js]
                want = {(s, j) for s in (range(batch) if tp["across_batch"] else [n]) for j in range(chunks)}
                assert sorted(folded) == sorted(want) and len(folded) == len(want), "finalize misses or repeats a partial"
                if tp["statistic"] == "moments":
                    cnt = sum(counts[j] for _, j in folded)
                    mean = sum(partials[s, g * chunks + j] * counts[j] for s, j in folded) / cnt
                    m2 = sum(partials[s, groups * chunks + g * chunks + j] + counts[j] * (partials[s, g * chunks + j] - mean) ** 2
                             for s, j in folded)
                    final[(n, g)] = (mean, m2 / cnt)
                else:
                    m = max(partials[s, g * chunks + j] for s, j in folded)
                    final[(n, g)] = (m, sum(partials[s, groups * chunks + g * chunks + j] * np.exp(partials[s, g * chunks + j] - m)
                                            for s, j in folded))
        for n in range(batch):  # apply
            for block in range(apply_k["grid_x"]):
                g, j = block // chunks, block % chunks
                count = min(chunk, glen - j * chunk)
                a, b = final[(None if tp["across_batch"] else n, g)]
                for tid in range(threads):
                    for it in range(items):
                        e = (it * threads + tid) * vec
                        if e >= count:
                            continue
                        for k in range(vec):
                            q = g * glen + j * chunk + e + k
                            out[n, q] = _normalize(tp, x[n, q], a, b)
                            channel[n, q] = q // tp["c_stride"]
                            element[n, q] = j * chunk + e + k
                            cov.writes[n, q] += 1
    else:  # strided softmax
        outer, elems, inner, vec = tp["outer"], tp["elems"], tp["inner"], tp["vec"]
        (kernel,) = tp["kernels"]
        assert kernel["grid_x"] * kernel["threads"] >= tp["groups_t"]
        for n in range(batch):
            for block in range(kernel["grid_x"]):
                for tid in range(kernel["threads"]):
                    slot = block * kernel["threads"] + tid
                    if slot >= tp["groups_t"]:
                        continue
                    p, t = slot // (inner // vec), slot % (inner // vec) * vec
                    base = p * (elems * inner) + t
                    for k in range(vec):
                        qs = [base + o * inner + k for o in range(elems)]
                        for q in qs:
                            cov.reads[n, q] += 1 if tp["registers"] else 2
                        a, b = _stat(tp, x[n, qs])
                        for o, q in enumerate(qs):
                            out[n, q] = _normalize(tp, x[n, q], a, b)
                            channel[n, q] = q // tp["c_stride"]
                            element[n, q] = o
                            cov.writes[n, q] += 1
    assert (cov.writes == 1).all(), "an element written never or twice"
    expect_reads = 2 if tp["mode"] == "strided" and not tp["registers"] else 1
    assert (cov.reads == expect_reads).all(), "an element read too rarely or too often"
    # the channel the kernel computes for each value is its channel coordinate
    if tp["needs_channel"]:
        truth = np.broadcast_to(np.arange(per_sample) // tp["c_stride"], (batch, per_sample))
        assert (channel == truth).all()
        assert tp["in_shape"][0] * tp["c_stride"] == per_sample
    if tp["affine_index"] == "element":  # a layer norm: e_el is the place in the normalized shape
        truth = np.broadcast_to(np.arange(per_sample) % tp["group_len"], (batch, per_sample))
        assert (element == truth).all()
    return out


def _apply_steps(spec, tp: dict, y: np.ndarray, params: dict, batch: int) -> np.ndarray:
    """The norm's weight and bias and the pointwise stages after it, with the PyTorch reference
    (`params` holds the saved values too, as the step's buffers bound to them)."""
    i = tp["index"]
    stage = spec.epilogue[i]
    t = torch.from_numpy(y).reshape(batch, *tp["in_shape"])
    row = ops.NORMS[stage.op]
    a = stage.args
    if row.params(a):
        shape = (-1, *[1] * (t.dim() - 2)) if row.affine == "channel" else tuple(a.normalized_shape)
        if a.weight:
            t = t * params[a.weight].double().reshape(shape)
        if a.bias:
            t = t + params[a.bias].double().reshape(shape)
    for j in _segment(spec, i).apply:
        st = spec.epilogue[j]
        row_j = ops.POINTWISE[st.op]
        t = reference._pointwise(row_j.torch_ref, st.args, row_j.params(st.args), row_j.inputs(st.args) + row_j.saved(st.args),
                                 t, {k: v.double() for k, v in params.items()})
    return t.reshape(batch, -1).numpy()


def _segment(spec, index):
    from specgen import tail

    return next(s for s in tail.split(spec)[1] if s.index == index)


def run_sequence(spec, plan: dict, x: torch.Tensor, weight, bias, params: dict) -> torch.Tensor:
    """A sequence layer as its steps run: body and rests by the reference of their part specs, tails
    by the model, through the plan's named buffers. Everything in float64."""
    batch = x.shape[0]
    buffers = {"x": x.double()}
    from specgen.torchop import transformed_weight

    weight = weight.double()  # (transformed in float64 too: the model checks the indexing, not the roundings)
    for transform in plan.get("weight_transforms", ()):  # the launch's weights (the plan's rewrites of the conv)
        weight = transformed_weight(weight, transform)
    for step in plan["steps"]:
        part = plan["parts"][step["part"]]
        if step["kind"] == "layer":
            pspec = part["spec"]
            src = buffers[step["in"]].reshape(batch, pspec.input.channels, *pspec.input.size)
            if part["role"] == "body":
                w, b = weight.double(), None if bias is None else bias.double()
                for transform in part["plan"].get("weight_transforms", ()):
                    w = transformed_weight(w, transform)
            else:
                w, b = torch.ones(pspec.weight_shape(), dtype=torch.float64), None
            names = pspec.params()
            y = reference.forward(pspec, src, w, b, {n: params[n].double().reshape(names[n]) for n in names})
            assert tuple(y.shape[1:]) == tuple(step["out_shape"])
            buffers[step["out"]] = y.reshape(batch, -1)
        elif part["role"] == "tapsum":  # the input's sums per tap (tests/tapsum_model.py)
            import tapsum_model

            buffers[step["args"][-1]] = torch.from_numpy(tapsum_model.run(part["plan"], buffers[step["args"][0]].reshape(batch, -1).numpy()))
            spec = part["folded_spec"]  # the later parts' stage numbers are the folded layer's
        elif part["role"] == "boxmean":  # the input's box means per tap (box_means below)
            buffers[step["args"][-1]] = box_means(part["plan"], buffers[step["args"][0]]).reshape(batch, -1)
            spec = part["folded_spec"]
        elif step["name"] == part["plan"]["kernels"][-1]["name"]:  # a tail's last kernel: run the whole tail
            tp = part["plan"]
            src = buffers[step["args"][0]].reshape(batch, -1).numpy()
            y = run_tail(tp, src, {})
            # an extra input the plan binds to one of its buffers (a saved value) reads that buffer
            kernel = next(k for k in tp["kernels"] if k["name"] == step["name"])
            bound = {a[2:]: buffers[b].reshape(batch, *tp["in_shape"]) for a, b in zip(kernel["args"], step["args"])
                     if a.startswith("i_") and b in buffers}
            buffers[step["args"][-1]] = torch.from_numpy(_apply_steps(spec, tp, y, {**params, **bound}, batch))
    return buffers["out"].reshape(batch, *plan["out_shape"])



def box_means(bp, x: torch.Tensor) -> torch.Tensor:
    """The box-mean kernel (specgen.boxfold) from its plan's dims, by torch's own average pool: per
    tap k, the pool of the input shifted by k (after the conv's padding), cut to the pooled extents.
    [batch, C_IN * TAPS, OD, OH, OW], channel c's taps at c * TAPS + t, t row-major over (D, H, W)."""
    batch = x.shape[0]
    dims = bp["dims"]
    v = x.double().reshape(batch, bp["cin"], *[d["size"] for d in dims])
    pads = [p for d in reversed(dims) for p in (d["pad"], d["pad"])]
    v = torch.nn.functional.pad(v, pads)
    means = []
    for kd in range(dims[0]["kernel"]):
        for kh in range(dims[1]["kernel"]):
            for kw in range(dims[2]["kernel"]):
                shifted = v[:, :, kd:, kh:, kw:]
                pooled = torch.nn.functional.avg_pool3d(shifted, [d["window"] for d in dims])
                means.append(pooled[:, :, : dims[0]["out"], : dims[1]["out"], : dims[2]["out"]])
    return torch.stack(means, dim=2).reshape(batch, bp["cin"] * bp["taps"], *[d["out"] for d in dims])
