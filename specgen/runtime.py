"""Load cubins into the GPU and launch them on torch's current stream, through the CUDA driver API.

The driver is called through ctypes on libcuda: a launch is two foreign calls (current context,
cuLaunchKernelEx) on pre-packed argument buffers and a launch configuration kept per grid, a few
microseconds of host time. One module is loaded per (cache key, device) and kept for the life of
the process.

Kernels whose blocks fill an SM each and share a sample's boxes through a thread-block cluster
are launched with the cluster size that finishes the batch soonest (cuLaunchKernelEx): large
clusters give a small batch many blocks (up to 16 where the device has them), small ones pack
the GPU's processor clusters fully (on an H200, clusters of 8 such blocks occupy 120 of its 132
SMs). The choice depends on the batch and the device only, so a run repeats bit for bit; the
order a sample's partial results are joined in follows the cluster size, so results for one
sample may differ in the last bits between batch sizes.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass, field

GRID_Y_MAX = 65535  # samples per launch: blockIdx.y indexes the sample
INT32_MAX = (1 << 31) - 1
GRID_X_MAX = INT32_MAX
# The most blocks a walking kernel's launch starts (None: as many as the device holds at once); the
# GPU tests lower it so that each block walks several boxes at a small batch.
WALK_BLOCKS_MAX: int | None = None
_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
_DEFAULT_SMEM_LIMIT = 48 * 1024
_CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4
_CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14
PORTABLE_CLUSTER = 8  # larger clusters need the kernel's opt-in, and a device that has them
# A block's fixed work (staging its weights, joining partials), in units of one box, when
# comparing cluster sizes: breaks ties towards fewer, longer-lived blocks.
BLOCK_OVERHEAD_BOXES = 0.25


class _LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: an id, padding to 8 bytes, a 64-byte value union."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_uint * 16)]


class _LaunchConfig(ctypes.Structure):
    """CUlaunchConfig."""

    _fields_ = [
        ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3),
        ("shared_mem_bytes", ctypes.c_uint),
        ("stream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(_LaunchAttribute)),
        ("num_attrs", ctypes.c_uint),
    ]


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
                lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
                lib.cuLaunchKernelEx.restype = ctypes.c_int
                lib.cuOccupancyMaxActiveClusters.argtypes = [
                    ctypes.POINTER(ctypes.c_int), ctypes.c_void_p, ctypes.POINTER(_LaunchConfig)
                ]
                lib.cuOccupancyMaxActiveClusters.restype = ctypes.c_int
                p, u32, u64p, u32p, ip = ctypes.c_void_p, ctypes.c_uint32, ctypes.POINTER(ctypes.c_uint64), \
                    ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_int)
                if hasattr(lib, "cuTensorMapEncodeTiled"):  # CUDA 12 drivers and newer
                    lib.cuTensorMapEncodeTiled.argtypes = [p, ctypes.c_int, u32, p, u64p, u64p, u32p, u32p, ctypes.c_int,
                                                           ctypes.c_int, ctypes.c_int, ctypes.c_int]
                    lib.cuTensorMapEncodeTiled.restype = ctypes.c_int
                    lib.cuTensorMapEncodeIm2col.argtypes = [p, ctypes.c_int, u32, p, u64p, u64p, ip, ip, u32, u32, u32p,
                                                            ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
                    lib.cuTensorMapEncodeIm2col.restype = ctypes.c_int
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
    # Clusters sized at launch: (largest cluster, boxes per kept tile); None for a fixed grid.
    cluster_at_launch: tuple[int, int] | None = None
    _cluster_for: dict[int, int] = field(default_factory=dict)  # clusters in a launch -> cluster size
    # Other kernels of the same module, by name (e.g. the TMA engine's layout passes).
    extra: dict[str, ctypes.c_void_p] = field(default_factory=dict)
    # A kernel whose blocks walk the batch's boxes (`SlabTiling.walk`): the blocks the device holds
    # at once (blocks per SM x SMs), the most a launch starts; 0: a block per box.
    walk_blocks: int = 0

    def grid(self, blocks_per_sample: int, batch: int) -> tuple[int, int]:
        """The (x, y) grid of a plain launch over `batch` samples."""
        if not self.walk_blocks:
            return blocks_per_sample, batch
        if blocks_per_sample * batch > INT32_MAX:
            raise ValueError(f"batch {batch}: {blocks_per_sample * batch} boxes, more than a walking kernel counts (2^31 - 1)")
        return min(blocks_per_sample * batch, self.walk_blocks, WALK_BLOCKS_MAX or self.walk_blocks), 1

    def cluster_size(self, clusters: int) -> int:
        """The cluster size that finishes `clusters` clusters (kept tiles x samples) soonest:
        waves of clusters the device holds at once, times each block's boxes."""
        size = self._cluster_for.get(clusters)
        if size is None:
            largest, boxes = self.cluster_at_launch
            best = None
            for c in sorted({largest, *(1 << k for k in range(largest.bit_length()) if 1 << k < largest)}):
                held = _max_active_clusters(self, c)
                if held <= 0:
                    continue
                cost = -(-clusters // held) * (-(-boxes // c) + BLOCK_OVERHEAD_BOXES)
                if best is None or cost <= best[0]:
                    best = (cost, c)
            size = best[1] if best is not None else min(largest, PORTABLE_CLUSTER)  # no answer: a size every device runs
            self._cluster_for[clusters] = size
        return size


_loaded: dict[tuple[str, int], LoadedKernel] = {}


def lookup(key: str, device_index: int) -> LoadedKernel | None:
    """The kernel already loaded for (key, device), else None."""
    return _loaded.get((key, device_index))


def _cluster_config(kernel: LoadedKernel, grid_x: int, grid_y: int, cluster: int):
    """A launch configuration (on the null stream) with its cluster-dimension attribute (both kept
    alive by the caller)."""
    attr = _LaunchAttribute()
    attr.id = _CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    attr.value[0], attr.value[1], attr.value[2] = cluster, 1, 1
    config = _LaunchConfig()
    config.grid[:] = (grid_x, grid_y, 1)
    config.block[:] = (kernel.threads, 1, 1)
    config.shared_mem_bytes = kernel.smem_bytes
    config.attrs = ctypes.pointer(attr)
    config.num_attrs = 1
    return config, attr


def _max_active_clusters(kernel: LoadedKernel, cluster: int) -> int:
    """How many clusters of `cluster` blocks of this kernel the device runs at once (0: none)."""
    lib = _driver()
    config, _attr = _cluster_config(kernel, cluster, 1, cluster)
    count = ctypes.c_int(0)
    previous = ctypes.c_void_p()
    lib.cuCtxGetCurrent(ctypes.byref(previous))
    lib.cuCtxSetCurrent(kernel.context)
    try:
        result = lib.cuOccupancyMaxActiveClusters(ctypes.byref(count), kernel.function, ctypes.byref(config))
    finally:
        if previous.value:
            lib.cuCtxSetCurrent(previous)
    return count.value if result == 0 else 0


def load(
    key: str,
    cubin: bytes,
    kernel_name: str,
    threads: int,
    smem_bytes: int,
    device_index: int,
    cluster_at_launch: tuple[int, int] | None = None,
    extra_functions: tuple[str, ...] = (),
    big_smem: tuple[str, ...] = (),
    walk_blocks: int = 0,
) -> LoadedKernel:
    """The kernel of `cubin` in device `device_index`'s primary context (the one torch uses).
    `cluster_at_launch`: (largest cluster, boxes per kept tile) when the cluster is sized at launch.
    `extra_functions`: other kernels of the module to look up (in `LoadedKernel.extra`); those in
    `big_smem` take the main kernel's dynamic shared memory (a split kernel), the others none.
    `walk_blocks`: for a kernel whose blocks walk the batch's boxes, the most blocks a launch starts."""
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
            if cluster_at_launch is not None and cluster_at_launch[0] > PORTABLE_CLUSTER:
                # Opt in to clusters past 8; where the device has none, occupancy says 0 for them.
                lib.cuFuncSetAttribute(function, _CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)
            extra = {}
            for name in extra_functions:
                f = ctypes.c_void_p()
                _check(lib, lib.cuModuleGetFunction(ctypes.byref(f), module, name.encode()), f"cuModuleGetFunction({name})")
                if name in big_smem and smem_bytes > _DEFAULT_SMEM_LIMIT:
                    _check(
                        lib,
                        lib.cuFuncSetAttribute(f, _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem_bytes),
                        f"cuFuncSetAttribute({name}, max dynamic shared memory)",
                    )
                extra[name] = f
        finally:
            if previous.value:
                lib.cuCtxSetCurrent(previous)
        memo = LoadedKernel(function, ctx, threads, smem_bytes, device_index, cluster_at_launch, extra=extra,
                            walk_blocks=walk_blocks)
        _loaded[(key, device_index)] = memo
        return memo


class _ArgBuffers(threading.local):
    """Per-thread argument storage: pointer values, the batch, and the void** array over them."""

    def __init__(self):
        self.by_count: dict[int, tuple] = {}
        self.context = ctypes.c_void_p()  # cuCtxGetCurrent's answer, reused by every launch
        self.context_ref = ctypes.byref(self.context)

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


class _ClusterConfigs(threading.local):
    """Per-thread launch configurations of clustered launches, packed once per grid and cluster."""

    def __init__(self):
        self.by_key: dict[tuple, tuple] = {}


_configs = _ClusterConfigs()


class _PlainConfigs(threading.local):
    """Per-thread launch configurations of plain launches, by (function, grid, block, shared
    memory): cuLaunchKernelEx on a packed configuration takes four arguments where cuLaunchKernel
    takes eleven, each converted by ctypes on every call (about a microsecond a launch)."""

    def __init__(self):
        self.by_key: dict[tuple, tuple] = {}


_plain = _PlainConfigs()


def _plain_config(grid_x: int, grid_y: int, threads: int, smem_bytes: int) -> tuple:
    """A launch configuration without attributes, and the reference cuLaunchKernelEx takes; its
    stream is set per launch."""
    config = _LaunchConfig()
    config.grid[0], config.grid[1], config.grid[2] = grid_x, grid_y, 1
    config.block[0], config.block[1], config.block[2] = threads, 1, 1
    config.shared_mem_bytes = smem_bytes
    config.num_attrs = 0
    return config, ctypes.byref(config)


def _launch_kernel(lib, function: ctypes.c_void_p, grid_x: int, grid_y: int, threads: int, smem_bytes: int,
                   stream: int, argv) -> None:
    """One launch of `function` on a (grid_x, grid_y) grid of `threads`-thread blocks."""
    key = (function.value, grid_x, grid_y, threads, smem_bytes)
    packed = _plain.by_key.get(key)
    if packed is None:
        if len(_plain.by_key) >= 4096:  # grids that come and go with the batch: keep the table small
            _plain.by_key.clear()
        packed = _plain.by_key[key] = _plain_config(grid_x, grid_y, threads, smem_bytes)
    config, ref = packed
    config.stream = stream
    result = lib.cuLaunchKernelEx(ref, function, argv, None)
    if result != 0:
        _check(lib, result, "cuLaunchKernelEx")


def _make_current(kernel: LoadedKernel) -> None:
    """Make the kernel's context current (if it is not)."""
    lib, args = _libcuda, _args
    lib.cuCtxGetCurrent(args.context_ref)
    if args.context.value != kernel.context.value:
        _check(lib, lib.cuCtxSetCurrent(kernel.context), "cuCtxSetCurrent")


def _prepare(kernel: LoadedKernel, n_pointers: int):
    """Make the kernel's context current (if it is not) and return this thread's argument buffers."""
    _make_current(kernel)
    return _args.get(n_pointers)


def launch(
    kernel: LoadedKernel,
    blocks_per_sample: int,
    pointers: list[int],
    strides: list[int],
    batch: int,
    stream: int,
) -> None:
    """Launch over `batch` samples, at most GRID_Y_MAX per launch.

    `blocks_per_sample`: the grid's x extent; for a cluster sized at launch, the kept tiles per
    sample (each gets a cluster). `pointers` are the kernel's pointer arguments in order;
    `strides[i]` is how many bytes pointer i advances per sample (0 for weights and parameters),
    used to offset later launches.
    """
    lib = _libcuda
    values, batch_arg, argv = _prepare(kernel, len(pointers))
    if kernel.walk_blocks or (batch <= GRID_Y_MAX and kernel.cluster_at_launch is None):
        # one plain launch, no offsets to apply (a walking kernel's blocks walk the whole batch)
        values[: len(pointers)] = pointers
        batch_arg.value = batch
        _launch_kernel(lib, kernel.function, *kernel.grid(blocks_per_sample, batch), kernel.threads, kernel.smem_bytes,
                       stream, argv)
        return
    for first in range(0, batch, GRID_Y_MAX):
        count = min(GRID_Y_MAX, batch - first)
        for i, (ptr, stride) in enumerate(zip(pointers, strides)):
            values[i] = ptr + first * stride
        batch_arg.value = count
        if kernel.cluster_at_launch is None:
            _launch_kernel(lib, kernel.function, blocks_per_sample, count, kernel.threads, kernel.smem_bytes, stream, argv)
        else:
            cluster = kernel.cluster_size(blocks_per_sample * count)
            key = (kernel.function.value, blocks_per_sample * cluster, count, cluster)
            packed = _configs.by_key.get(key)
            if packed is None:  # per thread: the stream field differs between threads
                packed = _configs.by_key[key] = _cluster_config(kernel, blocks_per_sample * cluster, count, cluster)
            config = packed[0]
            config.stream = stream
            result = lib.cuLaunchKernelEx(ctypes.byref(config), kernel.function, argv, None)
            if result != 0:
                _check(lib, result, "cuLaunchKernelEx")


class Prepared:
    """One plain launch of a kernel's main function worked out once: its own argument array
    (pointer slots, then the batch) and launch configuration, so a later call only writes the
    pointers that changed and launches. Owned by one thread (the arrays are not shared);
    `FusedLayer`'s repeat inference calls use it."""

    __slots__ = ("kernel", "function", "values", "argv", "_batch", "config", "ref")

    def __init__(self, kernel: LoadedKernel, grid_x: int, grid_y: int, pointers: list[int], batch: int,
                 function: ctypes.c_void_p | None = None, threads: int | None = None, smem_bytes: int | None = None):
        """`function`, `threads`, `smem_bytes`: another kernel of the module and its block (the
        implicit GEMM's split kernel or its reduction); the main function's when None."""
        n = len(pointers)
        self.kernel = kernel
        self.function = kernel.function if function is None else function
        self.values = (ctypes.c_uint64 * n)(*pointers)
        self._batch = ctypes.c_int(batch)
        self.argv = (ctypes.c_void_p * (n + 1))(
            *[ctypes.addressof(self.values) + 8 * i for i in range(n)], ctypes.addressof(self._batch))
        self.config, self.ref = _plain_config(grid_x, grid_y, kernel.threads if threads is None else threads,
                                              kernel.smem_bytes if smem_bytes is None else smem_bytes)

    def launch(self, stream: int) -> None:
        """Launch on `stream` with the argument values as they are now."""
        _make_current(self.kernel)
        self.config.stream = stream
        result = _libcuda.cuLaunchKernelEx(self.ref, self.function, self.argv, None)
        if result != 0:
            _check(_libcuda, result, "cuLaunchKernelEx")


def prepare(kernel: LoadedKernel, blocks_per_sample: int, pointers: list[int], batch: int) -> Prepared | None:
    """`launch`'s single launch as a `Prepared` one; None where `launch` would take several (a
    batch over GRID_Y_MAX) or size a cluster."""
    if not kernel.walk_blocks and (batch > GRID_Y_MAX or kernel.cluster_at_launch is not None):
        return None
    return Prepared(kernel, *kernel.grid(blocks_per_sample, batch), pointers, batch)


def prepare_flat(kernel: LoadedKernel, positions: int, block_m: int, n_tiles: int, pointers: list[int],
                 batch: int) -> Prepared | None:
    """`launch_flat`'s single launch as a `Prepared` one; None where it would take several."""
    if batch > _flat_per_launch(positions, block_m, n_tiles):
        return None
    return Prepared(kernel, -(-batch * positions // block_m) * n_tiles, 1, pointers, batch)


def launch_function(kernel: LoadedKernel, function: ctypes.c_void_p, grid_x: int, grid_y: int, threads: int,
                    smem_bytes: int, pointers: list[int], batch: int, stream: int) -> None:
    """One launch of another kernel of `kernel`'s module (pointer arguments, then the batch): a
    split kernel over (tiles, parts) or its reduction."""
    lib = _libcuda
    values, batch_arg, argv = _prepare(kernel, len(pointers))
    values[: len(pointers)] = pointers
    batch_arg.value = batch
    _launch_kernel(lib, function, grid_x, grid_y, threads, smem_bytes, stream, argv)


def _flat_per_launch(positions: int, block_m: int, n_tiles: int) -> int:
    """Samples one flat launch covers (its M index is a 32-bit int, its grid at most GRID_X_MAX)."""
    return max(1, min(GRID_X_MAX // positions, GRID_X_MAX // n_tiles * block_m // positions))


def launch_flat(
    kernel: LoadedKernel,
    positions: int,
    block_m: int,
    n_tiles: int,
    pointers: list[int],
    strides: list[int],
    batch: int,
    stream: int,
) -> None:
    """Launch a kernel whose grid is one flat axis over (batch x `positions`) / `block_m` tiles times
    `n_tiles` (the implicit-GEMM engine; a transposed conv's stride phases multiply them). A launch
    covers at most 2^31 - 1 positions (its M index is a 32-bit int); larger batches take several
    launches, with `strides` as in `launch`."""
    lib = _libcuda
    values, batch_arg, argv = _prepare(kernel, len(pointers))
    per_launch = _flat_per_launch(positions, block_m, n_tiles)
    for first in range(0, batch, per_launch):
        count = min(per_launch, batch - first)
        for i, (ptr, stride) in enumerate(zip(pointers, strides)):
            values[i] = ptr + first * stride
        batch_arg.value = count
        blocks = -(-count * positions // block_m) * n_tiles
        _launch_kernel(lib, kernel.function, blocks, 1, kernel.threads, kernel.smem_bytes, stream, argv)


# ---------------------------------------------------------------------------------------------
# Tensor maps (Hopper's tensor memory accelerator) and launches with by-value structs
# ---------------------------------------------------------------------------------------------

TENSOR_MAP_DTYPE = {"float32": 7, "float16": 6, "bfloat16": 9, "tfloat32": 11}  # CUtensorMapDataType
_L2_PROMOTION_128B = 2
_TENSOR_MAP_BYTES = 128
_SMALL_TENSOR = 128 * 1024


class TensorMap:
    """One CUtensorMap: 128 bytes, 64-byte aligned (as the driver asks), kept alive with its owner."""

    __slots__ = ("_raw", "address")

    def __init__(self):
        self._raw = ctypes.create_string_buffer(_TENSOR_MAP_BYTES + 64)
        self.address = ctypes.addressof(self._raw) + (-ctypes.addressof(self._raw)) % 64

    def words(self) -> list[int]:
        return list((ctypes.c_uint64 * 16).from_address(self.address))


_driver_version: list[int] = []


def _fix_small_tensor(tmap: TensorMap, nbytes: int) -> None:
    """Drivers up to 13.1 encode one flag wrongly for tensors under 128 KiB; CUTLASS clears bit 21 of
    the map's second word there, and so do we."""
    if not _driver_version:
        version = ctypes.c_int(0)
        _driver().cuDriverGetVersion(ctypes.byref(version))
        _driver_version.append(version.value)
    if _driver_version[0] <= 13010 and nbytes < _SMALL_TENSOR:
        words = (ctypes.c_uint64 * 16).from_address(tmap.address)
        words[1] &= ~(1 << 21)


def encode_im2col(dtype: str, address: int, dims: tuple[int, ...], strides: tuple[int, ...], lower: tuple[int, ...],
                  upper: tuple[int, ...], channels: int, pixels: int, element_strides: tuple[int, ...], swizzle: int,
                  nbytes: int) -> TensorMap:
    """An im2col tensor map over a channels-last tensor: `dims` innermost first (C, W[, H[, D]], N),
    `strides` in bytes of every dim but the first, the bounding box corners W first, `channels` x
    `pixels` per load, traversal `element_strides` (the conv's stride, 1 for C and N)."""
    lib = _driver()
    rank = len(dims)
    tmap = TensorMap()
    result = lib.cuTensorMapEncodeIm2col(
        ctypes.c_void_p(tmap.address), TENSOR_MAP_DTYPE[dtype], rank, ctypes.c_void_p(address),
        (ctypes.c_uint64 * rank)(*dims), (ctypes.c_uint64 * (rank - 1))(*strides),
        (ctypes.c_int * (rank - 2))(*lower), (ctypes.c_int * (rank - 2))(*upper), channels, pixels,
        (ctypes.c_uint32 * rank)(*element_strides), 0, swizzle, _L2_PROMOTION_128B, 0,
    )
    _check(lib, result, "cuTensorMapEncodeIm2col")
    _fix_small_tensor(tmap, nbytes)
    return tmap


def encode_tiled(dtype: str, address: int, dims: tuple[int, ...], strides: tuple[int, ...], box: tuple[int, ...],
                 swizzle: int, nbytes: int) -> TensorMap:
    """A tiled tensor map: `dims` innermost first, `strides` in bytes of every dim but the first, a
    `box` per load."""
    lib = _driver()
    rank = len(dims)
    tmap = TensorMap()
    result = lib.cuTensorMapEncodeTiled(
        ctypes.c_void_p(tmap.address), TENSOR_MAP_DTYPE[dtype], rank, ctypes.c_void_p(address),
        (ctypes.c_uint64 * rank)(*dims), (ctypes.c_uint64 * (rank - 1))(*strides), (ctypes.c_uint32 * rank)(*box),
        (ctypes.c_uint32 * rank)(*([1] * rank)), 0, swizzle, _L2_PROMOTION_128B, 0,
    )
    _check(lib, result, "cuTensorMapEncodeTiled")
    _fix_small_tensor(tmap, nbytes)
    return tmap


class ArgPack:
    """A kernel's argument array, packed once: each slot a tensor map (passed by value: the slot
    points at its 128 bytes), a pointer or an int. `set` changes the values; `argv` is what
    cuLaunchKernel takes."""

    __slots__ = ("kinds", "_ptrs", "_ints", "argv")

    def __init__(self, kinds: tuple[str, ...]):
        n = len(kinds)
        self.kinds = kinds
        self._ptrs = (ctypes.c_uint64 * n)()
        self._ints = (ctypes.c_int * n)()
        self.argv = (ctypes.c_void_p * n)()
        for i, kind in enumerate(kinds):
            if kind == "ptr":
                self.argv[i] = ctypes.addressof(self._ptrs) + 8 * i
            elif kind == "int":
                self.argv[i] = ctypes.addressof(self._ints) + 4 * i
            elif kind != "map":
                raise ValueError(f"unknown argument kind {kind!r}")

    def put(self, i: int, value: int) -> None:
        """Slot `i`'s value: a pointer or an int, as its kind says."""
        if self.kinds[i] == "ptr":
            self._ptrs[i] = value
        else:
            self._ints[i] = value

    def put_map(self, i: int, tmap: "TensorMap") -> None:
        """Slot `i`, a tensor map's, passes `tmap` (by value: the slot points at its bytes)."""
        self.argv[i] = tmap.address

    def set(self, values) -> "ArgPack":
        for i, (kind, v) in enumerate(zip(self.kinds, values)):
            if kind == "map":
                self.argv[i] = v.address
            elif kind == "ptr":
                self._ptrs[i] = v
            else:
                self._ints[i] = v
        return self


class _Packs(threading.local):
    def __init__(self):
        self.by_key: dict = {}


_packs = _Packs()


def arg_pack(key, kinds: tuple[str, ...]) -> ArgPack:
    """This thread's argument array for `key` (e.g. a kernel and its signature), made on first use."""
    pack = _packs.by_key.get(key)
    if pack is None:
        pack = _packs.by_key[key] = ArgPack(kinds)
    return pack


def launch_packed(kernel: LoadedKernel, function: ctypes.c_void_p, grid: int, threads: int, smem_bytes: int,
                  pack: ArgPack, stream: int, grid_y: int = 1) -> None:
    """Launch `function` (of `kernel`'s module) over a (grid, grid_y) grid with a packed argument array."""
    lib = _libcuda
    _make_current(kernel)
    _launch_kernel(lib, function, grid, grid_y, threads, smem_bytes, stream, pack.argv)


def launch_once(kernel: LoadedKernel, grid_x: int, pointers: list[int], batch: int, stream: int) -> None:
    """One launch of `grid_x` blocks whose kernel walks the whole batch itself (a training-mode batch
    norm's finalize kernel: its statistics span the batch); `batch` is its argument, never split."""
    launch_function(kernel, kernel.function, grid_x, 1, kernel.threads, kernel.smem_bytes, pointers, batch, stream)
