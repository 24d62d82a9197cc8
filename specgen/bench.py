"""`specgen bench`: time specgen against eager PyTorch and torch.compile in one process (GPU).

Each contender is timed two ways, warm-up first, the median of `reps` timed runs: one call from an
idle GPU between CUDA events (`ms`: host launch work and the GPU's wake-up count, as for a lone
call), and calls back to back (`ms_stream`: each rep a loop of calls between two events, what a
layer costs inside a model whose host runs ahead; % of floor uses this one). A row where specgen
is slower than eager by either measure is marked (`<< slower than eager`, saying which measure when
only one; `slower_than_eager` in JSON); not the runtime-dims rendering's, a measurement of what
constant folding buys that no layer runs.
`bench_model` (`specgen bench --model FILE.py:NAME`) times a whole model four ways — eager,
torch.compile, `from_module` and `torch.compile(from_module(...))` — with a row per chain
(specgen and PyTorch times from the never-slower measurement, and which one runs). The machine's
copy bandwidth, FFMA rate (fp32 matrix product, TF32 off) and TF32 rate are measured in the same
run; specgen's floor is the larger of fewest bytes / bandwidth and the plan's FLOPs at its engine's
rate: FLOPs / FFMA rate, 3 x FLOPs / TF32 rate for 3xTF32 tensor cores, FLOPs / TF32 rate in tf32
mode, FLOPs / bf16 rate in bf16 and fp16 modes (a bf16 matrix product, also measured).

The contenders run in the spec's precision: eager PyTorch (cuDNN's default TF32 flag, and TF32 off)
in float32, or in the spec's 16-bit dtype; eager with channels-last tensors (what PyTorch users
tune with); torch.compile; specgen on a contiguous and on a channels-last input.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from specgen import reference, render
from specgen.compile import CompileError
from specgen.kernelplan import SequencePlan
from specgen.module import FusedLayer
from specgen.spec import LayerSpec


def _time(fn, reps: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


STREAM_REP_MS = 1.0  # each streamed rep loops until it takes about this long
STREAM_MAX_CALLS = 200


def _time_stream(fn, reps: int, warmup: int = 3) -> float:
    """Median milliseconds per call when calls follow one another on the stream: each rep times a
    loop of calls (as many as take about STREAM_REP_MS) between two CUDA events. What a layer costs
    inside a model whose host runs ahead of the GPU; `_time`'s single call from an idle GPU also
    counts the host's launch work and the GPU's wake-up, which move a 0.1 ms layer by +-30%."""
    from specgen import measured

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    calls = measured._calls_per_rep(lambda _: fn(), [None], STREAM_REP_MS, STREAM_MAX_CALLS)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def ceilings(reps: int = 20) -> dict:
    """Copy bandwidth (bytes read + written) and the matrix-product rates with TF32 off (the
    FFMA proxy) and on (the tensor-core rate 3xTF32 plans are judged by)."""
    n = 1 << 28  # 1 GiB of float32
    src = torch.randn(n, device="cuda")
    dst = torch.empty_like(src)
    ms = _time(lambda: dst.copy_(src), reps)
    bandwidth = 2 * 4 * n / (ms * 1e-3)
    src = dst = None  # (frees the 2 GiB before the matrix products)
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    m = 8192
    a, b = torch.randn(m, m, device="cuda"), torch.randn(m, m, device="cuda")
    ms = _time(lambda: a @ b, max(5, reps // 4))
    torch.backends.cuda.matmul.allow_tf32 = True
    ms_tf32 = _time(lambda: a @ b, max(5, reps // 4))
    torch.backends.cuda.matmul.allow_tf32 = old
    a16, b16 = a.bfloat16(), b.bfloat16()
    ms_bf16 = _time(lambda: a16 @ b16, max(5, reps // 4))
    return {
        "copy_bytes_per_s": bandwidth,
        "fp32_flops_per_s": 2 * m**3 / (ms * 1e-3),
        "tf32_flops_per_s": 2 * m**3 / (ms_tf32 * 1e-3),
        "bf16_flops_per_s": 2 * m**3 / (ms_bf16 * 1e-3),
    }


TINY = {"name": "tiny", "input": {"channels": 1, "size": [8, 8]}, "conv": {"out_channels": 4, "kernel": 3}, "epilogue": ["relu"]}


def host_overhead(calls: int = 1000) -> dict:
    """Host time per call on a tiny layer, in a graph-free loop: the whole forward (custom op,
    checks, output allocation, launch) and the raw launch into a preallocated output."""
    from specgen.spec import validate

    layer = FusedLayer(validate(TINY), precision="fp32").cuda()
    x = torch.randn(1, 1, 8, 8, device="cuda")
    out = torch.empty(layer.spec.output_shape(1), device="cuda")
    result = {}
    cases = (
        ("forward_us", torch.no_grad, lambda: layer(x)),  # inference: the direct launch
        ("launch_us", torch.no_grad, lambda: layer(x, out=out)),  # into a preallocated output
        ("autograd_op_us", torch.enable_grad, lambda: layer(x)),  # through the custom op, recorded
    )
    for name, mode, call in cases:
        with mode():
            result[name] = host_us(call, calls)
    return result


def host_us(call, calls: int = 1000, warmup: int = 20) -> float:
    """Wall microseconds per call of `call()` over `calls` calls after `warmup`, the GPU
    synchronized before (a loop of small calls: their host time, where the GPU keeps up)."""
    for _ in range(warmup):
        call()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    result = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    return result


def gpu_ms(fn, inputs: list, calls: int = 20, warmup: int = 5) -> float:
    """Mean summed kernel time of `fn(x)` per call in ms, from the profiler's kernel durations
    (`calls` calls over `inputs` in turn, after `warmup`): what the call costs inside a CUDA graph,
    where a small batch's host time is gone."""
    from torch.profiler import ProfilerActivity, profile

    for i in range(warmup):
        fn(inputs[i % len(inputs)])
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(calls):
            fn(inputs[i % len(inputs)])
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / calls / 1000


