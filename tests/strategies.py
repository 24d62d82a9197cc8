"""Hypothesis strategies that draw valid specs from the whole vocabulary (and helpers for tests)."""

from __future__ import annotations

from hypothesis import strategies as st

POINTWISE_ARGS = {
    "relu": st.just({}),
    "leaky_relu": st.builds(lambda s: {"negative_slope": s}, st.sampled_from([0.01, 0.2, 0.5])),
    "gelu": st.builds(lambda a: {"approximate": a}, st.sampled_from(["none", "tanh"])),
    "sigmoid": st.just({}),
    "tanh": st.just({}),
    "mish": st.just({}),
    "hardswish": st.just({}),
    "hardtanh": st.builds(lambda lo, w: {"min_val": lo, "max_val": lo + w}, st.sampled_from([-1.0, -0.5]), st.sampled_from([0.75, 2.0])),
    "clamp": st.sampled_from([{"min": -0.5, "max": 0.75}, {"min": 0.0}, {"max": 0.25}]),
    "silu": st.just({}),
    "softplus": st.builds(lambda b, t: {"beta": b, "threshold": t}, st.sampled_from([1.0, 2.0]), st.sampled_from([20.0, 1.0])),
    "add": st.sampled_from([{"value": 0.5}, {"param": "bias2"}]),
    "sub": st.sampled_from([{"value": 0.25}, {"param": "shift"}]),
    "mul": st.sampled_from([{"value": 1.5}, {"param": "scale"}]),
    "div": st.sampled_from([{"value": 2.0}]),
    "min": st.just({"value": 0.5}),
    "max": st.just({"value": -0.5}),
    "expr": st.sampled_from(["x * clamp((x + 3) / 6, 0, 1)", "x * sigmoid(x) + 0.5 * tanh(x)", "max(x, 0.1 * x) - scale2 * x"]),
}
PER_CHANNEL_OPS = {"add", "sub", "mul", "div", "expr"}


@st.composite
def pointwise_stage(draw, allow_params=True):
    ops = sorted(POINTWISE_ARGS)
    op = draw(st.sampled_from(ops))
    args = draw(POINTWISE_ARGS[op])
    if not allow_params and (isinstance(args, dict) and "param" in args or op == "expr" and "scale2" in args):
        return {"relu": {}}
    return {op: args}


