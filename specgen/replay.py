"""A fused model replayed from one CUDA graph: small-batch inference without the host's launch time.

A fused model launches its kernels from Python, one chain after another. At small batches the
GPU finishes a chain before the host has launched the next, so the host's time per launch, not
the kernels, sets the pace (a ResNet-18 at batch 1: about 0.4 ms of kernels, over 1 ms of host
time). `GraphReplay` captures the model's forward for one input signature (the example inputs'
shapes, dtypes and device) in a CUDA graph, once, and then replays it: one launch per forward.
`from_module` builds one and keeps it where it measures faster (`cuda_graph=None`, the default),
always (`True`) or never (`False`).

A call replays the graph when all of these hold, and otherwise runs the model as usual:
- autograd is off (`torch.no_grad()` or `torch.inference_mode()`), the model is in eval mode,
  autocast is off, and PyTorch's TF32 flags (cuDNN's, matmul's) are as they were at the capture;
- the positional arguments are tensors of the captured shapes, dtypes and device, no keywords;
- no CUDA-graph capture is underway on the current stream (a caller's own graph captures the
  plain path);
- the model's parameters and buffers are unchanged since the capture (their version counters and
  addresses): an in-place update (an optimizer step, `load_state_dict`) or new storage
  (`p.data = ...`) makes the next call capture again, and
  so do a conversion (`.to()`, `.half()`, ...), `copy.deepcopy` and pickling (the copy captures
  its own graph on its first call that can replay). A parameter replaced by another tensor object
  is not seen: call `recapture()` after that.

Each call copies its inputs into the graph's input tensors and clones the outputs out of the
graph's, so it returns fresh tensors as the model does; calls that replay take a lock (the graph's
tensors are shared), and a call that finds it held runs the plain path. The graph keeps its own
memory pool (the intermediate tensors of one forward at the captured batch).

While capturing, the kernels' derived weights (layouts, TF32 planes) are read from the caches
the warm-up forward filled (`tmarun.reusing_caches`) rather than recomputed inside the graph:
the version check above guarantees they match the weights.
"""

from __future__ import annotations

import threading

import torch
import torch.nn as nn
from torch.utils import _pytree

from specgen import tmarun

WARMUP_CALLS = 2  # forwards before a capture (on a side stream): kernels loaded, caches filled


def _flags() -> tuple:
    """The math flags PyTorch's kernels in the graph were chosen under (TF32 for convs and matmuls)."""
    return torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32


def _autocast() -> bool:
    try:
        return torch.is_autocast_enabled("cuda")
    except TypeError:  # (older torch: no device argument, CUDA's autocast)
        return torch.is_autocast_enabled()


def _no_graph() -> dict:
    """A GraphReplay's graph state when it holds no graph (fresh, dropped, or a copy's)."""
    return {"_graph": None, "_static_in": (), "_static_out": None, "_tensors": [], "_versions": [], "_flags": ()}


def _check_inputs(example_inputs: tuple) -> None:
    bad = [i for i, t in enumerate(example_inputs) if not (isinstance(t, torch.Tensor) and t.is_cuda)]
    if not example_inputs or bad:
        raise ValueError(
            "GraphReplay: example inputs must be CUDA tensors"
            + (f" (argument {bad[0]} is {type(example_inputs[bad[0]]).__name__}"
               f"{' on ' + example_inputs[bad[0]].device.type if isinstance(example_inputs[bad[0]], torch.Tensor) else ''})" if bad else "")
        )