def _channels_last(t: torch.Tensor) -> torch.Tensor:
    """`t` with its channels innermost in memory (same values): channels_last(_3d), or for a 1-D conv
    the [N, W, C] order torch has no name for."""
    return t.movedim(1, -1).contiguous().movedim(-1, 1)


def bench(spec: LayerSpec, batch: int, reps: int = 20, compile: bool = True, ceil: dict | None = None) -> dict:
    """One spec: a row per contender, with ms, speedups, rel. L2 error and peak memory."""
    from specgen.torchop import PRECISION_DTYPE

    ceil = ceil or ceilings()
    dtype = PRECISION_DTYPE[spec.precision]
    torch.manual_seed(0)
    fused = FusedLayer(spec, precision=spec.precision).cuda()  # the spec's own (fp32 unless it says)
    plain = reference.Reference(spec).cuda().to(dtype)
    plain.load_state_dict(fused.state_dict())
    x_sets = [torch.randn(batch, spec.input.channels, *spec.input.size, device="cuda").to(dtype) for _ in range(2)]
    cl_sets = [_channels_last(x) for x in x_sets]
    # the spec's extra inputs (a shortcut): one random set, passed to every contender
    extras = [torch.randn((batch, *shape), device="cuda").to(dtype) for shape in spec.inputs().values()]
    params = fused.spec_params()
    ref64 = reference.forward64(spec, x_sets[0], fused.conv.weight, fused.conv.bias,
                                {**params, **dict(zip(spec.inputs(), extras))})
    norm = ref64.norm().item() or 1.0

    def rel_err(out):
        return ((out.double() - ref64).norm().item()) / norm

    contenders = []  # (name, setup returning the callable, the input sets)
    tf32 = spec.precision != "fp32"

    def eager(allow_tf32, channels_last=False):
        def setup():
            torch.backends.cudnn.allow_tf32 = allow_tf32
            fmt = torch.contiguous_format
            if channels_last and x_sets[0].dim() in (4, 5):
                fmt = torch.channels_last if x_sets[0].dim() == 4 else torch.channels_last_3d
            plain.conv.to(memory_format=fmt)  # (the conv's weight: per-channel parameters keep their shape)
            return plain

        return setup

    # "eager" runs the spec's precision: fp32 specs against cuDNN with TF32 off, tf32 ones with it on
    # (PyTorch's default); the other setting is a row of its own in float32.
    if dtype == torch.float32 and not tf32:
        contenders.append(("eager", eager(False), x_sets))
        contenders.append(("eager (TF32 on)", eager(True), x_sets))
    else:
        contenders.append(("eager", eager(True), x_sets))
        if dtype == torch.float32:
            contenders.append(("eager (TF32 off)", eager(False), x_sets))
    contenders.append(("eager channels_last", eager(tf32, True), cl_sets))
    if compile:
        def compiled():
            torch.backends.cudnn.allow_tf32 = tf32
            plain.conv.to(memory_format=torch.contiguous_format)
            # Every spec's reference shares one forward: past dynamo's recompile limit (8) it would
            # run that frame uncompiled, so each spec starts from a fresh dynamo.
            torch._dynamo.reset()
            return torch.compile(plain)

        contenders.append(("torch.compile", compiled, x_sets))
    contenders.append(("specgen", lambda: fused, x_sets))
    contenders.append(("specgen channels_last in", lambda: fused, cl_sets))

    def runtime_dims():
        from specgen import pipeline, torchop

        rt = pipeline.specialize_runtime_dims(spec)
        weight, bias = fused.conv.weight, fused.conv.bias
        return lambda x: torchop.launch(rt, x, weight, bias, params, None)

    if render.has_runtime_dims(fused.specialize().plan):  # (not the GEMM engines, nor a statistic stage's kernels)
        contenders.append(("specgen runtime-dims", runtime_dims, x_sets))

    rows = []
    for name, setup, inputs in contenders:
        try:
            model = setup()
            t0 = time.perf_counter()
            with torch.no_grad():
                out = model(inputs[0], *extras)
                torch.cuda.synchronize()
        except (RuntimeError, ValueError, CompileError) as err:
            if name != "specgen runtime-dims":
                raise
            # (a measurement only, which no layer runs: its failure costs the row, not the bench)
            print(f"specgen bench: {spec.name}: no runtime-dims row ({type(err).__name__}: {err})", file=sys.stderr)
            continue
        first_call_s = time.perf_counter() - t0
        with torch.no_grad():
            err = rel_err(out)
            del out
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            calls = [0]

            def run():
                calls[0] += 1
                return model(inputs[calls[0] % len(inputs)], *extras)

            ms = _time(run, reps)
            peak = torch.cuda.max_memory_allocated() - base
            ms_stream = _time_stream(run, reps)
        rows.append({"name": name, "ms": ms, "ms_stream": ms_stream, "rel_l2": err, "peak_bytes": peak,
                     "first_call_s": first_call_s})
    torch.backends.cudnn.allow_tf32 = True

    by = {r["name"]: r["ms"] for r in rows}
    by_stream = {r["name"]: r["ms_stream"] for r in rows}
    plan = fused.specialize().plan
    flops = plan["flops_per_sample"] * batch
    elem = x_sets[0].element_size()
    fewest_bytes = elem * (batch * (plan["in_per_sample"] + (1 + len(extras)) * plan["out_per_sample"])
                           + sum(p.numel() for p in fused.parameters()))
    # The floor of the engine the plan uses: FFMA at the fp32 rate; 3xTF32 (three tensor-core
    # products per multiply-add) or TF32 at the measured TF32 rate; bf16 / fp16 at the bf16 rate;
    # and never below moving the fewest bytes.
    copy_s = fewest_bytes / ceil["copy_bytes_per_s"]
    floor_ffma_ms = 1e3 * max(flops / ceil["fp32_flops_per_s"], copy_s)
    engine = plan["engine"]
    if isinstance(plan, SequencePlan):  # judged by its body's engine (the conv): the tails are memory-bound
        engine = next(p for p in plan.parts if p.role == "body").plan.engine
    on_tensor_cores = plan["mma"] is not None or engine in ("igemm", "tma")
    sixteen = engine == "tma" and dtype != torch.float32  # only the TMA engine multiplies in 16 bits
    if not on_tensor_cores:
        floor_ms, products = floor_ffma_ms, 1
    elif sixteen:
        products, rate = 1, ceil.get("bf16_flops_per_s", ceil["tf32_flops_per_s"])
        floor_ms = 1e3 * max(flops / rate, copy_s)
    else:
        products = 3 if spec.precision == "fp32" else 1
        floor_ms = 1e3 * max(products * flops / ceil["tf32_flops_per_s"], copy_s)
    mode = {"fp32": "3xTF32", "tf32": "TF32", "bf16": "bf16", "fp16": "fp16"}[spec.precision] if sixteen or spec.precision in ("fp32", "tf32") else "TF32 on widened inputs"
    if isinstance(plan, SequencePlan):
        label = f"sequence of {len(plan.steps)} launches, body: "
    else:
        label = ""
    if not on_tensor_cores:
        label += "fp32 FFMA"
    else:
        if engine == "tma":
            label += f"Hopper TMA + wgmma ({mode})"
        elif engine == "igemm":
            label += f"implicit GEMM ({'3xTF32' if products == 3 else 'TF32'})"
        else:
            label += f"tensor cores ({'3xTF32' if products == 3 else 'TF32'})"
    for r in rows:
        r["vs_eager"] = by["eager"] / r["ms"]
        r["vs_compile"] = by["torch.compile"] / r["ms"] if "torch.compile" in by else None
        r["stream_vs_eager"] = by_stream["eager"] / r["ms_stream"]
        r["stream_vs_compile"] = by_stream["torch.compile"] / r["ms_stream"] if "torch.compile" in by_stream else None
        r["slower_than_eager"] = slower_than_eager(r["name"], r["ms"], by["eager"], r["ms_stream"], by_stream["eager"])
        if r["name"].startswith("specgen"):
            r["pct_of_floor"] = 100 * floor_ms / r["ms_stream"]  # (a floor of GPU time: the streamed figure)
            r["pct_of_ffma_floor"] = 100 * floor_ffma_ms / r["ms_stream"]
    return {
        "spec": spec.name,
        "batch": batch,
        "precision": spec.precision,
        "folding_speedup": by["specgen runtime-dims"] / by["specgen"] if "specgen runtime-dims" in by else None,
        "rewrites": plan["rewrites"],
        "flops": flops,
        "fewest_bytes": fewest_bytes,
        "engine": label,
        "floor_ms": floor_ms,
        "floor_ffma_ms": floor_ffma_ms,
        "ceilings": ceil,
        "rows": rows,
    }


