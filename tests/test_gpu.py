"""Specialized kernels against the PyTorch reference on the GPU (marker `gpu`; skipped without CUDA).

Every check draws fresh random inputs and parameters, poisons the output with NaN first, and
requires rel. L2 error <= 1e-5 against float64 and allclose(1e-4, 1e-4) against PyTorch fp32
with TF32 off.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from hypothesis import HealthCheck, assume, given, settings  # noqa: E402

from specgen import reference  # noqa: E402
from specgen.module import FusedLayer  # noqa: E402
from specgen.spec import SpecError, load_specs, validate  # noqa: E402

from gpu_helpers import allocated_by, captured, compare, randomize, rel_l2  # noqa: E402
from strategies import specs as random_specs  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fp32_reference")]

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
SMALL = {"kb90": (8, 10, 12), "kb65": (40, 44)}  # the seeds at test sizes (same code path)


def shrink(spec):
    """The seeds at small sizes: same ops and code path, a fraction of the work."""
    size = SMALL.get(spec.name)
    if size is None:
        return spec
    data = spec.model_dump()
    data["input"]["size"] = list(size)
    return validate(data)


def example_specs():
    out = []
    for path in sorted(EXAMPLES.glob("*.yaml")):
        out += [pytest.param(s, id=f"{path.stem}:{s.name}") for s in load_specs(path)]
    return out


@pytest.mark.parametrize("spec", example_specs())
@pytest.mark.parametrize("batch", [1, 3])
def test_examples_match_reference(spec, batch):
    compare(FusedLayer(shrink(spec)).cuda(), batch, seed=batch)


RANDOM_SETTINGS = dict(deadline=None, derandomize=True, database=None,
                       suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                              HealthCheck.filter_too_much])
ENOUGH = 0.8
"""A random-spec test fails unless at least this share of max_examples specs were run and compared."""


def test_random_specs_match_reference():
    checked = []

    @settings(max_examples=120, **RANDOM_SETTINGS)
    @given(random_specs())
    def check(data):
        try:
            spec = validate(data)
        except SpecError as err:  # the strategy can draw an empty pooled output; validation tests cover it
            assert "spans" in str(err), err
            assume(False)
        layer = FusedLayer(spec).cuda()
        compare(layer, 1, seed=1)
        compare(layer, 5, seed=2)
        checked.append(spec.name)

    check()
    assert len(checked) >= ENOUGH * 120, f"only {len(checked)} of 120 random specs were checked"


def test_random_specs_on_tensor_cores_match_reference():
    """The same, with tensor cores asked for (the planner alone picks them only for deep layers).
    About three in four random specs cannot take them (refused by the plan): those are drawn again."""
    checked = []

    @settings(max_examples=30, **RANDOM_SETTINGS)
    @given(random_specs())
    def check(data):
        try:
            spec = validate({**data, "tile": {"tensor_cores": True}})
            layer = FusedLayer(spec).cuda()
            layer.specialize()
        except SpecError as err:  # PlanError included: no tensor cores for this layer
            assert "spans" in str(err) or "tile.tensor_cores" in str(err), err
            assume(False)
        compare(layer, 1, seed=3)
        compare(layer, 4, seed=4)
        checked.append(spec.name)

    check()
    assert len(checked) >= ENOUGH * 30, f"only {len(checked)} of 30 random specs were checked on tensor cores"


NESTED = [
    {"name": "nested_a", "input": {"channels": 4, "size": [20, 23]}, "conv": {"out_channels": 12, "kernel": 3, "padding": 1},
     "epilogue": ["relu", {"sum": {"dims": [2, 3], "keepdim": True}}, "tanh", {"amax": {"dims": [1]}}]},  # (relu: no tap-sum fold)
    {"name": "nested_b", "input": {"channels": 3, "size": [6, 9, 10]}, "conv": {"out_channels": 8, "kernel": 3},
     "epilogue": [{"logsumexp": {"dims": [1], "keepdim": True}}, {"mean": {"dims": [2, 3, 4]}}]},
    {"name": "nested_c", "input": {"channels": 8, "size": [33, 17]}, "conv": {"out_channels": 40, "kernel": [3, 2]},
     "epilogue": ["relu", {"amax": {"dims": [1]}}, {"sum": {"dims": [1, 2]}}]},
]


@pytest.mark.parametrize("data", NESTED, ids=[d["name"] for d in NESTED])
def test_nested_reductions_batched_match_reference(data):
    """Two reductions down to one value per sample: the outer one is taken a box at a time."""
    layer = FusedLayer(validate(data)).cuda()
    assert layer.specialize().plan["batched"]
    compare(layer, 1, seed=8)
    compare(layer, 3, seed=9)


def test_kb90_and_kb65_at_full_size():
    for name in ("kb90", "kb65"):
        layer = FusedLayer(load_specs(EXAMPLES / f"{name}.yaml")[0]).cuda()
        compare(layer, 2, seed=7)


def test_launch_checks_name_expected_and_got():
    layer = FusedLayer(shrink(load_specs(EXAMPLES / "kb65.yaml")[0])).cuda()
    x = torch.randn(2, 8, 40, 44, device="cuda")
    with pytest.raises(ValueError, match="float32"):
        layer(x.double())
    with pytest.raises(ValueError, match=r"\[batch, 8, 40, 44\].*\[2, 8, 44, 40\]"):
        layer(x.transpose(2, 3).contiguous())
    with pytest.raises(ValueError, match="expected a torch.float16 input"):
        layer.half()(x)  # the layer became fp16; a float32 input is refused


def test_batch_zero_and_non_contiguous_input():
    layer = FusedLayer(shrink(load_specs(EXAMPLES / "kb90.yaml")[0])).cuda()
    assert layer(torch.empty(0, 8, 8, 10, 12, device="cuda")).shape == (0, 64, 6, 8, 10)
    x = torch.randn(3, 8, 8, 12, 10, device="cuda").transpose(3, 4)
    assert not x.is_contiguous()
    sliced = torch.randn(3 * 8 * 8 * 10 * 12 + 1, device="cuda")[1:].view(3, 8, 8, 10, 12)  # contiguous, misaligned
    assert sliced.data_ptr() % 16
    ref = reference.forward(layer.spec, sliced, layer.conv.weight, layer.conv.bias, layer.spec_params())
    torch.testing.assert_close(layer(sliced), ref, atol=1e-4, rtol=1e-4)
    ref = reference.forward(layer.spec, x, layer.conv.weight, layer.conv.bias, layer.spec_params())
    torch.testing.assert_close(layer(x), ref, atol=1e-4, rtol=1e-4)


def test_only_the_output_is_allocated():
    layer = FusedLayer(shrink(load_specs(EXAMPLES / "kb90.yaml")[0])).cuda()
    x = torch.randn(16, 8, 8, 10, 12, device="cuda")
    layer(x)
    out, extra = allocated_by(lambda: layer(x))
    assert extra <= out.numel() * 4 + 512, f"forward allocated {extra} bytes; the output alone is {out.numel() * 4}"


def test_cuda_graph_capture_and_replay():
    layer = FusedLayer(shrink(load_specs(EXAMPLES / "kb90.yaml")[0])).cuda()
    static_x = torch.randn(4, 8, 8, 10, 12, device="cuda")
    graph, static_out = captured(layer, static_x)
    replays_match_reference(graph, layer, static_x, static_out)


def replays_match_reference(graph, layer, static_x, static_out):
    """Replays of `graph` on fresh inputs in `static_x` write the reference into `static_out`."""
    for seed in range(3):
        static_x.copy_(torch.randn(static_x.shape, generator=torch.Generator("cuda").manual_seed(seed), device="cuda"))
        static_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = reference.forward(layer.spec, static_x, layer.conv.weight, layer.conv.bias, layer.spec_params())
        torch.testing.assert_close(static_out, ref, atol=1e-4, rtol=1e-4)


def test_two_streams_in_flight():
    layer = FusedLayer(shrink(load_specs(EXAMPLES / "kb65.yaml")[0])).cuda()
    xs = [torch.randn(64, 8, 40, 44, device="cuda") for _ in range(2)]
    streams = [torch.cuda.Stream() for _ in range(2)]
    outs = []
    for x, s in zip(xs, streams):
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            outs.append(layer(x))
    torch.cuda.synchronize()
    for x, out in zip(xs, outs):
        ref = reference.forward(layer.spec, x, layer.conv.weight, layer.conv.bias, layer.spec_params())
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_state_dict_round_trips_with_the_seed_models():
    import importlib.util

    seeds_file = Path(__file__).resolve().parent / "seed_models.py"
    spec_ = importlib.util.spec_from_file_location("seed_models", seeds_file)
    seeds = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(seeds)
    for name, cls in (("kb90", seeds.KB90), ("kb65", seeds.KB65)):
        plain = cls().cuda()
        fused = FusedLayer(shrink(load_specs(EXAMPLES / f"{name}.yaml")[0])).cuda()
        fused.load_state_dict(plain.state_dict())
        plain.load_state_dict(fused.state_dict())
        size = SMALL[name]
        x = torch.randn(2, 8, *size, device="cuda")
        torch.testing.assert_close(fused(x), plain(x), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("engine", [True, False], ids=["tensor_cores", "ffma"])
@pytest.mark.parametrize("spec", example_specs())
def test_both_engines_match_reference(spec, engine):
    """Every example on tensor cores (where the plan allows them) and on FFMA, whatever the
    planner would pick: small-K layers exercise the padding of channels and taps."""
    from specgen.plan import PlanError
    from specgen.spec import TileSpec

    spec = shrink(spec)
    forced = spec.model_copy(update={"tile": TileSpec(tensor_cores=engine)})
    try:
        layer = FusedLayer(forced).cuda()
        layer.specialize()
    except PlanError as err:
        assert engine and "tile.tensor_cores" in str(err)
        pytest.skip(f"no tensor cores here: {err}")
    assert (layer.specialize().plan["mma"] is not None) == engine
    compare(layer, 3, seed=5)


@pytest.mark.parametrize("name", ["kb65", "conv2d_stride2_avgpool_fold", "conv2d_div_hardtanh_amax"])
def test_rewrites_match_the_unrewritten_kernel(name):
    spec = shrink(next(s for s in example_specs_flat() if s.name == name))
    folded = FusedLayer(spec).cuda()
    unfolded = FusedLayer(validate({**spec.model_dump(), "rewrites": False})).cuda()
    assert folded.specialize().plan["rewrites"] and not unfolded.specialize().plan["rewrites"]
    gen = torch.Generator(device="cuda").manual_seed(11)
    randomize(folded, gen)
    unfolded.load_state_dict(folded.state_dict())
    x = torch.randn((4, spec.input.channels, *spec.input.size), generator=gen, device="cuda")
    with torch.no_grad():
        a, b = folded(x), unfolded(x)
    ref64 = reference.forward64(spec, x, folded.conv.weight, folded.conv.bias, folded.spec_params())
    for out in (a, b):
        assert rel_l2(out, ref64) <= 1e-5
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def example_specs_flat():
    return [s for path in sorted(EXAMPLES.glob("*.yaml")) for s in load_specs(path)]


def _at_launch_specs():
    """Layers whose cluster is sized at launch (blocks that fill an SM each): kb65's one kernel at 192 x 192 (10
    boxes per sample, clusters of up to 8), the same conv with the other reductions' joins (max,
    logsumexp, mean), and a zoo fold."""
    kb65 = next(s for s in example_specs_flat() if s.name == "kb65").model_dump()
    kb65["input"]["size"] = [192, 192]
    kb65["tile"] = {"engine": "slab"}  # one kernel: the avg-pool fold, not the box fold (specgen.boxfold)
    out = [validate(kb65)]
    for i, last in enumerate([{"amax": {"dims": [1, 2, 3]}}, {"logsumexp": {"dims": [1, 2, 3]}}, {"mean": {"dims": [1, 2, 3]}}]):
        out.append(validate({**kb65, "name": f"kb65_{list(last)[0]}", "epilogue": [*kb65["epilogue"][:-1], last]}))
    out.append(next(s for s in example_specs_flat() if s.name == "conv2d_stride2_avgpool_fold"))
    out.append(validate({**kb65, "name": "kb65_full", "input": {"channels": 8, "size": [384, 384]}}))  # 48 boxes: clusters of 16
    return out


def _cluster_kernel(spec):
    """A layer whose cluster is sized at launch, and its loaded kernel."""
    from specgen import runtime, torchop

    layer = FusedLayer(spec).cuda()
    sp = layer.specialize()
    assert sp.plan["cluster_at_launch"], sp.plan["cluster"]
    return layer, runtime.lookup(sp.key, 0) or torchop.load_kernel(sp, 0)


@pytest.mark.parametrize("spec", _at_launch_specs(), ids=lambda s: s.name)
@pytest.mark.parametrize("cluster", [1, 2, 3, 4, 8, 10, 16])
def test_every_cluster_size_matches_reference(spec, cluster, monkeypatch):
    """The launch may pick any cluster size up to the plan's: each one is correct."""
    from specgen import runtime

    layer, kernel = _cluster_kernel(spec)
    largest = kernel.cluster_at_launch[0]
    if cluster > largest:
        pytest.skip(f"the plan's largest cluster is {largest}")
    if runtime._max_active_clusters(kernel, cluster) == 0:
        pytest.skip(f"this device runs no cluster of {cluster} of these blocks")
    monkeypatch.setattr(kernel, "cluster_size", lambda clusters: cluster)
    compare(layer, 3, seed=cluster)


def test_cluster_launch_repeats_bit_for_bit():
    layer, kernel = _cluster_kernel(_at_launch_specs()[0])
    gen = torch.Generator(device="cuda").manual_seed(3)
    randomize(layer, gen)
    x = torch.randn((5, 8, 192, 192), generator=gen, device="cuda")
    with torch.no_grad():
        first = layer(x)
        assert all(torch.equal(first, layer(x)) for _ in range(5))
    # the device holds clusters of each size the plan allows, and the choice is one of them
    assert kernel.cluster_size(5) in range(1, kernel.cluster_at_launch[0] + 1)


def test_clustered_launch_captured_in_a_cuda_graph_with_a_new_batch():
    """The first launch at a batch size asks the driver for cluster occupancy: allowed mid-capture."""
    layer, kernel = _cluster_kernel(_at_launch_specs()[0])
    layer(torch.randn(1, 8, 192, 192, device="cuda"))  # the module is loaded outside capture
    torch.cuda.synchronize()
    static_x = torch.randn(6, 8, 192, 192, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        static_out = layer(static_x)
    replays_match_reference(graph, layer, static_x, static_out)