class GraphReplay(nn.Module):
    """`module`'s forward on `example_inputs`' signature replayed from a CUDA graph (see the module
    docstring for when); other calls run `fallback` (default `module`) as usual. Attributes the
    wrapper does not have are looked up on `module` (`specgen_report`, submodules)."""

    def __init__(self, module: nn.Module, *example_inputs: torch.Tensor, fallback: nn.Module | None = None):
        super().__init__()
        _check_inputs(example_inputs)
        self.module = module
        # (not registered as a submodule: the fallback is the model itself or the original, whose
        # parameters `module` shares; state_dict() and .to() go through `module` alone)
        object.__setattr__(self, "fallback", module if fallback is None else fallback)
        self._signature = tuple((tuple(t.shape), t.dtype, t.device) for t in example_inputs)
        self._device = example_inputs[0].device
        self._lock = threading.Lock()
        self._forget()
        self.captures = 0  # how many times the graph was captured (the first one included)
        self.replays = 0
        self._capture(example_inputs)

    def _forget(self) -> None:
        """Drop the graph and its tensors: the next call that can replay captures again."""
        self.__dict__.update(_no_graph())

    def _apply(self, fn, recurse=True):
        # .to(), .cuda(), .half(), ...: conversions may move the parameters' memory without moving
        # their version counters, so the graph goes (the next call that can replay captures again);
        # a fallback other than the module (the original model, sharing its parameters) follows.
        super()._apply(fn, recurse)
        if self.fallback is not self.module:
            self.fallback._apply(fn, recurse)
        self._forget()
        return self

    def __getstate__(self):
        # (copy.deepcopy and pickle: a CUDA graph and a lock are neither; the copy captures its own)
        return {**self.__dict__, **_no_graph(), "_lock": None}

    def __setstate__(self, state):
        super().__setstate__(state)
        self._lock = threading.Lock()

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith("_"):  # (never a protocol's hook: copy looks up __deepcopy__ so, fx's GraphModule has one)
                raise
            return getattr(super().__getattr__("module"), name)

    # -- capture ---------------------------------------------------------------------------------

    def _watched(self) -> list[torch.Tensor]:
        return [*self.module.parameters(), *self.module.buffers()]  # (each listed once by torch)

    def _capture(self, inputs) -> None:
        """Capture the forward on copies of `inputs` (warm-up forwards first, on a side stream)."""
        if self.module.training:
            raise ValueError("GraphReplay: the model is in training mode; a graph replays eval-mode forwards only")
        self._forget()  # the old graph's pool goes with it
        static_in = tuple(t.detach().clone() for t in inputs)
        graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.device(self._device):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(WARMUP_CALLS):
                    self.module(*static_in)
            torch.cuda.current_stream().wait_stream(side)
            with tmarun.reusing_caches(), torch.cuda.graph(graph):
                static_out = self.module(*static_in)
        self._tensors = self._watched()
        self._versions = [tmarun.state(t) for t in self._tensors]
        self._flags = _flags()
        self._graph, self._static_in, self._static_out = graph, static_in, static_out
        self.captures += 1

    def recapture(self) -> None:
        """Drop the graph, so that the next call that can replay captures again (after replacing a
        parameter or buffer by another tensor object)."""
        with self._lock:
            self._forget()

    # -- calls -----------------------------------------------------------------------------------

    def _replays(self, args, kwargs) -> bool:
        if kwargs or torch.is_grad_enabled() or self.module.training or len(args) != len(self._signature):
            return False
        if _autocast() or (self._graph is not None and _flags() != self._flags):
            return False  # captured without autocast, under these math flags (a call without a graph captures one)
        for t, (shape, dtype, device) in zip(args, self._signature):
            if not isinstance(t, torch.Tensor) or t.shape != shape or t.dtype != dtype or t.device != device:
                return False
        return not torch.cuda.is_current_stream_capturing()

    def forward(self, *args, **kwargs):
        if not self._replays(args, kwargs) or not self._lock.acquire(blocking=False):
            return self.fallback(*args, **kwargs)
        try:
            if self._graph is None:
                self._capture(args)
            elif [tmarun.state(t) for t in self._tensors] != self._versions:
                self._capture(self._static_in)
            for static, t in zip(self._static_in, args):
                static.copy_(t)
            self._graph.replay()
            self.replays += 1
            out = self._static_out
            if isinstance(out, torch.Tensor):
                return out.clone()
            return _pytree.tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, out)
        finally:
            self._lock.release()
