"""Each specialized layer as a PyTorch custom op: `torch.ops.specgen.<spec name>_<key[:12]>`.

One op per cache key, registered once per process (by `FusedLayer` when it is built or
specialized). Its schema lists the tensors the layer reads, in a fixed order, and nothing else:

    specgen::kb90_1a2b3c4d5e6f(Tensor x, Tensor weight, Tensor bias, Tensor p_sum_tensor) -> Tensor

(`bias` only when the conv has one; one `p_<name>` per per-channel parameter, in `spec.params()`
order; then one `i_<name>` per extra input, in `spec.inputs()` order, of the output's shape or
one value per sample and channel).
The op mutates nothing and returns a fresh contiguous tensor of shape
`spec.output_shape(batch)`. A layer whose training-mode batch norms keep running statistics
returns `(Tensor, Tensor)`: the output and the batch statistics (`reference.forward_with_stats`),
from which the layer updates its running statistics outside the op (an op that mutated them
could not have an autograd formula).

- CUDA tensors: the specialized kernel, launched on torch's current stream (float32 only).
- Other devices: the PyTorch reference (`specgen.reference.forward`), any float dtype, so the op
  and everything built on it (opcheck, torch.compile, autograd) can be exercised without a GPU.
- Fake / meta tensors: the output's shape from the spec, x's dtype and device; no data touched.
- Autograd: the backward recomputes the layer with PyTorch ops (the reference) from the saved
  inputs and differentiates that; the forward stays one fused kernel. Nothing is saved under
  `no_grad` or `inference_mode`. Double backward is not supported (the recomputation is detached).

A process that never specializes a spec (no GPU) names the op after a hash of the spec and arch
instead of the cache key (which needs the CUDA toolchain); such an op specializes on first use
with CUDA tensors.
"""

from __future__ import annotations

import functools
import hashlib
import math
import threading
from dataclasses import dataclass

import torch

from specgen import pipeline, reference, runtime, splitk, tmarun
from specgen.spec import LayerSpec

NAMESPACE = "specgen"
LOWER_PRECISIONS = (torch.float16, torch.bfloat16)


@dataclass(frozen=True, eq=False)
class SpecOp:
    """A registered op and what it needs to know about its spec."""

    name: str  # the op's name inside the namespace: "<spec name>_<12 hex>"
    spec: LayerSpec
    arch: str | None
    has_bias: bool
    param_names: tuple[str, ...]  # spec.params() order: the schema's order
    in_shape: tuple[int, ...]  # (channels, *size), batch excluded
    arg_shapes: tuple[tuple[int, ...], ...]  # the shapes of the arguments after x
    out_tail: tuple[int, ...]  # the output shape after the batch
    specialized: pipeline.Specialized | None
    opdef: object  # torch.library.CustomOpDef
    stats_size: int = 0  # floats of batch statistics the op returns after the output (0: it returns the output only)
    input_names: tuple[str, ...] = ()  # extra inputs (spec.inputs() order), after the parameters, each [batch, *its shape]
    input_shapes: tuple[tuple[int, ...], ...] = ()  # their shapes per sample (spec.inputs() values)
    one_value_batch_norm: bool = False  # a batch-statistics batch norm sees one value per channel and sample

    @property
    def qualname(self) -> str:
        return f"{NAMESPACE}::{self.name}"

    @property
    def overload(self) -> torch._ops.OpOverload:
        """`torch.ops.specgen.<name>.default`: what FusedLayer calls (traceable by torch.compile)."""
        return getattr(getattr(torch.ops, NAMESPACE), self.name).default

    def __call__(self, x, weight, bias=None, params: dict | None = None) -> torch.Tensor:
        """The layer's output (an op that also returns batch statistics: its first result)."""
        result = self.overload(*self.arguments(x, weight, bias, params or {}))
        return result[0] if self.stats_size else result

    def arguments(self, x, weight, bias, params: dict) -> tuple:
        """The op's positional arguments from a layer's tensors (params by name)."""
        if self.has_bias != (bias is not None):
            raise ValueError(
                f"{self.spec.name}: the spec {'has' if self.has_bias else 'has no'} conv bias, "
                f"got bias={'a tensor' if bias is not None else None}"
            )
        missing = [n for n in self.param_names if n not in params]
        if missing:
            raise ValueError(f"{self.spec.name}: missing per-channel parameters {missing}")
        missing = [n for n in self.input_names if n not in params]
        if missing:
            raise ValueError(f"{self.spec.name}: missing extra inputs {missing}")
        names = (*self.param_names, *self.input_names)
        return (x, weight, *((bias,) if self.has_bias else ()), *(params[n] for n in names))

    def split(self, args) -> tuple:
        """(x, weight, bias or None, {name: tensor}) from the op's positional arguments (the extra
        inputs among the tensors by name, as the reference and the launch take them)."""
        x, weight, *rest = args
        bias = rest.pop(0) if self.has_bias else None
        return x, weight, bias, dict(zip((*self.param_names, *self.input_names), rest))


_ops: dict[str, SpecOp] = {}
_lock = threading.Lock()


def op_name(spec: LayerSpec, specialized: pipeline.Specialized | None = None, arch: str | None = None) -> str:
    if specialized is not None:
        label = specialized.key
    else:
        label = hashlib.sha256(f"{spec.canonical_json()}\n{arch}".encode()).hexdigest()
    return f"{spec.name}_{label[:12]}"


def register(spec: LayerSpec, specialized: pipeline.Specialized | None = None, arch: str | None = None) -> SpecOp:
    """The op of `spec` (of `specialized`'s cache key when given), registering it on first call."""
    name = op_name(spec, specialized, arch)
    hit = _ops.get(name)
    if hit is not None:
        return hit
    with _lock:
        hit = _ops.get(name)
        if hit is None:
            hit = _ops[name] = _define(name, spec, specialized, arch)
    return hit


def registered() -> dict[str, SpecOp]:
    """Every op this process has registered, by name."""
    return dict(_ops)


# ---------------------------------------------------------------------------------------------
# Definition
# ---------------------------------------------------------------------------------------------


