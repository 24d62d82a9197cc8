"""The implicit-GEMM engine against float64 on the GPU (marker `gpu`; skipped without CUDA).

fp32 mode (3xTF32): rel. L2 <= 1e-5 against float64 and allclose(1e-4, 1e-4) against PyTorch fp32.
tf32 mode: rel. L2 against float64 within 2x of PyTorch's own TF32 convolution's (cuDNN, same
inputs). Outputs are poisoned with NaN before each run; inputs are fresh per check.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hypothesis import HealthCheck, assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from specgen.module import FusedLayer  # noqa: E402
from specgen.spec import SpecError, validate  # noqa: E402

from gpu_helpers import compare as check  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fp32_reference")]


def layer_of(data: dict) -> FusedLayer:
    spec = validate({**data, "tile": {**data.get("tile", {}), "engine": "igemm"}})
    layer = FusedLayer(spec).cuda()
    assert layer.specialize().plan["engine"] == "igemm"
    return layer


CASES = {
    # name: (input channels, size, conv, epilogue)
    "c64_3x3_p1": (64, [20, 20], {"out_channels": 64, "kernel": 3, "padding": 1}, ["relu"]),
    "c128_s2_256": (128, [15, 17], {"out_channels": 256, "kernel": 3, "stride": 2, "padding": 1}, ["relu"]),
    "c1x1_vec": (32, [8, 12], {"out_channels": 96, "kernel": 1}, [{"leaky_relu": {"negative_slope": 0.1}}]),
    "c1x1_s2": (48, [9, 9], {"out_channels": 40, "kernel": 1, "stride": 2}, ["sigmoid"]),
    "cin3_7x7_s2": (3, [33, 31], {"out_channels": 24, "kernel": 7, "stride": 2, "padding": 3}, ["relu"]),
    "cin5_odd_cout": (5, [13, 11], {"out_channels": 37, "kernel": [3, 2], "padding": [1, 0]}, ["tanh"]),
    "cin20_pad_channels": (20, [10, 10], {"out_channels": 70, "kernel": 3, "dilation": 2, "padding": 2}, ["silu"]),
    "conv1d_gelu": (64, [300], {"out_channels": 128, "kernel": 5, "padding": 2}, [{"gelu": {"approximate": "none"}}]),
    "conv3d": (16, [6, 9, 10], {"out_channels": 32, "kernel": 3, "padding": 1}, ["relu", {"mul": 0.5}]),
    "no_bias_affine": (32, [12, 12], {"out_channels": 64, "kernel": 3, "bias": False}, [{"mul": 2.0}, {"add": 1.0}, "relu"]),
    "param_add": (16, [11, 9], {"out_channels": 48, "kernel": 3}, [{"add": {"param": "shift"}}, "mish"]),
    "wide_k": (256, [7, 7], {"out_channels": 128, "kernel": 3, "padding": 1}, ["relu"]),
    "cout_8": (64, [16, 16], {"out_channels": 8, "kernel": 3}, ["relu"]),
}


def _data(name: str, precision: str) -> dict:
    cin, size, conv, epilogue = CASES[name]
    return {"name": f"ig_{name}_{precision}", "input": {"channels": cin, "size": size}, "conv": conv,
            "epilogue": epilogue, "precision": precision}


@pytest.mark.parametrize("precision", ["fp32", "tf32"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_igemm_cases(name, precision):
    layer = layer_of(_data(name, precision))
    check(layer, 1, seed=1)
    check(layer, 3, seed=2)


@pytest.mark.parametrize("bk,stages,tile", [(8, 2, (4, 2, 2, 4)), (16, 4, (2, 4, 4, 4)), (32, 3, (8, 1, 2, 4))])
def test_igemm_configs(bk, stages, tile):
    """Other tile shapes and pipeline depths than the planner's (what a tuner would try)."""
    from specgen import igemm, pipeline, plan as plan_mod

    spec = validate({**_data("c64_3x3_p1", "fp32"), "tile": {"engine": "igemm"}})
    config = igemm.IgemmConfig(*tile, bk, stages)
    sp = pipeline.specialize(spec, igemm_config=config)
    assert sp.plan["igemm"].config == config
    layer = FusedLayer(spec).cuda()
    layer._specialized = sp
    layer._bind_op()
    del plan_mod
    check(layer, 2, seed=5)


