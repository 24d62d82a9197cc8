"""What the GPU tests share: fp32 reference flags, random parameters, NaN-poisoned outputs and the
accuracy bars against float64.

The bars: an fp32 kernel is within rel. L2 1e-5 of float64 and allclose(1e-4, 1e-4) to PyTorch
fp32 (TF32 off); a tf32 kernel is within 2x the rel. L2 error of PyTorch's own TF32 convolution
on the same inputs. Outputs are filled with NaN before the kernel runs, so an element it never
writes fails the finiteness check.

Only modules that need torch import this one (after `pytest.importorskip("torch")`).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from specgen import reference

FP32_REL_L2 = 1e-5
"""fp32 kernels against float64: relative L2 error at most this."""
FP32_ILL_CONDITIONED_FACTOR = 2.0
"""... or at most this times PyTorch fp32's own error, where that is already past FP32_REL_L2."""
FP32_ATOL = FP32_RTOL = 1e-4
"""fp32 kernels against PyTorch fp32: torch.allclose with these tolerances."""
TF32_FACTOR = 2.0
"""tf32 kernels: at most this times PyTorch's own TF32 error against float64."""
TF32_ROUNDING = 2.0**-11
"""The floor of PyTorch's TF32 error (one TF32 rounding per operand): PyTorch may run a small conv in
full fp32 even with TF32 allowed, and then its error says nothing about TF32."""
LOW_FACTOR = 2.0
"""bf16 / fp16 kernels: at most this times PyTorch's own error in that dtype."""
LOW_ROUNDING = {torch.bfloat16: 2.0**-9, torch.float16: 2.0**-12}
"""The floor of PyTorch's error in a 16-bit dtype (half an ulp of the output's rounding)."""
DTYPE = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@contextlib.contextmanager
def tf32_allowed(allowed: bool) -> Iterator[None]:
    """PyTorch's cuDNN and matmul TF32 switches set to `allowed` inside, restored after."""
    saved = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = allowed
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def randomize(layer: torch.nn.Module, gen: torch.Generator) -> None:
    """Fresh parameters from `gen`: weights (dim > 1) scaled by 0.3, the rest N(0, 1); and the batch-norm
    statistics of a FusedLayer (variances in [0.5, 1.5))."""
    inits = layer.spec.param_inits() if hasattr(layer, "spec") else {}
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, device=p.device) * (0.3 if p.dim() > 1 else 1.0))
        for name, b in layer.named_buffers():
            if name in inits and "var" in name:
                b.copy_(torch.rand(b.shape, generator=gen, device=b.device) + 0.5)
            elif name in inits:
                b.copy_(torch.randn(b.shape, generator=gen, device=b.device))


