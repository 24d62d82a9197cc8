"""The base of the layers that run one generated kernel of their own, outside a fused layer's spec
(`specgen.concat.ConcatLayer`, `specgen.maxpool.MaxPoolLayer`): a frozen plan, the kernel built
once (at construction where CUDA is there: never during a graph capture) and loaded per device,
its launches over the batch, and the plan's custom op (what torch.compile traces), bound again
when the layer is unpickled or copied."""

from __future__ import annotations

import ctypes
import hashlib
import json
import threading
from dataclasses import asdict

import torch
import torch.nn as nn

from specgen import runtime, tmarun
from specgen.torchop import _current_stream

THREADS = 256  # every standalone kernel's block
RECORD = True  # (off: every call takes the full path: checks, layout bits, argument packing)
DTYPES = {"float32": ("float", torch.float32), "bfloat16": ("__nv_bfloat16", torch.bfloat16),
          "float16": ("__half", torch.float16)}  # a plan's dtype -> (its C type, torch's)


def check_count(value, what: str, low: int, high: int | None = None) -> int:
    """`value`, an int from `low` to `high`; ValueError naming `what` otherwise (a bool is not one)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"from {low} to {high}" if high is not None else f"at least {low}"
        raise ValueError(f"{what}: expected an integer {bound}, got {value!r}")
    return value


def dtype_name(dtype: torch.dtype) -> str:
    """A plan's name of a torch dtype ("float32", "bfloat16", "float16"); ValueError for another."""
    for name, (_, t) in DTYPES.items():
        if t == dtype:
            return name
    raise ValueError(f"dtype: expected one of {', '.join(DTYPES)}, got {dtype}")


class StandalonePlan:
    """What names a standalone kernel's plan (a frozen dataclass): `KIND`, its fields as canonical
    JSON (the cache key's spec) and the kernel name derived from them."""

    KIND = ""

    def canonical_json(self) -> str:
        return json.dumps({self.KIND: asdict(self)}, sort_keys=True, separators=(",", ":"))

    @property
    def kernel_name(self) -> str:
        return f"specgen_{self.KIND}_" + hashlib.sha256(self.canonical_json().encode()).hexdigest()[:16]


def lies_channels_last(t: torch.Tensor) -> bool:
    """Whether `t` is laid out channels-last in a torch memory format (4-D or 5-D, and not also
    contiguous): the layout bit the kernels read."""
    return tmarun.channels_last_format(t.dim()) is not None and tmarun.channels_last(t)


def prebuild(requests: list) -> list:
    """The build results of `requests`, compiled in one parallel build where a GPU will run them
    (the layers then take them, `StandaloneLayer(built=...)`); Nones without a GPU."""
    if not requests or not torch.cuda.is_available():
        return [None] * len(requests)
    from specgen import cache

    return cache.build_many(requests)


_ops: dict[str, object] = {}  # a plan's kernel name -> its custom op
_op_layers: dict[str, "StandaloneLayer"] = {}  # ... and the layer the op runs


def register_op(layer_class, plan, schema: str, fake, setup_context, backward):
    """The custom op `torch.ops.specgen.<plan's kernel name>` of `schema`, registered once per plan:
    it runs a `layer_class(plan)`'s `_run`, `fake` gives its output's metadata, `backward` (with
    `setup_context`) its gradient."""
    name = plan.kernel_name
    op = _ops.get(name)
    if op is not None:
        return op

    def impl(*args):
        layer = _op_layers.get(name)
        if layer is None:
            layer = _op_layers[name] = layer_class(plan)
        return layer._run(*args)

    impl.__name__ = name
    op = torch.library.custom_op(f"specgen::{name}", impl, mutates_args=(), schema=schema)
    op.register_fake(fake)
    op.register_autograd(backward, setup_context=setup_context)
    _ops[name] = op
    return op


class Recorded:
    """A standalone layer's last single launch, worked out once: the inputs' shapes, strides,
    dtypes and device it was for (plain tensors), the output's shape and strides, and an argument array and launch
    configuration of its own (pointer slots, then the ints and the batch as they were). A call
    alike (every input as recorded, the same thread) allocates the output, writes the pointers and
    launches: the layer's checks, layout bits and argument packing already done. Owned by the
    thread that recorded it."""

    __slots__ = ("thread", "signature", "device_index", "out_shape", "out_strides", "kernel", "values", "argv",
                 "_ints", "config", "ref")

    def __init__(self, inputs, out: torch.Tensor, kernel, pointers: list[int], ints: tuple, batch: int, blocks: int):
        n, k = len(pointers), len(ints) + 1
        self.thread = threading.get_ident()
        self.signature = signature(inputs)
        self.device_index = out.get_device()
        self.out_shape, self.out_strides = tuple(out.shape), out.stride()
        self.kernel = kernel
        self.values = (ctypes.c_uint64 * n)(*pointers)
        self._ints = (ctypes.c_int * k)(*ints, batch)
        self.argv = (ctypes.c_void_p * (n + k))(*[ctypes.addressof(self.values) + 8 * i for i in range(n)],
                                                 *[ctypes.addressof(self._ints) + 4 * i for i in range(k)])
        self.config, self.ref = runtime._plain_config(blocks, batch, THREADS, 0)

    def run(self, inputs) -> torch.Tensor | None:
        """The launch again for `inputs` (each as recorded) into a new output; None where the call
        is not alike."""
        if threading.get_ident() != self.thread or signature(inputs) != self.signature:
            return None
        out = inputs[0].new_empty_strided(self.out_shape, self.out_strides)
        values = self.values
        for i, t in enumerate(inputs):
            values[i] = t.data_ptr()
        values[len(inputs)] = out.data_ptr()
        runtime._make_current(self.kernel)
        self.config.stream = _current_stream(self.device_index)
        result = runtime._libcuda.cuLaunchKernelEx(self.ref, self.kernel.function, self.argv, None)
        if result != 0:
            runtime._check(runtime._libcuda, result, "cuLaunchKernelEx")
        return out