def _wgmma_config(cout: int, warpgroups: int = 2, stages: int = 3):
    from specgen import igemm

    bn = min(256, -(-cout // 8) * 8)
    return igemm.IgemmConfig(4 * warpgroups, 1, 1, bn // 8, 32, stages, 1, True)


@pytest.mark.parametrize("precision", ["fp32", "tf32"])
@pytest.mark.parametrize("name", ["c64_3x3_p1", "c128_s2_256", "cin3_7x7_s2", "cin5_odd_cout", "conv1d_gelu",
                                  "conv3d", "no_bias_affine", "wide_k", "c1x1_vec", "cout_8"])
def test_igemm_wgmma(name, precision):
    """Hopper's warpgroup MMA (sm_90a): B from swizzled shared memory, A from registers."""
    from specgen import pipeline

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("wgmma needs an sm_90 GPU")
    data = _data(name, precision)
    spec = validate({**data, "tile": {"engine": "igemm"}})
    config = _wgmma_config(spec.conv.out_channels)
    sp = pipeline.specialize(spec, igemm_config=config)
    assert sp.plan["igemm"].wgmma and sp.build.arch == "sm_90a"
    layer = FusedLayer(spec).cuda()
    layer._specialized = sp
    layer._bind_op()
    check(layer, 1, seed=1)
    check(layer, 5, seed=2)


def test_igemm_large_batch_tail():
    """M not a multiple of the block tile, and many blocks: the last tile is partly past the end."""
    check(layer_of(_data("c1x1_s2", "fp32")), 37, seed=7)


def test_igemm_weights_follow_in_place_updates():
    """The permuted weight copy is remade when the weights change in place."""
    layer = layer_of(_data("c64_3x3_p1", "fp32"))
    check(layer, 2, seed=1)
    check(layer, 2, seed=2)  # randomizes the weights in place again


@settings(max_examples=80, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(
    nd=st.integers(1, 3),
    cin=st.sampled_from([1, 3, 4, 8, 12, 16, 24, 32, 64]),
    cout=st.sampled_from([4, 8, 16, 24, 40, 64, 72, 128]),
    k=st.integers(1, 3),
    stride=st.integers(1, 2),
    pad=st.integers(0, 2),
    dil=st.integers(1, 2),
    size=st.integers(3, 12),
    precision=st.sampled_from(["fp32", "tf32"]),
    act=st.sampled_from(["relu", "sigmoid", "tanh", {"gelu": {"approximate": "tanh"}}, {"clamp": {"min": -0.5, "max": 0.5}}]),
)
def _igemm_random_spec(nd, cin, cout, k, stride, pad, dil, size, precision, act):
    data = {"name": "ig_random", "input": {"channels": cin, "size": [size + 2 * d for d in range(nd)]},
            "conv": {"out_channels": cout, "kernel": k, "stride": stride, "padding": pad, "dilation": dil},
            "epilogue": [act], "precision": precision}
    try:
        layer = layer_of(data)
    except SpecError as err:
        assume("spans" not in str(err))  # an empty output: validation tests cover that
        raise
    check(layer, 1, seed=1)
    check(layer, 4, seed=2)
    _RANDOM_CHECKED.append(data)


_RANDOM_CHECKED: list[dict] = []


def test_igemm_random_specs():
    _RANDOM_CHECKED.clear()
    _igemm_random_spec()
    assert len(_RANDOM_CHECKED) >= 0.8 * 80, f"only {len(_RANDOM_CHECKED)} of 80 random specs were checked"


# ---- split K ---------------------------------------------------------------------------------------------

SPLIT_CASES = {
    # deep layers with few positions: at small batches their tiles leave most SMs idle
    "c512_7_shortcut": (512, [7, 7], {"out_channels": 512, "kernel": 3, "padding": 1},
                        [{"add": {"input": "shortcut"}}, "relu"]),
    "c1x1_576_96_param": (576, [14, 14], {"out_channels": 96, "kernel": 1, "bias": False},
                          [{"mul": {"param": "scale"}}, {"add": {"param": "shift"}}]),
    "conv1d_deep": (384, [20], {"out_channels": 100, "kernel": 3, "padding": 1}, [{"gelu": {"approximate": "none"}}]),
    "c256_14_to_64": (256, [14, 14], {"out_channels": 64, "kernel": 3, "padding": 1}, ["relu"]),  # wgmma in 3xTF32 too
}


@pytest.mark.parametrize("precision", ["fp32", "tf32"])
@pytest.mark.parametrize("name", sorted(SPLIT_CASES))
def test_igemm_split_k_small_batches(name, precision):
    """Batch 1, 2 and 5 run the split kernel and its reduction (asserted); a batch whose tiles fill the
    GPU runs the plain kernel; both at the mode's bar."""
    from specgen import tmarun, torchop

    cin, size, conv, epilogue = SPLIT_CASES[name]
    layer = layer_of({"name": f"igsplit_{name}_{precision}", "input": {"channels": cin, "size": size}, "conv": conv,
                      "epilogue": epilogue, "precision": precision})
    sp = layer.specialize()
    assert sp.plan["igemm"].split_k > 1
    lp, sms = torchop._launch_plan(sp), tmarun.sm_count(torch.cuda.current_device())
    for batch, seed in ((1, 1), (2, 2), (5, 3)):
        assert torchop.igemm_uses_split(lp, batch, sms), f"batch {batch} did not take the split kernel"
        check(layer, batch, seed=seed)
    big = next(b for b in range(8, 4096) if not torchop.igemm_uses_split(lp, b, sms))
    check(layer, big, seed=5)


def test_igemm_split_k_is_deterministic_and_replays_in_a_cuda_graph():
    from gpu_helpers import assert_repeatable_and_replayed, randomize

    cin, size, conv, epilogue = SPLIT_CASES["c1x1_576_96_param"]
    layer = layer_of({"name": "igsplit_graph", "input": {"channels": cin, "size": size}, "conv": conv,
                      "epilogue": epilogue, "precision": "fp32"})
    gen = torch.Generator(device="cuda").manual_seed(11)
    randomize(layer, gen)
    x = torch.randn((1, cin, *size), device="cuda", generator=gen)
    assert_repeatable_and_replayed(layer, x, gen)
