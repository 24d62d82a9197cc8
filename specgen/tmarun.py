"""The TMA engine's launch: prepared weights, the input's layout pass, tensor maps, two launches.

Per forward (on torch's current stream, so it also runs under CUDA-graph capture):

1. A 1x1 conv without padding (`TmaPlan.a_in_place`) reads a contiguous input where it lies:
   its A tiles are loaded from [batch][C_IN][positions] by a tiled tensor map (any other layout is
   made contiguous first; a strided conv's input positions, every stride-th, are copied out first,
   `TmaPlan.subsample`; in tf32 and fp32 mode the tiles are transposed in shared memory,
   `TmaPlan.a_staged`). Otherwise `<kernel>_prep` writes the input channels-last with its channels padded, [batch][positions][CIP]
   (split into hi and lo planes in fp32 mode), into a workspace from torch's allocator;
   `<kernel>_prep_cl` does the same from a channels-last input. A channels-last input whose
   channels need no padding is read in place (but in fp32 mode, which needs the planes). In tf32
   mode the tensor maps are of the TFLOAT32 type: the copy engine rounds each value to TF32 as it
   loads it (measured on an H200: the same results as rounding first), so nothing is rounded ahead.
2. The workspace's im2col tensor map (the TMA's description of it) is encoded, and the main kernel
   runs with it, the weights' tiled map, the bias, the parameters and the output. Where the batch
   is too small for its tiles to fill the GPU and the plan has a split kernel (`TmaPlan.split_k`,
   chosen by `splitk.pays` for this batch and this GPU's SM count), `<kernel>_split` runs
   instead, one block per (tile, part of K), into a workspace of partial sums, and
   `<kernel>_reduce` adds them up in order and runs the epilogue.

The launches for one input layout and batch are worked out once (`Launches`: the kernels, their
grids and argument arrays, where the workspace's parts lie; one allocation a call); a call writes
the addresses that changed and queues them. A `FusedLayer`'s repeat inference calls skip the rest
(`torchop.FastLaunch` keeps the call's own `Launches`).

The weights are kept permuted to [C_OUT][TAPS][CIP] and prepared like the input, with their
tensor maps, per weight tensor, and remade when the tensor changes (its version counter moves on
every in-place update, e.g. an optimizer step); under CUDA-graph capture they are always remade,
so that a replay recomputes them from the current weights.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from dataclasses import dataclass

import torch

from specgen import runtime
from specgen import splitk
from specgen.tma import INT32_MAX, NCHW_CHUNK, STAGED_BOX, STAGED_SPAN, SWIZZLE, TmaPlan

OPERAND_DTYPE = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MAP_DTYPE = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_PREP_THREADS = 256


def tf32_round(t: torch.Tensor) -> torch.Tensor:
    """Float32 values rounded to TF32 (to nearest, ties away from zero), as the kernels do."""
    bits = t.contiguous().view(torch.int32)
    return ((bits + 0x1000) & -8192).view(torch.float32)


def operand_planes(t: torch.Tensor, precision: str) -> list[torch.Tensor]:
    """`t` as the TMA hands it to the tensor cores: hi and lo planes in fp32 mode (3xTF32), else as
    it is (tf32 mode reads it through TFLOAT32 tensor maps, which round to nearest on the way)."""
    if precision == "fp32":
        hi = tf32_round(t)
        return [hi, t - hi]
    return [t.contiguous()]


def map_dtype(precision: str, dtype: torch.dtype) -> str:
    """The tensor-map element type: TFLOAT32 in tf32 mode (the copy engine rounds each float to TF32
    as it loads it), else the tensor's own."""
    return "tfloat32" if precision == "tf32" else MAP_DTYPE[dtype]


# ---- derived tensors, cached per source tensor and version -----------------------------------------
_derived: dict[tuple, tuple] = {}


_is_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)  # (absent from CPU builds)


def capturing(t: torch.Tensor) -> bool:
    """Whether a CUDA-graph capture is underway on the current stream (for CUDA `t`), cheaply."""
    return t.is_cuda and _is_capturing is not None and _is_capturing()


_reusing = [0]  # > 0 inside reusing_caches()


@contextlib.contextmanager
def reusing_caches():
    """Within: a capture reads the derived tensors already kept (their source unchanged) instead
    of recomputing them inside the graph; what is not kept is still made inside it, not kept.
    For a capture whose owner checks the sources' versions before every replay
    (`specgen.replay.GraphReplay`); any other capture remakes them, so that a replay follows the
    weights' current values."""
    _reusing[0] += 1
    try:
        yield
    finally:
        _reusing[0] -= 1


