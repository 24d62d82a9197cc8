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


@pytest.mark.parametrize("recorded_with", [False, True])
def test_a_tma_planned_launch_is_repeated_only_while_the_small_batch_rule_is_as_it_was(monkeypatch, recorded_with):
    """The small-batch rule (`SPECGEN_SMALL_BATCH`) picks the engine a TMA-planned layer's small
    batch runs on: a launch recorded under one setting is handed back once the setting changes
    (the full path plans the call again), and repeated again when it changes back."""
    monkeypatch.setattr(torchop, "_current_stream", lambda index: 77)
    weight = torch.nn.Parameter(torch.randn(4, 3, 3, 3))
    f = torchop.FastLaunch(_Prepared(3), (weight,), torch.Size((2, 3, 8, 8)), OUT_SHAPE, torch.float32, -1, (), 2,
                           small_batch=recorded_with).bind([({"weight": weight}, "weight", weight)])
    x = torch.randn(2, 3, 8, 8)
    for on, repeats in ((recorded_with, True), (not recorded_with, False), (recorded_with, True)):
        monkeypatch.setenv("SPECGEN_SMALL_BATCH", "1" if on else "0")
        assert (f.run(x, ()) is not None) == repeats, f"rule {'on' if on else 'off'}, recorded {recorded_with}"
    assert f.prepared.streams == [77, 77]


def test_a_launch_of_another_engine_ignores_the_small_batch_rule(fast, monkeypatch):
    for on in ("0", "1"):
        monkeypatch.setenv("SPECGEN_SMALL_BATCH", on)
        assert fast.run(torch.randn(2, 3, 8, 8), (torch.randn(OUT_SHAPE),)) is not None