@st.composite
def specs(draw, max_size=10):
    """A valid spec dict: conv (1-3D, stride, padding, dilation, groups), body, optional tail."""
    nd = draw(st.integers(1, 3))
    groups = draw(st.sampled_from([1, 1, 2, 3]))
    cin = groups * draw(st.integers(1, 3))
    cout = groups * draw(st.integers(1, 4))
    cap = {1: 24, 2: max_size + 3, 3: 7}[nd]
    size, kernel, stride, padding, dilation = [], [], [], [], []
    for _ in range(nd):
        k = draw(st.integers(1, 3))
        d = draw(st.integers(1, 2))
        p = draw(st.integers(0, 1))
        s = draw(st.integers(1, 2))
        span = d * (k - 1) + 1
        n = draw(st.integers(max(1, span - 2 * p), max(span - 2 * p, cap, 1)))
        size.append(n), kernel.append(k), stride.append(s), padding.append(p), dilation.append(d)
    spec = {
        "name": "rnd",
        "input": {"channels": cin, "size": size},
        "conv": {
            "out_channels": cout,
            "kernel": kernel,
            "stride": stride,
            "padding": padding,
            "dilation": dilation,
            "groups": groups,
            "bias": draw(st.booleans()),
        },
    }
    stages = [draw(pointwise_stage()) for _ in range(draw(st.integers(0, 2)))]
    pool = draw(st.sampled_from([None, None, "avg_pool", "max_pool", "global_avg_pool", "global_max_pool"]))
    if pool in ("avg_pool", "max_pool"):
        k = draw(st.integers(1, 3))
        pool_args = {"kernel": k, "stride": draw(st.integers(1, 3)), "padding": draw(st.integers(0, k // 2))}
        if pool == "avg_pool":
            pool_args["count_include_pad"] = draw(st.booleans())
        stages.append({pool: pool_args})
        stages += [draw(pointwise_stage()) for _ in range(draw(st.integers(0, 1)))]
    elif pool:
        stages.append(pool)
    n_red = draw(st.sampled_from([0, 0, 1, 1, 2]))
    rank = 1 + nd
    for _ in range(n_red):
        if rank < 2:
            break
        dims = draw(st.lists(st.integers(1, rank - 1), min_size=1, max_size=rank - 1, unique=True))
        keepdim = draw(st.booleans())
        op = draw(st.sampled_from(["sum", "mean", "amax", "amin", "logsumexp"]))
        stages.append({op: {"dims": dims, "keepdim": keepdim}})
        if not keepdim:
            rank -= len(dims)
        channel_alive = keepdim or 1 not in dims
        stages += [draw(pointwise_stage(allow_params=False)) for _ in range(draw(st.integers(0, 1)))]
        if not channel_alive:
            break
    spec["epilogue"] = stages
    return spec


@st.composite
def norm_stage(draw, shape, rank_with_batch):
    """A statistic stage that fits a tensor of per-sample `shape` (a StageShape), or None."""
    has_c = bool(shape.axes) and shape.axes[0].role == "c"
    sizes = list(shape.sizes)
    choices = ["layer_norm", "softmax", "log_softmax", "center"]
    if has_c:
        choices += ["group_norm", "batch_norm"]
        if len(sizes) > 1 and _prod(sizes[1:]) > 1:
            choices.append("instance_norm")
    op = draw(st.sampled_from(sorted(choices)))
    if op == "group_norm":
        c = sizes[0]
        groups = draw(st.sampled_from([g for g in range(1, c + 1) if c % g == 0]))
        return {"group_norm": {"num_groups": groups, "affine": draw(st.booleans()), "eps": draw(st.sampled_from([1e-5, 1e-3]))}}
    if op == "instance_norm":
        return {"instance_norm": {"affine": draw(st.booleans())}}
    if op == "batch_norm":
        return {"batch_norm": {"training": True, "momentum": draw(st.sampled_from([0.1, None])),
                               "track_running_stats": draw(st.booleans())}}
    if op == "layer_norm":
        k = draw(st.integers(1, len(sizes)))
        return {"layer_norm": {"normalized_shape": sizes[-k:], "elementwise_affine": draw(st.booleans())}}
    first = draw(st.integers(1, rank_with_batch - 1))
    last = rank_with_batch - 1 if op == "center" else draw(st.integers(first, rank_with_batch - 1))  # center: trailing dims
    dims = list(range(first, last + 1))
    return {op: {"dim": dims if len(dims) > 1 or draw(st.booleans()) else dims[0]}}


def _prod(values) -> int:
    out = 1
    for v in values:
        out *= v
    return out


@st.composite
def norm_specs(draw, max_size=10):
    """A valid spec dict with a statistic stage (sometimes two): a random body from `specs`, then a
    norm or softmax that fits the tensor it sees, pointwise ops and perhaps a pool or a reduction
    after it (the tail engine's segments)."""
    from hypothesis import assume

    from specgen.spec import SpecError, validate

    data = draw(specs(max_size))
    try:
        spec = validate(data)
    except SpecError:
        assume(False)
    stages = list(data["epilogue"])
    reduced = any(spec.epilogue[i].kind == "reduce" for i in range(len(stages)))
    for k in range(draw(st.integers(1, 2))):
        shape = spec.shapes()[-1]
        if not shape.axes:  # one value per sample: nothing to normalize over
            break
        saved = draw(st.booleans())  # the norm's input saved and read again after it (x + f(norm(x)))
        if saved:
            stages.append({"save": f"saved{k}"})
        stages.append(draw(norm_stage(shape, 1 + len(shape.axes))))
        channels = shape.axes[0].extent if shape.axes and shape.axes[0].role == "c" else None
        allow = channels == spec.conv.out_channels
        after_norm = [draw(pointwise_stage(allow_params=allow)) for _ in range(draw(st.integers(0, 2)))]
        if saved:
            after_norm.insert(draw(st.integers(0, len(after_norm))), {draw(st.sampled_from(["add", "sub", "mul"])): {"saved": f"saved{k}"}})
        stages += after_norm
        after = draw(st.sampled_from([None, None, "pool", "reduce"]))
        if after == "pool" and not reduced and len(shape.axes) == 1 + spec.ndim:
            k = draw(st.integers(1, max(1, min(2, *shape.sizes[1:]))))
            stages.append({draw(st.sampled_from(["max_pool", "avg_pool"])): {"kernel": k}})
        elif after == "reduce" and len(shape.axes) >= 1:
            dims = draw(st.lists(st.integers(1, len(shape.axes)), min_size=1, max_size=len(shape.axes), unique=True))
            stages.append({draw(st.sampled_from(["sum", "mean", "amax", "logsumexp"])): {"dims": dims, "keepdim": draw(st.booleans())}})
            reduced = True
        try:
            spec = validate({**data, "epilogue": stages})
        except SpecError:
            assume(False)
    assume(len(stages) > len(data["epilogue"]))
    return {**data, "name": "rnd_norm", "epilogue": stages}


# ---- malformed input, for the fuzz tests ----------------------------------------------------------

ODD_TEXT = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",)), max_size=12
) | st.sampled_from(["", "\u202e", "x\u0000y", "\ufeff", "名前", "🙂" * 50, "a" * 5000, "relu\n", "__ldg", "*/"])
EXTREME_NUMBERS = st.sampled_from(
    [float("nan"), float("inf"), -float("inf"), 1e308, -1e308, 3.4028234e38, 3.5e38, 1e-320, -0.0, 10**400, -(10**30),
     2**63, 0, -1, 1 << 20, (1 << 20) + 1, 4096, 1e39]
) | st.floats() | st.integers()
SCALARS = st.none() | st.booleans() | EXTREME_NUMBERS | ODD_TEXT
JUNK_TREES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(ODD_TEXT | st.sampled_from(
        ["name", "input", "conv", "epilogue", "kernel", "size", "channels", "dims", "param", "value", "expr"]), inner, max_size=4),
    max_leaves=16,
)


def _nested(depth: int, leaf):
    for _ in range(depth):
        leaf = [leaf]
    return leaf


BIG_OR_DEEP = st.one_of(
    st.integers(30, 400).map(lambda d: _nested(d, 1)),
    st.integers(100, 5000).map(lambda n: [1] * n),
    st.integers(65, 1000).map(lambda n: ["relu"] * n),
    st.integers(1, 300).map(lambda n: {"expr": "-" * n + "x"}),
    st.integers(1, 40).map(lambda n: {"expr": "(" * n + "x ** 4" + ") ** 4" * n}),
    st.just({"max_pool": {"kernel": 2, "stride": 1}}),
)

BASE = {"name": "fz", "input": {"channels": 2, "size": [8, 8]}, "conv": {"out_channels": 4, "kernel": 3},
        "epilogue": ["relu", {"add": {"param": "b"}}]}
PATHS = [(), ("name",), ("input",), ("input", "channels"), ("input", "size"), ("conv",), ("conv", "kernel"),
         ("conv", "dilation"), ("conv", "groups"), ("conv", "out_channels"), ("epilogue",), ("epilogue", 0),
         ("epilogue", 1), ("epilogue", 1, "add"), ("epilogue", 1, "add", "param"), ("tile",), ("precision",)]


@st.composite
def malformed_specs(draw):
    """A spec with one or two places replaced by junk: random YAML trees, wrong types, extreme and
    non-finite numbers, odd Unicode, huge lists, deep nesting; sometimes junk with no spec at all."""
    import copy

    if draw(st.integers(0, 9)) == 0:
        return draw(JUNK_TREES | BIG_OR_DEEP)
    data = copy.deepcopy(BASE)
    for _ in range(draw(st.integers(1, 2))):
        path = draw(st.sampled_from(PATHS))
        value = draw(JUNK_TREES | BIG_OR_DEEP | SCALARS)
        if not path:
            data = {**data, **{str(k): v for k, v in draw(st.dictionaries(ODD_TEXT, JUNK_TREES, max_size=2)).items()}}
            continue
        node = data
        try:
            for key in path[:-1]:
                node = node[key]
            node[path[-1]] = value
        except (KeyError, IndexError, TypeError):
            pass
    return data
