"""The TMA engine's launch: prepared weights, the input's layout pass, tensor maps, two launches.

Per forward (on torch's current stream, so it also runs under CUDA-graph capture):

1. A 16-bit 1x1 conv without padding (`TmaPlan.a_in_place`) reads a contiguous input where it lies:
   its A tiles are loaded from [batch][C_IN][positions] by a tiled tensor map (any other layout is
   made contiguous first; a strided conv's input positions, every stride-th, are copied out first,
   `TmaPlan.subsample`). Otherwise `<kernel>_prep` writes the input channels-last with its channels padded, [batch][positions][CIP]
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

The weights are kept permuted to [C_OUT][TAPS][CIP] and prepared like the input, with their
tensor maps, per weight tensor, and remade when the tensor changes (its version counter moves on
every in-place update, e.g. an optimizer step); under CUDA-graph capture they are always remade,
so that a replay recomputes them from the current weights.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from dataclasses import dataclass

import torch

from specgen import runtime
from specgen import splitk
from specgen.tma import INT32_MAX, NCHW_CHUNK, SWIZZLE, TmaPlan

OPERAND_DTYPE = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MAP_DTYPE = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_PREP_THREADS = 256
_MAP_CACHE = 256  # input tensor maps kept (by address, batch and layer): torch's allocator hands back few addresses


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


def channels_last(x: torch.Tensor) -> bool:
    """Whether `x` has its channels innermost in memory ([N, spatial..., C]: channels_last(_3d))."""
    if x.is_contiguous():  # the common case, cheaply (a one-channel input is both: either layout reads it)
        return False
    fmt = channels_last_format(x.dim())
    if fmt is not None:  # torch's own check: no view made (host time on every call)
        return x.is_contiguous(memory_format=fmt)
    return x.dim() > 2 and x.movedim(1, -1).is_contiguous()


# key -> (the layer's TmaPlan, the map). A key names the plan by id(); the entry holds the plan, so
# that id cannot pass to another layer's plan (a freed object's id is reused) while the entry lives.
_input_maps: dict[tuple, tuple[TmaPlan, runtime.TensorMap]] = {}


def _kept_map(key: tuple, tp: TmaPlan) -> runtime.TensorMap | None:
    """The input map kept under `key` for the plan `tp`, or None."""
    hit = _input_maps.get(key)
    return hit[1] if hit is not None and hit[0] is tp else None


def _keep_map(key: tuple, tp: TmaPlan, tmap: runtime.TensorMap) -> runtime.TensorMap:
    """`tmap` kept among the input maps under `key` (the oldest dropped past _MAP_CACHE)."""
    if len(_input_maps) >= _MAP_CACHE:
        _input_maps.pop(next(iter(_input_maps)))
    _input_maps[key] = (tp, tmap)
    return tmap


def _input_map(ws: torch.Tensor, tp: TmaPlan, spatial: tuple[int, ...], batch: int, precision: str,
               phase=None) -> runtime.TensorMap:
    """The im2col map of a channels-last [batch][positions][CIP] tensor, for the conv or one of its
    stride phases (`TmaPhase`: its own box corners, stride 1); cached: it depends only on the
    address, the batch, the layer and the phase."""
    key = (ws.data_ptr(), batch, ws.dtype, id(tp), None if phase is None else phase.index)
    tmap = _kept_map(key, tp)
    if tmap is not None:
        return tmap
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
    tmap = runtime.encode_im2col(
        map_dtype(precision, ws.dtype), ws.data_ptr(), dims, tuple(strides), lower, upper, tp.bkc, tp.bm,
        (1, *elem_strides, 1), tp.swizzle_tma, ws.numel() * ws.element_size(),
    )
    return _keep_map(key, tp, tmap)


def _nchw_map(x: torch.Tensor, tp: TmaPlan, batch: int) -> runtime.TensorMap:
    """The tiled map of a contiguous [batch][C_IN][positions] input whose A tiles are read in place
    (`TmaPlan.a_in_place`): a box of 64 positions x BKC channels of one sample, 128-byte-swizzled;
    cached like the im2col maps."""
    key = (x.data_ptr(), batch, x.dtype, id(tp), "nchw")
    tmap = _kept_map(key, tp)
    if tmap is not None:
        return tmap
    cin, e = x.shape[1], tp.elem_bytes
    tmap = runtime.encode_tiled(MAP_DTYPE[x.dtype], x.data_ptr(), (tp.positions, cin, batch),
                                (tp.positions * e, cin * tp.positions * e), (NCHW_CHUNK, tp.bkc, 1),
                                SWIZZLE[128]["tma"], x.numel() * x.element_size())
    return _keep_map(key, tp, tmap)


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
            size=tuple(spec.input.size), planes=planes, in_place_cl=tp.cip == spec.input.channels and not tp.split,
            operand_dtype=OPERAND_DTYPE[tp.precision], prep=f"{name}_prep", prep_cl=f"{name}_prep_cl",
            param_names=names, input_names=inputs, has_bias=spec.conv.bias,
            main_kinds=("map",) * (planes * tp.gemms + planes) + ("ptr",) * n_ptrs + ("int",),
            split=splitk.kernel_names(name) if tp.split_k > 1 else (),
            make_weights=functools.partial(_weights, tp=tp, cin=spec.input.channels, taps=plan["taps"],
                                           precision=tp.precision),
        )
    return call


def launch(sp, kernel: runtime.LoadedKernel, x: torch.Tensor, weight, bias, params: dict, out: torch.Tensor, stream: int):
    """Run the layer on CUDA `x` into `out` ([batch, C_OUT, ...] contiguous, the layer's dtype)."""
    c = _call(sp)
    tp = c.tp
    batch = x.shape[0]
    per_launch = max(1, INT32_MAX // max(tp.positions, tp.grid_positions))
    if batch > per_launch:  # M is a 32-bit index: several launches, each on its samples
        for first in range(0, batch, per_launch):
            launch(sp, kernel, x[first:first + per_launch], weight, bias, params, out[first:first + per_launch], stream)
        return out
    _planes_w, maps_w = derived(weight, c.weights_key, c.make_weights)
    if tp.a_in_place:
        if tp.subsample:  # a strided 1x1 conv: the stride-1 conv of the positions it reads
            x = x[(slice(None), slice(None), *(slice(None, None, st) for st in tp.subsample))]
        if not x.is_contiguous() or x.data_ptr() % 16:  # (the tensor map needs the layout, 16-byte aligned)
            x = x.clone(memory_format=torch.contiguous_format)
        values = [_nchw_map(x, tp, batch)]
    else:
        # (the workspace must outlive the launches: freed before them, its block could go to the
        # next allocation on this stream, such as a 16-bit bias widened below, and be overwritten)
        values, workspace = _laid_out_maps(c, kernel, x, batch, stream)
    values += maps_w
    if c.has_bias:
        values.append(as_float32(bias).data_ptr())
    for name in c.param_names:
        values.append(as_float32(params[name]).data_ptr())
    for name in c.input_names:  # extra inputs, in the layer's dtype
        values.append(params[name].data_ptr())
    values += [out.data_ptr(), batch]
    grid = -(-batch * (tp.grid_positions or tp.positions) // tp.bm) * tp.n_tiles * tp.grid_gemms
    if c.split and uses_split(tp, batch, sm_count(x.get_device())):  # (never with stride phases)
        maps = 2 * c.planes
        m_total = batch * tp.positions
        partial = torch.empty(tp.split_k * tp.cout * m_total, device=x.device, dtype=torch.float32)
        pack = runtime.arg_pack((kernel.function.value, "split"), ("map",) * maps + ("ptr", "int"))
        pack.set(values[:maps] + [partial.data_ptr(), batch])
        runtime.launch_packed(kernel, kernel.extra[c.split[0]], grid, tp.threads, tp.smem_bytes, pack, stream, tp.split_k)
        pack = runtime.arg_pack((kernel.function.value, "reduce"), ("ptr",) + c.main_kinds[maps:])
        pack.set([partial.data_ptr(), *values[maps:]])
        runtime.launch_packed(kernel, kernel.extra[c.split[1]], -(-m_total * tp.cout // splitk.REDUCE_THREADS),
                              splitk.REDUCE_THREADS, 0, pack, stream)
        return out
    if tp.persistent:  # (each block walks its tiles: as many blocks as the SMs hold at once, at most one per tile)
        grid = min(grid, sm_count(x.get_device()) * tp.blocks_per_sm)
    pack = runtime.arg_pack((kernel.function.value, "main"), c.main_kinds)
    runtime.launch_packed(kernel, kernel.function, grid, tp.threads, tp.smem_bytes, pack.set(values), stream)
    return out


def _laid_out_maps(c: "_Call", kernel: runtime.LoadedKernel, x: torch.Tensor, batch: int,
                   stream: int) -> tuple[list, list]:
    """The im2col maps of `x` laid out channels-last (a map per stride phase, plane by plane), and
    the tensors they read: `x` itself where it is already laid out (a channels-last input whose
    channels need no padding), else a workspace the layout pass writes (`<kernel>_prep` from a
    contiguous input, `_prep_cl` from a channels-last one). The caller holds those tensors until
    its launches are queued."""
    tp = c.tp
    cl = channels_last(x)
    if cl and c.in_place_cl:
        ws_planes = [x]  # read in place: already the layout (and tf32 maps round on the way)
    else:
        if not cl:
            x = x.contiguous()
        shape = (batch, tp.in_positions, tp.cip)
        ws_planes = [torch.empty(shape, device=x.device, dtype=c.operand_dtype) for _ in range(c.planes)]
        if cl:
            fn, blocks = c.prep_cl, -(-batch * tp.in_positions * tp.cip // _PREP_THREADS)
        else:
            fn, blocks = c.prep, batch * tp.prep_tiles
        pack = runtime.arg_pack((kernel.function.value, fn), ("ptr",) * (1 + c.planes) + ("int",))
        pack.set([x.data_ptr(), *(w.data_ptr() for w in ws_planes), batch])
        runtime.launch_packed(kernel, kernel.extra[fn], blocks, _PREP_THREADS, 0, pack, stream)
    if tp.phases:
        return [_input_map(w, tp, c.size, batch, c.precision, ph) for w in ws_planes for ph in tp.phases], ws_planes
    return [_input_map(w, tp, c.size, batch, c.precision) for w in ws_planes], ws_planes