def signature(inputs) -> tuple:
    """What a recorded launch repeats for: each input's shape, strides, dtype and device (None for
    anything but a plain tensor, which is never recorded: it takes the full path and its checks)."""
    return tuple((t.shape, t.stride(), t.dtype, t.get_device()) if type(t) is torch.Tensor else None for t in inputs)


class StandaloneLayer(nn.Module):
    """Subclasses give `_request(plan, arch)` (the plan's cache.BuildRequest), `_custom_op(plan)`
    (`register_op` for the plan) and `_run(...)` (the op's work: the kernel on CUDA tensors,
    PyTorch's ops elsewhere)."""

    @staticmethod
    def _request(plan, arch):
        raise NotImplementedError

    @staticmethod
    def _custom_op(plan):
        raise NotImplementedError

    def __init__(self, plan, arch: str | None = None, built=None):
        """`built`: the kernel's build result where the caller built it already (`prebuild`)."""
        super().__init__()
        self.plan = plan
        self.arch = arch
        self._kernels: dict[int, object] = {}
        self._recorded: Recorded | None = None  # (the last single launch, repeated for a call alike)
        self._result = built
        self._op = self._custom_op(plan)
        if torch.cuda.is_available():
            self.build()

    def __getstate__(self):
        # (the custom op and the loaded kernels are bound to this process: bound again on unpickling)
        state = dict(self.__dict__)
        state["_op"], state["_kernels"], state["_recorded"] = None, {}, None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._op = self._custom_op(self.plan)

    def build(self):
        """Compile (or find in the cache) the kernel; returns the build result."""
        if self._result is None:
            from specgen import cache

            self._result = cache.get_or_build(self._request(self.plan, self.arch))
        return self._result

    def _kernel(self, device_index: int):
        """The kernel loaded on CUDA device `device_index`."""
        kernel = self._kernels.get(device_index)
        if kernel is None:
            from specgen import cache

            result = self.build()
            kernel = self._kernels[device_index] = runtime.load(
                result.key, cache.load_cubin_bytes(result), self.plan.kernel_name, THREADS, 0, device_index)
        return kernel

    def _replay(self, inputs) -> torch.Tensor | None:
        """The recorded launch for `inputs` where they are as it was recorded for (then the checks
        it passed hold): the output; else None."""
        recorded = self._recorded
        return None if recorded is None or not RECORD else recorded.run(inputs)

    def _queue(self, device_index: int, pointers: list[int], sample_bytes: list[int], ints: tuple, blocks: int,
               batch: int, record=None) -> None:
        """Launch the kernel on device `device_index`'s current stream over `batch` samples, the most a launch covers at a
        time (`runtime.GRID_Y_MAX`; grid: `blocks` per sample x samples): its arguments `pointers`, pointer k
        `sample_bytes[k]` further on per sample, then `ints`, then the samples of the launch. `record`: (the inputs as
        the caller gave them, the output), whose pointers lead `pointers`: a single launch is kept for calls alike."""
        kernel = self._kernel(device_index)
        n = len(pointers)
        pack = runtime.arg_pack((kernel.function.value, "standalone"), ("ptr",) * n + ("int",) * (len(ints) + 1))
        for i, value in enumerate(ints):
            pack.put(n + i, value)
        stream = _current_stream(device_index)  # (the raw accessor: a Stream object costs microseconds a call)
        for first in range(0, batch, runtime.GRID_Y_MAX):
            count = min(runtime.GRID_Y_MAX, batch - first)
            for k, (pointer, step) in enumerate(zip(pointers, sample_bytes)):
                pack.put(k, pointer + first * step)
            pack.put(n + len(ints), count)
            runtime.launch_packed(kernel, kernel.function, blocks, THREADS, 0, pack, stream, count)
        if record is not None and RECORD and batch <= runtime.GRID_Y_MAX \
                and all(type(t) is torch.Tensor for t in record[0]):
            inputs, out = record
            self._recorded = Recorded(inputs, out, kernel, pointers, ints, batch, blocks)
