"""Load cubins into the GPU and launch them on torch's current stream, through the CUDA driver API.

The driver is called through ctypes on libcuda: a launch is two foreign calls (current context,
cuLaunchKernel) on pre-packed argument buffers, a few microseconds of host time. One module is
loaded per (cache key, device) and kept for the life of the process.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass

GRID_Y_MAX = 65535  # samples per launch: blockIdx.y indexes the sample
GRID_X_MAX = (1 << 31) - 1
_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
_DEFAULT_SMEM_LIMIT = 48 * 1024


class DriverError(RuntimeError):
    pass


_lock = threading.Lock()
_libcuda = None


def _driver():
    global _libcuda
    if _libcuda is None:
        with _lock:
            if _libcuda is None:
                try:
                    lib = ctypes.CDLL("libcuda.so.1")
                except OSError as err:
                    raise DriverError(f"cannot load the CUDA driver (libcuda.so.1): {err}") from None
                lib.cuLaunchKernel.argtypes = [
                    ctypes.c_void_p, *([ctypes.c_uint] * 7), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p
                ]
                lib.cuLaunchKernel.restype = ctypes.c_int
                _check(lib, lib.cuInit(0), "cuInit")
                _libcuda = lib
    return _libcuda


def _check(lib, result: int, what: str) -> None:
    if result != 0:
        name = ctypes.c_char_p()
        lib.cuGetErrorName(result, ctypes.byref(name))
        raise DriverError(f"{what} failed: {name.value.decode() if name.value else result}")


@dataclass
class LoadedKernel:
    """A kernel function loaded into one device's primary context."""

    function: ctypes.c_void_p
    context: ctypes.c_void_p
    threads: int
    smem_bytes: int
    device_index: int


_loaded: dict[tuple[str, int], LoadedKernel] = {}


def lookup(key: str, device_index: int) -> LoadedKernel | None:
    """The kernel already loaded for (key, device), else None."""
    return _loaded.get((key, device_index))


def load(key: str, cubin: bytes, kernel_name: str, threads: int, smem_bytes: int, device_index: int) -> LoadedKernel:
    """The kernel of `cubin` in device `device_index`'s primary context (the one torch uses)."""
    memo = _loaded.get((key, device_index))
    if memo is not None:
        return memo
    lib = _driver()
    with _lock:
        memo = _loaded.get((key, device_index))
        if memo is not None:
            return memo
        dev = ctypes.c_int()
        _check(lib, lib.cuDeviceGet(ctypes.byref(dev), device_index), "cuDeviceGet")
        ctx = ctypes.c_void_p()
        _check(lib, lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
        previous = ctypes.c_void_p()
        _check(lib, lib.cuCtxGetCurrent(ctypes.byref(previous)), "cuCtxGetCurrent")
        _check(lib, lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        try:
            module = ctypes.c_void_p()
            image = ctypes.create_string_buffer(cubin, len(cubin))
            _check(lib, lib.cuModuleLoadData(ctypes.byref(module), image), "cuModuleLoadData")
            function = ctypes.c_void_p()
            _check(
                lib, lib.cuModuleGetFunction(ctypes.byref(function), module, kernel_name.encode()), "cuModuleGetFunction"
            )
            if smem_bytes > _DEFAULT_SMEM_LIMIT:
                _check(
                    lib,
                    lib.cuFuncSetAttribute(function, _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem_bytes),
                    "cuFuncSetAttribute(max dynamic shared memory)",
                )
        finally:
            if previous.value:
                lib.cuCtxSetCurrent(previous)
        memo = LoadedKernel(function, ctx, threads, smem_bytes, device_index)
        _loaded[(key, device_index)] = memo
        return memo


class _ArgBuffers(threading.local):
    """Per-thread argument storage: pointer values, the batch, and the void** array over them."""

    def __init__(self):
        self.by_count: dict[int, tuple] = {}

    def get(self, n_pointers: int):
        bufs = self.by_count.get(n_pointers)
        if bufs is None:
            values = (ctypes.c_uint64 * n_pointers)()
            batch = ctypes.c_int()
            argv = (ctypes.c_void_p * (n_pointers + 1))(
                *[ctypes.addressof(values) + 8 * i for i in range(n_pointers)], ctypes.addressof(batch)
            )
            bufs = (values, batch, argv)
            self.by_count[n_pointers] = bufs
        return bufs


_args = _ArgBuffers()


def launch(
    kernel: LoadedKernel,
    blocks_per_sample: int,
    pointers: list[int],
    strides: list[int],
    batch: int,
    stream: int,
) -> None:
    """Launch over `batch` samples, at most GRID_Y_MAX per launch.

    `pointers` are the kernel's pointer arguments in order; `strides[i]` is how many bytes pointer
    i advances per sample (0 for weights and parameters), used to offset later launches.
    """
    lib = _libcuda
    current = ctypes.c_void_p()
    lib.cuCtxGetCurrent(ctypes.byref(current))
    if current.value != kernel.context.value:
        _check(lib, lib.cuCtxSetCurrent(kernel.context), "cuCtxSetCurrent")
    values, batch_arg, argv = _args.get(len(pointers))
    for first in range(0, batch, GRID_Y_MAX):
        count = min(GRID_Y_MAX, batch - first)
        for i, (ptr, stride) in enumerate(zip(pointers, strides)):
            values[i] = ptr + first * stride
        batch_arg.value = count
        result = lib.cuLaunchKernel(
            kernel.function, blocks_per_sample, count, 1, kernel.threads, 1, 1, kernel.smem_bytes, stream, argv, None
        )
        if result != 0:
            _check(lib, result, "cuLaunchKernel")
