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
    def layer_launch(self, sp, x, weight, bias, params, out, record=None):
        self.events.append({"kind": "layer", "part": sp.part, "in": (x.data_ptr(), tuple(x.shape)),
                            "out": (out.data_ptr(), tuple(out.shape)), "weight": weight, "bias": bias})
        if record is not None:  # a plain call: its launch kept, as torchop.launch keeps one
            replay = _PartReplay(self, sp.part, tuple(x.shape), tuple(out.shape), weight, bias)
            record.append(types.SimpleNamespace(prepared=replay, out_slot=1, input_slots=(), held=(weight,),
                                                small_batch=None))
        return out


class _PartReplay:
    """Stands in for a body or rest part's recorded launch (`values`: x's address, then out's)."""

    def __init__(self, rec, part, in_shape, out_shape, weight, bias):
        self.rec, self.part, self.shapes, self.weight, self.bias = rec, part, (in_shape, out_shape), weight, bias
        self.values = [0, 0]

    def launch(self, stream):
        self.rec.events.append({"kind": "layer", "part": self.part, "in": (self.values[0], self.shapes[0]),
                                "out": (self.values[1], self.shapes[1]), "weight": self.weight, "bias": self.bias,
                                "stream": stream})


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


def run(sp, spec, batch, stats=None, record=None):
    x = torch.randn(batch, spec.input.channels, *spec.input.size)
    weight = torch.randn(spec.weight_shape())
    bias = torch.randn(spec.conv.out_channels) if spec.conv.bias else None
    params = {n: torch.randn(s) for n, s in spec.params().items()}
    params.update({n: torch.randn(batch, *s) for n, s in spec.inputs().items()})
    out = tailrun.launch(sp, x, weight, bias, params, None, stats, record)
    return x, weight, params, out


@pytest.mark.parametrize("name", ["gn_pool", "bn_train", "sm_max", "two_norms", "chain_1d"])
def test_steps_launch_in_order_and_hand_each_buffer_on(recorder, name):
    spec, plan, sp = sequence(name)
    rec = recorder(plan)
    batch = 3
    x, weight, params, out = run(sp, spec, batch)
    assert tuple(out.shape) == spec.output_shape(batch)
    written = check_wiring(plan, rec.events, x.data_ptr(), weight, params, batch)
    assert written["out"] == out.data_ptr()


def check_wiring(plan, events, x_address, weight, params, batch, stream=5) -> dict:
    """Each of the plan's steps launched in order, each reading the buffers the steps before it
    wrote and the parameters, on the grid its plan gives; the buffer name -> address each writer used."""
    assert len(events) == len(plan["steps"])
    written = {"x": x_address}  # buffer name -> the address its writer used
    for step, event in zip(plan["steps"], events):
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
        assert event["block"] == step["threads"] and event["stream"] == stream
        assert event["grid"] == ((step["grid_x"], 1, 1) if step["once"] else (step["grid_x"], batch, 1))
        assert event["batch"] == batch
        for arg, pointer in zip(step["args"], event["pointers"]):
            if arg.startswith(("p_", "i_")):
                assert pointer == params[arg[2:]].data_ptr(), arg
            elif arg == step["args"][-1]:
                written[arg] = pointer
            else:
                assert pointer == written[arg], arg
    return written


# a group norm, then an extra input of the output's shape added (read by the tail kernel)
RESIDUAL = {"name": "gn_residual", "input": {"channels": 4, "size": [6, 5]}, "conv": {"out_channels": 8, "kernel": 3},
            "epilogue": [{"group_norm": 2}, {"add": {"input": "shortcut"}}, "relu"]}


def _sequence_of(data):
    spec = validate(data)
    plan = build_plan(spec)
    build = types.SimpleNamespace(key="9" * 64)
    return spec, plan, types.SimpleNamespace(spec=spec, plan=plan, source="", build=build, key=build.key)


@pytest.mark.parametrize("name", ["gn_pool", "sm_max", "two_norms", "chain_1d", "gn_split", "residual"])
def test_a_recorded_sequence_repeats_its_launches_into_new_addresses(recorder, monkeypatch, name):
    """`record=`: a plain call keeps its launches (`SequenceReplay` in a FastLaunch). Repeated with
    a new x, extra input and output, every step launches again in order, each reading what the one
    before it wrote; the workspaces are kept per stream: the same addresses on the same stream,
    others on another; over `torchop.KEPT_WORKSPACE_BYTES` they are allocated per call."""
    spec, plan, sp = _sequence_of(RESIDUAL) if name == "residual" else sequence(name)
    rec = recorder(plan)
    record = []
    batch = 2
    x, weight, params, out = run(sp, spec, batch, record=record)
    (fast,) = record
    replay = fast.prepared
    assert isinstance(replay, tailrun.SequenceReplay) and fast.in_shape == x.shape and fast.out_shape == out.shape
    assert fast.input_slots == tuple(range(1, 1 + len(spec.inputs())))
    names = list(spec.inputs())

    def again(stream):
        new = {n: torch.randn_like(params[n]) for n in names}
        x2, out2 = torch.randn_like(x), torch.empty_like(out)
        replay.values[:] = [x2.data_ptr(), *(new[n].data_ptr() for n in names), out2.data_ptr()]
        rec.events.clear()
        replay.launch(stream)
        written = check_wiring(plan, rec.events, x2.data_ptr(), weight, {**params, **new}, batch, stream)
        assert written["out"] == out2.data_ptr()
        return {k: v for k, v in written.items() if k not in ("x", "out")}

    first = again(5)
    assert first and again(5) == first, "the same workspaces on the same stream"
    other = again(9)
    assert set(other.values()).isdisjoint(first.values()), "another stream's own workspaces"
    assert again(5) == first
    monkeypatch.setattr(torchop, "KEPT_WORKSPACE_BYTES", 0)
    record.clear()
    run(sp, spec, batch, record=record)
    assert record[0].prepared.workspaces is None  # (allocated per call: each launch's own)


def test_a_call_with_batch_statistics_is_not_recorded(recorder):
    """A training-mode batch norm writes the batch statistics the layer returns: such a call takes
    the full path every time."""
    spec, plan, sp = sequence("bn_train")
    recorder(plan)
    record = []
    run(sp, spec, 2, record=record)
    assert record == []
    spec, plan, sp = sequence("gn_pool")  # (the same call without statistics is recorded)
    recorder(plan)
    run(sp, spec, 2, record=record)
    assert len(record) == 1


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
