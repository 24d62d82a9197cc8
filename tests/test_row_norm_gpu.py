"""A statistic stage over trailing spatial dims in the TMA engine's epilogue (`tma.row_norm`)
against float64 on the GPU (marker `gpu`; skipped without an sm_90 GPU): LayerNorms over W and
over H and W, softmax and log-softmax over W, an instance norm of a small map, the transposed
KernelBench-34 layer's W pairs, a pool reading its output. At each precision's bar (see
gpu_helpers.compare), outputs poisoned first, fresh inputs and parameters per check, batches
whose last tile is partly past the end, both input memory formats."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from specgen.module import FusedLayer  # noqa: E402
from specgen.spec import validate  # noqa: E402

from gpu_helpers import compare as check, compare_formats  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fp32_reference")]

C3 = {"kernel": 3, "padding": 1}
KB34_CONV = {"kernel": 4, "stride": 2, "padding": 1, "transposed": True}


@pytest.fixture(autouse=True)
def _hopper():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the TMA engine needs an sm_90 GPU")


CASES = {
    # name: (input channels, size, conv, epilogue)
    "ln_w64_gelu": (64, [6, 64], {"out_channels": 64, **C3}, ["relu", {"layer_norm": 64}, "gelu"]),
    "ln_w32_300ch": (32, [5, 32], {"out_channels": 300, **C3}, [{"layer_norm": 32}, {"mul": {"param": "s"}}]),
    "ln_hw_3d": (16, [3, 8, 8], {"out_channels": 40, **C3}, [{"add": 0.5}, {"layer_norm": [8, 8]}, "tanh"]),
    "ln_w128_1d": (64, [128], {"out_channels": 96, "kernel": 5, "padding": 2}, [{"layer_norm": {"normalized_shape": [128], "eps": 1e-3}}]),
    "ln_w16_plain": (48, [9, 16], {"out_channels": 24, **C3}, [{"layer_norm": {"normalized_shape": [16], "elementwise_affine": False}}]),
    "softmax_w32": (32, [7, 32], {"out_channels": 72, **C3}, [{"softmax": -1}, {"mul": 3.0}]),
    "log_softmax_w16": (64, [11, 16], {"out_channels": 40, **C3}, [{"mul": 4.0}, {"log_softmax": -1}]),
    "instance_norm_8x8": (64, [8, 8], {"out_channels": 128, **C3}, [{"instance_norm": {"affine": True}}, "relu"]),
    "conv3d_s2_ln_w16": (16, [6, 8, 32], {"out_channels": 32, "kernel": 3, "stride": 2, "padding": 1}, [{"layer_norm": 16}, "gelu"]),
    "kb34_pairs": (32, [3, 6, 32], {"out_channels": 64, **KB34_CONV}, [{"layer_norm": 64}, "gelu", {"mul": 1.5}]),
}


def layer_of(name: str, precision: str) -> FusedLayer:
    cin, size, conv, epilogue = CASES[name]
    # (the engine asked for: left to the planner, an fp32 layer of few multiply-adds per input byte runs
    # as a sequence of the implicit GEMM and the tail engine)
    spec = validate({"name": f"rn_{name}_{precision}", "input": {"channels": cin, "size": size}, "conv": conv,
                     "epilogue": epilogue, "precision": precision, "tile": {"engine": "tma"}})
    layer = FusedLayer(spec).cuda()
    plan = layer.specialize().plan
    assert plan["engine"] == "tma" and plan["tma"].row_norm, plan.get("why")
    return layer


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_row_norm_cases(name, precision):
    layer = layer_of(name, precision)
    compare_formats(layer)


@pytest.mark.parametrize("precision", ["tf32", "fp32"])
def test_a_walking_block_meets_many_tiles(precision):
    """Enough tiles that each block walks several (the barriers and the statistics' shared memory
    reused from tile to tile), the last one partly past the batch."""
    layer = layer_of("ln_w64_gelu", precision)
    assert layer.specialize().plan["tma"].persistent
    check(layer, 61, seed=4)


def test_the_transposed_layer_runs_two_blocks_per_sm():
    layer = layer_of("kb34_pairs", "tf32")
    tp = layer.specialize().plan["tma"]
    assert tp.blocks_per_sm == 2 and tp.w_pairs
    check(layer, 5, seed=6)


@pytest.mark.parametrize("precision", ["fp32", "tf32"])
def test_a_pool_after_a_layer_norm_over_w_reads_its_output(precision):
    data = {"name": f"rn_pool_{precision}", "input": {"channels": 32, "size": [10, 32]},
            "conv": {"out_channels": 48, **C3}, "epilogue": [{"layer_norm": 32}, {"avg_pool": 2}, "gelu"],
            "precision": precision}
    layer = FusedLayer(validate(data)).cuda()
    plan = layer.specialize().plan
    assert [p.role for p in plan["parts"]] == ["body", "rest"] and plan["parts"][0].plan["tma"].row_norm
    check(layer, 1, seed=1)
    check(layer, 3, seed=2)