def reusing() -> bool:
    """Whether a `reusing_caches` block is open."""
    return _reusing[0] > 0


def cache_readable(t: torch.Tensor) -> tuple[bool, bool]:
    """(may a kept derived tensor of `t` be read, may a new one be kept): (True, True) outside a
    capture, (False, False) inside one, (True, False) inside one under `reusing_caches`."""
    if not capturing(t):
        return True, True
    return reusing(), False


def state(t: torch.Tensor) -> tuple[int, int]:
    """What moves when `t`'s values may have changed: its version counter (an in-place update) and
    its address (`t.data = ...`, which leaves the counter alone)."""
    return t._version, t.data_ptr()


def derived(t: torch.Tensor, what, make):
    """`make(t)`, kept per (`t`, `what`: any hashable) while `t` lives and is unchanged (`state`),
    remade under capture (but see `reusing_caches`)."""
    read, keep = cache_readable(t)
    # A view made per call (an imported Linear's [C_out, C_in] weight seen as the 1x1 conv's) is kept
    # per the tensor it views and where it lies in it, not per view object (a new one every call).
    src = t if t._base is None else t._base
    key = (id(t), what) if src is t else (id(src), what, t.shape, t.stride(), t.storage_offset())
    if read:
        hit = _derived.get(key)
        if hit is not None and hit[0]() is src and hit[1] == state(src):
            return hit[2]
    with torch.no_grad():
        value = make(t.detach())
    if keep:
        for k in [k for k, v in _derived.items() if v[0]() is None]:  # forget tensors that are gone
            del _derived[k]
        _derived[key] = (weakref.ref(src), state(src), value)
    return value


def weight_layout(weight: torch.Tensor, tp: TmaPlan, cin: int, taps: int) -> torch.Tensor:
    """The weights [C_OUT][C_IN][taps] as the main loop reads them, [C_OUT][TAPS x CIP]: K tap-major,
    the channels padded with zeros."""
    cout = weight.shape[0]
    w = weight.reshape(cout, cin, taps).transpose(1, 2)
    if tp.cip != cin:
        w = torch.nn.functional.pad(w, (0, tp.cip - cin))
    return w.reshape(cout, taps * tp.cip).contiguous()


