"""Statistic stages on the GPU (marker `gpu`; skipped without CUDA): every tail kernel variant
against float64, running statistics against nn.BatchNorm2d, determinism, CUDA graphs,
torch.compile, a batch past the grid's y limit and random specs with statistic stages.

Every comparison draws fresh random inputs and parameters, poisons the output with NaN first and
requires rel. L2 <= 1e-5 against float64 and allclose(1e-4, 1e-4) against PyTorch fp32 with TF32
off (tests/gpu_helpers.py)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import torch.nn as nn  # noqa: E402
from hypothesis import HealthCheck, assume, given, settings  # noqa: E402

from specgen import reference  # noqa: E402
from specgen.module import FusedLayer  # noqa: E402
from specgen.spec import SpecError, validate  # noqa: E402

from gpu_helpers import captured, compare, poisoned, random_input, randomize, rel_l2  # noqa: E402
from strategies import norm_specs  # noqa: E402
from test_tail import BN_TRAIN, IDS, VARIANTS, modes  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fp32_reference")]


def layer_of(data) -> FusedLayer:
    return FusedLayer(validate(data)).cuda()


@pytest.mark.parametrize("data", VARIANTS, ids=IDS)
@pytest.mark.parametrize("batch", [1, 3, 5])
def test_every_tail_variant_matches_float64(data, batch):
    """One pass, split (per sample and across the batch), strided; rests; odd batches and channel
    counts that no tile divides (5, 6, 40, 72 channels; odd extents)."""
    compare(layer_of(data), batch, seed=batch)  # (the batch norms here see more than one value per channel and sample)


def seeded(name: str, batch: int, seed: int):
    """A variant's layer on random parameters and a random input of `batch` samples."""
    layer = layer_of(VARIANTS[IDS.index(name)])
    gen = torch.Generator(device="cuda").manual_seed(seed)
    randomize(layer, gen)
    return layer, random_input(layer.spec, batch, gen)


def test_the_variants_take_every_kernel():
    seen = {m for data in VARIANTS for m in modes(validate(data))}
    assert seen == {"one_pass", "split", "strided"}


@pytest.mark.parametrize("name", ["gn_one_pass", "gn_split", "sm_reread", "sm_split", "ln_row", "two_norms", "bn_train"])
def test_runs_repeat_bit_for_bit(name):
    layer, x = seeded(name, 4, seed=0)
    with torch.no_grad():
        first = layer(x).clone()
        for _ in range(3):
            assert torch.equal(layer(x), first)


@pytest.mark.parametrize("name", ["gn_one_pass", "gn_split", "sm_reread", "sm_split", "lsm_middle", "in_div"])
def test_a_sample_does_not_depend_on_the_batch(name):
    """Statistics per sample: a sample's result is the same bits alone and in a batch."""
    layer, x = seeded(name, 5, seed=1)
    with torch.no_grad():
        whole = layer(x)
        for i in (0, 3):
            assert torch.equal(layer(x[i:i + 1]), whole[i:i + 1])


def _bn_pair(momentum, channels=8):
    spec = validate({**BN_TRAIN, "epilogue": [{"batch_norm": {"training": True, "momentum": momentum}}]})
    layer = FusedLayer(spec).cuda()
    gen = torch.Generator(device="cuda").manual_seed(2)
    randomize(layer, gen)
    m = nn.BatchNorm2d(channels, momentum=momentum).cuda()
    with torch.no_grad():
        m.weight.copy_(layer.bn_weight.flatten())
        m.bias.copy_(layer.bn_bias.flatten())
    return layer, m, gen


