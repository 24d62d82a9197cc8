"""A standalone layer's recorded launch without a GPU (the driver stubbed, as in test_fast_launch):
a call alike repeats the last single launch with the new input's and output's addresses and
nothing else changed; a call not alike (batch, strides, dtype, thread), a batch over the grid's
limit, an input copied first, a copy of the layer, or RECORD off takes the full path."""

from __future__ import annotations

import copy
import ctypes
import threading

import pytest

torch = pytest.importorskip("torch")

from specgen import runtime, standalone  # noqa: E402
from specgen.concat import ConcatLayer, ConcatPlan, Source  # noqa: E402
from specgen.maxpool import MaxPoolLayer, MaxPoolPlan  # noqa: E402
from test_fast_launch import _Driver  # noqa: E402

FUNCTION = 7
JOIN = 8  # (the join's stand-in function: argument arrays are kept per function)


@pytest.fixture
def driver(monkeypatch):
    driver = _Driver({FUNCTION: 0, JOIN: 0})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(runtime, "_libcuda", driver)
    monkeypatch.setattr(standalone, "_current_stream", lambda index: 5)
    return driver


def _arguments(launch_argv, n_pointers: int, n_ints: int) -> list[int]:
    """The pointers, then the ints, a launch's argument array points at."""
    return ([ctypes.c_uint64.from_address(launch_argv[i]).value for i in range(n_pointers)]
            + [ctypes.c_int.from_address(launch_argv[n_pointers + i]).value for i in range(n_ints)])


class _Argv(_Driver):
    """Records each launch's arguments (pointers, then ints) as well."""

    def __init__(self, n_pointers: int, n_ints: int):
        super().__init__({FUNCTION: 0, JOIN: 0})
        self.shape = (n_pointers, n_ints)
        self.arguments = []

    def cuLaunchKernelEx(self, config_ref, function, argv, extra):
        self.arguments.append(_arguments(argv, *self.shape))
        return super().cuLaunchKernelEx(config_ref, function, argv, extra)


def _layer(layer, function: int = FUNCTION):
    """`layer` with a stand-in kernel loaded for CPU tensors (device index -1)."""
    layer._kernels[-1] = runtime.LoadedKernel(ctypes.c_void_p(function), ctypes.c_void_p(99), 256, 0, -1)
    return layer


def _full(layer, inputs, out, ints, blocks, sample_bytes, record=True):
    """The full path's launch for `inputs` into `out` (as `_launch` queues it), recording it."""
    pointers = [t.data_ptr() for t in inputs] + [out.data_ptr()]
    layer._queue(-1, pointers, sample_bytes, ints, blocks, inputs[0].shape[0], record=(tuple(inputs), out) if record else None)


def test_a_pool_call_alike_repeats_the_recorded_launch_with_the_new_addresses(monkeypatch, driver):
    argv = _Argv(2, 2)
    monkeypatch.setattr(runtime, "_libcuda", argv)
    layer = _layer(MaxPoolLayer(MaxPoolPlan(3, (4, 6), (2, 2), (2, 2), "float32")))
    x, out = torch.randn(2, 3, 4, 6), torch.empty(2, 3, 2, 3)
    _full(layer, [x], out, (0,), 1, [288, 72])
    y = torch.randn(2, 3, 4, 6)
    got = layer._run(y)  # (CPU tensors alike: the recorded launch, not PyTorch's pool)
    assert got.shape == out.shape and got.stride() == out.stride() and got.data_ptr() not in (out.data_ptr(), 0)
    first, again = argv.launches
    assert {**first, "pointers": None, "batch": None} == {**again, "pointers": None, "batch": None}
    assert argv.arguments == [[x.data_ptr(), out.data_ptr(), 0, 2], [y.data_ptr(), got.data_ptr(), 0, 2]]
    assert again["grid"] == (1, 2) and again["stream"] == 5


@pytest.mark.parametrize("other", ["batch", "channels_last", "dtype", "thread", "off", "copy"])
def test_a_call_not_alike_takes_the_full_path(driver, monkeypatch, other):
    layer = _layer(MaxPoolLayer(MaxPoolPlan(3, (4, 6), (2, 2), (2, 2), "float32")))
    x, out = torch.randn(2, 3, 4, 6), torch.empty(2, 3, 2, 3)
    _full(layer, [x], out, (0,), 1, [288, 72])
    y = torch.randn(2, 3, 4, 6)
    assert layer._replay((y,)) is not None  # (alike: repeated)
    if other == "batch":
        y = torch.randn(3, 3, 4, 6)
    elif other == "channels_last":
        y = y.contiguous(memory_format=torch.channels_last)
    elif other == "dtype":
        y = y.double()
    elif other == "off":
        monkeypatch.setattr(standalone, "RECORD", False)
    elif other == "copy":
        layer = copy.deepcopy(layer)
        assert layer._recorded is None
    if other == "thread":
        got = []
        worker = threading.Thread(target=lambda: got.append(layer._replay((y,))))
        worker.start()
        worker.join()
        assert got == [None]
    else:
        assert layer._replay((y,)) is None
    assert len(driver.launches) == 2


def test_nothing_is_recorded_past_the_grid_limit_or_for_an_input_copied_first(driver):
    layer = _layer(MaxPoolLayer(MaxPoolPlan(3, (4, 6), (2, 2), (2, 2), "float32")))
    layer._queue(-1, [4096, 8192], [48, 12], (0,), 1, runtime.GRID_Y_MAX + 1, record=((torch.randn(1),), torch.empty(1)))
    assert layer._recorded is None and len(driver.launches) == 2
    layer._launch(torch.randn(2, 3, 6, 4).transpose(2, 3))  # (neither layout: copied, then launched)
    assert layer._recorded is None and len(driver.launches) == 3
    x = torch.randn(2, 3, 4, 6).contiguous(memory_format=torch.channels_last)
    out = layer._launch(x)  # (as given: recorded, its layout bit set)
    assert layer._recorded is not None and out.is_contiguous(memory_format=torch.channels_last)
    assert layer._replay((torch.randn_like(x),)).stride() == out.stride() and len(driver.launches) == 5


def test_a_join_call_alike_repeats_its_launch_with_each_source_s_address(monkeypatch, driver):
    argv = _Argv(3, 2)
    monkeypatch.setattr(runtime, "_libcuda", argv)
    plan = ConcatPlan((Source(4, (2, 3), (2, 2)), Source(2, (4, 6), (1, 1))), (4, 6), "float32", False)
    layer = _layer(ConcatLayer(plan), JOIN)
    a, b, out = torch.randn(1, 4, 2, 3), torch.randn(1, 2, 4, 6), torch.empty(1, 6, 4, 6)
    _full(layer, [a, b], out, (0,), plan.tiles, [96, 192, 576])
    a2, b2 = torch.randn(1, 4, 2, 3), torch.randn(1, 2, 4, 6)
    got = layer._run([a2, b2])
    assert got.shape == out.shape
    assert argv.arguments[1] == [a2.data_ptr(), b2.data_ptr(), got.data_ptr(), 0, 1]
    assert layer._replay([b2, a2]) is None  # (sources swapped: not alike)
    assert layer._replay([a2, torch.nn.Parameter(b2)]) is None  # (a subclass: the full path)
    with pytest.raises(ValueError, match="input 1"):
        layer._run([a2, "b"])  # (not a tensor: the full path's error)
