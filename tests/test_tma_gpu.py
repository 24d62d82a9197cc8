"""The Hopper TMA/wgmma engine against float64 on the GPU (marker `gpu`; skipped without CUDA, and
without an sm_90 GPU).

fp32 mode (3xTF32): rel. L2 <= 1e-5 against float64 and allclose(1e-4, 1e-4) against PyTorch fp32.
tf32 mode: rel. L2 within 2x of PyTorch's own TF32 convolution's; bf16 / fp16: within 2x of
PyTorch's own in that dtype (same inputs). Outputs are poisoned with NaN before each run; inputs
are fresh per check; both input memory formats.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hypothesis import HealthCheck, assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from specgen.module import FusedLayer  # noqa: E402
from specgen.spec import SpecError, validate  # noqa: E402

from gpu_helpers import compare as check, compare_formats  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fp32_reference")]


@pytest.fixture(autouse=True)
def _hopper():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the TMA engine needs an sm_90 GPU")


def layer_of(data: dict) -> FusedLayer:
    spec = validate({**data, "tile": {**data.get("tile", {}), "engine": "tma"}})
    layer = FusedLayer(spec).cuda()
    sp = layer.specialize()
    assert sp.plan["engine"] == "tma" and sp.build.arch == "sm_90a"
    return layer


CASES = {
    # name: (input channels, size, conv, epilogue)
    "c64_3x3_p1": (64, [20, 20], {"out_channels": 64, "kernel": 3, "padding": 1}, ["relu"]),
    "c128_s2_256": (128, [15, 17], {"out_channels": 256, "kernel": 3, "stride": 2, "padding": 1}, ["relu"]),
    "c1x1": (32, [8, 12], {"out_channels": 96, "kernel": 1}, [{"leaky_relu": {"negative_slope": 0.1}}]),
    "c1x1_s2": (48, [9, 9], {"out_channels": 40, "kernel": 1, "stride": 2}, ["sigmoid"]),
    "cin3_7x7_s2": (3, [33, 31], {"out_channels": 24, "kernel": 7, "stride": 2, "padding": 3}, ["relu"]),
    "cin5_odd_cout": (5, [13, 11], {"out_channels": 37, "kernel": [3, 2], "padding": [1, 0]}, ["tanh"]),
    "cin20_dilated": (20, [10, 10], {"out_channels": 70, "kernel": 3, "dilation": 2, "padding": 2}, ["silu"]),
    "conv1d_gelu": (64, [300], {"out_channels": 128, "kernel": 5, "padding": 2}, [{"gelu": {"approximate": "none"}}]),
    "conv3d": (16, [6, 9, 10], {"out_channels": 32, "kernel": 3, "padding": 1}, ["relu", {"mul": 0.5}]),
    "no_bias_affine": (32, [12, 12], {"out_channels": 64, "kernel": 3, "bias": False}, [{"mul": 2.0}, {"add": 1.0}, "relu"]),
    "param_add": (16, [11, 9], {"out_channels": 48, "kernel": 3}, [{"add": {"param": "shift"}}, "mish"]),
    "wide_k": (256, [7, 7], {"out_channels": 128, "kernel": 3, "padding": 1}, ["relu"]),
    "cout_8": (64, [16, 16], {"out_channels": 8, "kernel": 3}, ["relu"]),
    "cout_300": (32, [9, 7], {"out_channels": 300, "kernel": 3, "padding": 1}, ["relu"]),
    # the layout pass's row reads: 8-byte pieces (bf16 rows of 196 values), 4-byte ones (bf16 90, fp32 63)
    "rows_14x14": (48, [14, 14], {"out_channels": 32, "kernel": 3, "padding": 1}, ["relu"]),
    "rows_10x9": (16, [10, 9], {"out_channels": 24, "kernel": 3, "padding": 1}, ["relu"]),
    # reductions over the channels, on the accumulators (one block holds every channel)
    "min_channels": (16, [11, 13], {"out_channels": 64, "kernel": 3}, [{"mul": 2.0}, {"amin": {"dims": [1], "keepdim": True}}, "tanh"]),
    "lse_channels": (32, [9, 10], {"out_channels": 40, "kernel": 3, "padding": 1}, [{"add": {"param": "shift"}}, {"logsumexp": {"dims": [1]}}]),
    "mean_channels_3d": (8, [5, 6, 7], {"out_channels": 24, "kernel": 3, "padding": 1}, ["relu", {"mean": {"dims": [1], "keepdim": True}}]),
    "max_channels_odd": (20, [13, 7], {"out_channels": 100, "kernel": 3}, ["gelu", {"amax": {"dims": [1]}}, {"sub": 0.5}]),
    "sum_channels_1d": (64, [200], {"out_channels": 128, "kernel": 5, "padding": 2}, [{"sum": {"dims": [1]}}]),
    # a softmax over the channels, on the accumulators (one block holds every channel)
    "softmax_channels": (32, [11, 13], {"out_channels": 64, "kernel": 3, "padding": 1},
                         ["relu", {"softmax": 1}, {"mul": {"param": "w"}}, "tanh"]),
    "log_softmax_channels_odd": (20, [9, 7], {"out_channels": 100, "kernel": 3}, [{"mul": 3.0}, {"log_softmax": 1}]),
    "softmax_sum_channels_3d": (8, [5, 6, 7], {"out_channels": 24, "kernel": 3, "padding": 1},
                                [{"softmax": 1}, {"mul": {"param": "w"}}, {"sum": {"dims": [1], "keepdim": True}}, "sigmoid"]),
    "softmax_channels_1d": (64, [200], {"out_channels": 40, "kernel": 5, "padding": 2}, [{"softmax": -2}, {"sub": 0.01}]),
}


def _data(name: str, precision: str) -> dict:
    cin, size, conv, epilogue = CASES[name]
    return {"name": f"tma_{name}_{precision}", "input": {"channels": cin, "size": size}, "conv": conv,
            "epilogue": epilogue, "precision": precision}


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16", "fp16"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_tma_cases(name, precision):
    layer = layer_of(_data(name, precision))
    compare_formats(layer)


@pytest.mark.parametrize("precision", ["tf32", "bf16"])
def test_tma_reduction_over_256_channels(precision):
    """The widest tile a reduction over the channels takes: BN = 256 (not in fp32 mode: its two
    planes' accumulators would not fit)."""
    layer = layer_of({"name": f"tma_amin256_{precision}", "input": {"channels": 48, "size": [10, 11]},
                      "conv": {"out_channels": 256, "kernel": 3, "padding": 1},
                      "epilogue": [{"amin": {"dims": [1], "keepdim": True}}], "precision": precision})
    assert layer.specialize().plan["tma"].bn == 256
    check(layer, 3, seed=4)
    check(layer, 37, seed=5)


@pytest.mark.parametrize("precision", ["tf32", "bf16"])
def test_tma_softmax_over_256_channels(precision):
    """The widest tile a softmax over the channels takes: BN = 256, at a batch whose last tile is partly past the end."""
    layer = layer_of({"name": f"tma_softmax256_{precision}", "input": {"channels": 48, "size": [10, 11]},
                      "conv": {"out_channels": 256, "kernel": 3, "padding": 1},
                      "epilogue": [{"log_softmax": 1}, "silu"], "precision": precision})
    assert layer.specialize().plan["tma"].bn == 256
    check(layer, 3, seed=4)
    check(layer, 37, seed=5)


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
def test_a_pool_after_a_softmax_over_the_channels_reads_its_output(precision):
    """The TMA kernel writes the normalized values (T0); the pools and the mean read them over an identity conv."""
    data = {"name": f"smpool_{precision}", "input": {"channels": 16, "size": [6, 12, 13]},
            "conv": {"out_channels": 48, "kernel": 3, "padding": 1},
            "epilogue": ["hardswish", {"softmax": 1}, {"max_pool": {"kernel": 2}}, {"max_pool": {"kernel": 2}},
                         {"mean": {"dims": [2, 3, 4]}}], "precision": precision}
    layer = FusedLayer(validate(data)).cuda()
    plan = layer.specialize().plan
    assert [p["role"] for p in plan["parts"]] == ["body", "rest"] and plan["parts"][0]["plan"]["tma"].channel_norm
    compare_formats(layer)


@pytest.mark.parametrize("precision", ["tf32", "fp32"])
def test_tma_large_batch_tail(precision):
    """M not a multiple of the block tile, and many blocks: the last tile is partly past the end."""
    check(layer_of(_data("c1x1_s2", precision)), 37, seed=7)


def test_tma_weights_follow_in_place_updates():
    """The prepared weight copy (and its tensor map) is remade when the weights change in place."""
    layer = layer_of(_data("c64_3x3_p1", "tf32"))
    check(layer, 2, seed=1)
    check(layer, 2, seed=2)  # randomizes the weights in place again


def test_tma_under_cuda_graph():
    """Launched on the current stream, with its workspace from torch's allocator: a graph replays it."""
    from gpu_helpers import randomize

    layer = layer_of(_data("c64_3x3_p1", "tf32"))
    gen = torch.Generator(device="cuda").manual_seed(3)
    randomize(layer, gen)
    x = torch.randn((4, 64, 20, 20), device="cuda", generator=gen)
    with torch.no_grad():
        want = layer(x)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            layer(x)  # warm-up on the side stream
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = layer(x)
        x.copy_(torch.randn(x.shape, device="cuda", generator=gen))
        graph.replay()
        torch.cuda.synchronize()
        want = layer(x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(
    nd=st.integers(1, 3),
    cin=st.sampled_from([1, 3, 4, 8, 12, 16, 24, 32, 40, 64]),
    cout=st.sampled_from([4, 8, 16, 24, 40, 64, 72, 136]),
    k=st.integers(1, 3),
    stride=st.integers(1, 2),
    pad=st.integers(0, 2),
    dil=st.integers(1, 2),
    size=st.integers(3, 12),
    precision=st.sampled_from(["fp32", "tf32", "bf16", "fp16"]),
    act=st.sampled_from(["relu", "sigmoid", "tanh", {"gelu": {"approximate": "tanh"}}, {"clamp": {"min": -0.5, "max": 0.5}}]),
)
def _tma_random_spec(nd, cin, cout, k, stride, pad, dil, size, precision, act):
    data = {"name": "tma_random", "input": {"channels": cin, "size": [size + 2 * d for d in range(nd)]},
            "conv": {"out_channels": cout, "kernel": k, "stride": stride, "padding": pad, "dilation": dil},
            "epilogue": [act], "precision": precision}
    try:
        layer = layer_of(data)
    except SpecError as err:
        assume("spans" not in str(err))  # an empty output: validation tests cover that
        raise
    check(layer, 1, seed=1)
    check(layer, 3, seed=2)
    _RANDOM_CHECKED.append(data)


_RANDOM_CHECKED: list[dict] = []


def test_tma_random_specs():
    _RANDOM_CHECKED.clear()
    _tma_random_spec()
    assert len(_RANDOM_CHECKED) >= 0.8 * 60, f"only {len(_RANDOM_CHECKED)} of 60 random specs were checked"


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
def test_a_pool_after_a_deep_conv_runs_split(precision):
    """The conv into T0, the max pool and what follows over an identity conv: the conv on the TMA
    engine in bf16, on the slab engine in tf32 (`plan.slab_in_tf32`) and in fp32 (3 input channels: at most
    `plan.SLAB_TF32_MAX_CHANNELS`, `tail.split_engine`)."""
    data = {"name": f"split_{precision}", "input": {"channels": 3, "size": [33, 31]},
            "conv": {"out_channels": 64, "kernel": 7, "stride": 2, "padding": 3},  # (24 channels: fp32 would not pay)
            "epilogue": ["relu", {"max_pool": {"kernel": 3, "stride": 2, "padding": 1}}, "sigmoid"], "precision": precision}
    layer = FusedLayer(validate(data)).cuda()
    plan = layer.specialize().plan
    assert plan["engine"] == "sequence" and plan["parts"][0]["plan"]["engine"] == ("tma" if precision == "bf16" else "slab")
    compare_formats(layer)


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
def test_a_reduction_after_a_deep_conv_runs_split(precision):
    """The conv on the TMA engine into T0, the reductions over an identity conv."""
    data = {"name": f"rsplit_{precision}", "input": {"channels": 64, "size": [15, 13]},
            "conv": {"out_channels": 128, "kernel": 3, "padding": 1},
            "epilogue": ["relu", {"mean": {"dims": [2, 3], "keepdim": True}}, {"add": {"param": "b2"}},  # (relu: no tap-sum fold)
                         {"logsumexp": {"dims": [1], "keepdim": True}}], "precision": precision}
    layer = FusedLayer(validate(data)).cuda()
    plan = layer.specialize().plan
    assert plan["engine"] == "sequence" and plan["parts"][0]["plan"]["engine"] == "tma"
    check(layer, 1, seed=1)
    check(layer, 3, seed=2)


# ---- split K ---------------------------------------------------------------------------------------------

SPLIT_CASES = {
    # deep layers with few positions: at small batches their tiles leave most SMs idle
    "resnet_stage4_shortcut": (512, [7, 7], {"out_channels": 512, "kernel": 3, "padding": 1},
                               [{"add": {"input": "shortcut"}}, "relu"]),
    "c256_14_param": (256, [14, 14], {"out_channels": 200, "kernel": 3, "padding": 1, "bias": False},
                      [{"mul": {"param": "scale"}}, {"add": {"param": "shift"}}, "relu"]),
    "conv1d_deep": (384, [20], {"out_channels": 96, "kernel": 3, "padding": 1}, [{"gelu": {"approximate": "none"}}]),
}


def _split_layer(name: str, precision: str) -> FusedLayer:
    cin, size, conv, epilogue = SPLIT_CASES[name]
    layer = layer_of({"name": f"split_{name}_{precision}", "input": {"channels": cin, "size": size}, "conv": conv,
                      "epilogue": epilogue, "precision": precision})
    assert layer.specialize().plan["tma"].split_k > 1
    return layer


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16", "fp16"])
@pytest.mark.parametrize("name", sorted(SPLIT_CASES))
def test_split_k_small_batches(name, precision):
    """Batch 1, 2 and 5 run the split kernel and its reduction (asserted); a batch whose tiles fill the
    GPU runs the plain kernel; both at the mode's bar."""
    from specgen import tmarun

    layer = _split_layer(name, precision)
    tp, sms = layer.specialize().plan["tma"], tmarun.sm_count(torch.cuda.current_device())
    for batch, seed in ((1, 1), (2, 2), (5, 3)):
        assert tmarun.uses_split(tp, batch, sms), f"batch {batch} did not take the split kernel"
        check(layer, batch, seed=seed)
    check(layer, 2, seed=4, channels_last=True)
    big = next(b for b in range(8, 4096) if not tmarun.uses_split(tp, b, sms))
    check(layer, big, seed=5)


def test_split_k_is_deterministic_and_replays_in_a_cuda_graph():
    """The parts are added in a fixed order: two runs agree bit for bit, and a graph replays it with a
    fresh input."""
    from gpu_helpers import assert_repeatable_and_replayed, extra_inputs, randomize

    layer = _split_layer("c256_14_param", "tf32")
    gen = torch.Generator(device="cuda").manual_seed(11)
    randomize(layer, gen)
    x = torch.randn((1, 256, 14, 14), device="cuda", generator=gen)
    assert not extra_inputs(layer.spec, 1, gen)
    assert_repeatable_and_replayed(layer, x, gen)


# ---- a strided transposed conv's stride phases -------------------------------------------------
TRANSPOSED_CASES = {
    # name: (input channels, size, conv, epilogue)
    "k3s2_op1": (32, [9, 11], {"out_channels": 48, "kernel": 3, "stride": 2, "padding": 1, "output_padding": 1}, ["relu"]),
    "k4s2_p1_odd_out": (24, [8, 7], {"out_channels": 40, "kernel": 4, "stride": 2, "padding": 1, "output_padding": 1},
                        [{"sub": 0.5}, "tanh"]),
    "k4s2_softmax": (64, [6, 9], {"out_channels": 128, "kernel": 4, "stride": 2, "padding": 1, "output_padding": 1},
                     [{"softmax": 1}, {"add": {"param": "b"}}, {"mul": 2.0}, "sigmoid"]),
    "k3s2_min_channels": (16, [7, 8], {"out_channels": 64, "kernel": 3, "stride": 2, "padding": 1, "output_padding": 1},
                          [{"amin": {"dims": [1], "keepdim": True}}, "gelu"]),
    "k5s3_cout_300": (20, [5, 6], {"out_channels": 300, "kernel": 5, "stride": 3, "padding": 2, "output_padding": 2}, ["silu"]),
    "k2s2_1d": (64, [100], {"out_channels": 72, "kernel": 2, "stride": 2}, ["relu"]),
    "k3s2_3d": (32, [4, 5, 6], {"out_channels": 64, "kernel": 3, "stride": 2, "padding": 1, "output_padding": 1},
                [{"add": {"param": "shift"}}, "hardswish"]),
    "k4s2_3d_uneven": (16, [3, 4, 5], {"out_channels": 24, "kernel": [4, 3, 2], "stride": [2, 2, 2], "padding": [1, 0, 0]},
                       ["relu"]),
}


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16", "fp16"])
@pytest.mark.parametrize("name", sorted(TRANSPOSED_CASES))
def test_tma_stride_phases(name, precision):
    cin, size, conv, epilogue = TRANSPOSED_CASES[name]
    layer = layer_of({"name": f"tma_t_{name}_{precision}", "input": {"channels": cin, "size": size},
                      "conv": {**conv, "transposed": True}, "epilogue": epilogue, "precision": precision})
    assert layer.specialize().plan["tma"].phases
    compare_formats(layer)


def test_tma_stride_phases_with_an_extra_input():
    """A residual read at each phase's output positions (the output's own index)."""
    layer = layer_of({"name": "tma_t_residual", "input": {"channels": 32, "size": [10, 9]},
                      "conv": {"out_channels": 32, "kernel": 4, "stride": 2, "padding": 1, "transposed": True},
                      "epilogue": [{"add": {"input": "skip"}}, "relu"], "precision": "tf32"})
    assert layer.specialize().plan["tma"].phases
    check(layer, 2, seed=1)
    check(layer, 5, seed=2)


def test_a_channels_last_input_takes_the_layers_tma_variant():
    """A thin tf32 1x1 conv plans the implicit GEMM for contiguous inputs (too few multiply-adds per
    byte to pay a layout pass); a channels-last input runs the TMA engine's plan, read in place."""
    from specgen import pipeline

    layer = FusedLayer(validate({"name": "cl_thin_1x1", "input": {"channels": 64, "size": [9, 11]},
                                 "conv": {"out_channels": 32, "kernel": 1}, "epilogue": ["relu"], "precision": "tf32"})).cuda()
    sp = layer.specialize()
    assert sp.plan["engine"] == "igemm"
    check(layer, 3, seed=1, channels_last=True)
    assert pipeline._variants[(sp.key, sp.arch)].plan["engine"] == "tma"  # (made by the channels-last call)
    check(layer, 2, seed=2)  # contiguous: the implicit GEMM still
    check(layer, 5, seed=3, channels_last=True)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_16_bit_depthwise_conv_reads_a_channels_last_input(precision):
    """A 16-bit layer on an engine without a 16-bit path widens a channels-last input to contiguous
    fp32 in one pass."""
    layer = FusedLayer(validate({"name": f"cl_dw_{precision}", "input": {"channels": 24, "size": [10, 9]},
                                 "conv": {"out_channels": 24, "kernel": 3, "padding": 1, "groups": 24},
                                 "epilogue": [{"clamp": {"min": 0.0, "max": 6.0}}], "precision": precision})).cuda()
    assert layer.specialize().plan["engine"] == "ffma"
    check(layer, 3, seed=1, channels_last=True)
    check(layer, 2, seed=2)


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
@pytest.mark.parametrize("size", [[12, 12], [9, 11], [14, 14]])  # rows of whole 16-byte vectors, of 2 (bf16) or 4-byte units, of 8-byte ones (bf16)
def test_the_layout_pass_reads_a_misaligned_input_as_an_aligned_copy(precision, size):
    """A contiguous input at an address that is not 16-byte aligned (a view with an offset) takes the
    layout pass's element-wise reads: the output is bit for bit the aligned copy's."""
    layer = layer_of({"name": f"tma_misaligned_{precision}_{size[1]}", "input": {"channels": 24, "size": size},
                      "conv": {"out_channels": 32, "kernel": 3, "padding": 1}, "epilogue": ["relu"], "precision": precision})
    dtype = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16}[precision]
    shape = (3, 24, *size)
    flat = torch.randn(3 * 24 * size[0] * size[1] + 1, device="cuda").to(dtype)
    sliced = flat[1:].view(shape)
    assert sliced.is_contiguous() and sliced.data_ptr() % 16
    with torch.no_grad():
        got, want = layer(sliced), layer(sliced.clone())
    assert bool(torch.isfinite(want).all())
    assert torch.equal(got, want)