def phase_weight_layout(weight: torch.Tensor, tp: TmaPlan, cin: int) -> torch.Tensor:
    """A transposed conv's weights [C_IN][C_OUT][taps] as its stride phases read them,
    [PHASES x N_PAD][K_TOTAL]: phase by phase, [C_OUT][the phase's taps t' x CIP] (K tap-major, in
    `TmaPhase.tap_index` order), zeros in the padded channels, past a phase's taps and past C_OUT."""
    cout = weight.shape[1]
    w = weight.reshape(cin, cout, -1)
    out = weight.new_zeros(tp.gemms, tp.n_pad, tp.k_total // tp.cip, tp.cip)
    for ph in tp.phases:
        out[ph.index, :cout, :ph.taps, :cin] = w[:, :, list(ph.tap_index)].permute(1, 2, 0)
    return out.reshape(tp.gemms * tp.n_pad, tp.k_total)


def _weights(weight: torch.Tensor, tp: TmaPlan, cin: int, taps: int, precision: str):
    """(planes, tensor maps) of the weights in `weight_layout` (`phase_weight_layout` for stride
    phases); a map's box is one B tile."""
    if tp.phases:
        layout = phase_weight_layout(weight, tp, cin)
    else:
        layout = weight_layout(weight, tp, cin, taps)
    rows = layout.shape[0]
    planes = operand_planes(layout, precision)
    maps = [
        runtime.encode_tiled(map_dtype(precision, p.dtype), p.data_ptr(), (tp.k_total, rows), (tp.k_total * tp.elem_bytes,),
                             (tp.bkc, tp.bn), tp.swizzle_tma, p.numel() * p.element_size())
        for p in planes
    ]
    return planes, maps


def as_float32(t: torch.Tensor) -> torch.Tensor:
    """`t` itself if float32, else its float32 copy, kept per tensor version (`derived`)."""
    return t if t.dtype == torch.float32 else derived(t, "float32", lambda v: v.float().contiguous())


def channels_last_format(dims: int) -> torch.memory_format | None:
    """torch's channels-last memory format for tensors of `dims` dims (4: channels_last, 5:
    channels_last_3d), or None (a 1-D conv's [N, C, L] has none)."""
    return {4: torch.channels_last, 5: torch.channels_last_3d}.get(dims)


def laid_out(t: torch.Tensor, channels_last: bool) -> torch.Tensor:
    """`t` in channels-last memory order where asked and torch has the format (4-D and 5-D tensors)."""
    fmt = channels_last_format(t.dim()) if channels_last else None
    return t if fmt is None else t.contiguous(memory_format=fmt)


def channels_last(x: torch.Tensor) -> bool:
    """Whether `x` has its channels innermost in memory ([N, spatial..., C]: channels_last(_3d))."""
    if x.is_contiguous():  # the common case, cheaply (a one-channel input is both: either layout reads it)
        return False
    fmt = channels_last_format(x.dim())
    if fmt is not None:  # torch's own check: no view made (host time on every call)
        return x.is_contiguous(memory_format=fmt)
    return x.dim() > 2 and x.movedim(1, -1).is_contiguous()


def _input_map(address: int, nbytes: int, dtype: torch.dtype, tp: TmaPlan, spatial: tuple[int, ...], batch: int,
               precision: str, phase=None) -> runtime.TensorMap:
    """The im2col map of a channels-last [batch][positions][CIP] tensor at `address`, for the conv or
    one of its stride phases (`TmaPhase`: its own box corners, stride 1)."""
    e = tp.elem_bytes
    dims = (tp.cip, *reversed(spatial), batch)  # C, W[, H[, D]], N
    strides, step = [], tp.cip * e
    for n in dims[1:]:
        strides.append(step)
        step *= n
    if phase is None:
        lower, upper, elem_strides = tp.lower, tp.upper, tp.elem_strides
    else:
        lower, upper, elem_strides = phase.lower_map, phase.upper_map, (1,) * len(phase.lower_map)
    return runtime.encode_im2col(map_dtype(precision, dtype), address, dims, tuple(strides), lower, upper, tp.bkc, tp.bm,
                                 (1, *elem_strides, 1), tp.swizzle_tma, nbytes)


def _nchw_map(address: int, dtype: torch.dtype, cin: int, tp: TmaPlan, batch: int) -> runtime.TensorMap:
    """The tiled map of a contiguous [batch][C_IN][positions] input at `address` whose A tiles are
    read in place (`TmaPlan.a_in_place`): a box of 64 positions x BKC channels of one sample,
    128-byte-swizzled (of STAGED_BOX positions where the tiles are staged, `TmaPlan.a_staged`: 128
    bytes of fp32; a TFLOAT32 map in tf32 mode rounds them as they land, fp32 mode splits them; of
    STAGED_SPAN unswizzled where the taps shift them, `TmaPlan.a_shifted`)."""
    e = tp.elem_bytes
    if tp.a_shifted:  # a conv of several taps: boxes of STAGED_SPAN positions, unswizzled, from any 16-byte boundary
        box, swizzle = STAGED_SPAN, 0
    else:
        box, swizzle = (STAGED_BOX if tp.a_staged else NCHW_CHUNK), SWIZZLE[128]["tma"]
    return runtime.encode_tiled(map_dtype(tp.precision, dtype), address, (tp.positions, cin, batch),
                                (tp.positions * e, cin * tp.positions * e), (box, tp.bkc, 1),
                                swizzle, batch * cin * tp.positions * e)


def extra_functions(plan: dict) -> tuple[str, ...]:
    """The module's kernels besides the main one: the layout passes (none where A is read in
    place), and the split kernel and its reduction where the plan has them."""
    name, tp = plan["kernel_name"], plan["tma"]
    prep = () if tp.a_in_place else (f"{name}_prep", f"{name}_prep_cl")
    return prep + (splitk.kernel_names(name) if tp.split_k > 1 else ())


_sm_counts: dict[int, int] = {}


def sm_count(index: int) -> int:
    """The SMs of CUDA device `index` (asked once per device)."""
    count = _sm_counts.get(index)
    if count is None:
        count = _sm_counts[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return count


def uses_split(tp: TmaPlan, batch: int, sms: int) -> bool:
    """Whether a launch of `batch` samples runs the split kernel."""
    return splitk.takes(batch, tp.positions, tp.bm, tp.n_tiles, tp.k_iters, tp.split_k, tp.cout, sms * tp.blocks_per_sm)


@dataclass(frozen=True)
class _Call:
    """What every launch of one TMA layer needs, worked out once per layer (its cache key)."""

    tp: TmaPlan
    precision: str
    weights_key: str  # the prepared weights' key among the derived tensors
    size: tuple  # the input's spatial extents
    cin: int
    planes: int  # operand planes: 2 (hi, lo) in fp32 mode, else 1
    in_place_cl: bool  # a channels-last input is read as it is (no padding, one plane)
    operand_dtype: torch.dtype
    prep: str  # the layout pass from a contiguous input
    prep_cl: str  # ... from a channels-last one
    param_names: tuple
    input_names: tuple
    has_bias: bool
    main_kinds: tuple  # the main kernel's argument kinds
    split: tuple  # the split kernel and its reduction (`splitk.kernel_names`), () where the plan has none
    make_weights: functools.partial  # the weights' planes and tensor maps from the conv weight


_calls: dict[str, _Call] = {}


def _call(sp) -> _Call:
    call = _calls.get(sp.key)
    if call is None:
        plan, spec = sp.plan, sp.spec
        tp: TmaPlan = plan["tma"]
        planes = 2 if tp.split else 1
        names = tuple(p["name"] for p in plan["params"])
        inputs = tuple(i["name"] for i in plan["inputs"])
        n_ptrs = spec.conv.bias + len(names) + len(inputs) + 1
        name = plan["kernel_name"]
        call = _calls[sp.key] = _Call(
            tp=tp, precision=tp.precision, weights_key=f"tma:{sp.key}",
            size=tuple(spec.input.size), cin=spec.input.channels, planes=planes, in_place_cl=tp.cip == spec.input.channels and not tp.split,
            operand_dtype=OPERAND_DTYPE[tp.precision], prep=f"{name}_prep", prep_cl=f"{name}_prep_cl",
            param_names=names, input_names=inputs, has_bias=spec.conv.bias,
            main_kinds=("map",) * ((1 if tp.a_in_place else planes * tp.gemms) + planes) + ("ptr",) * n_ptrs + ("int",),
            split=splitk.kernel_names(name) if tp.split_k > 1 else (),
            make_weights=functools.partial(_weights, tp=tp, cin=spec.input.channels, taps=plan["taps"],
                                           precision=tp.precision),
        )
    return call


_WS_ALIGN = 256  # each part of a launch's workspace starts at a multiple of this many bytes
_MAPS_KEPT = 8  # input tensor maps a `Launches` keeps, by address: torch's allocator hands back few addresses
_LAUNCHES_KEPT = 256  # `Launches` a thread keeps for the full path, by layer, input layout and batch
_KEPT_STREAMS = 4  # streams a tensor kept per stream (`per_stream`) is kept for


def per_stream(kept: dict, stream: int, make):
    """What `kept` holds for `stream`, made by `make()` (on the current stream, `stream`) the first
    time. Launches on one stream run in order, so tensors that only they use are free again for the
    next launch on that stream. Past _KEPT_STREAMS streams all are dropped, which is safe with
    launches still queued: each tensor was made on its own stream, and torch's allocator hands a
    freed block only to later work on that stream."""
    t = kept.get(stream)
    if t is None:
        if len(kept) >= _KEPT_STREAMS:
            kept.clear()
        t = kept[stream] = make()
    return t


class Launches:
    """One TMA layer's launches for one input layout (`mode`) and batch, worked out once: the
    layout pass (modes "prep" and "prep_cl"), then the main kernel, or the split kernel and its
    reduction, each with its own argument array, and where its workspace parts lie. Per call
    (`run`) only the addresses change: the input, the extra inputs, the output and the workspace,
    one allocation from torch's allocator for the pass's planes and the split's partial sums; the
    input's tensor maps are kept per address. The layer's own tensors (the weights' maps, the
    bias, the parameters) are written by `set_layer`: on every call on the full path, once for a
    recorded launch (`torchop.FastLaunch`). Owned by one thread (the arrays are not shared).

    Modes: "nchw" (a contiguous input whose A tiles are read in place, `TmaPlan.a_in_place`),
    "in_place" (a channels-last input already laid out: its channels need no padding, one plane),
    "prep" / "prep_cl" (the layout pass from a contiguous / channels-last input)."""

    __slots__ = ("c", "kernel", "batch", "mode", "prep", "plane_offsets", "plane_bytes", "partial_offset",
                 "ws_bytes", "n_maps", "steps", "layer_at", "partial_at", "_maps")

    def __init__(self, c: "_Call", kernel: runtime.LoadedKernel, mode: str, batch: int, split: bool, grid: int):
        self.c, tp = c, c.tp
        self.kernel, self.batch, self.mode = kernel, batch, mode
        offset = 0
        self.plane_offsets = ()
        self.plane_bytes = batch * tp.in_positions * tp.cip * tp.elem_bytes
        self.prep = None
        if mode in ("prep", "prep_cl"):
            step = -(-self.plane_bytes // _WS_ALIGN) * _WS_ALIGN
            self.plane_offsets = tuple(i * step for i in range(c.planes))
            offset = c.planes * step
            blocks = batch * tp.prep_tiles if mode == "prep" else -(-batch * tp.in_positions * tp.cip // _PREP_THREADS)
            pack = runtime.ArgPack(("ptr",) * (1 + c.planes) + ("int",))
            pack.put(1 + c.planes, batch)
            self.prep = (kernel.extra[c.prep if mode == "prep" else c.prep_cl], blocks, pack)
        # the input's maps: a tiled one in place; else an im2col map per plane (and stride phase)
        self.n_maps = 1 if mode == "nchw" else c.planes * max(1, len(tp.phases))
        self._maps: dict[int, list] = {}
        main_maps = self.n_maps + c.planes  # then the weights' maps, a plane each
        self.partial_offset = offset
        steps = []
        # The first step reads the maps (input, then weights); the last holds the epilogue's
        # pointers from `layer_at`: the layer's (bias, parameters), the extra inputs', the output's.
        if split:
            m_total = batch * tp.positions
            offset += tp.split_k * tp.cout * m_total * 4
            pack = runtime.ArgPack(("map",) * main_maps + ("ptr", "int"))
            pack.put(main_maps + 1, batch)
            steps.append((kernel.extra[c.split[0]], grid, tp.split_k, tp.threads, tp.smem_bytes, pack))
            reduce = runtime.ArgPack(("ptr",) + c.main_kinds[main_maps:])
            reduce.put(len(reduce.kinds) - 1, batch)
            steps.append((kernel.extra[c.split[1]], -(-m_total * tp.cout // splitk.REDUCE_THREADS), 1,
                          splitk.REDUCE_THREADS, 0, reduce))
            self.partial_at = main_maps  # (the split kernel's partial sums; the reduction's first pointer)
            self.layer_at = 1
        else:
            pack = runtime.ArgPack(c.main_kinds)
            pack.put(len(pack.kinds) - 1, batch)
            steps.append((kernel.function, grid, 1, tp.threads, tp.smem_bytes, pack))
            self.partial_at, self.layer_at = None, main_maps
        self.steps = tuple(steps)
        self.ws_bytes = offset

    def set_layer(self, weight_maps: list, pointers: list[int]) -> None:
        """The layer's own arguments: the weights' tensor maps, and the bias's and parameters' addresses."""
        pack = self.steps[0][-1]
        for i, tmap in enumerate(weight_maps):
            pack.put_map(self.n_maps + i, tmap)
        pack = self.steps[-1][-1]
        for i, p in enumerate(pointers):
            pack.put(self.layer_at + i, p)

    def _input_maps(self, address: int) -> list:
        """The input's maps, of the tensor (or the workspace) at `address`, made once per address."""
        maps = self._maps.get(address)
        if maps is None:
            c, tp, batch = self.c, self.c.tp, self.batch
            if self.mode == "nchw":
                maps = [_nchw_map(address, c.operand_dtype, c.cin, tp, batch)]
            else:
                planes = [address + o for o in self.plane_offsets] or [address]
                phases = tp.phases or (None,)
                maps = [_input_map(a, self.plane_bytes, c.operand_dtype, tp, c.size, batch, c.precision, ph)
                        for a in planes for ph in phases]
            if len(self._maps) >= _MAPS_KEPT:
                self._maps.pop(next(iter(self._maps)))
            self._maps[address] = maps
        return maps

    def run(self, x_address: int, inputs, out_address: int, stream: int, device: torch.device,
            ws: torch.Tensor | None = None) -> None:
        """Queue the launches on `stream`: `x_address` the input (laid out as the mode says),
        `inputs` the extra inputs' addresses, `out_address` the output's. `ws`: the workspace
        (`ws_bytes` bytes) where the caller keeps one for `stream`; else one is allocated."""
        kernel = self.kernel
        # (the workspace is held until every launch that reads it is queued: freed earlier, its
        # block could go to the next allocation on this stream and be overwritten)
        if ws is None and self.ws_bytes:
            ws = torch.empty(self.ws_bytes, dtype=torch.uint8, device=device)
        base = x_address
        if self.prep is not None:
            base = ws.data_ptr()
            function, blocks, pack = self.prep
            pack.put(0, x_address)
            for i, o in enumerate(self.plane_offsets):
                pack.put(1 + i, base + o)
            runtime.launch_packed(kernel, function, blocks, _PREP_THREADS, 0, pack, stream)
        pack = self.steps[0][-1]
        for i, tmap in enumerate(self._input_maps(base)):
            pack.put_map(i, tmap)
        if self.partial_at is not None:
            partial = ws.data_ptr() + self.partial_offset
            pack.put(self.partial_at, partial)
            self.steps[-1][-1].put(0, partial)
        pack = self.steps[-1][-1]
        at = self.layer_at + self.c.has_bias + len(self.c.param_names)
        for i, p in enumerate(inputs):
            pack.put(at + i, p)
        pack.put(at + len(self.c.input_names), out_address)
        for function, grid, grid_y, threads, smem, pack in self.steps:
            runtime.launch_packed(kernel, function, grid, threads, smem, pack, stream, grid_y)


class _PerThread(threading.local):
    def __init__(self):
        self.launches: dict[tuple, Launches] = {}


_per_thread = _PerThread()


def launch(sp, kernel: runtime.LoadedKernel, x: torch.Tensor, weight, bias, params: dict, out: torch.Tensor, stream: int,
           record: list | None = None):
    """Run the layer on CUDA `x` into `out` ([batch, C_OUT, ...], the layer's dtype and memory
    format). `record`: where `x` is read as it is (no copy made here), the call's own `Launches`,
    its layer arguments set, and the tensors behind them are appended as (launches, held)."""
    c = _call(sp)
    tp = c.tp
    batch = x.shape[0]
    per_launch = max(1, INT32_MAX // max(tp.positions, tp.grid_positions))
    if batch > per_launch:  # M is a 32-bit index: several launches, each on its samples
        for first in range(0, batch, per_launch):
            launch(sp, kernel, x[first:first + per_launch], weight, bias, params, out[first:first + per_launch], stream)
        return out
    planes_w, maps_w = derived(weight, c.weights_key, c.make_weights)
    if tp.a_in_place:
        mode = "nchw"
        if tp.subsample:  # a strided 1x1 conv: the stride-1 conv of the positions it reads
            x = x[(slice(None), slice(None), *(slice(None, None, st) for st in tp.subsample))]
        if not x.is_contiguous() or x.data_ptr() % 16:  # (the tensor map needs the layout, 16-byte aligned)
            x = x.clone(memory_format=torch.contiguous_format)
            record = None
    elif channels_last(x):
        mode = "in_place" if c.in_place_cl else "prep_cl"
    else:
        mode = "prep"
        if not x.is_contiguous():
            x = x.contiguous()
            record = None
    device_index = x.get_device()
    split = bool(c.split) and uses_split(tp, batch, sm_count(device_index))  # (never with stride phases)
    grid = -(-batch * (tp.grid_positions or tp.positions) // tp.bm) * tp.n_tiles * tp.grid_gemms
    if tp.persistent and not split:  # (each block walks its tiles: as many blocks as the SMs hold at once, at most one per tile)
        grid = min(grid, sm_count(device_index) * tp.blocks_per_sm)
    held = [planes_w, maps_w]
    layer = []
    if c.has_bias:
        held.append(as_float32(bias))
        layer.append(held[-1].data_ptr())
    for name in c.param_names:
        held.append(as_float32(params[name]))
        layer.append(held[-1].data_ptr())
    if record is None:
        key = (sp.key, kernel.function.value, mode, batch, split)
        kept = _per_thread.launches
        launches = kept.get(key)
        if launches is None:
            if len(kept) >= _LAUNCHES_KEPT:
                kept.pop(next(iter(kept)))
            launches = kept[key] = Launches(c, kernel, mode, batch, split, grid)
    else:
        launches = Launches(c, kernel, mode, batch, split, grid)
        record.append((launches, tuple(held)))
    launches.set_layer(maps_w, layer)
    launches.run(x.data_ptr(), [params[name].data_ptr() for name in c.input_names], out.data_ptr(), stream, x.device)
    return out
