"""Repeat inference calls on the GPU (marker `gpu`; skipped without CUDA): a FusedLayer keeps its
last plain launch (`torchop.FastLaunch`) and repeats it while the calls are alike; any change to
the layer's tensors (in place, or replaced) or to the input's shape takes the full path again.
Each output is checked against float64 at the mode's bar, and bit for bit against the full path
into a NaN-poisoned output (so an element the repeat leaves unwritten fails)."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

from specgen import FusedLayer, tailrun, torchop  # noqa: E402
from specgen.spec import validate  # noqa: E402

from gpu_helpers import as_channels_last, captured, check_output, extra_inputs, random_input, randomize  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fp32_reference")]

# name -> (input channels, size, conv, epilogue, engine, precision)
CASES = {
    "ffma_fp32": (3, [32, 32], {"out_channels": 16, "kernel": 3, "padding": 1}, ["relu"], "ffma", "fp32"),
    "ffma_bf16": (8, [12, 12], {"out_channels": 16, "kernel": 3, "padding": 1}, ["batch_norm", {"hardtanh": {"min_val": 0.0, "max_val": 6.0}}], "ffma", "bf16"),
    "igemm_inputs_fp32": (16, [10, 10], {"out_channels": 24, "kernel": 3, "padding": 1},
                          ["batch_norm", {"add": {"input": "shortcut"}}, {"mul": {"input": "gate"}}, "relu"], "igemm", "fp32"),
    "igemm_tf32": (32, [9, 11], {"out_channels": 48, "kernel": 1}, [{"add": {"input": "shortcut"}}, "relu"], "igemm", "tf32"),
    # ... split K at these batches (the split kernel, then its reduction: `torchop._SplitReplay`)
    "igemm_tf32_split": (256, [7, 7], {"out_channels": 256, "kernel": 3, "padding": 1},
                         [{"add": {"input": "shortcut"}}, "relu"], "igemm", "tf32"),
    "slab_fp32": (8, [20, 20], {"out_channels": 32, "kernel": 3}, [{"div": {"value": 2.0}}, "hardtanh"], "slab", "fp32"),
    # the TMA engine: a layout pass into 3xTF32 planes, then the GEMM (`tmarun.Launches`)
    "tma_fp32": (64, [32, 32], {"out_channels": 64, "kernel": 3, "padding": 1}, [{"add": {"input": "shortcut"}}, "gelu"],
                 "tma", "fp32"),
    # ... split K at these batches (the pass, the split kernel, its reduction: one workspace)
    "tma_tf32_split": (256, [7, 7], {"out_channels": 256, "kernel": 3, "padding": 1}, ["relu"], "tma", "tf32"),
    # ... a 16-bit 1x1 conv reading a contiguous input in place
    "tma_bf16": (64, [16, 16], {"out_channels": 128, "kernel": 1}, [{"add": {"input": "shortcut"}}, "relu"], "tma", "bf16"),
}
CHANNELS_LAST = {"tma_fp32", "tma_tf32_split", "tma_bf16"}  # also run on channels-last inputs and extra inputs


def _layer(name: str) -> FusedLayer:
    cin, size, conv, epilogue, engine, precision = CASES[name]
    spec = validate({"name": f"fast_{name}", "input": {"channels": cin, "size": size}, "conv": conv, "epilogue": epilogue,
                     "precision": precision, "tile": {"engine": engine}})
    layer = FusedLayer(spec).cuda().eval()
    assert layer.specialize().plan["engine"] == engine
    return layer


@pytest.mark.parametrize("name,memory_format", [(n, torch.contiguous_format) for n in sorted(CASES)]
                         + [(n, "channels_last") for n in sorted(CHANNELS_LAST)])
def test_repeat_calls_take_the_recorded_launch_until_the_layer_changes(name, memory_format, monkeypatch):
    layer = _layer(name)
    spec = layer.spec
    laid = (lambda t: t) if memory_format == torch.contiguous_format else as_channels_last
    gen = torch.Generator(device="cuda").manual_seed(5)
    randomize(layer, gen)
    full = []  # the calls that took the full path
    real = torchop.launch
    monkeypatch.setattr(torchop, "launch", lambda *a, **k: (full.append(a[1].shape[0]), real(*a, **k))[1])
    weight = layer.conv.weight
    steps = [
        (2, None, True),  # the first call: the full path, recorded
        (2, None, False),  # alike: the recorded launch
        (2, lambda: weight.mul_(-0.5), True),  # the weight changed in place (version counter)
        (2, None, False),
        (3, None, True),  # another batch
        (3, lambda: setattr(weight, "data", weight.data * 1.5), True),  # the weight's storage replaced
        (3, None, False),
    ]
    for step, (batch, change, takes_full) in enumerate(steps):
        with torch.no_grad():
            if change is not None:
                change()
            x = laid(random_input(spec, batch, gen))
            extras = {k: laid(v) for k, v in extra_inputs(spec, batch, gen).items()}
            before = len(full)
            y = layer(x, *extras.values())
            took_full = len(full) > before
            assert took_full == takes_full, f"call {step}: full path {took_full}, expected {takes_full}"
            assert layer._fast is not None, f"call {step}: no launch recorded"
            assert y.is_contiguous() == x.is_contiguous(), f"call {step}: the output is not laid out as the input"
            check_output(layer, x, extras, y, f"{spec.name} call {step}")
            into = torch.full_like(y, float("nan"))  # (laid out as y: the same kernel)
            layer(x, *extras.values(), out=into)  # the full path (out= never records)
            assert torch.equal(y, into), f"call {step}: the recorded launch and the full path differ"


def test_grad_enabled_calls_and_other_inputs_take_the_full_path(monkeypatch):
    layer = _layer("ffma_fp32")
    spec = layer.spec
    gen = torch.Generator(device="cuda").manual_seed(9)
    randomize(layer, gen)
    x = random_input(spec, 2, gen)
    with torch.no_grad():
        layer(x)
    assert layer._fast is not None
    full = []
    real = torchop.launch
    monkeypatch.setattr(torchop, "launch", lambda *a, **k: (full.append(1), real(*a, **k))[1])
    y = layer(x)  # autograd on: the op's formula, a graph recorded
    assert y.requires_grad and len(full) == 1
    with torch.no_grad():
        cl = x.contiguous(memory_format=torch.channels_last)
        check_output(layer, cl, {}, layer(cl), "a channels-last input")
        offset = torch.empty(x.numel() + 1, device="cuda")[1:].view_as(x).copy_(x)  # 4 bytes past an aligned start
        check_output(layer, offset, {}, layer(offset), "an input 4 bytes off alignment")
        assert len(full) == 3
        with pytest.raises(ValueError, match="expected an input of shape"):
            layer(x[:, :2])


@pytest.mark.parametrize("name", ["igemm_tf32", "ffma_bf16"])
def test_a_call_captured_in_a_graph_is_not_kept(name):
    """Under capture the derived weights (permuted, widened) are made inside the graph, whose memory
    holds nothing until a replay: an eager call right after the capture must not reuse them."""
    layer = _layer(name)
    spec = layer.spec
    gen = torch.Generator(device="cuda").manual_seed(13)
    randomize(layer, gen)
    x = random_input(spec, 2, gen)
    extras = extra_inputs(spec, 2, gen)
    graph, out = captured(lambda t: layer(t, *extras.values()), x, grad=False)
    with torch.no_grad():
        x2 = random_input(spec, 2, gen)
        check_output(layer, x2, extras, layer(x2, *extras.values()), f"{spec.name}: an eager call after a capture")
        check_output(layer, x2, extras, layer(x2, *extras.values()), f"{spec.name}: its repeat")
    graph.replay()
    torch.cuda.synchronize()
    check_output(layer, x, extras, out, f"{spec.name}: the graph's replay")


def test_an_imported_linear_over_tokens_repeats_its_launches(monkeypatch):
    """A Linear over tokens [N, L, C] fused by from_module reads its input as a channels-last view
    ([N, C, L, 1]) with a residual read the same way: repeat calls take the recorded launches."""
    from torch import nn

    import specgen

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(384, 384)  # over 196 tokens: the TMA engine's (asserted below)

        def forward(self, x):
            return x + nn.functional.gelu(self.fc(x))

    gen = torch.Generator(device="cuda").manual_seed(21)
    model = Block().cuda().eval()
    x = torch.randn(2, 196, 384, device="cuda", generator=gen)
    fused = specgen.from_module(model, x, keep_slower=True, cuda_graph=False)
    (layer,) = [m for m in fused.modules() if isinstance(m, FusedLayer)]
    assert layer.specialize().plan["engine"] == "tma"  # (the other engines copy a channels-last input first)
    reference = copy.deepcopy(model).double()
    full = []
    real = torchop.launch
    monkeypatch.setattr(torchop, "launch", lambda *a, **k: (full.append(1), real(*a, **k))[1])
    with torch.no_grad():
        for step in range(3):
            x = torch.randn(2, 196, 384, device="cuda", generator=gen)
            y = fused(x)
            ref = reference(x.double())
            err = ((y.double() - ref).norm() / ref.norm()).item()
            assert err <= 1e-5, f"call {step}: rel L2 {err:.2e}"
    assert len(full) == 1, f"{len(full)} calls took the full path (the first only expected)"


def _kept_launch_follows_the_switch(monkeypatch, spec, engine: str, seed: int, start: bool, flip, picked) -> None:
    """A batch-1 layer planned for `engine` across switch flips (`flip(on)`, starting at `start`):
    each call's kernel is the one the switch picks (`picked(kernel, layer_kernel)` is the switch),
    the first call after a flip takes the full path and keeps its launch (recorded with the
    switch: `FastLaunch.small_batch`), the next repeats it, and every output meets the bar."""
    layer = FusedLayer(spec).cuda().eval()
    sp = layer.specialize()
    assert sp.plan["engine"] == engine
    gen = torch.Generator(device="cuda").manual_seed(seed)
    randomize(layer, gen)
    full = []
    real = torchop.launch
    monkeypatch.setattr(torchop, "launch", lambda *a, **k: (full.append(1), real(*a, **k))[1])
    for step, (on, takes_full) in enumerate([(start, True), (start, False), (not start, True), (not start, False),
                                             (start, True)]):
        flip(on)
        x = random_input(spec, 1, gen)
        assert picked(torchop.kernel_for(sp, x), sp) == on, f"call {step}: the switch ({on}) did not pick its kernel"
        with torch.no_grad():
            before = len(full)
            y = layer(x)
        assert (len(full) > before) == takes_full, f"call {step} (switch {on}): full path {len(full) > before}"
        assert layer._fast is not None and layer._fast.small_batch == ((engine, on),), f"call {step}: the kept launch"
        check_output(layer, x, {}, y, f"call {step} (switch {on})")


def test_a_kept_tma_launch_follows_the_small_batch_rules_switch(monkeypatch):
    """The small-batch rule (`SPECGEN_SMALL_BATCH`) moves a TMA-planned layer's small batch to the
    implicit GEMM: switched after a first call, the next call takes the full path on the rule's
    engine (and keeps that launch), and switched back, the TMA kernels again."""
    # (ResNet-18's 3x3 64 -> 64 at 56^2: at batch 1 the rule's tile is one launch, no split K, so kept too)
    spec = validate({"name": "fast_rule_switch", "input": {"channels": 64, "size": [56, 56]},
                     "conv": {"out_channels": 64, "kernel": 3, "padding": 1}, "epilogue": ["relu"], "precision": "tf32"})
    _kept_launch_follows_the_switch(
        monkeypatch, spec, "tma", 21, False, lambda on: monkeypatch.setenv("SPECGEN_SMALL_BATCH", "1" if on else "0"),
        lambda kernel, _: kernel.plan["engine"] == "igemm")


@pytest.mark.small_batch
def test_a_kept_ffma_launch_follows_the_depthwise_rules_switch(monkeypatch):
    """The depthwise small-batch box (`pipeline.SMALL_BATCH_SPREAD`) gives a depthwise layer's
    batch-1 call its box of one tile a thread: switched after a first call, the next call takes
    the full path on the other kernel (and keeps that launch), and switched back, the first again."""
    spec = validate({"name": "fast_spread_switch", "input": {"channels": 144, "size": [56, 56]},
                     "conv": {"out_channels": 144, "kernel": 3, "padding": 1, "groups": 144},
                     "epilogue": [{"batch_norm": {}}, {"hardtanh": {"min_val": 0.0, "max_val": 6.0}}], "precision": "tf32"})
    _kept_launch_follows_the_switch(
        monkeypatch, spec, "ffma", 22, True, lambda on: monkeypatch.setattr(torchop.pipeline, "SMALL_BATCH_SPREAD", on),
        lambda kernel, own: kernel.plan["blocks_per_sample"] > own.plan["blocks_per_sample"])


# Layers run as a sequence of kernels (`specgen.tailrun`): the body into a workspace, then the
# statistic stages' kernels; their repeat calls take the recorded launches (`tailrun.SequenceReplay`).
SEQUENCES = {
    # FFMA body, a group norm's kernels, an extra input added by the tail kernel
    "gn_residual_fp32": {"input": {"channels": 8, "size": [12, 10]}, "conv": {"out_channels": 16, "kernel": 3, "padding": 1},
                         "epilogue": [{"group_norm": 4}, {"add": {"input": "shortcut"}}, "relu"], "precision": "fp32"},
    # a TMA body (tf32), a softmax over the channels, then a max pool over an identity conv
    "softmax_pool_tf32": {"input": {"channels": 64, "size": [16, 16]}, "conv": {"out_channels": 128, "kernel": 3, "padding": 1},
                          "epilogue": [{"softmax": 1}, {"max_pool": 2}], "precision": "tf32"},
    # a mean over the length folded before the conv (specgen/tapsum.py): the input's sums per tap,
    # then the conv of those as a GEMM on the implicit GEMM's split K (`torchop._SplitReplay`)
    "folded_mean_split_tf32": {"input": {"channels": 128, "size": [1024]}, "conv": {"out_channels": 256, "kernel": 5, "padding": 2},
                               "epilogue": [{"mean": {"dims": [2]}}, "sigmoid"], "precision": "tf32"},
    # a TMA body (tf32), then an instance norm's kernels
    "instance_norm_tf32": {"input": {"channels": 64, "size": [14, 14]}, "conv": {"out_channels": 64, "kernel": 3},
                           "epilogue": ["instance_norm", {"mul": 2.0}], "precision": "tf32"},
}


@pytest.mark.parametrize("name", sorted(SEQUENCES))
def test_a_sequence_repeats_its_recorded_launches_until_the_layer_changes(name, monkeypatch):
    spec = validate({"name": f"fast_seq_{name}", **SEQUENCES[name]})
    layer = FusedLayer(spec).cuda().eval()
    assert layer.specialize().plan["engine"] == "sequence"
    gen = torch.Generator(device="cuda").manual_seed(23)
    randomize(layer, gen)
    full = []
    real = torchop.launch
    monkeypatch.setattr(torchop, "launch", lambda *a, **k: (full.append(1), real(*a, **k))[1])  # (the parts' too)
    weight = layer.conv.weight
    steps = [(2, None, True), (2, None, False), (2, None, False), (2, lambda: weight.mul_(-0.5), True), (2, None, False),
             (3, None, True), (3, None, False)]
    stream = torch.cuda.Stream()
    for step, (batch, change, takes_full) in enumerate(steps):
        with torch.no_grad():
            if change is not None:
                change()
            x = random_input(spec, batch, gen)
            extras = extra_inputs(spec, batch, gen)
            before = len(full)
            if step == 2:  # on another stream: its own workspaces
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    y = layer(x, *extras.values())
                torch.cuda.current_stream().wait_stream(stream)
            else:
                y = layer(x, *extras.values())
            took_full = len(full) > before
            assert took_full == takes_full, f"call {step}: full path {took_full}, expected {takes_full}"
            assert layer._fast is not None and isinstance(layer._fast.prepared, tailrun.SequenceReplay), f"call {step}"
            check_output(layer, x, extras, y, f"{spec.name} call {step}")
            into = torch.full_like(y, float("nan"))
            layer(x, *extras.values(), out=into)  # the full path (out= never records)
            assert torch.equal(y, into), f"call {step}: the recorded launches and the full path differ"
