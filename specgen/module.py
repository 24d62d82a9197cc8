"""`specgen.FusedLayer`: a drop-in nn.Module that runs one specialized kernel per forward.

Its parameters have the names and shapes of the plain PyTorch model (`conv.weight`,
`conv.bias`, one parameter per per-channel name), so `load_state_dict` works both ways.
Every forward computes what the layer's custom op `torch.ops.specgen.<name>_<key[:12]>` does (see
`specgen.torchop`): on CUDA tensors the specialized kernel on torch's current stream, on CPU
tensors the PyTorch reference, so a model stays portable. The layer works with autograd (the
backward recomputes with PyTorch ops), `torch.compile(fullgraph=True)` (which traces the op) and
CUDA graphs. Eager CUDA calls skip the op's dispatch, which costs more host time than a small
layer's kernel: under no_grad they launch directly, with autograd on they record the op's own
formula (`torchop.eager_autograd`). `forward(x, out=...)` is the raw launch: it fills `out` and
records no autograd graph.

The layer's dtype follows its spec's precision: float32 for `fp32` and `tf32`, bfloat16 for
`bf16`, float16 for `fp16`. Converting the layer (`.half()`, `.bfloat16()`, `.to(dtype)`, or a
parent model's conversion) changes its precision to match and specializes it again; `.float()`
brings back the 32-bit precision it had.

A layer with training-mode batch norms (`batch_norm: {training: true}`) behaves as nn.BatchNormNd:
in training mode it normalizes with the batch's statistics and updates its running statistics (the
op returns the batch statistics; the layer applies nn.BatchNormNd's update to its buffers), after
`.eval()` it runs its eval twin, the same layer normalizing with the running statistics (a kernel
of its own, specialized when the layer is switched to eval mode).
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn as nn

from specgen import pipeline, reference, tmarun, torchop
from specgen.log import get_logger
from specgen.spec import LayerSpec, load


class FusedLayer(nn.Module):
    # The shape the conv weight is viewed in for the op where the layer keeps it otherwise (an
    # imported Linear's weight, [C_out, C_in], for the 1x1 conv's [C_out, C_in, 1, 1]; the kernels
    # read the same memory); None: kept in the spec's shape.
    _flat_weight: tuple | None = None
    _SHAPE_HINT = ""  # what a wrong input shape's error adds (an imported layer: where its sizes came from)
    # Whether an input of other sizes past the channels runs a sibling layer specialized for them
    # (`_at_size`: an imported layer, whose sizes came from an example) rather than being refused
    # (a layer built from a spec: its sizes are what the user wrote).
    _OTHER_SIZES = False
    _SIZES_KEPT = 8  # siblings a layer keeps, one per size (then the oldest goes)

    def __init__(self, spec_or_path, *, arch: str | None = None, tune: bool = False, tune_batch: int | None = None,
                 precision: str | None = None):
        """`precision` overrides the spec's; a spec that does not set one runs as PyTorch would run
        the layer: `tf32` while `torch.backends.cudnn.allow_tf32` is True (PyTorch's default), else
        `fp32` (read once, here).

        `tune=True` (or SPECGEN_AUTOTUNE=1) measures the tile candidates on this GPU now, for the
        batch bucket of `tune_batch` (default 64), unless a choice is stored for it already, and
        uses that bucket's choice. Otherwise a stored choice for this GPU is used when there is
        one (of the largest batch bucket tuned; a call whose batch bucket was tuned to another tile
        runs that bucket's kernel), else the planner's heuristic tile."""
        super().__init__()
        spec = load(spec_or_path)
        if precision is None and "precision" not in spec.model_fields_set:
            precision = "tf32" if torch.backends.cudnn.allow_tf32 else "fp32"
        if precision is not None:
            if precision not in torchop.PRECISION_DTYPE:
                raise ValueError(f"precision: expected one of {', '.join(torchop.PRECISION_DTYPE)}, got {precision!r}")
            spec = spec.model_copy(update={"precision": precision})
        self.spec: LayerSpec = spec
        self.arch = arch
        if tune_batch is not None and (isinstance(tune_batch, bool) or not isinstance(tune_batch, int) or tune_batch < 1):
            raise ValueError(f"tune_batch: expected a positive int, got {tune_batch!r}")
        self._tune_batch = tune_batch
        self._tune = bool(tune)
        self.conv = reference.make_conv(self.spec)
        reference.add_spec_params(self, self.spec)
        # The 32-bit precision to come back to from a 16-bit one (.float()).
        self._precision32 = self.spec.precision if self.spec.precision in ("fp32", "tf32") else "fp32"
        dtype = torchop.PRECISION_DTYPE[self.spec.precision]
        if dtype != torch.float32:
            nn.Module._apply(self, lambda t: t.to(dtype) if t.is_floating_point() else t)
        self._derive(self.spec)
        if torch.cuda.is_available():
            self.specialize()  # compile at construction (never during a graph capture)
        else:
            self._bind_op()

    def _derive(self, spec: LayerSpec) -> None:
        """Take `spec` as the layer's: what the layer derives from it, nothing specialized yet
        (__init__; a sibling for other input sizes, `_at_size`)."""
        self.spec = spec
        # Plain Python values read on every forward, so torch.compile traces it without graph breaks.
        self._name = spec.name
        self._input_shape = (spec.input.channels, *spec.input.size)
        self._param_names = tuple(spec.params())
        self._input_shapes = spec.inputs()  # extra inputs: forward(x, *inputs), name -> shape per sample
        self._input_names = tuple(self._input_shapes)
        self._out_tail = tuple(spec.shapes()[-1].sizes)
        self._has_bias = spec.conv.bias
        self._stats_size = reference.stats_size(spec)  # batch statistics the op returns (training-mode batch norms)
        self._running_stats = reference.running_stats(spec)
        self._twin_spec = spec.eval_twin()  # the layer in eval mode, when that computes something else
        self._twin_params = tuple(self._twin_spec.params().items()) if self._twin_spec is not None else ()
        self._one_value_batch_norm = reference.one_value_batch_norm(spec)
        self._twin_specialized: pipeline.Specialized | None = None
        self._twin_op = self._twin_spec_op = None
        self._specialized: pipeline.Specialized | None = None
        self._fast: torchop.FastLaunch | None = None  # the last plain inference launch, for repeats
        self._op = None
        self._at_sizes: dict = {}  # input sizes past the channels -> the sibling layer for them (`_at_size`)

    # -- specialization ------------------------------------------------------------------------

    def specialize(self) -> pipeline.Specialized:
        """Compile the kernel, or load it from the cache (microseconds once done in this process)."""
        if self._specialized is None:
            asked, config = self._tuned_choice()
            if asked:
                self._specialized = pipeline.specialize(self.spec, self.arch, igemm_config=config, tuned=False)
            else:  # any stored choice is the pipeline's to take
                self._specialized = pipeline.specialize(self.spec, self.arch)
            self._bind_op()
            self._load_on_device()
        return self._specialized

    def _tuned_choice(self):
        """(asked, tile): when tuning was asked for, the asked batch bucket's tile (tuned now if
        none is stored; None: the heuristic won or there is nothing to tune). Not asked: the
        pipeline takes any stored choice itself."""
        from specgen import tune
        from specgen.measured import batch_bucket

        if not (self._tune or tune.autotune_env()):
            return False, None
        batch = self._tune_batch or tune.DEFAULT_TUNE_BATCH
        tune.ensure_tuned([self.spec], batch=batch, arch=self.arch)
        record = tune.stored_choice(self.spec, self.arch, batch_bucket(batch))
        return True, None if record is None else record["config"]

    def _bind_op(self) -> None:
        """Register (once per process) and remember this layer's custom op."""
        self._spec_op = torchop.register(self.spec, self._specialized, self.arch)
        self._op = self._spec_op.overload

    @property
    def op(self) -> torchop.SpecOp:
        """The layer's custom op, `torch.ops.specgen.<name>_<key[:12]>`."""
        return torchop.register(self.spec, self._specialized, self.arch)

    def _op_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """The conv weight as the op takes it: the spec's shape (a view, through which gradients
        reach the tensor kept: an imported Linear's [C_out, C_in] weight, `_flat_weight`)."""
        return weight if self._flat_weight is None else weight.view(self._flat_weight)

    def _op_tensors(self) -> list[torch.Tensor]:
        tensors = [self._op_weight(self.conv.weight)]
        if self._has_bias:
            tensors.append(self.conv.bias)
        tensors.extend(_tensor(self, name) for name in self._param_names)
        return tensors

    # -- precision and devices -----------------------------------------------------------------

    def _apply(self, fn, recurse=True):
        result = super()._apply(fn, recurse)
        self._at_sizes = {}  # (made again, on the new device or dtype, when called)
        dtype = self.conv.weight.dtype
        if dtype != torchop.PRECISION_DTYPE[self.spec.precision] and dtype in (torch.float32, *torchop.LOWER_PRECISIONS):
            self._adopt(dtype)
        self._load_on_device()
        return result

    def _adopt(self, dtype) -> None:
        """The layer's tensors became `dtype`: run in the matching precision from now on."""
        precision = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, self._precision32)
        self.spec = self.spec.model_copy(update={"precision": precision})
        self._specialized = self._fast = None
        if torch.cuda.is_available():
            self.specialize()
        else:
            self._bind_op()

    def _load_on_device(self) -> None:
        """Load the kernel into the parameters' GPU now, so the first forward (perhaps being
        captured into a CUDA graph) only launches."""
        weight = self.conv.weight
        if self._specialized is not None and weight.is_cuda and weight.dtype == torchop.PRECISION_DTYPE[self.spec.precision]:
            index = weight.device.index if weight.device.index is not None else torch.cuda.current_device()
            torchop.load_kernel(self._specialized, index)
            if self._twin_specialized is not None:
                torchop.load_kernel(self._twin_specialized, index)

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_op"] = state["_twin_op"] = state["_spec_op"] = state["_twin_spec_op"] = None  # bound again on unpickling
        state["_at_sizes"] = {}  # (siblings share this layer's dicts: a copy makes its own when called)
        return state

    def __setstate__(self, state):
        state.setdefault("_at_sizes", {})
        super().__setstate__(state)
        self._bind_op()
        if self._twin_spec is not None:
            self._bind_twin()

    # -- eval mode of a layer with training-mode batch norms -----------------------------------

    def train(self, mode: bool = True):
        """As nn.Module.train; switching a layer with training-mode batch norms to eval mode
        specializes its eval twin now (on a GPU), not in the first eval forward."""
        result = super().train(mode)
        if not mode and self._twin_spec is not None:
            self._bind_twin(specialize=torch.cuda.is_available())
        return result

    def _bind_twin(self, specialize: bool = False) -> None:
        if specialize and self._twin_specialized is None:
            self._twin_specialized = pipeline.specialize(self._twin_spec, self.arch)
            weight = self.conv.weight
            if weight.is_cuda and weight.dtype == torch.float32:
                torchop.load_kernel(self._twin_specialized, weight.device.index if weight.device.index is not None
                                    else torch.cuda.current_device())
        self._twin_spec_op = torchop.register(self._twin_spec, self._twin_specialized, self.arch)
        self._twin_op = self._twin_spec_op.overload

    def _twin_tensors(self) -> list[torch.Tensor]:
        """The eval twin's tensors after x: weight, bias, then its params() (batch norms' running
        statistics among them), each viewed in the twin's shape."""
        tensors = [self._op_weight(self.conv.weight), *([self.conv.bias] if self._has_bias else [])]
        for name, want in self._twin_params:
            tensors.append(spec_shaped(_tensor(self, name), want))
        return tensors

    def _forward_eval(self, x: torch.Tensor, out: torch.Tensor | None, inputs: tuple = ()) -> torch.Tensor:
        """Eval mode of a layer with training-mode batch norms: its eval twin, on the running statistics."""
        if self._twin_op is None:
            self._bind_twin(specialize=x.is_cuda)
        tensors = self._twin_tensors()
        if x.is_cuda:
            self._check_input(x)
            if out is not None or not torch.compiler.is_compiling():
                if self._twin_specialized is None:
                    self._bind_twin(specialize=True)
                if out is None and torch.is_grad_enabled():  # eager autograd, without the op's dispatch
                    return torchop.eager_autograd(self._twin_spec_op, self._twin_specialized, (x, *tensors, *inputs))
                bias = tensors[1] if self._has_bias else None
                params = dict(zip((name for name, _ in self._twin_params), tensors[1 + self._has_bias:]))
                params.update(zip(self._input_names, inputs))
                return torchop.launch(self._twin_specialized, x.contiguous(), tensors[0], bias, params, out)
        else:
            self._check_portable_input(x)
        if out is None:
            return self._twin_op(x, *tensors, *inputs)
        with torch.no_grad():
            y = self._twin_op(x, *tensors, *inputs)
        return _copy_out(self._name, y, out)

    def _forward_training(self, x: torch.Tensor, out: torch.Tensor | None, inputs: tuple = ()) -> torch.Tensor:
        """Training mode of a layer with training-mode batch norms: the output, and nn.BatchNormNd's
        update of the running statistics from the batch statistics the op (or the launch) returns."""
        batch = x.shape[0]
        if x.is_cuda and out is not None:
            self._check_input(x)
            if self._one_value_batch_norm and batch == 1:
                reference.check_batch_stats_size(self.spec, batch)
            stats = torch.empty(self._stats_size, device=x.device, dtype=torch.float32)
            conv = self._modules["conv"]
            bias = _tensor(conv, "bias") if self._has_bias else None
            params = self._launch_params()
            params.update(zip(self._input_names, inputs))
            torchop.launch(self._specialized or self.specialize(), x.contiguous(), _tensor(conv, "weight"), bias, params, out, stats)
            y = out
        else:
            if x.is_cuda:
                self._check_input(x)
            else:
                self._check_portable_input(x)
            if out is None:
                y, stats = self._op(x, *self._op_tensors(), *inputs)
            else:
                with torch.no_grad():
                    y, stats = self._op(x, *self._op_tensors(), *inputs)
                y = _copy_out(self._name, y, out)
        if batch > 0:
            reference.update_running_stats(self, self._running_stats, stats, batch)
        return y

    @property
    def key(self) -> str | None:
        return None if self._specialized is None else self._specialized.key

    def extra_repr(self) -> str:
        key = self.key[:16] if self.key else "not yet specialized"
        return f"spec={self.spec.name!r}, key={key}"

    def spec_params(self) -> dict:
        return {name: getattr(self, name) for name in self.spec.params()}

    # -- forward -------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, *inputs: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The layer on `x`, through its custom op (differentiable). `inputs`: the spec's extra
        inputs (`spec.inputs()`, in that order), each of its shape (the output's, or [batch, C, 1, ...]
        where the spec says so) and the layer's dtype.

        With `out` (a preallocated contiguous output of the right shape and the layer's dtype) the kernel fills
        it directly on CUDA (the raw launch) and no autograd graph is recorded, on any device.
        """
        if not torch.compiler.is_compiling():
            fast = self._fast  # a repeat of the last inference call: its checks and one launch
            if fast is not None and out is None and not torch.is_grad_enabled():
                y = fast.run(x, inputs)
                if y is not None:
                    return y
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{self._name}: expected a torch.Tensor input, got {type(x).__name__}")
        if self._OTHER_SIZES and x.shape[1:] != self._input_shape:
            return self._at_size(x).forward(x, *inputs, out=out)  # (forward: the hooks ran for this call)
        if inputs or self._input_names:
            self._check_extra_inputs(x, inputs)
        if self._twin_spec is not None and not self.training:
            return self._forward_eval(x, out, inputs)
        if self._stats_size:
            return self._forward_training(x, out, inputs)
        if out is not None:
            return self._forward_into(x, out, inputs)
        if x.is_cuda:
            conv = self._modules["conv"]
            weight = _tensor(conv, "weight")
            self._check_input(x, weight)
            if not torch.compiler.is_compiling():
                # Eager mode: skip the custom op's dispatch (tens of microseconds of host time).
                # Inference launches directly; with autograd on, the op's own formula records it.
                if not torch.is_grad_enabled():
                    return self._launch(x, None, conv, weight, inputs)
                sp = self._specialized or self.specialize()  # (binds the op of its key)
                bias = (_tensor(conv, "bias"),) if self._has_bias else ()
                params = self._launch_params() if self._param_names else {}
                return torchop.eager_autograd(self._spec_op, sp, (x, self._op_weight(weight), *bias, *(params[n] for n in self._param_names),
                                                                  *inputs))
        else:
            self._check_portable_input(x)
        return self._op(x, *self._op_tensors(), *inputs)

    def _forward_into(self, x: torch.Tensor, out: torch.Tensor, inputs: tuple = ()) -> torch.Tensor:
        if x.is_cuda:
            self._check_input(x)
            return self._launch(x, out, inputs=inputs)
        self._check_portable_input(x)
        with torch.no_grad():
            y = self._op(x, *self._op_tensors(), *inputs)
        return _copy_out(self._name, y, out)

    def _check_extra_inputs(self, x: torch.Tensor, inputs: tuple) -> None:
        """The extra inputs the spec names, each of its shape (the output's, or one value per sample
        and channel), x's dtype and device (the raw launch reads them unchecked)."""
        names = self._input_names
        if len(inputs) != len(names):
            want = f"the extra inputs {', '.join(names)}" if names else "no extra inputs"
            raise TypeError(f"{self._name}: takes x and {want} (spec.inputs()), got {len(inputs)} extra argument(s)")
        shapes = self._input_shapes
        for name, t in zip(names, inputs):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{self._name}: extra input {name}: expected a torch.Tensor, got {type(t).__name__}")
            shape = (x.shape[0], *shapes[name])
            if tuple(t.shape) != shape or t.dtype != x.dtype or t.device != x.device:
                what = "the output's" if shapes[name] == self._out_tail else "one value per sample and channel"
                raise ValueError(
                    f"{self._name}: extra input {name}: expected a {x.dtype} tensor of shape {list(shape)} ({what}) "
                    f"on {x.device}, got {t.dtype} {list(t.shape)} on {t.device}"
                )

    def _at_size(self, x: torch.Tensor) -> "FusedLayer":
        """The layer for `x`'s sizes past the channels, where they differ from the spec's: a
        sibling sharing this layer's parameters and buffers (the same tensors), its spec the same
        but for the input size, specialized on its first call (a kernel of its own, compiled once
        and cached as every kernel is), kept per size. Refused with the shape error where `x`
        differs in rank or channels, or the layer cannot take that size (its pool's window, say)."""
        size = tuple(x.shape[2:])
        sibling = self._at_sizes.get(size)
        if sibling is None:
            if x.dim() != 1 + len(self._input_shape) or x.shape[1] != self._input_shape[0]:
                self._check_device_and_shape(x, _tensor(self._modules["conv"], "weight"))
            try:
                spec = LayerSpec.model_validate(
                    {**self.spec.model_dump(), "input": {**self.spec.input.model_dump(), "size": list(size)}})
            except ValueError as error:  # (pydantic's ValidationError: its messages without the input dump)
                why = "; ".join(e["msg"].removeprefix("Value error, ") for e in error.errors()) \
                    if hasattr(error, "errors") else str(error)
                want = ", ".join(map(str, self._input_shape))
                raise ValueError(f"{self._name}: fused for inputs of shape [batch, {want}]; an input of shape "
                                 f"{list(x.shape)} does not fit the layer: {why}") from None
            get_logger().warning("%s: an input of sizes %s past the channels (the layer was fused at %s): "
                                 "specializing a kernel for them", self._name, list(size), list(self._input_shape[1:]))
            sibling = copy.copy(self)  # (a shallow copy: the same parameter, buffer and module dicts)
            sibling._derive(spec)
            sibling._bind_op()
            if sibling._twin_spec is not None:
                sibling._bind_twin()
            if len(self._at_sizes) >= self._SIZES_KEPT:
                self._at_sizes.pop(next(iter(self._at_sizes)))
            self._at_sizes[size] = sibling
        sibling.training = self.training
        return sibling

    def _check_portable_input(self, x: torch.Tensor) -> None:
        """Off the GPU any float dtype runs (the reference); a 16-bit dtype only in a 16-bit precision."""
        name = self._name
        weight = self.conv.weight
        want = torchop.PRECISION_DTYPE[self.spec.precision]
        for t in (x, weight):
            if (want == torch.float32 and t.dtype in torchop.LOWER_PRECISIONS) or (want != torch.float32 and t.dtype != want):
                raise ValueError(f"{name}: a precision {self.spec.precision} layer takes {want} tensors, got {t.dtype}")
        self._check_device_and_shape(x, weight)

    def _check_device_and_shape(self, x: torch.Tensor, weight: torch.Tensor) -> None:
        name = self._name
        if weight.device != x.device:
            raise ValueError(f"{name}: expected the input on the layer's device {weight.device}, got {x.device}")
        want = self._input_shape
        if x.dim() != 1 + len(want) or tuple(x.shape[1:]) != want:
            raise ValueError(
                f"{name}: expected an input of shape [batch, {', '.join(map(str, want))}], got {list(x.shape)}"
                f"{self._SHAPE_HINT}"
            )

    def _check_input(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> None:
        if weight is None:
            weight = _tensor(self._modules["conv"], "weight")
        want = torchop.PRECISION_DTYPE[self.spec.precision]
        # The common case in a few cheap comparisons (this runs on every inference forward).
        if (
            x.dtype == want
            and weight.dtype == want
            and x.get_device() == weight.get_device()
            and x.shape[1:] == self._input_shape  # also refuses a 0-d or wrongly ranked x
        ):
            return
        name = self._name
        if x.dtype != want:
            raise ValueError(f"{name}: expected a {want} input (precision {self.spec.precision}), got {x.dtype}")
        if weight.dtype != want:
            raise ValueError(
                f"{name}: the layer's parameters are {weight.dtype}, its precision {self.spec.precision} wants {want}"
            )
        self._check_device_and_shape(x, weight)

    def _launch(self, x: torch.Tensor, out: torch.Tensor | None, conv=None, weight=None, inputs: tuple = ()) -> torch.Tensor:
        """The raw kernel launch on torch's current stream (no checks of x, no autograd)."""
        if conv is None:
            conv = self._modules["conv"]
        if weight is None:
            weight = _tensor(conv, "weight")
        bias = _tensor(conv, "bias") if self._has_bias else None
        params = self._launch_params() if self._param_names else {}
        if inputs:
            params.update(zip(self._input_names, inputs))
        sp = self._specialized or self.specialize()
        if out is not None or self._twin_spec is not None or self._stats_size or tmarun.capturing(x):
            # (under a CUDA-graph capture the derived weights are made inside the graph, whose
            # memory holds nothing until a replay: a launch kept from it must not run outside)
            return torchop.launch(sp, x, weight, bias, params, out)
        # A plain inference call: kept as a FastLaunch where it is one launch, for the next call.
        record = []
        y = torchop.launch(sp, x, weight, bias, params, None, record=record)
        sources = self._fast_sources(conv) if record else None
        self._fast = None if sources is None else record[0].bind(sources)
        return y

    def _fast_sources(self, conv) -> list | None:
        """(container, name, tensor) for each of the layer's tensors a launch reads: the conv's weight
        and bias, then the per-channel parameters (FastLaunch checks them on every call); None if
        one is a plain attribute, not a parameter or buffer."""
        sources = []
        for owner, name in ((conv, "weight"), *(((conv, "bias"),) if self._has_bias else ()),
                            *((self, name) for name in self._param_names)):
            container = owner._parameters if name in owner._parameters else owner._buffers
            tensor = container.get(name)
            if tensor is None:
                return None
            sources.append((container, name, tensor))
        return sources

    def _launch_params(self) -> dict:
        """The per-channel tensors by name, as the raw launch reads them."""
        return {name: _tensor(self, name) for name in self._param_names}


def spec_shaped(tensor: torch.Tensor, want: tuple) -> torch.Tensor:
    """`tensor` viewed in the spec's shape `want`: reshaped, or a one-element tensor (a scalar
    parameter) expanded to every channel; a view either way, so gradients reach the tensor."""
    if tuple(tensor.shape) == want:
        return tensor
    if tensor.numel() == 1 and tensor.numel() != math.prod(want):
        return tensor.reshape((1,) * len(want)).expand(want)
    return tensor.reshape(want)


def _copy_out(name: str, y: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`y` copied into the caller's `out` (off the GPU, where `out=` has no raw launch)."""
    if tuple(out.shape) != tuple(y.shape) or out.dtype != y.dtype or out.device != y.device:
        raise ValueError(
            f"{name}: out must be a {y.dtype} tensor of shape {list(y.shape)} on {y.device}, "
            f"got {out.dtype} {list(out.shape)} on {out.device}"
        )
    with torch.no_grad():
        out.copy_(y)
    return out


def _tensor(module: nn.Module, name: str) -> torch.Tensor:
    """`module.<name>` read from its parameters or buffers directly: nn.Module's attribute
    lookup costs about a microsecond a name, and the launch path reads several per forward."""
    tensor = module._parameters.get(name)
    if tensor is None:
        tensor = module._buffers.get(name)
        if tensor is None:
            tensor = getattr(module, name)
    return tensor
