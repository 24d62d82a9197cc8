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

from specgen import pipeline, runtime, torchop


@dataclass(frozen=True)
class Part(pipeline.Specialized):
    """A body-engine part of a sequence (the body or a rest): its own spec and plan, the sequence's
    build. Its key names the part, so its launch plan and loaded kernel are its own."""

    part: str = ""

    @property
    def key(self) -> str:
        return f"{self.build.key}:{self.part}"


@dataclass(frozen=True)
class _Sequence:
    parts: dict  # step index of a body-engine part -> its Part
    in_shapes: dict  # step index -> the per-sample input shape of that part


_sequences: dict[str, _Sequence] = {}
_lock = threading.Lock()


def _sequence(sp: pipeline.Specialized) -> _Sequence:
    seq = _sequences.get(sp.key)
    if seq is None:
        parts, in_shapes = {}, {}
        for index, part in enumerate(sp.plan["parts"]):
            if part["role"] in ("body", "rest"):
                parts[index] = Part(part["spec"], part["plan"], sp.source, sp.build, part["namespace"])
                spec = part["spec"]
                in_shapes[index] = (spec.input.channels, *spec.input.size)
        seq = _sequences[sp.key] = _Sequence(parts, in_shapes)
    return seq


def load(sp: pipeline.Specialized, device_index: int) -> None:
    """Load every kernel of the sequence into a device (once per process and device)."""
    seq = _sequence(sp)
    for part in seq.parts.values():
        torchop.load_kernel(part, device_index)
    for step in sp.plan["steps"]:
        if step["kind"] == "kernel":
            _kernel(sp, step, device_index)


def _kernel(sp: pipeline.Specialized, step: dict, device_index: int) -> runtime.LoadedKernel:
    key = f"{sp.key}:{step['name']}"
    kernel = runtime.lookup(key, device_index)
    if kernel is None:
        kernel = runtime.load(key, torchop.cubin_bytes(sp), step["name"], step["threads"], 0, device_index)
    return kernel


_ones: dict[tuple, torch.Tensor] = {}


def _identity_weight(channels: int, ndim: int, device: torch.device) -> torch.Tensor:
    """The weights of a rest's identity conv (1x1, depthwise): ones, [C, 1, 1...]. Kept per device
    outside a CUDA-graph capture; made afresh inside one (the graph owns what it allocates)."""
    shape = (channels, 1, *([1] * ndim))
    if torch.cuda.is_current_stream_capturing():
        return torch.ones(shape, device=device)
    key = (device, shape)
    ones = _ones.get(key)
    if ones is None:
        with _lock:
            ones = _ones.setdefault(key, torch.ones(shape, device=device))
    return ones


def launch(sp: pipeline.Specialized, x: torch.Tensor, weight, bias, params: dict, out: torch.Tensor | None,
           stats: torch.Tensor | None = None) -> torch.Tensor:
    """Run the sequence on contiguous float32 CUDA `x` into `out` (allocated when None). `stats`: where
    the training-mode batch norms with running statistics write their batch statistics
    (reference.forward_with_stats' layout); allocated (and dropped) when None."""
    plan = sp.plan
    batch = x.shape[0]
    shape = (batch, *plan["out_shape"])
    # The layer's dtype (float32, or a pool split's 16-bit one): its output and the tensors its
    # parts hand on (the statistic stages' tails compute in float32 only).
    dtype = torchop.PRECISION_DTYPE[sp.spec.precision]
    if out is None:
        out = torch.empty(shape, device=x.device, dtype=dtype)
    elif tuple(out.shape) != shape or out.dtype != dtype or out.device != x.device or not out.is_contiguous():
        raise ValueError(
            f"{sp.spec.name}: out must be a contiguous {dtype} tensor of shape {list(shape)} on {x.device}, "
            f"got {out.dtype} {list(out.shape)} on {out.device}"
        )
    if plan["stats_floats"] and (stats is None or stats.numel() != plan["stats_floats"] or stats.device != x.device):
        if stats is not None:
            raise ValueError(f"{sp.spec.name}: stats must be a float32 tensor of {plan['stats_floats']} values on {x.device}")
        stats = torch.empty(plan["stats_floats"], device=x.device, dtype=torch.float32)
    if batch == 0:
        return out
    if out.data_ptr() % 16:
        raise ValueError(f"{sp.spec.name}: out must start at a 16-byte aligned address (got a view with an offset)")
    device_index = x.get_device()
    stream = torchop._current_stream(device_index)
    seq = _sequence(sp)
    buffers, per_sample = {"x": x, "out": out}, {"x": 4 * plan["in_per_sample"], "out": 4 * math.prod(plan["out_shape"])}
    for name, size in plan["buffers"].items():
        if isinstance(size, int):  # values per sample
            buffers[name] = torch.empty(batch * size, device=x.device, dtype=dtype)
            per_sample[name] = buffers[name].element_size() * size
        elif size[0] == "stats":  # a slice of the batch statistics the layer returns
            buffers[name] = stats[size[1]:]
            per_sample[name] = 0
        else:  # ("once", floats): one for the whole batch
            buffers[name] = torch.empty(size[1], device=x.device, dtype=torch.float32)
            per_sample[name] = 0
    for step in plan["steps"]:
        if step["kind"] == "layer":
            part = seq.parts[step["part"]]
            src = buffers[step["in"]].view(batch, *seq.in_shapes[step["part"]])
            dst = buffers[step["out"]].view(batch, *step["out_shape"])
            if sp.plan["parts"][step["part"]]["role"] == "body":
                torchop.launch(part, src, weight, bias, params, dst)
            else:
                ones = _identity_weight(step["ones"], len(seq.in_shapes[step["part"]]) - 1, x.device)
                torchop.launch(part, src, ones, None, params, dst)
            continue
        kernel = _kernel(sp, step, device_index)
        pointers, strides = [], []
        for arg in step["args"]:
            if arg.startswith("p_"):
                pointers.append(params[arg[2:]].data_ptr())  # aligned by torchop.launch
                strides.append(0)
            elif arg.startswith("i_"):  # an extra input, of the output's shape: advances with it per sample
                pointers.append(params[arg[2:]].data_ptr())
                strides.append(per_sample["out"])
            else:
                pointers.append(buffers[arg].data_ptr())
                strides.append(per_sample[arg])
        if step["once"]:
            runtime.launch_once(kernel, step["grid_x"], pointers, batch, stream)
        else:
            runtime.launch(kernel, step["grid_x"], pointers, strides, batch, stream)
    return out
