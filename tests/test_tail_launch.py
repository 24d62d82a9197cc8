"""The sequence launcher's host work (specgen/tailrun.py), checked on CPU with the driver and the
body engine's launch stood in for: every step in the plan's order, each kernel on the grid its plan
gives with the workspaces it names (the buffer one kernel writes is the one the next reads), the
per-sample strides when a batch is past the grid's limit, and a batch norm's finalize launched once
over the whole batch, writing into the layer's batch statistics."""

from __future__ import annotations

import ctypes
import types

import pytest
import torch

from specgen import runtime, tailrun, torchop
from specgen.plan import build_plan
from specgen.spec import validate

from test_tail import IDS, VARIANTS


class Recorder:
    """Stands in for libcuda and for torchop.launch: records every launch in order."""

    def __init__(self, plan):
        self.events = []
        self.n_pointers = {}
        self.kernels = {}
        for index, step in enumerate(plan["steps"]):
            if step["kind"] == "kernel":
                function = ctypes.c_void_p(1000 + index)
                self.n_pointers[function.value] = len(step["args"])
                self.kernels[step["name"]] = runtime.LoadedKernel(function, ctypes.c_void_p(99), step["threads"], 0, 0)

    # libcuda
    def cuCtxGetCurrent(self, ref):
        return 0

    def cuCtxSetCurrent(self, ctx):
        return 0

    def cuLaunchKernelEx(self, config_ref, function, argv, extra):
        config = config_ref._obj  # the CUlaunchConfig the launch packed
        return self.cuLaunchKernel(function, *config.grid, *config.block, config.shared_mem_bytes, config.stream, argv, extra)

    def cuLaunchKernel(self, function, gx, gy, gz, bx, by, bz, smem, stream, argv, extra):
        function = function.value  # the kernel's c_void_p, as the launch passes it
        n = self.n_pointers[function]
        values = [ctypes.cast(argv[i], ctypes.POINTER(ctypes.c_uint64))[0] for i in range(n)]
        batch = ctypes.cast(argv[n], ctypes.POINTER(ctypes.c_int))[0]
        self.events.append({"kind": "kernel", "function": function, "grid": (gx, gy, gz), "block": bx,
                            "pointers": values, "batch": batch, "stream": stream})
        return 0

    # torchop.launch for the body and the rests
    def layer_launch(self, sp, x, weight, bias, params, out):
        self.events.append({"kind": "layer", "part": sp.part, "in": (x.data_ptr(), tuple(x.shape)),
                            "out": (out.data_ptr(), tuple(out.shape)), "weight": weight, "bias": bias})
        return out


@pytest.fixture
def recorder(monkeypatch):
    def make(plan):
        rec = Recorder(plan)
        monkeypatch.setattr(runtime, "_libcuda", rec)
        monkeypatch.setattr(torchop, "launch", rec.layer_launch)
        monkeypatch.setattr(torchop, "_current_stream", lambda device: 5)
        monkeypatch.setattr(tailrun, "_kernel", lambda sp, step, device: rec.kernels[step["name"]])
        monkeypatch.setattr(tailrun, "_identity_weight", lambda c, nd, device: torch.ones((c, 1, *[1] * nd)))
        tailrun._sequences.clear()
        return rec

    return make


def sequence(name):
    spec = validate(VARIANTS[IDS.index(name)])
    plan = build_plan(spec)
    build = types.SimpleNamespace(key="7" * 64)
    return spec, plan, types.SimpleNamespace(spec=spec, plan=plan, source="", build=build, key=build.key)


def run(sp, spec, batch, stats=None):
    x = torch.randn(batch, spec.input.channels, *spec.input.size)
    weight = torch.randn(spec.weight_shape())
    bias = torch.randn(spec.conv.out_channels) if spec.conv.bias else None
    params = {n: torch.randn(s) for n, s in spec.params().items()}
    out = tailrun.launch(sp, x, weight, bias, params, None, stats)
    return x, weight, params, out


@pytest.mark.parametrize("name", ["gn_pool", "bn_train", "sm_max", "two_norms", "chain_1d"])
def test_steps_launch_in_order_and_hand_each_buffer_on(recorder, name):
    spec, plan, sp = sequence(name)
    rec = recorder(plan)
    batch = 3
    x, weight, params, out = run(sp, spec, batch)
    assert tuple(out.shape) == spec.output_shape(batch)
    assert len(rec.events) == len(plan["steps"])
    written = {"x": x.data_ptr()}  # buffer name -> the address its writer used
    for step, event in zip(plan["steps"], rec.events):
        assert event["kind"] == step["kind"]
        if step["kind"] == "layer":
            part = plan["parts"][step["part"]]
            assert event["part"] == part["namespace"]
            assert event["in"][0] == written[step["in"]]
            assert event["in"][1] == (batch, part["spec"].input.channels, *part["spec"].input.size)
            assert event["out"][1] == (batch, *step["out_shape"])
            if part["role"] == "body":
                assert event["weight"] is weight
            else:  # the identity conv of a rest: ones, depthwise, no bias
                assert torch.equal(event["weight"], torch.ones(part["spec"].weight_shape())) and event["bias"] is None
            written[step["out"]] = event["out"][0]
            continue
        assert event["block"] == step["threads"] and event["stream"] == 5
        assert event["grid"] == ((step["grid_x"], 1, 1) if step["once"] else (step["grid_x"], batch, 1))
        assert event["batch"] == batch
        for arg, pointer in zip(step["args"], event["pointers"]):
            if arg.startswith("p_"):
                assert pointer == params[arg[2:]].data_ptr()
            elif arg == step["args"][-1]:
                written[arg] = pointer
            else:
                assert pointer == written[arg], arg
    assert written["out"] == out.data_ptr()


