"""A layer's recorded launch (`torchop.FastLaunch`, `runtime.Prepared`) without a GPU: which calls
it repeats and which it hands back to the full path, and the argument arrays and launch
configuration it packs. The GPU side (the kernels run through it) is tests/test_fast_launch_gpu.py."""

from __future__ import annotations

import copy
import ctypes
import pickle
import threading

import pytest

torch = pytest.importorskip("torch")

from specgen import runtime, torchop  # noqa: E402


class _Prepared:
    """Stands in for runtime.Prepared: the argument values, and the streams it was launched on."""

    def __init__(self, n: int):
        self.values = [0] * n
        self.streams: list[int] = []

    def launch(self, stream: int) -> None:
        self.streams.append(stream)


OUT_SHAPE = torch.Size((2, 4, 8, 8))


class _Recorded:
    """A recorded launch and the container its weight sits in (as a module's _parameters)."""

    def __init__(self, fast: torchop.FastLaunch, container: dict):
        self.fast, self.container = fast, container
        self.run, self.prepared = fast.run, fast.prepared


@pytest.fixture
def fast(monkeypatch):
    """A recorded launch of x [2, 3, 8, 8] with one extra input: slots x, weight, input, out; on
    CPU tensors (device index -1), the stream a fixed number."""
    monkeypatch.setattr(torchop, "_current_stream", lambda index: 77)
    weight = torch.nn.Parameter(torch.randn(4, 3, 3, 3))
    container = {"weight": weight}
    f = torchop.FastLaunch(_Prepared(4), (weight,), torch.Size((2, 3, 8, 8)), OUT_SHAPE, torch.float32, -1, (2,), 3)
    return _Recorded(f.bind([(container, "weight", weight)]), container)


def test_a_call_like_the_recorded_one_sets_the_new_addresses_and_launches(fast):
    x, shortcut = torch.randn(2, 3, 8, 8), torch.randn(OUT_SHAPE)
    out = fast.run(x, (shortcut,))
    assert out.shape == OUT_SHAPE and out.dtype == torch.float32
    values = fast.prepared.values
    assert values[0] == x.data_ptr() and values[2] == shortcut.data_ptr() and values[3] == out.data_ptr()
    assert fast.prepared.streams == [77]


def _offset(shape):
    """A contiguous tensor of `shape` that starts 4 bytes past an aligned address."""
    n = torch.Size(shape).numel()
    return torch.randn(n + 1)[1:].view(shape)


@pytest.mark.parametrize(
    "what, call",
    [
        ("another dtype", lambda f: f.run(torch.randn(2, 3, 8, 8, dtype=torch.float64), (torch.randn(OUT_SHAPE),))),
        ("another batch", lambda f: f.run(torch.randn(3, 3, 8, 8), (torch.randn(3, 4, 8, 8),))),
        ("a strided input", lambda f: f.run(torch.randn(2, 3, 8, 8).transpose(2, 3), (torch.randn(OUT_SHAPE),))),
        ("a misaligned input", lambda f: f.run(_offset((2, 3, 8, 8)), (torch.randn(OUT_SHAPE),))),
        ("a tensor subclass", lambda f: f.run(torch.nn.Parameter(torch.randn(2, 3, 8, 8)), (torch.randn(OUT_SHAPE),))),
        ("no extra input", lambda f: f.run(torch.randn(2, 3, 8, 8), ())),
        ("an extra input of another shape", lambda f: f.run(torch.randn(2, 3, 8, 8), (torch.randn(2, 4, 8, 7),))),
        ("a misaligned extra input", lambda f: f.run(torch.randn(2, 3, 8, 8), (_offset(OUT_SHAPE),))),
    ],
)
def test_a_call_unlike_the_recorded_one_is_handed_back(fast, what, call):
    assert call(fast) is None, what
    assert fast.prepared.streams == [], f"{what}: launched"


def _changed_in_place(f):
    with torch.no_grad():
        f.container["weight"].mul_(2.0)  # the version counter moves


def _replaced(f):
    f.container["weight"] = torch.nn.Parameter(torch.randn(4, 3, 3, 3))


def _storage_replaced(f):
    w = f.container["weight"]
    w.data = torch.randn(4, 3, 3, 3)  # same object and version, another address


