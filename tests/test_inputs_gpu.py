"""Extra inputs on the GPU (marker `gpu`; skipped without CUDA): every engine that reads them, in
every precision it has, against float64 at the mode's bar (fp32: rel. L2 <= 1e-5 and allclose to
PyTorch fp32; tf32, bf16, fp16: within 2x PyTorch's own error). Outputs poisoned with NaN, fresh
random inputs and extra inputs per check, batch 1 and odd batches, both input memory formats;
inputs of one value per sample and channel; gradients through the op; a residual block and a time
embedding imported whole."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

from specgen import FusedLayer, from_module, reference  # noqa: E402

from gpu_helpers import assert_model_bar, pinned_layer, precision_params, skip_unless_engine_runs  # noqa: E402
from gpu_helpers import compare_formats  # noqa: E402
from gpu_helpers import rel_l2, tf32_allowed  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fp32_reference")]

RESIDUAL = ["batch_norm", {"add": {"input": "shortcut"}}, "relu"]
# name -> (input channels, size, conv, epilogue, engine, precisions)
CASES = {
    "tma_3x3": (64, [14, 14], {"out_channels": 64, "kernel": 3, "padding": 1, "bias": False}, RESIDUAL, "tma",
                ["fp32", "tf32", "bf16", "fp16"]),
    "tma_1x1_gate": (64, [9, 11], {"out_channels": 96, "kernel": 1}, [{"add": {"input": "shortcut"}}, "relu", {"mul": {"input": "gate"}}],
                     "tma", ["tf32", "bf16"]),
    # a strided transposed conv's W pairs: each thread reads the extra inputs at outputs 2j and 2j + 1
    "tma_transposed_even": (32, [7, 9], {"out_channels": 24, "kernel": 3, "stride": 2, "padding": 1, "output_padding": 1,
                                         "transposed": True}, [{"add": {"input": "shortcut"}}, "relu", {"mul": {"input": "gate"}}],
                            "tma", ["fp32", "tf32", "bf16"]),
    "tma_transposed_odd_3d": (16, [4, 5, 6], {"out_channels": 40, "kernel": 3, "stride": 2, "padding": 1, "transposed": True},
                              [{"add": {"input": "shortcut"}}, "hardswish"], "tma", ["tf32", "fp16"]),
    "igemm": (16, [10, 10], {"out_channels": 24, "kernel": 3, "padding": 1},
              ["batch_norm", {"add": {"input": "shortcut"}}, {"mul": {"input": "gate"}}, "relu"], "igemm", ["fp32", "tf32"]),
    "tail_train_bn": (16, [12, 12], {"out_channels": 32, "kernel": 3, "padding": 1, "bias": False},
                      [{"batch_norm": {"training": True}}, {"sub": {"input": "shortcut"}}, "relu"], "sequence", ["fp32"]),
    "tail_group_norm": (8, [9, 9], {"out_channels": 16, "kernel": 3}, [{"group_norm": 4}, {"div": {"input": "scale"}}], "sequence",
                        ["fp32", "tf32"]),
    # one value per sample and channel (`shape: [C, 1, ...]`, a time embedding), beside a shortcut
    # of the output's shape; 1-D and 3-D; the implicit GEMM's split-K reduction; the tail engine
    "tma_temb": (64, [14, 14], {"out_channels": 64, "kernel": 3, "padding": 1},
                 [{"add": {"input": "temb", "shape": [64, 1, 1]}}, "silu"], "tma", ["fp32", "tf32", "bf16", "fp16"]),
    "tma_temb_shortcut_3d": (16, [4, 6, 6], {"out_channels": 32, "kernel": 3, "padding": 1},
                             [{"mul": {"input": "temb", "shape": [32, 1, 1, 1]}}, {"add": {"input": "shortcut"}}], "tma",
                             ["tf32", "bf16"]),
    "tma_temb_1d": (32, [50], {"out_channels": 48, "kernel": 3, "padding": 1},
                    [{"sub": {"input": "temb", "shape": [48, 1]}}, "gelu"], "tma", ["tf32"]),
    "igemm_temb": (16, [10, 10], {"out_channels": 24, "kernel": 3, "padding": 1},
                   ["batch_norm", {"add": {"input": "temb", "shape": [24, 1, 1]}}, {"mul": {"input": "gate"}}, "relu"],
                   "igemm", ["fp32", "tf32"]),
    "igemm_temb_split": (256, [6, 6], {"out_channels": 32, "kernel": 3, "padding": 1},
                         [{"add": {"input": "temb", "shape": [32, 1, 1]}}, "relu"], "igemm", ["fp32"]),
    "tail_temb": (8, [9, 9], {"out_channels": 16, "kernel": 3}, [{"group_norm": 4}, {"add": {"input": "temb", "shape": [16, 1, 1]}},
                                                                 "silu"], "sequence", ["fp32", "tf32"]),
    # read by the body kernel before a statistic stage (the tail normalizes what it wrote)
    "body_temb_group_norm": (64, [12, 12], {"out_channels": 64, "kernel": 3, "padding": 1},
                             [{"add": {"input": "temb", "shape": [64, 1, 1]}}, {"group_norm": 8}, "silu"], "sequence",
                             ["fp32", "tf32"]),
    "body_shortcut_train_bn": (64, [10, 10], {"out_channels": 64, "kernel": 3, "padding": 1, "bias": False},
                               [{"add": {"input": "shortcut"}}, {"batch_norm": {"training": True}}, "relu"], "sequence", ["tf32"]),
}


def _layer(name: str, precision: str) -> FusedLayer:
    cin, size, conv, epilogue, engine, _ = CASES[name]
    return pinned_layer(f"in_{name}_{precision}", cin, size, conv, epilogue, engine, precision)


PARAMS = precision_params(CASES)


@pytest.mark.parametrize("name, precision", PARAMS)
def test_extra_inputs_match_float64(name, precision):
    skip_unless_engine_runs(CASES[name][4])
    layer = _layer(name, precision)
    compare_formats(layer)


def test_the_split_k_case_plans_a_split():
    assert _layer("igemm_temb_split", "fp32").specialize().plan["igemm"].split_k > 1


def test_a_transposed_conv_with_an_extra_input_runs_w_pairs_on_the_tma_engine_when_asked():
    for name in ("tma_transposed_even", "tma_transposed_odd_3d"):
        tp = _layer(name, "tf32").specialize().plan["tma"]
        assert tp.phases and tp.w_pairs, name


@pytest.mark.parametrize("name", ["tma_3x3", "igemm", "tail_train_bn", "tma_temb", "tail_temb"])
def test_the_raw_launch_and_the_op_agree_and_gradients_reach_the_shortcut(name):
    layer = _layer(name, "fp32")
    spec = layer.spec
    gen = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn((3, spec.input.channels, *spec.input.size), generator=gen, device="cuda")
    extras = [torch.randn((3, *shape), generator=gen, device="cuda", requires_grad=True) for shape in spec.inputs().values()]
    layer.train()
    y = layer(x, *extras)  # through the op: differentiable
    with torch.no_grad():
        raw = layer(x, *extras)  # the raw launch
    torch.testing.assert_close(raw, y.detach(), rtol=0, atol=0)  # the same kernels: bit for bit
    grad = torch.randn_like(y)
    y.backward(grad)
    leaves = [e.detach().clone().requires_grad_() for e in extras]
    want = reference.forward(spec, x, layer.conv.weight, layer.conv.bias, {**layer.spec_params(), **dict(zip(spec.inputs(), leaves))})
    want.backward(grad)
    for got, expected in zip(extras, leaves):
        assert rel_l2(got.grad, expected.grad) <= 1e-5


class Block(torch.nn.Module):
    """ResNet's basic block with a projection shortcut, computed first (as torchvision writes it)."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        nn = torch.nn
        self.conv1, self.bn1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
        self.conv2, self.bn2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        identity = self.down(x)
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + identity)