def _define(name: str, spec: LayerSpec, specialized, arch) -> SpecOp:
    has_bias = spec.conv.bias
    param_names = tuple(spec.params())
    input_shapes = spec.inputs()
    input_names = tuple(input_shapes)
    arg_names = ["x", "weight", *(["bias"] if has_bias else []), *(f"p_{n}" for n in param_names),
                 *(f"i_{n}" for n in input_names)]
    stats_size = reference.stats_size(spec)
    schema = "(" + ", ".join(f"Tensor {a}" for a in arg_names) + ") -> " + ("(Tensor, Tensor)" if stats_size else "Tensor")
    box: dict[str, SpecOp] = {}

    def impl(*args):
        return _run(box["op"], args)

    impl.__name__ = name
    opdef = torch.library.custom_op(f"{NAMESPACE}::{name}", impl, mutates_args=(), schema=schema)

    def fake(*args):
        op = box["op"]
        x = args[0]
        _check_args(op, args)
        y = torch.empty((x.shape[0], *op.out_tail), dtype=x.dtype, device=x.device,
                        memory_format=_output_format(op, x))
        return (y, x.new_empty((op.stats_size,))) if op.stats_size else y

    def backward(ctx, grad, *stats_grad):  # the batch statistics are not differentiable
        return _backward(box["op"], ctx, grad)

    opdef.register_fake(fake)
    opdef.register_autograd(backward, setup_context=_setup_context)
    op = SpecOp(
        name=name,
        spec=spec,
        arch=arch,
        has_bias=has_bias,
        param_names=param_names,
        in_shape=(spec.input.channels, *spec.input.size),
        arg_shapes=_arg_shapes(spec),
        out_tail=tuple(spec.shapes()[-1].sizes),
        specialized=specialized,
        opdef=opdef,
        stats_size=stats_size,
        one_value_batch_norm=reference.one_value_batch_norm(spec),
        input_names=input_names,
        input_shapes=tuple(input_shapes.values()),
    )
    box["op"] = op
    return op


def _output_format(op: SpecOp, x: torch.Tensor) -> torch.memory_format:
    """The memory format of the op's output on `x` (real or fake): channels-last where a CUDA input
    arrives channels-last and the layer has a kernel that keeps the format (`kernel_for`)."""
    if x.device.type != "cuda" or x.is_contiguous() or not tmarun.channels_last(x):
        return torch.contiguous_format
    sp = op.specialized if op.specialized is not None else pipeline.specialize(op.spec, op.arch)
    return _writes_format(kernel_for(sp, x)) or torch.contiguous_format


def _arg_shapes(spec: LayerSpec) -> tuple[tuple[int, ...], ...]:
    cout = spec.conv.out_channels
    return (spec.weight_shape(), *([(cout,)] if spec.conv.bias else []), *spec.params().values())


def _check_args(op: SpecOp, args) -> None:
    """What the kernel needs, checked the same way on real and fake tensors."""
    x = args[0]
    label = op.spec.name
    precision = op.spec.precision
    want = PRECISION_DTYPE[precision]
    for t in args:
        if want == torch.float32 and t.dtype in LOWER_PRECISIONS:
            raise ValueError(
                f"{label}: a precision {precision} layer takes float32 tensors, got a {t.dtype} tensor "
                f"(a spec with precision bf16 or fp16 takes those)"
            )
        if t.device != x.device:
            raise ValueError(f"{label}: every tensor must be on {x.device}, got one on {t.device}")
    if x.device.type == "cuda" or want != torch.float32:
        for t in args:
            if t.dtype != want:
                raise ValueError(f"{label}: expected {want} tensors (precision {precision}), got {t.dtype}")
    if x.dim() != 1 + len(op.in_shape) or tuple(x.shape[1:]) != op.in_shape:
        raise ValueError(
            f"{label}: expected an input of shape [batch, {', '.join(map(str, op.in_shape))}], got {list(x.shape)}"
        )
    names = ("weight", *(("bias",) if op.has_bias else ()), *op.param_names)
    for name, t, want in zip(names, args[1:], op.arg_shapes):
        if tuple(t.shape) != want:
            raise ValueError(f"{label}: expected {name} of shape {list(want)}, got {list(t.shape)}")
    for name, shape, t in zip(op.input_names, op.input_shapes, args[1 + len(op.arg_shapes):]):
        want_input = (x.shape[0], *shape)
        if tuple(t.shape) != want_input:
            what = "the output's" if shape == op.out_tail else "one value per sample and channel"
            raise ValueError(f"{label}: expected the extra input {name} of shape {list(want_input)} ({what}), "
                             f"got {list(t.shape)}")
    if op.one_value_batch_norm and x.shape[0] == 1:
        reference.check_batch_stats_size(op.spec, 1)


def _reference(op: SpecOp, args) -> torch.Tensor:
    x, weight, bias, params = op.split(args)
    return reference.forward(op.spec, x, weight, bias, params)


def _run(op: SpecOp, args) -> torch.Tensor:
    _check_args(op, args)
    x = args[0]
    if x.device.type == "cuda":
        x, weight, bias, params = op.split(args)
        sp = op.specialized if op.specialized is not None else pipeline.specialize(op.spec, op.arch)
        if op.stats_size:
            stats = torch.empty(op.stats_size, device=x.device, dtype=torch.float32)
            return launch(sp, x, weight, bias, params, None, stats), stats
        return launch(sp, x, weight, bias, params, None)
    if op.stats_size:
        x, weight, bias, params = op.split(args)
        y, stats = reference.forward_with_stats(op.spec, x, weight, bias, params)
        return y.contiguous(), stats.contiguous()
    return _reference(op, args).contiguous()


# ---------------------------------------------------------------------------------------------
# Autograd: recompute with the reference, differentiate that
# ---------------------------------------------------------------------------------------------


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)
    if isinstance(output, tuple):  # (output, batch statistics): only the output has a gradient
        ctx.mark_non_differentiable(output[1])


def _in_shape(t: torch.Tensor, want: tuple) -> torch.Tensor:
    """`t` viewed in the op's argument shape `want` (a one-element tensor expanded to every channel)."""
    if tuple(t.shape) == want:
        return t
    if t.numel() == 1 and math.prod(want) != 1:
        return t.reshape((1,) * len(want)).expand(want)
    return t.reshape(want)


def in_op_shapes(op: SpecOp, args) -> list:
    """The op's positional arguments with each per-channel tensor viewed in the op's shape."""
    n = len(op.arg_shapes)
    return [args[0], *(_in_shape(t, want) for t, want in zip(args[1:], op.arg_shapes)), *args[1 + n:]]


def _backward(op: SpecOp, ctx, grad, needs=None, reshape: bool = False):
    """The gradients of the saved arguments: the reference recomputed on them and differentiated.
    `reshape`: the saved per-channel tensors are as the model holds them (C values in any shape),
    viewed in the op's shapes for the reference, so their gradients come back in their own."""
    saved = ctx.saved_tensors
    needs = ctx.needs_input_grad if needs is None else needs
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(bool(n)) for t, n in zip(saved, needs)]
        y = _reference(op, in_op_shapes(op, leaves) if reshape else leaves)
        wanted = [t for t, n in zip(leaves, needs) if n]
        got = iter(torch.autograd.grad(y, wanted, grad, allow_unused=True)) if wanted else iter(())
    return tuple(next(got) if n else None for n in needs)