def format_table(result: dict) -> str:
    lines = [
        f"{result['spec']} ({result.get('precision', 'fp32')}) batch {result['batch']}: {result['flops'] / 1e9:.1f} GFLOP, {result['fewest_bytes'] / 1e9:.2f} GB fewest bytes;"
        f" {result['engine']}, floor {result['floor_ms']:.3f} ms (FFMA floor {result['floor_ffma_ms']:.3f} ms)",
        f"{'':31}{'ms':>9}{'x eager':>9}{'x compile':>10}{'streamed':>9}{'x eager':>9}{'x compile':>10}"
        f"{'rel L2':>10}{'peak MB':>9}{'% floor':>9}",
    ]
    for r in result["rows"]:
        vc = f"{r['vs_compile']:.2f}" if r.get("vs_compile") else "-"
        pf = f"{r['pct_of_floor']:.0f}" if "pct_of_floor" in r else ""
        if "ms_stream" in r:
            svc = f"{r['stream_vs_compile']:.2f}" if r.get("stream_vs_compile") else "-"
            streamed = f"{r['ms_stream']:9.3f}{r['stream_vs_eager']:9.2f}{svc:>10}"
        else:  # (a record from before the streamed column)
            streamed = f"{'-':>9}{'-':>9}{'-':>10}"
        lines.append(
            f"{r['name']:31}{r['ms']:9.3f}{r['vs_eager']:9.2f}{vc:>10}{streamed}{r['rel_l2']:10.1e}{r['peak_bytes'] / 1e6:9.0f}{pf:>9}"
            + (slower_mark(r) if r.get("slower_than_eager") else "")
        )
    if result["folding_speedup"] is not None:
        lines.append(f"constant folding: specgen is {result['folding_speedup']:.2f}x its runtime-dims rendering")
    return "\n".join(lines)