def test_a_residual_block_imports_whole_and_matches_in_tf32():
    """The shortcut's add joins a chain as an extra input; the block matches at the tf32 bar."""
    torch.manual_seed(0)
    model = Block(64, 128, stride=2).cuda().eval()
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            with torch.no_grad():
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 1.5)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
    x = torch.randn(4, 64, 28, 28, device="cuda")
    fused = from_module(copy.deepcopy(model), x, keep_slower=True, precision="tf32")
    report = fused.specgen_report
    assert any(spec.inputs() for spec in report.specs), str(report)
    with torch.no_grad():
        got = fused(x)
        ref64 = copy.deepcopy(model).double()(x.double())
        with tf32_allowed(True):
            ref_tf32 = model(x)
    assert bool(torch.isfinite(got).all())
    assert rel_l2(got, ref64) <= 2 * max(rel_l2(ref_tf32, ref64), 2.0**-11)


class TimeBlock(torch.nn.Module):
    """A diffusion U-Net's residual block: group norm, SiLU, conv; the time embedding projected and
    added per sample and channel; again; the block's input added."""

    def __init__(self, c: int = 64, t: int = 128):
        super().__init__()
        nn = torch.nn
        self.norm1, self.conv1 = nn.GroupNorm(8, c), nn.Conv2d(c, c, 3, padding=1)
        self.emb = nn.Linear(t, c)
        self.norm2, self.conv2 = nn.GroupNorm(8, c), nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x, t):
        h = self.conv1(torch.nn.functional.silu(self.norm1(x)))
        h = h + self.emb(torch.nn.functional.silu(t))[:, :, None, None]
        h = self.conv2(torch.nn.functional.silu(self.norm2(h)))
        return x + h


@pytest.mark.parametrize("precision", ["fp32", "tf32"])
def test_a_time_embedding_block_fuses_the_embedding_as_an_input_and_matches(precision):
    torch.manual_seed(0)
    model = TimeBlock().cuda().eval()
    x, t = torch.randn(3, 64, 24, 24, device="cuda"), torch.randn(3, 128, device="cuda")
    fused = from_module(copy.deepcopy(model), x, t, keep_slower=True, precision=precision)
    shapes = [spec.inputs() for spec in fused.specgen_report.specs]
    assert {(64, 1, 1)} <= {s for inputs in shapes for s in inputs.values()}, str(fused.specgen_report)
    with torch.no_grad():
        got = fused(x, t)
        ref64 = copy.deepcopy(model).double()(x.double(), t.double())
        with tf32_allowed(precision == "tf32"):
            ref = model(x, t)
    assert_model_bar(got, ref64, ref, precision)