class _Eager(torch.autograd.Function):
    """The op's autograd formula without the op's dispatch, for eager CUDA calls with autograd on
    (the dispatch of a Python custom op costs tens of microseconds of host time a call; under
    torch.compile the layer calls the op, which the compiler traces). The same launch forward and
    the same recomputing backward as the op: results are identical either way. Written with `ctx`
    in `forward`: a Function with a separate setup_context binds its arguments through
    inspect.signature on every call, several times the cost of the rest."""

    @staticmethod
    def forward(ctx, op: SpecOp, sp: pipeline.Specialized, *args):
        ctx.op = op
        ctx.save_for_backward(*args)
        return _launch_args(op, sp, args)

    @staticmethod
    def backward(ctx, grad):
        return (None, None, *_backward(ctx.op, ctx, grad, ctx.needs_input_grad[2:], reshape=True))


_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)
# Function.apply's own work past the checks above (torch.func's transforms, which go to the op
# instead): the autograd node, the forward, the outputs' grad_fn. Skipping its Python wrapper
# saves several microseconds a call.
_apply = super(torch.autograd.Function, _Eager).apply


def eager_autograd(op: SpecOp, sp: pipeline.Specialized, args: tuple) -> torch.Tensor:
    """The op on CUDA `args` (its positional arguments, checked by the caller as the raw launch
    needs) outside torch.compile: the kernel, recorded for autograd when any argument needs a
    gradient (under torch.func's transforms, the op itself). The per-channel tensors may be as the
    model holds them (C contiguous values, the raw launch's reading; a view in the op's shape per
    tensor and call costs microseconds); the backward views them in the op's shapes. Not for ops
    that return batch statistics."""
    if any(t.requires_grad for t in args):
        if _functorch_active():
            return op.overload(*in_op_shapes(op, args))
        return _apply(op, sp, *args)
    return _launch_args(op, sp, args)


def _launch_args(op: SpecOp, sp: pipeline.Specialized, args) -> torch.Tensor:
    """The kernel on the op's positional arguments, into a new output."""
    x, weight, bias, params = op.split(args)
    return launch(sp, x, weight, bias, params, None)


# ---------------------------------------------------------------------------------------------
# The kernel launch
# ---------------------------------------------------------------------------------------------

_cubins: dict[str, bytes] = {}


def cubin_bytes(sp: pipeline.Specialized) -> bytes:
    data = _cubins.get(sp.key)
    if data is None:
        from specgen import cache

        data = _cubins[sp.key] = cache.load_cubin_bytes(sp.build)
    return data