SLOWER_MARK = "  << slower than eager"
# The rows of `bench` a user's layer runs as (the runtime-dims rendering is a measurement only).
RUNS_AS_SPECGEN = ("specgen", "specgen channels_last in")


def slower_than_eager(row: str, ms: float, eager_ms: float, ms_stream: float | None = None,
                      eager_stream_ms: float | None = None) -> bool:
    """Whether `bench` marks a row: one a layer runs as (`RUNS_AS_SPECGEN`), slower than eager
    by either measure (one call from an idle GPU, or calls back to back when both are given)."""
    if row not in RUNS_AS_SPECGEN:
        return False
    streamed = ms_stream is not None and eager_stream_ms is not None and ms_stream > eager_stream_ms
    return ms > eager_ms or streamed


def slower_mark(row: dict) -> str:
    """SLOWER_MARK, saying by which measure a row lost to eager when it lost by one only."""
    idle = row["vs_eager"] < 1
    streamed = "ms_stream" in row and row["stream_vs_eager"] < 1
    if idle and not streamed and "ms_stream" in row:
        return SLOWER_MARK + " (one call from idle)"
    if streamed and not idle:
        return SLOWER_MARK + " (streamed)"
    return SLOWER_MARK


def bench_model(model, x: torch.Tensor, reps: int = 20, compile: bool = True, label: str | None = None,
                compile_fused: bool = True, memory_format: str = "as_given") -> dict:
    """A whole model on `x` (CUDA): eager, torch.compile (default and reduce-overhead, its CUDA
    graphs), from_module (and, where it replays a CUDA graph, the fused model without it) and
    torch.compile of the fused model (`compile_fused`).

    Each row: ms per forward (median), x eager, x compile, rel. L2 against the float64 model and
    the first call's seconds (compilation included). `chains`: one row per fusable chain with the
    never-slower measurement's times and verdict. `specialize_s`: from_module's wall time."""
    import copy

    from specgen.importer import from_module
    from specgen.replay import GraphReplay

    model = model.cuda()
    x = x.cuda()
    inputs = [x, torch.randn_like(x)]
    with torch.no_grad():
        ref64 = copy.deepcopy(model).double()(x.double())
    norm = ref64.double().norm().item() or 1.0
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fused = from_module(model, x, memory_format=memory_format)
    torch.cuda.synchronize()
    specialize_s = time.perf_counter() - t0
    report = getattr(fused, "specgen_report", None)

    # from_module's result may replay a CUDA graph (specgen.replay): torch.compile's own CUDA-graph
    # mode is a contender beside its default, and torch.compile runs on the fused model it wraps
    plain_fused = fused.module if isinstance(fused, GraphReplay) else fused
    contenders = [("eager", lambda: model)]
    if compile:
        contenders.append(("torch.compile", lambda: torch.compile(model)))
        contenders.append(("torch.compile reduce-overhead", lambda: torch.compile(model, mode="reduce-overhead")))
    contenders.append(("specgen", lambda: fused))
    if isinstance(fused, GraphReplay):
        contenders.append(("specgen, no CUDA graph", lambda: fused.fallback))
    if compile and compile_fused:
        contenders.append(("specgen + torch.compile", lambda: torch.compile(plain_fused)))
    rows = []
    for name, setup in contenders:
        row = {"name": name}
        try:
            run = setup()
            with torch.no_grad():
                t0 = time.perf_counter()
                out = run(x)
                torch.cuda.synchronize()
                row["first_call_s"] = time.perf_counter() - t0
                row["rel_l2"] = (out.double() - ref64).norm().item() / norm
                del out
                calls = [0]

                def step():
                    calls[0] += 1
                    return run(inputs[calls[0] % 2])

                row["ms"] = _time(step, reps)
        except Exception as err:  # noqa: BLE001  (torch.compile may refuse a model: the row says why)
            row["error"] = f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0][:200]}"
        rows.append(row)
    by = {r["name"]: r["ms"] for r in rows if "ms" in r}
    for r in rows:
        if "ms" not in r:
            continue
        r["vs_eager"] = by["eager"] / r["ms"] if "eager" in by else None
        r["vs_compile"] = by["torch.compile"] / r["ms"] if "torch.compile" in by else None
        r["slower_than_eager"] = r["name"].startswith("specgen") and "eager" in by and r["ms"] > by["eager"]
    chains = []
    if report is not None:
        specs = {spec.name: spec for spec in report.specs}
        for c in report.choices:
            spec = specs[c.layer]
            chains.append(
                {
                    "layer": c.layer,
                    "conv": f"conv{spec.ndim}d {spec.input.channels}->{spec.conv.out_channels}",
                    "stages": [stage.op for stage in spec.epilogue],
                    "runs_as": "specgen" if c.fused else "PyTorch",
                    "specgen_ms": c.specgen_ms,
                    "pytorch_ms": c.pytorch_ms,
                    "how": c.how,
                }
            )
    return {
        "model": label or type(model).__name__,
        "input_shape": list(x.shape),
        "batch": x.shape[0],
        "specialize_s": specialize_s,
        "chains_fusable": len(chains),
        "chains_fused": sum(c["runs_as"] == "specgen" for c in chains),
        "fallbacks": len(report.fallbacks) if report is not None else None,
        "memory_format": report.memory_format if report is not None else None,
        "memory_formats_ms": report.memory_formats if report is not None else None,
        "rows": rows,
        "chains": chains,
    }


