"""The inference launch path's host work, checked on CPU with the driver stood in for.

What the path must not do: go through nn.Module's attribute lookup (a microsecond a name) or
build torch.device objects per call; what it must still do: refuse bad inputs, hand the
layer's very tensors to the launch, and split batches past the grid's limit."""

from __future__ import annotations

import ctypes
import types

import pytest
import torch
import torch.nn as nn

from specgen import runtime, torchop
from specgen.importer import from_module
from specgen.module import FusedLayer
from specgen.spec import validate

SPEC = {
    "name": "hosty",
    "input": {"channels": 2, "size": [8, 8]},
    "conv": {"out_channels": 4, "kernel": 3},
    "epilogue": ["relu", {"add": {"param": "shift"}}],
}


@pytest.fixture
def captured(monkeypatch):
    calls = []

    def fake_launch(sp, x, weight, bias, params, out, record=None):
        calls.append((sp, x, weight, bias, params, out))
        if record is not None:  # a plain call asks for its launch to be kept: keep a stand-in
            record.append(torchop.FastLaunch(types.SimpleNamespace(values=[0] * 4), (), x.shape, x.shape, x.dtype,
                                             x.get_device(), (), 3))
        return "launched"

    monkeypatch.setattr(torchop, "launch", fake_launch)
    return calls


@pytest.fixture
def getattr_count(monkeypatch):
    count = [0]
    real = nn.Module.__getattr__

    def counting(self, name):
        count[0] += 1
        return real(self, name)

    monkeypatch.setattr(nn.Module, "__getattr__", counting)
    return count


def test_launch_reads_the_layers_tensors_without_module_attribute_lookups(captured, getattr_count):
    layer = FusedLayer(validate(SPEC))
    layer._specialized = types.SimpleNamespace(key="0" * 64)
    x = torch.randn(3, 2, 8, 8)
    getattr_count[0] = 0
    layer._check_input(x)
    assert layer._launch(x, None) == "launched"
    assert getattr_count[0] == 0
    (sp, got_x, weight, bias, params, out), = captured
    assert sp is layer._specialized and got_x is x and out is None
    assert weight is layer.conv.weight and bias is layer.conv.bias and params == {"shift": layer.shift}
    # the kept launch checks the layer's very tensors, where they live, on every repeat
    sources = [(container, name, t) for container, name, t, _, _ in layer._fast.sources]
    assert sources == [(layer.conv._parameters, "weight", layer.conv.weight), (layer.conv._parameters, "bias", layer.conv.bias),
                       (layer._parameters, "shift", layer.shift)]
    assert layer._launch(x, torch.empty(3, 4, 6, 6)) == "launched" and layer._fast is not None  # out= keeps it as it is


def test_launch_finds_buffers_of_an_imported_layer(captured):
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(2, 4, 3, bias=False)
            self.bn = nn.BatchNorm2d(4)

        def forward(self, x):
            return torch.relu(self.bn(self.conv(x)))

    model = Model().eval()
    fused = from_module(model, torch.randn(1, 2, 8, 8))
    (layer,) = [m for m in fused.modules() if isinstance(m, FusedLayer)]
    layer._specialized = types.SimpleNamespace(key="1" * 64)
    layer._launch(torch.randn(1, 2, 8, 8), None)
    (_, _, weight, bias, params, _), = captured
    assert weight is model.conv.weight and bias is None
    tensors = {id(t) for t in params.values()}
    assert {id(model.bn.running_mean), id(model.bn.running_var)} <= tensors
    kept = {name: (container, t) for container, name, t, _, _ in layer._fast.sources}
    assert kept["weight"] == (model.conv._parameters, model.conv.weight)
    buffers = [t for container, t in kept.values() if container is layer._buffers]
    assert {id(model.bn.running_mean), id(model.bn.running_var)} <= {id(t) for t in buffers}


@pytest.mark.parametrize(
    "x, message",
    [
        (torch.randn(3, 2, 8, 8, dtype=torch.float64), r"expected a torch.float32 input \(precision tf32\), got torch.float64"),
        (torch.randn(3, 2, 8, 9), r"expected an input of shape \[batch, 2, 8, 8\], got \[3, 2, 8, 9\]"),
        (torch.randn(2, 8, 8), r"expected an input of shape \[batch, 2, 8, 8\], got \[2, 8, 8\]"),
        (torch.tensor(1.0), r"expected an input of shape \[batch, 2, 8, 8\], got \[\]"),
        (torch.randn(1, 3, 2, 8, 8), r"expected an input of shape \[batch, 2, 8, 8\], got \[1, 3, 2, 8, 8\]"),
    ],
)
def test_the_cheap_input_check_still_refuses(x, message):
    layer = FusedLayer(validate(SPEC))
    with pytest.raises(ValueError, match=message):
        layer._check_input(x)