def test_the_launch_is_worked_out_from_the_typed_steps(recorder):
    """What `tailrun` reads of the plan: a body or rest step's part, buffers and identity channels;
    a kernel step's arguments (a buffer, a parameter) and the bytes each advances per sample; the
    workspaces: per sample, a slice of the layer's statistics."""
    spec, plan, sp = sequence("bn_train")
    recorder(plan)
    seq = tailrun._sequence(sp)
    kinds = [type(s) for s in seq.steps]
    assert kinds == [tailrun._Layer, tailrun._Kernel, tailrun._Kernel, tailrun._Kernel, tailrun._Layer, tailrun._Kernel]
    body, stats, finalize, apply, rest, norm = seq.steps
    assert body.body and (body.part.part, body.src, body.dst, body.in_shape, body.out_shape, body.ones) == \
        ("body", "x", "t0", (4, 9, 9), (8, 7, 7), 0)
    assert not rest.body and (rest.part.part, rest.src, rest.dst, rest.in_shape, rest.ones) == ("e0_rest", "u0", "t3", (8, 7, 7), 8)
    t0, partials = 4 * plan.buffers["t0"], 4 * plan.buffers["partials0"]
    assert (stats.args, stats.strides, stats.once) == ((("b", "t0"), ("b", "partials0")), (t0, partials), False)
    assert (finalize.args, finalize.strides, finalize.once) == ((("b", "partials0"), ("b", "stat0")), (partials, 0), True)
    assert apply.args == (("b", "t0"), ("b", "stat0"), ("p", "bn_weight"), ("p", "bn_bias"), ("b", "u0"))
    assert apply.strides == (t0, 0, 0, 0, 4 * plan.buffers["u0"])
    assert norm.key == f"{sp.key}:specgen_bn_train_e3_norm" and norm.grid_x == plan.steps[-1].grid_x
    assert seq.buffers == (("t0", "sample", 392), ("u0", "sample", 392), ("partials0", "sample", 16), ("stat0", "stats", 0),
                           ("t3", "sample", 72))
    assert seq.stats_floats == 16 and seq.out_shape == tuple(plan.out_shape)


def test_batch_statistics_land_in_the_layers_stats_tensor(recorder):
    spec, plan, sp = sequence("bn_train")
    rec = recorder(plan)
    stats = torch.full((plan["stats_floats"],), float("nan"))
    run(sp, spec, 2, stats)
    finalize = next(e for s, e in zip(plan["steps"], rec.events) if s.get("name", "").endswith("_finalize"))
    assert finalize["pointers"][1] == stats.data_ptr() and finalize["grid"] == (8, 1, 1)
    with pytest.raises(ValueError, match="stats must be a float32 tensor of 16 values"):
        run(sp, spec, 2, torch.empty(3))


WIDE = {"name": "wide", "input": {"channels": 1, "size": [4]}, "conv": {"out_channels": 2, "kernel": 1},
        "epilogue": [{"batch_norm": {"training": True}}, {"group_norm": 1}, {"softmax": 1}]}


def test_a_batch_past_the_grid_limit_splits_per_sample_kernels_only(recorder):
    spec = validate(WIDE)
    plan = build_plan(spec)
    build = types.SimpleNamespace(key="8" * 64)
    sp = types.SimpleNamespace(spec=spec, plan=plan, source="", build=build, key=build.key)
    rec = recorder(plan)
    batch = runtime.GRID_Y_MAX + 2
    run(sp, spec, batch)
    name_of = {k.function.value: name for name, k in rec.kernels.items()}
    launches = {}
    for event in rec.events:
        if event["kind"] == "kernel":
            launches.setdefault(name_of[event["function"]], []).append(event)
    first, second = launches["specgen_wide_e0_stats"]
    assert [(e["grid"][1], e["batch"]) for e in (first, second)] == [(runtime.GRID_Y_MAX, runtime.GRID_Y_MAX), (2, 2)]
    assert second["pointers"][0] - first["pointers"][0] == 4 * plan["buffers"]["t0"] * runtime.GRID_Y_MAX
    assert second["pointers"][1] - first["pointers"][1] == 4 * plan["buffers"]["partials0"] * runtime.GRID_Y_MAX
    (finalize,) = launches["specgen_wide_e0_finalize"]  # one launch walks every sample's partials
    assert finalize["batch"] == batch and finalize["grid"] == (2, 1, 1)
    first, second = launches["specgen_wide_e0_apply"]
    assert second["pointers"][1] == first["pointers"][1]  # the batch's statistic: no stride
    assert second["pointers"][-1] - first["pointers"][-1] == 4 * plan["buffers"]["u0"] * runtime.GRID_Y_MAX
    for name in ("specgen_wide_e1_norm", "specgen_wide_e2_softmax"):
        assert [e["batch"] for e in launches[name]] == [runtime.GRID_Y_MAX, 2]


def test_out_is_checked(recorder):
    spec, plan, sp = sequence("gn_pool")
    recorder(plan)
    x = torch.randn(2, spec.input.channels, *spec.input.size)
    with pytest.raises(ValueError, match=r"out must be a contiguous torch.float32 tensor of shape \[2, 8, 9, 9\]"):
        tailrun.launch(sp, x, torch.randn(spec.weight_shape()), torch.randn(8), {"scale": torch.randn(8, 1, 1)}, torch.empty(3))
    out = torch.empty(2 * 8 * 9 * 9 + 1)[1:].view(2, 8, 9, 9)
    with pytest.raises(ValueError, match="16-byte aligned"):
        tailrun.launch(sp, x, torch.randn(spec.weight_shape()), torch.randn(8), {"scale": torch.randn(8, 1, 1)}, out)