def random_input(spec, batch: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn((batch, spec.input.channels, *spec.input.size), generator=gen, device="cuda")
    return x.to(DTYPE[spec.precision])


def allocated_by(call):
    """`call()`'s result, and the bytes it asked torch's caching allocator for at its peak beyond
    what was live before, as requested. (max_memory_allocated counts the cached block each request
    landed in, and a block is not split when less than 1 MB would remain: a 1.9 MB output reusing
    a free 2.5 MB block counted as 2.5 MB, which made an allocation test fail now and then.)"""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_stats()["requested_bytes.all.current"]
    result = call()
    torch.cuda.synchronize()
    return result, torch.cuda.memory_stats()["requested_bytes.all.peak"] - base


def poisoned(shape, dtype=torch.float32) -> torch.Tensor:
    """An output tensor full of NaN: what the kernel does not write stays NaN."""
    return torch.full(tuple(shape), float("nan"), device="cuda", dtype=dtype)


def tf32_rounded(t: torch.Tensor) -> torch.Tensor:
    """Float32 values rounded to TF32 (10 mantissa bits, to nearest)."""
    bits = t.detach().float().contiguous().view(torch.int32)
    return ((bits + 0x1000) & -8192).view(torch.float32)


def rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in float64 (want's norm floored at 1e-30)."""
    want = want.double()
    return ((got.double() - want).norm() / want.norm().clamp_min(1e-30)).item()


def assert_fp32(what: str, out: torch.Tensor, ref64: torch.Tensor, ref32: torch.Tensor) -> float:
    """The fp32 bars: finite (no unwritten NaN), rel. L2 to float64 <= 1e-5, allclose to PyTorch fp32.

    Where PyTorch's own fp32 result is already further than 1e-5 from float64 (an ill-conditioned
    draw: a norm over two nearly equal values, then a difference of what it normalized, loses
    digits in any fp32 arithmetic), the bar is 2x PyTorch fp32's error on those very inputs."""
    assert out.shape == ref64.shape, f"{what}: shape {tuple(out.shape)}, expected {tuple(ref64.shape)}"
    assert bool(torch.isfinite(out).all()), f"{what}: unwritten (NaN) or non-finite outputs"
    rel, torch_rel = rel_l2(out, ref64), rel_l2(ref32, ref64)
    bar = max(FP32_REL_L2, FP32_ILL_CONDITIONED_FACTOR * torch_rel)
    assert rel <= bar, f"{what}: rel L2 {rel:.3e} > {bar:.1e} against float64 (PyTorch fp32: {torch_rel:.3e})"
    close = torch.allclose(out, ref32, atol=FP32_ATOL, rtol=FP32_RTOL)
    assert close, f"{what}: not allclose to PyTorch fp32 (max abs diff {(out - ref32).abs().max().item():.3e})"
    return rel


def assert_tf32(what: str, out: torch.Tensor, ref64: torch.Tensor, ref_tf32: torch.Tensor,
                emulated: torch.Tensor | None = None) -> dict:
    """The tf32 bar: finite, rel. L2 to float64 within 2x PyTorch TF32's own, floored at TF32's
    rounding, or at the error of `emulated` (the conv's operands rounded to TF32, float64
    arithmetic: what TF32 costs on these very inputs, where cancellation makes it large)."""
    assert out.shape == ref64.shape, f"{what}: shape {tuple(out.shape)}, expected {tuple(ref64.shape)}"
    assert bool(torch.isfinite(out).all()), f"{what}: unwritten (NaN) or non-finite outputs"
    rel, torch_rel = rel_l2(out, ref64), rel_l2(ref_tf32, ref64)
    floor = TF32_ROUNDING if emulated is None else max(TF32_ROUNDING, rel_l2(emulated, ref64))
    bar = TF32_FACTOR * max(torch_rel, floor)
    assert rel <= bar, f"{what}: tf32 rel L2 {rel:.3e} > {bar:.3e} (PyTorch TF32: {torch_rel:.3e})"
    return {"rel_l2": rel, "torch_rel_l2": torch_rel}


def assert_low(what: str, out: torch.Tensor, ref64: torch.Tensor, ref_low: torch.Tensor) -> dict:
    """The bf16 / fp16 bar: finite, rel. L2 to float64 within 2x PyTorch's own in that dtype."""
    assert out.shape == ref64.shape, f"{what}: shape {tuple(out.shape)}, expected {tuple(ref64.shape)}"
    assert out.dtype == ref_low.dtype, f"{what}: a {out.dtype} output, expected {ref_low.dtype}"
    assert bool(torch.isfinite(out).all()), f"{what}: unwritten (NaN) or non-finite outputs"
    rel, torch_rel = rel_l2(out, ref64), rel_l2(ref_low, ref64)
    bar = LOW_FACTOR * max(torch_rel, LOW_ROUNDING[out.dtype])
    assert rel <= bar, f"{what}: {out.dtype} rel L2 {rel:.3e} > {bar:.3e} (PyTorch in {out.dtype}: {torch_rel:.3e})"
    return {"rel_l2": rel, "torch_rel_l2": torch_rel}


def extra_inputs(spec, batch: int, gen: torch.Generator) -> dict:
    """Fresh random extra inputs (spec.inputs()), each of its shape (the output's, or one value per
    sample and channel) and the layer's dtype."""
    return {name: torch.randn((batch, *shape), generator=gen, device="cuda").to(DTYPE[spec.precision])
            for name, shape in spec.inputs().items()}


def as_channels_last(t: torch.Tensor) -> torch.Tensor:
    """`t` (same values) with its channels innermost in memory: channels_last(_3d) for 4-D and
    5-D tensors; a 3-D [N, C, L] tensor laid out [N][L][C] (what the engines read as channels-last)."""
    return t.movedim(1, -1).contiguous().movedim(-1, 1) if t.dim() > 2 else t


def run(layer, batch: int, seed: int, channels_last: bool = False, extras: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Randomize `layer` and run it on a random input (and `extras`, its extra inputs by name) into
    a NaN-poisoned output: (input, output). `channels_last`: the input in channels-last memory
    order (same values)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    randomize(layer, gen)
    x = random_input(layer.spec, batch, gen)
    out = poisoned(layer.spec.output_shape(batch), DTYPE[layer.spec.precision])
    if channels_last:  # (the output too, where torch has the format: a layer with a channels-last kernel writes it)
        x = as_channels_last(x)
        if out.dim() > 3:
            out = as_channels_last(out)
    layer(x, *(extras or {}).values(), out=out)
    torch.cuda.synchronize()
    return x, out


def compare(layer, batch: int, seed: int, channels_last: bool = False) -> dict:
    """Run a FusedLayer on fresh random parameters and input; check it against the reference at its
    precision's bar (fp32: float64 and PyTorch fp32 with TF32 off; tf32: PyTorch's own TF32;
    bf16 / fp16: PyTorch's own in that dtype)."""
    spec = layer.spec
    extras = extra_inputs(spec, batch, torch.Generator(device="cuda").manual_seed(seed + 7919))
    if channels_last:  # extra inputs in the output's format, as a channels-last model hands them on
        extras = {name: as_channels_last(t) for name, t in extras.items()}
    x, out = run(layer, batch, seed, channels_last, extras)
    return check_output(layer, x, extras, out, f"{spec.name} at batch {batch}")


def compare_formats(layer) -> None:
    """`compare` at batch 1 and 3 in the given memory format and at batch 2 channels-last, each on
    fresh inputs and parameters."""
    compare(layer, 1, seed=1)
    compare(layer, 3, seed=2)
    compare(layer, 2, seed=3, channels_last=True)


def check_output(layer, x: torch.Tensor, extras: dict, out: torch.Tensor, what: str) -> dict:
    """`out`, the layer's output on `x` (and `extras`, its extra inputs by name), against the
    reference at its precision's bar (see `compare`)."""
    spec = layer.spec
    params = {**layer.spec_params(), **extras}
    with torch.no_grad():
        ref64 = reference.forward64(spec, x, layer.conv.weight, layer.conv.bias, params)
        if spec.precision == "fp32":
            with tf32_allowed(False):
                ref32 = reference.forward(spec, x, layer.conv.weight, layer.conv.bias, params)
            return {"rel_l2": assert_fp32(what, out, ref64, ref32)}
        if spec.precision in ("bf16", "fp16"):
            ref_low = reference.forward(spec, x, layer.conv.weight, layer.conv.bias, params)
            return assert_low(what, out, ref64, ref_low)
        with tf32_allowed(True):
            ref_tf32 = reference.forward(spec, x, layer.conv.weight, layer.conv.bias, params)
        emulated = reference.forward64(spec, tf32_rounded(x), tf32_rounded(layer.conv.weight), layer.conv.bias, params)
        return assert_tf32(what, out, ref64, ref_tf32, emulated)


def captured(layer, x: torch.Tensor, grad: bool = True):
    """`layer(x)` captured in a CUDA graph, its kernels loaded by a first call on a side stream
    outside the capture: (graph, the graph's output tensor). `grad=False` captures under no_grad."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        layer(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.set_grad_enabled(grad), torch.cuda.graph(graph):
        out = layer(x)
    return graph, out


def assert_repeatable_and_replayed(layer, x: torch.Tensor, gen: torch.Generator) -> None:
    """Two calls of `layer` on `x` agree bit for bit (a fixed order of sums: no atomics), and a CUDA
    graph of it replays with a fresh input in `x` to what an eager call gives."""
    with torch.no_grad():
        first, second = layer(x).clone(), layer(x).clone()
        torch.testing.assert_close(first, second, rtol=0, atol=0)
        graph, got = captured(layer, x, grad=False)
        x.copy_(torch.randn(x.shape, device=x.device, generator=gen))
        graph.replay()
        torch.cuda.synchronize()
        want = layer(x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not torch.equal(got, first)


def precision_params(cases: dict) -> list:
    """pytest params (name, precision) of `cases`, whose last field lists each case's precisions."""
    import pytest

    return [pytest.param(name, p, id=f"{name}-{p}") for name, case in sorted(cases.items()) for p in case[-1]]


def skip_unless_engine_runs(engine) -> None:
    """Skip the test where the GPU cannot run `engine` (the TMA engine needs an sm_90 GPU)."""
    import pytest

    if engine == "tma" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the TMA engine needs an sm_90 GPU")


def pinned_layer(name: str, cin: int, size, conv: dict, epilogue: list, engine, precision: str):
    """A CUDA FusedLayer of that geometry in `precision`, its engine pinned by a tile where it is
    "tma" or "igemm" (else the planner's), checked to plan for `engine` (None: any)."""
    from specgen import FusedLayer
    from specgen.spec import validate

    data = {"name": name, "input": {"channels": cin, "size": size}, "conv": conv, "epilogue": epilogue, "precision": precision}
    if engine in ("tma", "igemm"):
        data["tile"] = {"engine": engine}
    layer = FusedLayer(validate(data)).cuda()
    assert engine is None or layer.specialize().plan["engine"] == engine
    return layer


def assert_model_bar(got: torch.Tensor, ref64: torch.Tensor, ref: torch.Tensor, precision: str) -> None:
    """A whole model's output at its mode's bar: fp32 rel. L2 <= 1e-5 against float64 and allclose
    to PyTorch fp32; tf32 within 2x PyTorch's own TF32 error (`ref`: PyTorch in that mode)."""
    assert bool(torch.isfinite(got).all())
    if precision == "fp32":
        assert rel_l2(got, ref64) <= 1e-5
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    else:
        assert rel_l2(got, ref64) <= 2 * max(rel_l2(ref, ref64), 2.0**-11)