@pytest.mark.parametrize("change", [_changed_in_place, _replaced, _storage_replaced])
def test_a_changed_layer_tensor_hands_the_call_back(fast, change):
    x, shortcut = torch.randn(2, 3, 8, 8), torch.randn(OUT_SHAPE)
    assert fast.run(x, (shortcut,)) is not None
    change(fast)
    assert fast.run(x, (shortcut,)) is None
    assert fast.prepared.streams == [77]


def test_another_thread_is_handed_back(fast):
    got = []
    thread = threading.Thread(target=lambda: got.append(fast.run(torch.randn(2, 3, 8, 8), (torch.randn(OUT_SHAPE),))))
    thread.start()
    thread.join()
    assert got == [None] and fast.prepared.streams == []


def test_a_copied_layer_starts_without_one(fast):
    assert copy.deepcopy({"fast": fast.fast}) == {"fast": None}
    assert pickle.loads(pickle.dumps([fast.fast])) == [None]


def _kernel(**kw) -> runtime.LoadedKernel:
    return runtime.LoadedKernel(ctypes.c_void_p(0x1000), ctypes.c_void_p(0x2000), threads=128, smem_bytes=4096,
                                device_index=0, **kw)


def test_prepared_packs_its_own_arguments_and_configuration():
    p = runtime.prepare(_kernel(), 7, [10, 20, 30], 5)
    assert (list(p.config.grid), list(p.config.block), p.config.shared_mem_bytes) == ([7, 5, 1], [128, 1, 1], 4096)
    assert [p.argv[i] for i in range(3)] == [ctypes.addressof(p.values) + 8 * i for i in range(3)]
    assert list(p.values) == [10, 20, 30]
    assert ctypes.c_int.from_address(p.argv[3]).value == 5  # the batch, after the pointers
    p.values[0] = 99  # what a repeat writes is what the kernel's first argument points at
    assert ctypes.c_uint64.from_address(p.argv[0]).value == 99
    flat = runtime.prepare_flat(_kernel(), 100, 64, 2, [1, 2], 3)
    assert list(flat.config.grid) == [-(-3 * 100 // 64) * 2, 1, 1]


def test_launches_of_several_parts_are_not_prepared():
    assert runtime.prepare(_kernel(), 7, [1], runtime.GRID_Y_MAX + 1) is None
    assert runtime.prepare(_kernel(cluster_at_launch=(8, 4)), 7, [1], 2) is None
    assert runtime.prepare_flat(_kernel(), 1 << 30, 128, 1, [1], 3) is None  # over 2^31 positions
    assert runtime.prepare_flat(_kernel(), 1 << 30, 128, 1, [1], 1) is not None



@pytest.fixture
def strided(monkeypatch):
    """A recorded launch of a channels-last x [2, 3, 8, 8] writing a channels-last output, with one
    extra input laid out as the output (the TMA engine's layouts)."""
    monkeypatch.setattr(torchop, "_current_stream", lambda index: 77)
    weight = torch.nn.Parameter(torch.randn(4, 3, 1, 1))
    container = {"weight": weight}
    cl = torch.channels_last
    x_strides = torch.randn(2, 3, 8, 8).to(memory_format=cl).stride()
    out_strides = torch.randn(OUT_SHAPE).to(memory_format=cl).stride()
    f = torchop.FastLaunch(_Prepared(3), (weight,), torch.Size((2, 3, 8, 8)), OUT_SHAPE, torch.float32, -1, (1,), 2,
                           x_strides, out_strides)
    return _Recorded(f.bind([(container, "weight", weight)]), container)


def test_a_strided_recorded_launch_takes_inputs_laid_out_as_recorded(strided):
    cl = torch.channels_last
    x, shortcut = torch.randn(2, 3, 8, 8).to(memory_format=cl), torch.randn(OUT_SHAPE).to(memory_format=cl)
    out = strided.run(x, (shortcut,))
    assert out is not None and out.shape == OUT_SHAPE and out.is_contiguous(memory_format=cl) and not out.is_contiguous()
    assert strided.prepared.values == [x.data_ptr(), shortcut.data_ptr(), out.data_ptr()]
    assert strided.prepared.streams == [77]


@pytest.mark.parametrize("what, x, shortcut", [
    ("a contiguous input", torch.randn(2, 3, 8, 8), torch.randn(OUT_SHAPE).to(memory_format=torch.channels_last)),
    ("a contiguous extra input", torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last), torch.randn(OUT_SHAPE)),
])
def test_a_strided_recorded_launch_hands_back_other_layouts(strided, what, x, shortcut):
    assert strided.run(x, (shortcut,)) is None, what
    assert strided.prepared.streams == [], what


def _set_rule(monkeypatch, engine: str, on: bool) -> None:
    """Turn `engine`'s small-batch switch (`pipeline.small_batch_state`) on or off."""
    if engine == "tma":
        monkeypatch.setenv("SPECGEN_SMALL_BATCH", "1" if on else "0")
    else:
        monkeypatch.setattr(torchop.pipeline, "SMALL_BATCH_SPREAD", on)


@pytest.mark.parametrize("engine, other", [("tma", "ffma"), ("ffma", "tma")])
@pytest.mark.parametrize("recorded_with", [False, True])
def test_a_launch_is_repeated_only_while_its_engines_small_batch_rule_is_as_it_was(monkeypatch, engine, other,
                                                                                    recorded_with):
    """The small-batch rules pick the kernel a layer's small batch runs (`SPECGEN_SMALL_BATCH`: the
    implicit GEMM for a TMA-planned layer; `pipeline.SMALL_BATCH_SPREAD`: the box of one tile a
    thread for an FFMA-planned one): a launch recorded under one setting of its engine's switch is
    handed back while it differs (the full path plans the call again) and repeated again when it
    changes back; the other engine's switch does not matter to it."""
    monkeypatch.setattr(torchop, "_current_stream", lambda index: 77)
    weight = torch.nn.Parameter(torch.randn(4, 3, 3, 3))
    f = torchop.FastLaunch(_Prepared(3), (weight,), torch.Size((2, 3, 8, 8)), OUT_SHAPE, torch.float32, -1, (), 2,
                           small_batch=((engine, recorded_with),)).bind([({"weight": weight}, "weight", weight)])
    x = torch.randn(2, 3, 8, 8)
    for on, repeats in ((recorded_with, True), (not recorded_with, False), (recorded_with, True)):
        _set_rule(monkeypatch, engine, on)
        for other_on in (False, True):
            _set_rule(monkeypatch, other, other_on)
            assert (f.run(x, ()) is not None) == repeats, f"rule {'on' if on else 'off'}, recorded {recorded_with}"
    assert f.prepared.streams == [77] * 4


def test_a_launch_of_another_engine_ignores_the_small_batch_rule(fast, monkeypatch):
    for on in ("0", "1"):
        monkeypatch.setenv("SPECGEN_SMALL_BATCH", on)
        assert fast.run(torch.randn(2, 3, 8, 8), (torch.randn(OUT_SHAPE),)) is not None


class _Driver:
    """Stands in for libcuda: records each launch's function, grid, block, stream and pointers."""

    def __init__(self, n_pointers: dict):
        self.n_pointers, self.launches = n_pointers, []

    def cuCtxGetCurrent(self, ref):
        return 0

    def cuCtxSetCurrent(self, ctx):
        return 0

    def cuLaunchKernelEx(self, config_ref, function, argv, extra):
        config = config_ref._obj
        n = self.n_pointers[function.value]
        self.launches.append({
            "function": function.value, "grid": tuple(config.grid)[:2], "block": config.block[0],
            "smem": config.shared_mem_bytes, "stream": config.stream,
            "pointers": [ctypes.c_uint64.from_address(argv[i]).value for i in range(n)],
            "batch": ctypes.c_int.from_address(argv[n]).value})
        return 0


@pytest.mark.parametrize("kept", [True, False])
def test_a_split_k_call_is_kept_as_its_two_launches(monkeypatch, kept):
    """An implicit-GEMM call on its split kernel (tiles x parts, then the reduction): recorded as
    both launches, repeated with the new input's and output's addresses, the partial sums kept per
    stream (or, past `KEPT_WORKSPACE_BYTES`, allocated per call) and handed from the split kernel
    to the reduction."""
    from specgen import pipeline, splitk, tmarun
    from specgen.spec import validate

    spec = validate({"name": "sk", "input": {"channels": 512, "size": [7, 7]}, "epilogue": [{"add": {"input": "shortcut"}}, "relu"],
                     "conv": {"out_channels": 512, "kernel": 3, "padding": 1}, "tile": {"engine": "igemm"}})
    sp = pipeline.specialize(spec, "sm_80")
    lp = torchop._launch_plan(sp)
    split_name, reduce_name = lp.igemm_split[4]
    kernel = runtime.LoadedKernel(ctypes.c_void_p(0x1000), ctypes.c_void_p(0x2000), threads=128, smem_bytes=4096,
                                  device_index=0, extra={split_name: ctypes.c_void_p(0x3000),
                                                         reduce_name: ctypes.c_void_p(0x4000)})
    n = 2 + lp.has_bias + len(lp.param_names) + len(lp.input_names) + 1
    driver = _Driver({0x3000: 3, 0x4000: n - 1})
    monkeypatch.setattr(runtime, "_libcuda", driver)
    monkeypatch.setattr(tmarun, "sm_count", lambda index: 132)
    monkeypatch.setattr(torchop, "igemm_uses_split", lambda lp, batch, sms: True)
    if not kept:
        monkeypatch.setattr(torchop, "KEPT_WORKSPACE_BYTES", 16)
    stream = [7]
    monkeypatch.setattr(torchop, "_current_stream", lambda index: stream[0])
    weight, bias = torch.randn(512, 512, 3, 3), torch.randn(512)
    params = {name: torch.randn(512) for name in lp.param_names}
    batch = 2
    x, shortcut = torch.randn(batch, 512, 7, 7), torch.randn(batch, 512, 7, 7)
    record = []
    out = torchop._launch_fp32(sp, lp, kernel, x, weight, bias, {**params, "shortcut": shortcut}, None, batch, 7,
                               record)
    fast = record[0]
    positions, bm, n_tiles, _, _ = lp.igemm
    parts, cout = lp.igemm_split[0], lp.igemm_split[3]
    split_grid = (-(-batch * positions // bm) * n_tiles, parts)
    reduce_grid = (-(-batch * positions * cout // splitk.REDUCE_THREADS), 1)

    def check(launches, x, shortcut, out, stream):
        split, reduce = launches
        assert (split["function"], split["grid"], split["block"], split["smem"]) == (0x3000, split_grid, 128, 4096)
        assert (reduce["function"], reduce["grid"], reduce["block"], reduce["smem"]) == (
            0x4000, reduce_grid, splitk.REDUCE_THREADS, 0)
        assert split["stream"] == reduce["stream"] == stream and split["batch"] == reduce["batch"] == batch
        assert split["pointers"][0] == x.data_ptr() and split["pointers"][2] == reduce["pointers"][0]
        assert reduce["pointers"][-2:] == [shortcut.data_ptr(), out.data_ptr()]
        return split["pointers"][1], split["pointers"][2], reduce["pointers"][1:-2]

    fixed, first_partial, rest = check(driver.launches, x, shortcut, out, 7)
    fast.bind([])
    partials = [first_partial]
    for s in (7, 7, 9, 7):
        stream[0] = s
        x2, shortcut2 = torch.randn(batch, 512, 7, 7), torch.randn(batch, 512, 7, 7)
        driver.launches.clear()
        out2 = fast.run(x2, (shortcut2,))
        assert out2 is not None and out2.shape == out.shape and out2.data_ptr() not in (out.data_ptr(), 0)
        w, partial, rest2 = check(driver.launches, x2, shortcut2, out2, s)
        assert w == fixed and rest2 == rest  # the gemm weight, bias and parameters as recorded
        partials.append(partial)
    if kept:  # one workspace per stream: the first call's on stream 7, another on stream 9
        assert partials[1] == partials[2] == partials[4] != partials[3]
        assert len(fast.prepared.workspaces) == 2
        assert fast.prepared.workspaces[7].numel() == parts * cout * batch * positions
    else:
        assert fast.prepared.workspaces is None
