"""Running a layer that is a sequence of kernels (specgen/tail.py): its workspaces, then its steps.

Every workspace comes from torch's caching allocator on the current stream (so a CUDA-graph
capture takes them from the graph's pool), and every kernel runs on that stream in the plan's
order: the body into T0 through the ordinary launch path (`torchop.launch`), then each tail
kernel, and each rest over an identity conv (weights 1) through the ordinary path again. A layer
whose reduction folds before the conv (specgen.tapsum) first runs its tap-sum kernel into S, which
the body reads. One
cubin holds every kernel; each is loaded once per device.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import torch

from specgen import pipeline, runtime, tmarun, torchop
from specgen.kernelplan import KernelStep, LayerStep, SequencePlan


@dataclass(frozen=True)
class Part(pipeline.Specialized):
    """A body-engine part of a sequence (the body or a rest): its own spec and plan, the sequence's
    build. Its key names the part, so its launch plan and loaded kernel are its own."""

    part: str = ""

    @property
    def key(self) -> str:
        return f"{self.build.key}:{self.part}"


@dataclass(frozen=True)
class _Layer:
    """A body or rest step: `part` reads buffer `src` (viewed [batch, *in_shape]) and writes `dst`."""

    part: Part
    body: bool
    src: str
    dst: str
    in_shape: tuple
    out_shape: tuple
    ones: int  # a rest's identity conv: its channels (0 for the body)


@dataclass(frozen=True)
class _Kernel:
    """A tail kernel step: its loaded-kernel key, its arguments, each (source, name): source "p" a
    parameter, "i" an extra input, "b" a buffer, "w" the conv's weights (as the plan's weight
    transforms left them: [taps][C] for specgen.dwcl), "bias" its bias, and the bytes each advances
    per sample."""

    key: str
    step: KernelStep
    args: tuple
    strides: tuple
    once: bool
    grid_x: int


@dataclass(frozen=True)
class _Sequence:
    """What every launch of one sequence needs, worked out once per layer (its cache key)."""

    parts: dict  # step index of a body-engine part -> its Part
    steps: tuple  # _Layer and _Kernel, in order
    buffers: tuple  # (name, kind, values): kind "sample" (values per sample), "stats" (offset), "once"
    out_shape: tuple
    stats_floats: int
    dtype: torch.dtype
    raw_x: bool  # a kernel step reads x by its address, as NC(D)HW (a box-mean or tap-sum kernel)
    channels_last: bool  # x and out channels-last (specgen.dwcl's one kernel)


_sequences: dict[str, _Sequence] = {}
_lock = threading.Lock()


def _sequence(sp: pipeline.Specialized) -> _Sequence:
    seq = _sequences.get(sp.key)
    if seq is None:
        plan: SequencePlan = sp.plan
        parts, in_shapes = {}, {}
        for index, part in enumerate(plan.parts):
            if part.role in ("body", "rest"):
                parts[index] = Part(part.spec, part.plan, sp.source, sp.build, part=part.namespace)
                in_shapes[index] = (part.spec.input.channels, *part.spec.input.size)
        dtype = torchop.PRECISION_DTYPE[sp.spec.precision]
        item = torch.empty((), dtype=dtype).element_size()
        buffers, per_sample = [], {"x": 4 * plan.in_per_sample, "out": 4 * math.prod(plan.out_shape)}
        for name, size in plan.buffers.items():
            if isinstance(size, int):  # values per sample
                buffers.append((name, "sample", size))
                per_sample[name] = item * size
            elif size[0] == "stats":  # a slice of the batch statistics the layer returns
                buffers.append((name, "stats", size[1]))
                per_sample[name] = 0
            else:  # ("once", floats): one for the whole batch
                buffers.append((name, "once", size[1]))
                per_sample[name] = 0
        steps = []
        for step in plan.steps:
            if isinstance(step, LayerStep):
                index = step.part
                steps.append(_Layer(parts[index], plan.parts[index].role == "body", step.in_, step.out,
                                    in_shapes[index], tuple(step.out_shape), step.ones))
                continue
            args, strides = [], []
            for arg in step.args:
                if arg.startswith("p_"):
                    args.append(("p", arg[2:]))
                    strides.append(0)
                elif arg in ("weight", "bias"):  # the conv's own (specgen.dwcl)
                    args.append(("w" if arg == "weight" else "bias", arg))
                    strides.append(0)
                elif arg.startswith("i_"):  # an extra input (the output's shape, or [C, 1, ...]): a sample's worth per sample
                    args.append(("i", arg[2:]))
                    strides.append(4 * math.prod(sp.spec.inputs()[arg[2:]]))
                else:
                    args.append(("b", arg))
                    strides.append(per_sample[arg])
            steps.append(_Kernel(f"{sp.key}:{step.name}", step, tuple(args), tuple(strides), step.once, step.grid_x))
        channels_last = plan.channels_last_io
        raw_x = not channels_last and any(type(st) is _Kernel and ("b", "x") in st.args for st in steps)
        seq = _sequences[sp.key] = _Sequence(parts, tuple(steps), tuple(buffers), tuple(plan.out_shape),
                                             plan.stats_floats, dtype, raw_x, channels_last)
    return seq


def load(sp: pipeline.Specialized, device_index: int) -> None:
    """Load every kernel of the sequence into a device (once per process and device)."""
    seq = _sequence(sp)
    for part in seq.parts.values():
        torchop.load_kernel(part, device_index)
    for step in sp.plan.steps:
        if isinstance(step, KernelStep):
            _kernel(sp, step, device_index)


def _kernel(sp: pipeline.Specialized, step: KernelStep, device_index: int) -> runtime.LoadedKernel:
    key = f"{sp.key}:{step.name}"
    kernel = runtime.lookup(key, device_index)
    if kernel is None:
        kernel = runtime.load(key, torchop.cubin_bytes(sp), step.name, step.threads, 0, device_index)
    return kernel


_ones: dict[tuple, torch.Tensor] = {}


def _identity_weight(channels: int, ndim: int, device: torch.device) -> torch.Tensor:
    """The weights of a rest's identity conv (1x1, depthwise): ones, [C, 1, 1...]. Kept per device
    outside a CUDA-graph capture; made afresh inside one (the graph owns what it allocates)."""
    shape = (channels, 1, *([1] * ndim))
    key = (device, shape)
    capturing = torch.cuda.is_current_stream_capturing()
    ones = _ones.get(key) if not capturing or tmarun.reusing() else None
    if ones is None and capturing:
        return torch.ones(shape, device=device)
    if ones is None:
        with _lock:
            ones = _ones.setdefault(key, torch.ones(shape, device=device))
    return ones


def launch(sp: pipeline.Specialized, x: torch.Tensor, weight, bias, params: dict, out: torch.Tensor | None,
           stats: torch.Tensor | None = None, record: list | None = None) -> torch.Tensor:
    """Run the sequence on contiguous float32 CUDA `x` into `out` (allocated when None; a channels-last
    sequence, specgen.dwcl's, takes and gives channels-last tensors). `stats`: where
    the training-mode batch norms with running statistics write their batch statistics
    (reference.forward_with_stats' layout); allocated (and dropped) when None. `record`: where the
    call can be repeated as it is (x read where it lies, no batch statistics, each step one plain
    launch, every extra input of the output's shape), a `torchop.FastLaunch` of its launches
    (`SequenceReplay`) is appended, for the caller to repeat."""
    given = x
    seq = _sequence(sp)
    batch = x.shape[0]
    shape = (batch, *seq.out_shape)
    # The layer's dtype (float32, or a pool split's 16-bit one): its output and the tensors its
    # parts hand on (the statistic stages' tails compute in float32 only).
    dtype = seq.dtype
    fmt = tmarun.channels_last_format(len(shape)) if seq.channels_last else torch.contiguous_format
    if out is None:
        out = torch.empty(shape, device=x.device, dtype=dtype, memory_format=fmt)
    elif tuple(out.shape) != shape or out.dtype != dtype or out.device != x.device or not out.is_contiguous(memory_format=fmt):
        raise ValueError(
            f"{sp.spec.name}: out must be a {'channels-last' if seq.channels_last else 'contiguous'} {dtype} tensor of "
            f"shape {list(shape)} on {x.device}, got {out.dtype} {list(out.shape)} on {out.device}"
        )
    if seq.channels_last and not x.is_contiguous(memory_format=fmt):
        x = x.contiguous(memory_format=fmt)  # (the kernel reads a channels-last x; torchop hands it one)
    floats = seq.stats_floats
    if floats and (stats is None or stats.numel() != floats or stats.device != x.device):
        if stats is not None:
            raise ValueError(f"{sp.spec.name}: stats must be a float32 tensor of {floats} values on {x.device}")
        stats = torch.empty(floats, device=x.device, dtype=torch.float32)
    if batch == 0:
        return out
    if out.data_ptr() % 16:
        raise ValueError(f"{sp.spec.name}: out must start at a 16-byte aligned address (got a view with an offset)")
    if seq.raw_x and not x.is_contiguous():
        # (a body step reads a channels-last x through its own engine; a kernel step that reads x
        # by address reads NC(D)HW only)
        x = x.contiguous()
    device_index = x.get_device()
    stream = torchop._current_stream(device_index)
    names = tuple(sp.spec.inputs())
    # the launches kept for a repeat, as they are queued: (step, its Prepared or body FastLaunch)
    kept = [] if (record is not None and x is given and not floats and all(kind != "stats" for _, kind, _ in seq.buffers)
                  and all(tuple(params[n].shape) == shape for n in names)) else None
    buffers = {"x": x, "out": out}
    for name, kind, size in seq.buffers:
        if kind == "sample":
            buffers[name] = torch.empty(batch * size, device=x.device, dtype=dtype)
        elif kind == "stats":
            buffers[name] = stats[size:]
        else:
            buffers[name] = torch.empty(size, device=x.device, dtype=torch.float32)
    for step in seq.steps:
        if type(step) is _Layer:
            src = buffers[step.src].view(batch, *step.in_shape)
            dst = buffers[step.dst].view(batch, *step.out_shape)
            sub = None if kept is None else []
            if step.body:
                torchop.launch(step.part, src, weight, bias, params, dst, record=sub)
            else:
                ones = _identity_weight(step.ones, len(step.in_shape) - 1, x.device)
                torchop.launch(step.part, src, ones, None, params, dst, record=sub)
            if kept is not None:
                kept = kept + [(step, sub[0])] if sub else None
            continue
        kernel = runtime.lookup(step.key, device_index) or _kernel(sp, step.step, device_index)
        # (parameters and extra inputs aligned by torchop.launch)
        tensors = [_argument(source, name, buffers, params, weight, bias) for source, name in step.args]  # (alive until queued)
        pointers = [t.data_ptr() for t in tensors]
        prepared = None
        if kept is not None:
            # (a "once" kernel walks the whole batch over grid_x blocks; the others take the
            # batch along y, in one launch where `runtime.prepare` gives one)
            prepared = (runtime.Prepared(kernel, step.grid_x, 1, pointers, batch) if step.once
                        else runtime.prepare(kernel, step.grid_x, pointers, batch))
            kept = kept + [(step, prepared)] if prepared is not None else None
        if prepared is not None:
            prepared.launch(stream)
        elif step.once:
            runtime.launch_once(kernel, step.grid_x, pointers, batch, stream)
        else:
            runtime.launch(kernel, step.grid_x, pointers, step.strides, batch, stream)
    if kept is not None:
        record.append(_recorded(seq, kept, names, batch, x, out, weight, bias, params, device_index))
    return out


def _recorded(seq: _Sequence, kept: list, names: tuple, batch: int, x: torch.Tensor, out: torch.Tensor, weight, bias,
              params: dict, device_index: int) -> torchop.FastLaunch:
    """The call's launches (`kept`: each step and its Prepared launch or body FastLaunch) as a
    FastLaunch that repeats them (`SequenceReplay`)."""
    held, steps, rules = [weight, bias, *(t for n, t in params.items() if n not in names)], [], set()
    for step, launch in kept:
        if type(step) is _Layer:  # the part's FastLaunch: x at 0, its extra inputs, its output
            part_inputs = torchop._launch_plan(step.part).input_names
            slots = [(0, step.src), (launch.out_slot, step.dst),
                     *((slot, "i_" + n) for slot, n in zip(launch.input_slots, part_inputs))]
            held.append(launch.held)
            rules.update(launch.small_batch or ())
            steps.append((launch.prepared, tuple(slots)))
        else:  # a tail kernel: its buffers' and extra inputs' pointer slots
            slots = [(i, name if source == "b" else "i_" + name)
                     for i, (source, name) in enumerate(step.args) if source in ("b", "i")]
            steps.append((launch, tuple(slots)))
    sizes = tuple((name, batch * size if kind == "sample" else size, seq.dtype if kind == "sample" else torch.float32)
                  for name, kind, size in seq.buffers)
    replay = SequenceReplay(tuple(steps), sizes, names, x.device)
    n = len(names)
    return torchop.FastLaunch(replay, tuple(held), x.shape, out.shape, out.dtype, device_index, tuple(range(1, 1 + n)),
                              1 + n, torchop._strides(x), torchop._strides(out), tuple(sorted(rules)) or None)


class SequenceReplay:
    """A sequence's launches from a plain inference call, as `torchop.FastLaunch` repeats them:
    `values` holds the addresses of x, the extra inputs (the layer's order) and the output; each
    step (a body or rest part's recorded launch, a tail kernel's `runtime.Prepared`) keeps every
    other argument, and gets those addresses and its workspaces' in its slots before it is queued.
    The workspaces are kept per stream (`tmarun.per_stream`) where they add up to at most
    `torchop.KEPT_WORKSPACE_BYTES`; larger ones are allocated per call."""

    __slots__ = ("steps", "sizes", "names", "device", "values", "workspaces")

    def __init__(self, steps: tuple, sizes: tuple, names: tuple, device: torch.device):
        self.steps, self.sizes, self.names, self.device = steps, sizes, names, device
        self.values = [0] * (len(names) + 2)
        self.workspaces = torchop.kept_workspaces(sum(numel * dtype.itemsize for _, numel, dtype in sizes))

    def launch(self, stream: int) -> None:
        # (a workspace made per call is held here until every launch that uses it is queued)
        tensors, addresses = torchop.workspace(self.workspaces, stream, self._workspaces)
        values = self.values
        where = dict(addresses, x=values[0], out=values[-1])
        for i, name in enumerate(self.names):
            where["i_" + name] = values[1 + i]
        for target, slots in self.steps:
            into = target.values
            for slot, key in slots:
                into[slot] = where[key]
            target.launch(stream)

    def _workspaces(self) -> tuple:
        tensors = [torch.empty(numel, dtype=dtype, device=self.device) for _, numel, dtype in self.sizes]
        return tensors, {name: t.data_ptr() for (name, _, _), t in zip(self.sizes, tensors)}


def _argument(source: str, name: str, buffers: dict, params: dict, weight, bias) -> torch.Tensor:
    """The tensor a kernel step's argument points at (see _Kernel)."""
    if source == "b":
        return buffers[name]
    if source == "w":
        return weight
    if source == "bias":
        return bias
    return params[name]