def format_model_table(result: dict) -> str:
    shape = "x".join(map(str, result["input_shape"]))
    kept = result["chains_fusable"] - result["chains_fused"]
    lines = [
        f"{result['model']} input {shape}: {result['chains_fused']} of {result['chains_fusable']} chain(s) fused"
        f" ({kept} kept as PyTorch: not faster fused); from_module took {result['specialize_s']:.2f} s",
        *([f"  activations {result['memory_format']}"
           + (" (channels-last {:.3f} ms, as given {:.3f} ms)".format(*result["memory_formats_ms"])
              if result.get("memory_formats_ms") else "")] if result.get("memory_format") else []),
        f"{'':31}{'ms':>9}{'x eager':>9}{'x compile':>10}{'rel L2':>10}{'first s':>9}",
    ]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"{r['name']:31}  failed: {r['error']}")
            continue
        vc = f"{r['vs_compile']:.2f}" if r.get("vs_compile") else "-"
        lines.append(
            f"{r['name']:31}{r['ms']:9.3f}{r['vs_eager']:9.2f}{vc:>10}{r['rel_l2']:10.1e}{r['first_call_s']:9.2f}"
            + (SLOWER_MARK if r.get("slower_than_eager") else "")
        )
    if result["chains"]:
        lines.append(f"  {'chain':28}{'layer':24}{'specgen ms':>11}{'PyTorch ms':>11}{'x':>7}  runs as")
        for c in result["chains"]:
            if c["specgen_ms"] is None:
                times = f"{'-':>11}{'-':>11}{'-':>7}"
            else:
                times = f"{c['specgen_ms']:11.4f}{c['pytorch_ms']:11.4f}{c['pytorch_ms'] / c['specgen_ms']:7.2f}"
            layer = f"{c['conv']} | {', '.join(c['stages'])}"
            lines.append(f"  {c['layer'][:28]:28}{layer[:24]:24}{times}  {c['runs_as']} ({c['how']})")
    return "\n".join(lines)