def test_half_parameters_are_refused_by_the_cheap_check():
    layer = FusedLayer(validate(SPEC))
    with torch.no_grad():
        weight = layer.conv.weight.half()
    with pytest.raises(ValueError, match="the layer's parameters are torch.float16, its precision tf32 wants torch.float32"):
        layer._check_input(torch.randn(1, 2, 8, 8), weight)


class FakeDriver:
    """Stands in for libcuda: records each launch's grid and the pointer arguments it saw."""

    def __init__(self, n_pointers):
        self.n = n_pointers
        self.launches = []
        self.set_current = 0

    def cuCtxGetCurrent(self, ref):
        return 0

    def cuCtxSetCurrent(self, ctx):
        self.set_current += 1
        return 0

    def cuLaunchKernelEx(self, config_ref, function, argv, extra):
        config = config_ref._obj  # the CUlaunchConfig the launch packed
        return self.cuLaunchKernel(function, *config.grid, *config.block, config.shared_mem_bytes, config.stream, argv, extra)

    def cuLaunchKernel(self, function, gx, gy, gz, bx, by, bz, smem, stream, argv, extra):
        values = [ctypes.cast(argv[i], ctypes.POINTER(ctypes.c_uint64))[0] for i in range(self.n)]
        batch = ctypes.cast(argv[self.n], ctypes.POINTER(ctypes.c_int))[0]
        self.launches.append({"grid": (gx, gy, gz), "block": bx, "stream": stream, "pointers": values, "batch": batch})
        return 0


@pytest.mark.parametrize("batch", [1, 5, runtime.GRID_Y_MAX])
def test_a_batch_that_fits_one_grid_is_one_launch(monkeypatch, batch):
    driver = FakeDriver(3)
    monkeypatch.setattr(runtime, "_libcuda", driver)
    kernel = runtime.LoadedKernel(ctypes.c_void_p(7), ctypes.c_void_p(99), 128, 0, 0)
    runtime.launch(kernel, 6, [4096, 8192, 16384], (64, 0, 32), batch, 5)
    assert driver.launches == [{"grid": (6, batch, 1), "block": 128, "stream": 5, "pointers": [4096, 8192, 16384], "batch": batch}]
    assert driver.set_current == 1  # the fake's current context (none) is not the kernel's


def test_a_batch_past_the_grid_limit_is_split_with_offsets(monkeypatch):
    driver = FakeDriver(3)
    monkeypatch.setattr(runtime, "_libcuda", driver)
    kernel = runtime.LoadedKernel(ctypes.c_void_p(7), ctypes.c_void_p(99), 128, 0, 0)
    batch = runtime.GRID_Y_MAX + 3
    runtime.launch(kernel, 6, [4096, 8192, 16384], (64, 0, 32), batch, 5)
    assert [(launch["grid"][1], launch["batch"]) for launch in driver.launches] == [(runtime.GRID_Y_MAX, runtime.GRID_Y_MAX), (3, 3)]
    assert driver.launches[1]["pointers"] == [4096 + 64 * runtime.GRID_Y_MAX, 8192, 16384 + 32 * runtime.GRID_Y_MAX]


def test_the_implicit_gemm_grid_is_flat_over_batch_times_positions(monkeypatch):
    driver = FakeDriver(3)
    monkeypatch.setattr(runtime, "_libcuda", driver)
    kernel = runtime.LoadedKernel(ctypes.c_void_p(7), ctypes.c_void_p(99), 256, 0, 0)
    runtime.launch_flat(kernel, 196, 128, 4, [4096, 8192, 16384], (64, 0, 32), 5, 3)
    # ceil(5 * 196 / 128) = 8 position tiles, times 4 channel tiles, in one launch
    assert driver.launches == [{"grid": (32, 1, 1), "block": 256, "stream": 3, "pointers": [4096, 8192, 16384], "batch": 5}]