def load_kernel(sp: pipeline.Specialized, device_index: int):
    """The kernel loaded into a device (once per process and device; never call it mid-capture first)."""
    from specgen import runtime

    plan = sp.plan
    if plan["engine"] == "sequence":  # every kernel of the sequence
        from specgen import tailrun

        return tailrun.load(sp, device_index)
    cluster = (plan["cluster"], plan["r1_chunks"]) if plan["cluster_at_launch"] else None
    name = plan["kernel_name"]
    engine = plan[plan["engine"]] if plan["engine"] in ("tma", "igemm") else None
    split = splitk.kernel_names(name) if engine is not None and engine.split_k > 1 else ()
    extra = tmarun.extra_functions(plan) if plan["engine"] == "tma" else (*split, f"{name}_from_cl")
    # (the split kernel takes the main kernel's dynamic shared memory)
    mma = plan["mma"] if plan["engine"] == "slab" else None
    walk_blocks = plan["min_blocks"] * tmarun.sm_count(device_index) if mma is not None and mma.walk else 0
    return runtime.load(sp.key, cubin_bytes(sp), name, plan["threads"], plan["smem_bytes"], device_index, cluster,
                        extra, split[:1], walk_blocks)


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _current_stream(device_index: int) -> int:
    """The raw handle of torch's current stream on a device (the cheap accessor where it exists)."""
    if _raw_stream is not None:
        return _raw_stream(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream


@dataclass(frozen=True)
class _LaunchPlan:
    """What every launch of one kernel needs, computed once."""

    out_tail: tuple
    blocks_per_sample: int
    strides: tuple  # bytes each pointer argument advances per sample
    param_names: tuple
    has_bias: bool
    input_names: tuple = ()  # extra inputs: pointers after the parameters, advancing a sample's worth per sample
    # The implicit-GEMM engine: (positions per sample, block tile BM, blocks along N, the weight
    # layout (c_in, taps, padded c_in, padded taps), GEMMs); its grid is one flat axis over batch x
    # positions, times the blocks along N and the GEMMs (a transposed conv's stride phases).
    igemm: tuple | None = None
    tma: bool = False  # the TMA engine: launched by specgen.tmarun
    # The implicit GEMM's split kernel (`specgen.splitk`): (parts, K chunks, blocks per SM, C_OUT,
    # (split kernel, reduction)); None where the plan has none.
    igemm_split: tuple | None = None
    # The output (and each extra input) channels innermost: the TMA engine's plan for channels-last
    # inputs (`TmaPlan.channels_last_out`); the torch memory format it is allocated in, else None.
    memory_format: torch.memory_format | None = None
    # The kernel reads x and writes out in the layer's 16-bit dtype (the FFMA engine, plan io_ctype);
    # False: float32 tensors (a 16-bit layer's are widened around the launch).
    native_16: bool = False


_launch_plans: dict[str, _LaunchPlan] = {}


def igemm_uses_split(lp: _LaunchPlan, batch: int, sms: int) -> bool:
    """Whether an implicit-GEMM launch of `batch` samples runs the split kernel (`splitk.pays`)."""
    positions, bm, n_tiles, _, _ = lp.igemm
    parts, k_tiles, blocks_per_sm, cout, _ = lp.igemm_split
    return splitk.takes(batch, positions, bm, n_tiles, k_tiles, parts, cout, sms * blocks_per_sm)


def _launch_plan(sp: pipeline.Specialized) -> _LaunchPlan:
    lp = _launch_plans.get(sp.key)
    if lp is None:
        plan = sp.plan
        names = tuple(p["name"] for p in plan["params"])
        input_names = tuple(i["name"] for i in plan.get("inputs", ()))
        has_bias = sp.spec.conv.bias
        n_inputs = 2 + has_bias + len(names)
        native_16 = plan["io_ctype"] != "float"
        io_bytes = 2 if native_16 else 4
        out_stride = io_bytes * plan["out_per_sample"]
        input_strides = tuple(io_bytes * i["per_sample"] for i in plan.get("inputs", ()))  # (the output's, or C values)
        strides = (io_bytes * plan["in_per_sample"],) + (0,) * (n_inputs - 1) + input_strides + (out_stride,)
        blocks = plan["f_tiles"] if plan["cluster_at_launch"] else plan["blocks_per_sample"]  # see runtime.launch
        ig = plan.get("igemm")
        flat = None if ig is None else (ig.positions, ig.bm, ig.n_tiles, gemm_layout(plan), ig.grid_gemms)
        split = None
        if ig is not None and ig.split_k > 1:
            split = (ig.split_k, ig.k_tiles, plan["min_blocks"], ig.cout, splitk.kernel_names(plan["kernel_name"]))
        fmt = None
        if plan["engine"] == "tma" and plan["tma"].channels_last_out:
            fmt = tmarun.channels_last_format(1 + len(plan["out_shape"]))
        lp = _launch_plans[sp.key] = _LaunchPlan(tuple(plan["out_shape"]), blocks, strides, names, has_bias, igemm=flat,
                                                 tma=plan["engine"] == "tma", input_names=input_names, igemm_split=split,
                                                 memory_format=fmt, native_16=native_16)
    return lp


def gemm_layout(plan: dict) -> tuple:
    """How an implicit-GEMM plan's kernel reads its weights: (c_in, taps, padded c_in, padded taps);
    for a transposed conv ("phases", c_in, padded c_in, ((flat taps, padded count) per stride phase))."""
    ig = plan["igemm"]
    if ig.phases:
        return ("phases", plan["cin"], ig.cip, tuple((ph.tap_index, ph.taps_pad) for ph in ig.phases))
    return (plan["cin"], plan["taps"], ig.cip, ig.taps_pad)


def gemm_weight(weight: torch.Tensor, layout: tuple) -> torch.Tensor:
    """`weight` [C_OUT, C_IN, k...] as the implicit-GEMM kernel reads it: [C_OUT, TAPS_PAD, CIP]
    (tap-major K, zero padding); for a transposed conv ([C_IN, C_OUT, k...]), each stride phase's
    taps so, phase after phase. Kept per weight tensor and layout while the tensor is unchanged,
    remade under CUDA-graph capture (`tmarun.derived`)."""
    make = _phase_weights if layout[0] == "phases" else _permuted_weights
    return tmarun.derived(weight, ("gemm", layout), functools.partial(make, layout=layout))


def _plain_channel_axes(weight: torch.Tensor, groups: int) -> torch.Tensor:
    """A transposed conv's weight [C_in, C_out / groups, k...] with its channel axes swapped within
    each group, as a plain conv holds them: [C_out, C_in / groups, k...]."""
    cin, cout_g, *kernel = weight.shape
    w = weight.reshape(groups, cin // groups, cout_g, *kernel).transpose(1, 2)
    return w.reshape(groups * cout_g, cin // groups, *kernel)


_matrices: dict[tuple, torch.Tensor] = {}


def _tap_matrix(rows: tuple, like: torch.Tensor) -> torch.Tensor:
    """The float64 matrix `rows` (a tuple of tuples) on `like`'s device, kept per device: it depends
    on the plan only. Under CUDA-graph capture, where a host-to-device copy is not allowed, a
    matrix not yet kept is built on the device by fills (the graph owns it then)."""
    key = (rows, like.device)
    hit = _matrices.get(key)
    if hit is not None:
        return hit
    if tmarun.capturing(like):
        m = torch.zeros(len(rows), len(rows[0]), dtype=torch.float64, device=like.device)
        for j, row in enumerate(rows):
            for k, v in enumerate(row):
                if v:
                    m[j, k] = v
        return m
    m = _matrices[key] = torch.tensor(rows, dtype=torch.float64).to(like.device)
    return m


def _combined_taps(w: torch.Tensor, r: int, rows: tuple) -> torch.Tensor:
    """`w` [C_out, C_in / groups, k...] (float64) with spatial dim r's taps replaced by their
    combinations: new tap j = sum over k of rows[j][k] * w[..., k, ...]."""
    return torch.tensordot(w, _tap_matrix(rows, w), dims=([2 + r], [1])).movedim(-1, 2 + r)


def forward_weight(weight: torch.Tensor, groups: int) -> torch.Tensor:
    """A transposed conv's weight [C_in, C_out / groups, k...] as the plain conv it equals at
    stride 1 reads it: [C_out, C_in / groups, k...], channel axes swapped within each group and
    the taps reversed along every spatial dim."""
    w = _plain_channel_axes(weight, groups)
    return w.flip(list(range(2, w.dim()))).contiguous()


def tap_fold_weight(weight: torch.Tensor, reduced: list, positions: int, transposed: bool, sets: list) -> torch.Tensor:
    """The folded conv's weight (specgen.tapsum): along each reduced dim the weights of the taps that
    read the same input set added up (`sets[i][k]`: the set tap k of reduced dim i reads, -1 none),
    the sets moved to the first reduced dim in row-major order, where the tap sums hold them (the
    other reduced dims 1), and all divided by the positions averaged: in double, rounded once. A
    transposed conv's weight [C_in, C_out, k...] (one group) reads as [C_out, C_in, k...]."""
    w = (_plain_channel_axes(weight, 1) if transposed else weight).double()
    for r, of_tap in zip(reduced, sets):
        member = tuple(tuple(1.0 if of == j else 0.0 for of in of_tap) for j in range(max(of_tap) + 1))
        w = _combined_taps(w, r, member)
    cout, cin_g, *kernel = w.shape
    r0 = reduced[0]
    order = [*range(r0), *reduced, *[j for j in range(r0 + 1, len(kernel)) if j not in reduced]]
    folded = [1 if j in reduced else k for j, k in enumerate(kernel)]
    folded[r0] = math.prod(kernel[r] for r in reduced)
    w = w.permute(0, 1, *[2 + j for j in order]).reshape(cout, cin_g, *folded)
    return (w / positions).to(weight.dtype).contiguous()


def pool_fold_weight(weight: torch.Tensor, groups: int, dims: list) -> torch.Tensor:
    """The plain conv a strided transposed conv and the avg pool after it make (specgen.poolfold):
    the weight [C_in, C_out / groups, k...] read as [C_out, C_in / groups, k...] (channel axes
    swapped per group), then along each dim its plain tap j' = the sum over (count, k) in
    dims[r]["taps"][j'] of count * w[k], / the window; in double, rounded once."""
    w = _plain_channel_axes(weight.double(), groups)
    for r, d in enumerate(dims):
        a = [[0.0] * w.shape[2 + r] for _ in range(d["kernel"])]
        for j, pairs in enumerate(d["taps"]):
            for count, k in pairs:
                a[j][k] += count / d["window"]
        w = _combined_taps(w, r, tuple(map(tuple, a)))
    return w.to(weight.dtype).contiguous()


def box_fold_weight(weight: torch.Tensor, taps: int) -> torch.Tensor:
    """The 1x1 conv over the box means (specgen.boxfold): [C_OUT, C_IN / groups, k...] read as
    [C_OUT, C_IN / groups * taps, 1...], each input channel's taps in order (a view of the weights)."""
    return weight.reshape(weight.shape[0], weight.shape[1] * taps, *([1] * (weight.dim() - 2))).contiguous()


def transformed_weight(weight: torch.Tensor, transform: dict) -> torch.Tensor:
    """One of a plan's `weight_transforms` applied to the conv weight it receives."""
    if transform["kind"] == "transposed_to_plain":  # a stride-1 transposed conv planned as a plain conv
        return forward_weight(weight, transform["groups"])
    if transform["kind"] == "tap_fold":  # a mean over whole dims taken before the conv
        return tap_fold_weight(weight, transform["reduced"], transform["positions"], transform["transposed"], transform["sets"])
    if transform["kind"] == "box_fold":  # an avg pool taken before the conv's taps: a 1x1 conv over the box means
        return box_fold_weight(weight, transform["taps"])
    if transform["kind"] == "transposed_pool_fold":  # an avg pool after a strided transposed conv
        return pool_fold_weight(weight, transform["groups"], transform["dims"])
    if transform["kind"] == "upsample_fold":  # a conv over an upsampled input, as the transposed conv it equals
        return upsample_weight(weight, transform["groups"], transform["taps"])
    if transform["kind"] == "taps_major":  # a depthwise conv's [C, 1, k...] as [taps][C] (specgen.dwcl's kernel)
        return weight.reshape(transform["channels"], transform["taps"]).t().contiguous()
    raise ValueError(f"unknown weight transform {transform['kind']!r}")


def upsample_weight(weight: torch.Tensor, groups: int, taps: list) -> torch.Tensor:
    """A conv's weight [C_out, C_in / groups, k...] as the weight of the transposed conv it equals
    over the input before upsampling (`specgen.upsample`): tap j of each dim sums the conv taps
    `taps[dim][j]`, and the channel axes swap per group, to [C_in, C_out / groups, k'...]. Summed
    in double, rounded once."""
    w = weight.double()
    for dim, dim_taps in enumerate(taps):
        axis = 2 + dim
        m = torch.zeros(len(dim_taps), w.shape[axis], dtype=w.dtype, device=w.device)
        for j, ks in enumerate(dim_taps):
            m[j, list(ks)] = 1.0
        w = torch.movedim(torch.tensordot(w, m, dims=([axis], [1])), -1, axis)
    cout, cin_g = w.shape[:2]
    w = w.reshape(groups, cout // groups, cin_g, *w.shape[2:]).transpose(1, 2)  # [g, C_in/g, C_out/g, k'...]
    return w.reshape(groups * cin_g, cout // groups, *w.shape[3:]).to(weight.dtype).contiguous()


_transforms: dict[str, tuple] = {}


def _weight_transforms(sp: pipeline.Specialized) -> tuple:
    """The plan's weight transforms as (cache key, function) pairs, made once per layer: the key is
    the whole transform (one weight may serve layers of other sizes, folded otherwise)."""
    steps = _transforms.get(sp.key)
    if steps is None:
        steps = _transforms[sp.key] = tuple(
            (repr(sorted(t.items())), functools.partial(transformed_weight, transform=t))
            for t in sp.plan.get("weight_transforms", ()))
    return steps


def _permuted_weights(weight: torch.Tensor, layout: tuple) -> torch.Tensor:
    cin, taps, cip, taps_pad = layout
    w = weight.reshape(weight.shape[0], cin, taps).transpose(1, 2)
    if cip != cin or taps_pad != taps:
        w = torch.nn.functional.pad(w, (0, cip - cin, 0, taps_pad - taps))
    return w.contiguous()


def _phase_weights(weight: torch.Tensor, layout: tuple) -> torch.Tensor:
    """[C_IN, C_OUT, k...] -> per phase [C_OUT][its padded taps][CIP], the phases one after another."""
    _, cin, cip, phases = layout
    w = weight.reshape(cin, weight.shape[1], -1)
    parts = []
    for tap_index, taps_pad in phases:
        if not tap_index:
            continue  # a phase no tap reaches has no weights
        p = w[:, :, list(tap_index)].permute(1, 2, 0)  # [C_OUT, taps, C_IN]
        p = torch.nn.functional.pad(p, (0, cip - cin, 0, taps_pad - len(tap_index)))
        parts.append(p.reshape(-1))
    return torch.cat(parts).contiguous()


def _aligned(t: torch.Tensor, memory_format: torch.memory_format | None = None) -> torch.Tensor:
    # Contiguous (in `memory_format` where given), and 16-byte aligned: kernels read input rows and
    # write outputs in vectors (a contiguous view with a storage offset, such as x[1:], may start anywhere).
    fmt = memory_format or torch.contiguous_format
    if t.is_contiguous(memory_format=fmt) and t.data_ptr() % 16 == 0:
        return t
    return t.clone(memory_format=fmt)


def reads_channels_last_in_place(sp: pipeline.Specialized) -> bool:
    """Whether `sp`'s layer reads a channels-last input where it lies: the kernel such an input
    takes (`kernel_for`) is the TMA engine's, with one operand plane (not fp32 mode's two), no
    channels to pad and its A tiles not read from NC(D)HW in place (`tmarun.launch`'s "in_place"
    mode). Elsewhere a channels-last input costs a layout pass, which a contiguous one may not."""
    variant = pipeline.channels_last_variant(sp) or sp
    if variant.plan["engine"] != "tma":
        return False
    tp = variant.plan["tma"]
    return not tp.a_in_place and not tp.split and tp.cip == variant.spec.input.channels


def _writes_format(sp: pipeline.Specialized) -> torch.memory_format | None:
    """The channels-last memory format `sp`'s kernel writes its output in, or None (NC(D)HW)."""
    if sp.plan["engine"] == "sequence":
        return tmarun.channels_last_format(1 + len(sp.plan.out_shape)) if sp.plan.channels_last_io else None
    return _launch_plan(sp).memory_format


def kernel_for(sp: pipeline.Specialized, x: torch.Tensor, out: torch.Tensor | None = None) -> pipeline.Specialized:
    """The kernel that runs `sp`'s layer on `x`: a channels-last input takes the layer's channels-last
    kernel where it has one (`pipeline.channels_last_variant`: the TMA engine reading it in place,
    not a copy into NC(D)HW for the contiguous plan's engine, and writing a channels-last output, as
    PyTorch's conv does), unless the caller's `out` is contiguous. The same answer for real and fake
    tensors (the fake kernel gives the output's strides from it). A real CUDA input read as
    NC(D)HW whose batch bucket `specgen tune` gave a tile of its own takes that bucket's kernel,
    and a small batch on a TMA-planned layer the implicit GEMM's (`pipeline.batch_variant`: both
    write NC(D)HW as the layer's kernel does, so the same output strides)."""
    if x.is_contiguous() or not tmarun.channels_last(x) or (out is not None and out.is_contiguous()):
        if sp.follows_tuning and type(x) is torch.Tensor and x.is_cuda:  # (a dict lookup after a bucket's first call)
            return pipeline.batch_variant(sp, x.shape[0])
        return sp
    # (`channels_last_variant` keeps its answer per layer: after the first call, a dict lookup)
    variant = pipeline.channels_last_variant(sp)
    if variant is None:
        return sp
    if out is not None and not out.is_contiguous(memory_format=_writes_format(variant) or torch.contiguous_format):
        return sp
    return variant


PRECISION_DTYPE = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def launch(sp: pipeline.Specialized, x: torch.Tensor, weight, bias, params: dict, out: torch.Tensor | None,
           stats: torch.Tensor | None = None, record: list | None = None):
    """Run the kernel on CUDA `x` (the layer's dtype) into `out` (allocated when None), on the current stream.
    A layer with statistic stages runs its sequence of kernels (specgen.tailrun); `stats` receives
    the batch statistics of its training-mode batch norms. `record`: where the call can be repeated
    as it is (one plain launch of the FFMA, slab or implicit-GEMM engine on a contiguous input; the
    TMA engine's launches on an input it reads without a copy first), a `FastLaunch` of it is
    appended, for the caller to repeat."""
    # (a TMA- or FFMA-planned layer's call is planned under its small-batch rule as it stands: its
    # kept launch is repeated only while the rule stays as it was, `FastLaunch.small_batch`)
    engine = sp.plan["engine"]
    rule = ((engine, pipeline.small_batch_state(engine)),) if record is not None and engine in ("tma", "ffma") else None
    sp = kernel_for(sp, x, out)
    if out is not None and not out.is_contiguous() and _writes_format(sp) is None and tmarun.channels_last(out):
        # A channels-last `out` for a kernel that writes NC(D)HW (the layer has no channels-last
        # kernel): computed apart, then copied in.
        return out.copy_(launch(sp, x, weight, bias, params, None, stats))
    # Every engine reads a parameter as C contiguous values and an extra input in the output's
    # layout: a view that is not (a scalar tensor expanded to every channel) is copied here, once,
    # and the copy lives until the kernels are queued.
    fmt = _writes_format(sp)
    # (a sequence that writes channels-last, specgen.dwcl's kernel, takes no extra inputs)
    inputs = () if fmt is None or sp.plan["engine"] == "sequence" else _launch_plan(sp).input_names
    params = {name: _aligned(t, fmt if name in inputs else None) for name, t in params.items()}
    for key, make in _weight_transforms(sp):  # the plan's rewrites of the conv, in order (kept per weight version)
        weight = tmarun.derived(weight, key, make)
    if sp.plan["engine"] == "sequence":
        from specgen import tailrun

        return tailrun.launch(sp, x, weight, bias, params, out, stats, record)
    lp = _launch_plan(sp)
    batch = x.shape[0]
    shape = (batch, *lp.out_tail)
    dtype = PRECISION_DTYPE[sp.spec.precision]
    fmt = lp.memory_format or torch.contiguous_format
    if out is None:
        out = torch.empty(shape, device=x.device, dtype=dtype, memory_format=fmt)
    elif tuple(out.shape) != shape or out.dtype != dtype or out.device != x.device or not out.is_contiguous(memory_format=fmt):
        raise ValueError(
            f"{sp.spec.name}: out must be a {dtype} tensor of shape {list(shape)} on {x.device}, contiguous or "
            f"channels-last (as the input), got {out.dtype} {list(out.shape)} on {out.device}"
        )
    if batch == 0:
        return out
    if out.data_ptr() % 16:
        raise ValueError(f"{sp.spec.name}: out must start at a 16-byte aligned address (got a view with an offset)")
    device_index = x.get_device()  # a CUDA tensor's device index, without building a torch.device
    kernel = runtime.lookup(sp.key, device_index) or load_kernel(sp, device_index)
    stream = _current_stream(device_index)
    if lp.tma:
        recorded = None if record is None else []
        tmarun.launch(sp, kernel, x, weight, bias, params, out, stream, recorded)
        if recorded:  # x read as it is: the call's launches are kept, for the caller to repeat
            launches, held = recorded[0]
            n = len(lp.input_names)
            record.append(FastLaunch(_TmaReplay(launches, n, x.device), held, x.shape, out.shape, out.dtype, device_index,
                                     tuple(range(1, 1 + n)), 1 + n, _strides(x), _strides(out), rule))
        return out
    if not x.is_contiguous() and tmarun.channels_last(x):
        x = _from_channels_last(sp, kernel, x, stream, dtype if lp.native_16 else torch.float32)
        record = None
    if dtype == torch.float32:
        return _launch_fp32(sp, lp, kernel, x, weight, bias, params, out, batch, stream, record, rule)
    # A 16-bit layer: its weights, bias and parameters as float32 (widened once per tensor version).
    wide = tmarun.as_float32
    weight, bias = wide(weight), None if bias is None else wide(bias)
    if lp.native_16:
        # x and out in the layer's dtype, read and written by the kernel itself.
        return _launch_fp32(sp, lp, kernel, x, weight, bias, {k: wide(v) for k, v in params.items()}, out, batch, stream,
                            record)
    # An engine without a 16-bit path: fp32 arithmetic on the (exactly) widened tensors, the output
    # rounded to the layer's dtype once.
    # (an extra input is new on every call: widened afresh, never cached)
    # (one pass from any memory format to contiguous float32: a channels-last x is not widened, then copied)
    y = _launch_fp32(sp, lp, kernel, x.to(torch.float32, memory_format=torch.contiguous_format), weight, bias,
                     {k: v.float() if k in lp.input_names else wide(v) for k, v in params.items()}, None, batch, stream)
    out.copy_(y)
    return out


_FROM_CL_THREADS = 256  # templates/from_cl.cu.j2: a 32 x 32 tile per block of 32 x 8 threads,
_FROM_CL_SMEM = 32 * 33 * 4  # ... through a [32][33] float tile of dynamic shared memory


def _from_channels_last(sp: pipeline.Specialized, kernel, x: torch.Tensor, stream: int, dtype: torch.dtype) -> torch.Tensor:
    """A channels-last input as the NC(D)HW tensor the engines other than TMA read (`dtype`: float32,
    or the layer's 16-bit dtype where the kernel reads it), by the module's own layout pass
    (`<kernel>_from_cl`: tiled through shared memory, widening a 16-bit input to float32 on the
    way), where torch's copy would be one strided pass."""
    fn = f"{sp.plan['kernel_name']}_from_cl"
    batch, cin = x.shape[0], x.shape[1]
    positions = math.prod(x.shape[2:])
    wide = torch.empty(x.shape, device=x.device, dtype=dtype)
    pack = runtime.arg_pack((kernel.function.value, fn), ("ptr", "ptr", "int"))
    pack.set([x.data_ptr(), wide.data_ptr(), batch])
    blocks = batch * -(-positions // 32) * -(-cin // 32)
    runtime.launch_packed(kernel, kernel.extra[fn], blocks, _FROM_CL_THREADS, _FROM_CL_SMEM, pack, stream)
    return wide


def _launch_fp32(sp, lp, kernel, x, weight, bias, params, out, batch, stream, record=None, rule=None):
    if out is None:
        out = torch.empty((batch, *lp.out_tail), device=x.device, dtype=torch.float32)
    if lp.igemm is not None:
        weight = gemm_weight(weight, lp.igemm[3])
    # (aligned copies held here until the launch is queued: a copy dropped after taking its pointer
    # could hand its memory to the next copy; `launch` aligned the parameters and inputs already)
    x, weight = _aligned(x), _aligned(weight)
    pointers = [x.data_ptr(), weight.data_ptr()]
    if lp.has_bias:
        bias = _aligned(bias)
        pointers.append(bias.data_ptr())
    pointers.extend(params[name].data_ptr() for name in (*lp.param_names, *lp.input_names))
    pointers.append(out.data_ptr())
    if lp.igemm is not None:
        positions, bm, n_tiles, _, gemms = lp.igemm
        if lp.igemm_split is not None and igemm_uses_split(lp, batch, tmarun.sm_count(x.get_device())):
            parts, _, _, cout, (split, reduce) = lp.igemm_split
            m_total = batch * positions
            split_grid = (-(-m_total // bm) * n_tiles, parts)
            reduce_grid = -(-m_total * cout // splitk.REDUCE_THREADS)
            if record is not None:  # the two launches kept, with their partial sums per stream
                replay = _SplitReplay(
                    runtime.Prepared(kernel, *split_grid, [pointers[0], pointers[1], 0], batch, kernel.extra[split]),
                    runtime.Prepared(kernel, reduce_grid, 1, [0, *pointers[2:]], batch, kernel.extra[reduce],
                                     splitk.REDUCE_THREADS, 0),
                    pointers, parts * cout * m_total, x.device)
                replay.launch(stream)
                held = (weight, bias, *(params[name] for name in lp.param_names))
                first_input = 2 + lp.has_bias + len(lp.param_names)
                record.append(FastLaunch(replay, held, x.shape, out.shape, out.dtype, x.get_device(),
                                         tuple(range(first_input, first_input + len(lp.input_names))),
                                         len(pointers) - 1, small_batch=rule))
                return out
            partial = torch.empty(parts * cout * m_total, device=x.device, dtype=torch.float32)
            runtime.launch_function(kernel, kernel.extra[split], *split_grid, kernel.threads,
                                    kernel.smem_bytes, [pointers[0], pointers[1], partial.data_ptr()], batch, stream)
            runtime.launch_function(kernel, kernel.extra[reduce], reduce_grid, 1,
                                    splitk.REDUCE_THREADS, 0, [partial.data_ptr(), *pointers[2:]], batch, stream)
            return out
        # (a transposed conv's stride phases are blocks of their own along x, beside each M tile's N tiles)
        prepared = None if record is None else runtime.prepare_flat(kernel, positions, bm, n_tiles * gemms, pointers, batch)
        if prepared is None:
            runtime.launch_flat(kernel, positions, bm, n_tiles * gemms, pointers, lp.strides, batch, stream)
    else:
        prepared = None if record is None else runtime.prepare(kernel, lp.blocks_per_sample, pointers, batch)
        if prepared is None:
            runtime.launch(kernel, lp.blocks_per_sample, pointers, lp.strides, batch, stream)
    if prepared is not None:  # one plain launch: run it as kept, and keep it
        prepared.launch(stream)
        held = (weight, bias, *(params[name] for name in lp.param_names))  # the tensors behind the fixed pointers
        first_input = 2 + lp.has_bias + len(lp.param_names)  # pointers: x, weight, [bias], parameters, inputs, out
        record.append(FastLaunch(prepared, held, x.shape, out.shape, out.dtype, x.get_device(),
                                 tuple(range(first_input, first_input + len(lp.input_names))), len(pointers) - 1,
                                 small_batch=rule))
    return out


def _strides(t: torch.Tensor) -> tuple | None:
    """`t`'s strides where it is not contiguous (None where it is)."""
    return None if t.is_contiguous() else t.stride()


# A recorded TMA launch keeps its workspace (the layout pass's planes, the split's partial sums)
# from call to call where it is at most this many bytes: one allocation fewer per call (about 3 us
# of a batch-1 call's host time), and the input maps over the planes made once. Larger ones (large
# batches, whose calls are not host-bound) come from torch's allocator per call.
KEPT_WORKSPACE_BYTES = 8 << 20


def kept_workspaces(nbytes: int) -> dict | None:
    """Where a recorded launch keeps a workspace of `nbytes` bytes, by stream (`workspace`): a dict,
    or None where it is over KEPT_WORKSPACE_BYTES (made per call)."""
    return {} if nbytes <= KEPT_WORKSPACE_BYTES else None


def workspace(kept: dict | None, stream: int, make):
    """A recorded launch's workspace on `stream`: the one `kept` holds for it (`tmarun.per_stream`),
    or, where `kept` is None, a new one from `make()`, which the caller holds until its launches
    are queued."""
    return make() if kept is None else tmarun.per_stream(kept, stream, make)


class _TmaReplay:
    """A TMA layer's recorded launches (`tmarun.Launches`) as `FastLaunch` repeats them: the
    addresses in `values` are the input's, the extra inputs' and the output's. Its workspace is
    kept per stream (`tmarun.per_stream`)."""

    __slots__ = ("launches", "values", "device", "workspaces")

    def __init__(self, launches: tmarun.Launches, n_inputs: int, device: torch.device):
        self.launches, self.device = launches, device
        self.values = [0] * (n_inputs + 2)
        self.workspaces = kept_workspaces(launches.ws_bytes) if launches.ws_bytes else None

    def launch(self, stream: int) -> None:
        values = self.values
        ws = workspace(self.workspaces, stream, self._workspace) if self.launches.ws_bytes else None
        self.launches.run(values[0], values[1:-1], values[-1], stream, self.device, ws)

    def _workspace(self) -> torch.Tensor:
        return torch.empty(self.launches.ws_bytes, dtype=torch.uint8, device=self.device)


class _SplitReplay:
    """The implicit GEMM's split-K call (its split kernel over (tiles, parts), then the reduction
    adding the parts up in a fixed order and running the epilogue) as `FastLaunch` repeats it:
    `values` holds the layer's pointer arguments (x, weight, [bias], parameters, extra inputs, out),
    handed to the two launches; the partial sums are kept per stream (`tmarun.per_stream`) where
    they are at most `KEPT_WORKSPACE_BYTES`, else allocated per call."""

    __slots__ = ("split", "reduce", "values", "floats", "device", "workspaces")

    def __init__(self, split: runtime.Prepared, reduce: runtime.Prepared, pointers: list, floats: int,
                 device: torch.device):
        self.split, self.reduce, self.floats, self.device = split, reduce, floats, device
        self.values = list(pointers)
        self.workspaces = kept_workspaces(floats * 4)

    def launch(self, stream: int) -> None:
        values = self.values
        partial = workspace(self.workspaces, stream, self._workspace)  # (held until both launches are queued)
        address = partial.data_ptr()
        split, reduce = self.split.values, self.reduce.values
        split[0], split[2] = values[0], address
        reduce[0] = address
        reduce[1:] = values[2:]  # bias, parameters, extra inputs, out
        self.split.launch(stream)
        self.reduce.launch(stream)

    def _workspace(self) -> torch.Tensor:
        return torch.empty(self.floats, dtype=torch.float32, device=self.device)


def _no_fast_launch() -> None:
    return None


class FastLaunch:
    """One layer's plain launch for one input shape and layout, from a first call through `launch`:
    kernel, grid and every argument but the addresses of x, the extra inputs and the output fixed
    (`runtime.Prepared`; the TMA engine's launches, `_TmaReplay`). `run` repeats it for a call
    like the first and answers None for any other, which then takes the full path. About a third
    of `launch`'s host time: a layer at batch 1 is bound by it. `sources`, set by the caller
    (`bind`): the layer's own tensors the fixed pointers come from, checked on every call to be
    the same objects, unchanged (version counter) and at the same address. `in_strides` /
    `out_strides`: x's and the output's strides, None for contiguous (the extra inputs are laid
    out as the output). `small_batch`: for a layer the planner put on the TMA or FFMA engine (or a
    sequence with such parts), (engine, its small-batch switch when the call was planned:
    `pipeline.small_batch_state`) pairs, which pick the kernels a small batch runs: a repeat needs
    them unchanged; None for other layers."""

    __slots__ = ("prepared", "held", "in_shape", "out_shape", "dtype", "device_index", "input_slots",
                 "out_slot", "thread", "sources", "in_strides", "out_strides", "small_batch")

    def __init__(self, prepared: runtime.Prepared, held: tuple, in_shape: torch.Size, out_shape: torch.Size,
                 dtype: torch.dtype, device_index: int, input_slots: tuple, out_slot: int,
                 in_strides: tuple | None = None, out_strides: tuple | None = None, small_batch: tuple | None = None):
        self.small_batch = small_batch
        self.prepared, self.held = prepared, held
        self.in_shape, self.out_shape, self.dtype, self.device_index = in_shape, out_shape, dtype, device_index
        self.input_slots, self.out_slot = input_slots, out_slot
        self.in_strides, self.out_strides = in_strides, out_strides
        self.thread = threading.get_ident()  # the argument array is this thread's
        self.sources: tuple = ()

    def __reduce__(self):
        # A copy of the layer (deepcopy, pickle) starts without one: this one holds this process's
        # addresses and the original layer's tensors.
        return (_no_fast_launch, ())

    def bind(self, sources) -> "FastLaunch":
        """`sources`: (container, name, tensor) per tensor of the layer the fixed pointers come from
        (a module's `_parameters` or `_buffers` dict, the name in it, the tensor found there)."""
        self.sources = tuple((c, name, t, *tmarun.state(t)) for c, name, t in sources)
        return self

    def run(self, x: torch.Tensor, inputs: tuple) -> torch.Tensor | None:
        """The layer on `x` (and its extra inputs) by the recorded launch; None where the call is
        not like the recorded one."""
        if (
            type(x) is not torch.Tensor
            or x.dtype != self.dtype
            or x.shape != self.in_shape
            or x.get_device() != self.device_index
            or (not x.is_contiguous() if self.in_strides is None else x.stride() != self.in_strides)
            or x.data_ptr() % 16
            or len(inputs) != len(self.input_slots)
            or threading.get_ident() != self.thread
            or tmarun.capturing(x)  # a capture remakes the derived weights inside the graph
            or (self.small_batch is not None
                and any(pipeline.small_batch_state(engine) != state for engine, state in self.small_batch))
        ):
            return None
        for container, name, t, version, ptr in self.sources:  # (tmarun.state, inlined: every call runs this)
            if container.get(name) is not t or t._version != version or t.data_ptr() != ptr:
                return None
        values = self.prepared.values
        strides = self.out_strides
        for slot, t in zip(self.input_slots, inputs):
            if (type(t) is not torch.Tensor or t.dtype != self.dtype or t.shape != self.out_shape
                    or t.get_device() != self.device_index or t.data_ptr() % 16
                    or (not t.is_contiguous() if strides is None else t.stride() != strides)):
                return None
            values[slot] = t.data_ptr()
        out = x.new_empty(self.out_shape) if strides is None else x.new_empty_strided(self.out_shape, strides)
        values[0] = x.data_ptr()
        values[self.out_slot] = out.data_ptr()
        self.prepared.launch(_current_stream(self.device_index))
        return out