def model_main(args) -> int:
    """`specgen bench --model FILE.py:NAME --input-shape B,C,... [--batch N...]`: exit code."""
    import argparse
    import json
    import sys
    from pathlib import Path

    from specgen import importcli

    def fail(message: str) -> int:
        print(f"specgen bench: {message}", file=sys.stderr)
        return 2

    try:
        if not args.input_shape:
            raise importcli._BadInput("--model needs --input-shape (batch first, e.g. --input-shape 8,3,224,224)")
        shape = importcli._parse_shape(args.input_shape)
        file, name = importcli._parse_target(args.model)
        module = importcli._load_module(file)
        model = importcli._build_model(module, name, argparse.Namespace(args=None, kwargs=None, train=False), file)
    except importcli._BadInput as err:
        return fail(str(err))
    if args.files:
        return fail("give spec files or --model, not both")
    batches = args.batch or [shape[0]]
    if any(b <= 0 for b in batches):
        return fail(f"--batch: expected positive ints, got {batches}")
    if not torch.cuda.is_available():
        return fail("--model times the model on a CUDA GPU; none is available")
    results = []
    for batch in batches:
        generator = torch.Generator().manual_seed(0)
        x = torch.randn((batch, *shape[1:]), generator=generator)
        result = bench_model(model, x, reps=args.reps, compile=not args.no_compile, label=name)
        results.append(result)
        print(format_model_table(result), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": environment(), "results": results}, indent=1))
    return 0


def environment() -> dict:
    """Date, GPU and versions, recorded with every bench result."""
    import datetime
    import platform

    from specgen import __version__
    from specgen import compile as nvcc

    compiler = nvcc.resolve_compiler()
    ident = nvcc.compiler_id(compiler).splitlines()

    return {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        compiler: ident[-1] if compiler == "nvcc" else ident[0],  # the compiler builds use (nvcc or NVRTC)
        "specgen": __version__,
        "python": platform.python_version(),
    }