@pytest.mark.parametrize("momentum", [0.1, None])
def test_training_batch_norm_updates_running_statistics_as_nn_batch_norm(momentum):
    layer, m, gen = _bn_pair(momentum)
    for step, batch in enumerate((3, 1, 4, 2)):
        x = torch.randn(batch, 4, 8, 8, generator=gen, device="cuda")
        if step % 2:  # the raw launch into a poisoned output, and the op, in turn
            y = poisoned(layer.spec.output_shape(batch))
            layer(x, out=y)
        else:
            y = layer(x)
        with torch.no_grad():
            c = layer.conv(x)
            want64 = nn.functional.batch_norm(c.double(), None, None, m.weight.double(), m.bias.double(), True, 0.0, m.eps)
            want = m(c)
        assert rel_l2(y, want64) <= 1e-5
        torch.testing.assert_close(y.detach(), want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(layer.bn_running_mean.flatten(), m.running_mean, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(layer.bn_running_var.flatten(), m.running_var, atol=1e-6, rtol=1e-5)
    assert layer.bn_num_batches_tracked.item() == m.num_batches_tracked.item() == 4
    layer.eval(), m.eval()  # the eval twin: running statistics, nothing updated
    x = torch.randn(3, 4, 8, 8, generator=gen, device="cuda")
    with torch.no_grad():
        torch.testing.assert_close(layer(x), m(layer.conv(x)), atol=1e-4, rtol=1e-4)
    assert layer.bn_num_batches_tracked.item() == 4


def test_the_kernels_batch_statistics():
    layer = layer_of(BN_TRAIN)
    x = torch.randn(5, 4, 8, 8, device="cuda")
    args = layer.op.arguments(x, layer.conv.weight, layer.conv.bias, layer.spec_params())
    y, stats = layer.op.overload(*args)
    with torch.no_grad():
        c = layer.conv(x).double()
    want = torch.cat([c.mean((0, 2, 3)), c.var((0, 2, 3), unbiased=False)])
    assert rel_l2(stats, want) <= 1e-6


def test_a_batch_past_the_grid_limit():
    """More samples than blockIdx.y holds: per-sample kernels are launched in pieces, a batch norm's
    finalize walks every sample's partials in one launch."""
    data = {"name": "wide", "input": {"channels": 1, "size": [4]}, "conv": {"out_channels": 2, "kernel": 1},
            "epilogue": [{"batch_norm": {"training": True}}, {"group_norm": 1}, {"softmax": 1}]}
    compare(layer_of(data), 65535 + 4, seed=5)


def test_cuda_graph_capture_and_replay_of_a_sequence():
    layer = layer_of(VARIANTS[IDS.index("gn_pool")])
    gen = torch.Generator(device="cuda").manual_seed(3)
    randomize(layer, gen)
    static_x = random_input(layer.spec, 3, gen)
    graph, static_out = captured(layer, static_x)
    for seed in range(3):
        static_x.copy_(torch.randn(static_x.shape, generator=torch.Generator("cuda").manual_seed(seed), device="cuda"))
        static_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want = reference.forward(layer.spec, static_x, layer.conv.weight, layer.conv.bias, layer.spec_params())
        torch.testing.assert_close(static_out.detach(), want, atol=1e-4, rtol=1e-4)


def test_cuda_graph_replays_update_running_statistics():
    layer, m, gen = _bn_pair(0.1)
    static_x = torch.randn(4, 4, 8, 8, generator=gen, device="cuda")
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            layer(static_x)
            m(layer.conv(static_x))
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = layer(static_x)
        for seed in range(3):
            static_x.copy_(torch.randn(static_x.shape, generator=torch.Generator("cuda").manual_seed(seed), device="cuda"))
            graph.replay()
            want = m(layer.conv(static_x))
            torch.testing.assert_close(static_out, want, atol=1e-4, rtol=1e-4)
        torch.cuda.synchronize()
    torch.testing.assert_close(layer.bn_running_mean.flatten(), m.running_mean, atol=1e-6, rtol=1e-5)
    assert layer.bn_num_batches_tracked.item() == m.num_batches_tracked.item() == 4


@pytest.mark.parametrize("name", ["gn_pool", "sm_channels", "bn_train"])
def test_inductor_fullgraph_training(name):
    torch._dynamo.reset()
    data = VARIANTS[IDS.index(name)]
    layer = layer_of(data)
    plain = reference.Reference(validate(data)).cuda()
    plain.load_state_dict(layer.state_dict())
    compiled = torch.compile(layer, fullgraph=True)
    for seed in range(3):
        x = torch.randn(3, layer.spec.input.channels, *layer.spec.input.size, device="cuda",
                        generator=torch.Generator("cuda").manual_seed(seed))
        y = compiled(x)
        want = plain(x)
        torch.testing.assert_close(y.detach(), want.detach(), atol=1e-4, rtol=1e-4)
        y.square().sum().backward()
        want.square().sum().backward()
    for (pname, p), q in zip(layer.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-3, rtol=1e-3, msg=f"gradient of {pname}")
    for bname, b in layer.named_buffers():
        torch.testing.assert_close(b, dict(plain.named_buffers())[bname], atol=1e-5, rtol=1e-5, msg=bname)
    torch._dynamo.reset()


RANDOM = dict(deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])


def test_random_specs_with_statistic_stages_match_float64():
    checked = []

    @settings(max_examples=60, **RANDOM)
    @given(norm_specs())
    def check(data):
        try:
            layer = layer_of(data)
        except SpecError:
            assume(False)
        compare(layer, 2 if reference.one_value_batch_norm(layer.spec) else 1, seed=1)
        compare(layer, 5, seed=2)
        checked.append(data["name"])

    check()
    assert len(checked) >= 0.8 * 60, f"only {len(checked)} of 60 random specs were checked"