def test_the_implicit_gemm_splits_batches_past_32_bit_positions(monkeypatch):
    driver = FakeDriver(3)
    monkeypatch.setattr(runtime, "_libcuda", driver)
    kernel = runtime.LoadedKernel(ctypes.c_void_p(7), ctypes.c_void_p(99), 256, 0, 0)
    positions = 1 << 20  # 2048 samples make 2^31 positions: one more than a 32-bit M holds
    runtime.launch_flat(kernel, positions, 128, 1, [4096, 8192, 16384], (64, 0, 32), 2048, 3)
    assert [launch["batch"] for launch in driver.launches] == [2047, 1]
    assert all(launch["batch"] * positions <= runtime.GRID_X_MAX for launch in driver.launches)
    assert driver.launches[1]["pointers"] == [4096 + 64 * 2047, 8192, 16384 + 32 * 2047]


def test_eager_autograd_records_the_ops_backward(monkeypatch):
    """With autograd on, an eager call runs the launch inside an autograd.Function whose backward is
    the op's (recompute with the reference): checked on CPU with the kernel stood in for by the
    reference's detached result."""
    from specgen import reference

    spec = validate(SPEC)
    layer = FusedLayer(spec)
    op = layer.op

    grad_mode = []

    def kernel(sp, x, weight, bias, params, out):
        assert out is None
        grad_mode.append(torch.is_grad_enabled())
        shaped = {name: t.reshape(spec.params()[name]) for name, t in params.items()}  # C values, as the kernel reads them
        return reference.forward(spec, x, weight, bias, shaped).detach()

    monkeypatch.setattr(torchop, "launch", kernel)
    x = torch.randn(2, 2, 8, 8, requires_grad=True)
    tensors = layer._op_tensors()
    y = torchop.eager_autograd(op, None, (x, *tensors))
    assert "_Eager" in type(y.grad_fn).__name__ and grad_mode == [False]  # the Function's forward records nothing
    g = torch.randn(y.shape)
    got = torch.autograd.grad(y, [x, *tensors], g)
    y_ref = reference.forward(spec, x, tensors[0], tensors[1], {"shift": tensors[2]})
    want = torch.autograd.grad(y_ref, [x, *tensors], g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    # the per-channel tensors as a model holds them (C values, here 1-D; the raw launch reads them so):
    # their gradients come back in their own shape
    flat = tensors[2].detach().reshape(-1).clone().requires_grad_()
    assert tuple(flat.shape) != tuple(tensors[2].shape)
    y = torchop.eager_autograd(op, None, (x, tensors[0], tensors[1], flat))
    got = torch.autograd.grad(y, [x, flat], g)
    y_ref = reference.forward(spec, x, tensors[0], tensors[1], {"shift": flat.reshape(tensors[2].shape)})
    want = torch.autograd.grad(y_ref, [x, flat], g)
    assert got[1].shape == flat.shape
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    # nothing needs a gradient: the launch alone, no graph
    with torch.no_grad():
        frozen = [t.detach() for t in tensors]
    assert torchop.eager_autograd(op, None, (x.detach(), *frozen)).grad_fn is None


@pytest.mark.parametrize("batch,grid_x", [(1, 6), (5, 30), (200, 264), (runtime.GRID_Y_MAX + 3, 264)])
def test_a_walking_kernel_is_one_launch_of_at_most_the_blocks_the_device_holds(monkeypatch, batch, grid_x):
    """A kernel whose blocks walk the batch's boxes (`SlabTiling.walk`) is one launch of
    min(boxes, blocks the device holds) blocks along x, the whole batch passed, no pointer offsets."""
    driver = FakeDriver(3)
    monkeypatch.setattr(runtime, "_libcuda", driver)
    kernel = runtime.LoadedKernel(ctypes.c_void_p(7), ctypes.c_void_p(99), 128, 0, 0, walk_blocks=264)
    runtime.launch(kernel, 6, [4096, 8192, 16384], (64, 0, 32), batch, 5)
    assert driver.launches == [{"grid": (grid_x, 1, 1), "block": 128, "stream": 5, "pointers": [4096, 8192, 16384], "batch": batch}]
    prepared = runtime.prepare(kernel, 6, [4096, 8192, 16384], batch)
    assert prepared is not None and tuple(prepared.config.grid) == (grid_x, 1, 1) and prepared._batch.value == batch
    monkeypatch.setattr(runtime, "WALK_BLOCKS_MAX", 4)
    assert kernel.grid(6, batch) == (4, 1)
    with pytest.raises(ValueError, match="more than a walking kernel counts"):
        kernel.grid(1 << 20, 1 << 12)
