"""Autograd through the specgen op, on the CPU: gradcheck in float64 for specs that together use
every op, pool and reduction of the vocabulary; gradients and a short training run against the
plain PyTorch model; nothing saved for backward under no_grad / inference_mode."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from specgen import ops, reference  # noqa: E402
from specgen.module import FusedLayer  # noqa: E402
from specgen.spec import validate  # noqa: E402

# Small specs that, together, use every stage op (and both GELUs, scalar and per-channel
# operands, 1D/2D/3D convs with stride, padding, dilation, groups and no bias).
GRAD_SPECS = [
    {
        "name": "pointwise_a",
        "input": {"channels": 2, "size": [3, 4]},
        "conv": {"out_channels": 4, "kernel": 3, "padding": 1},
        "epilogue": [
            {"leaky_relu": {"negative_slope": 0.1}},
            {"add": {"param": "shift"}},
            {"mul": {"param": "scale"}},
            {"gelu": {"approximate": "none"}},
            {"sub": 0.25},
            {"div": {"param": "denom"}},
            "tanh",
            {"add": 0.5},
            {"mul": 1.5},
            {"div": 2.0},
            {"sub": {"param": "shift"}},
            "sigmoid",
        ],
    },
    {
        "name": "pointwise_b",
        "input": {"channels": 3, "size": [11]},
        "conv": {"out_channels": 4, "kernel": 3, "stride": 2, "padding": 1, "dilation": 2},
        "epilogue": [
            {"gelu": {"approximate": "tanh"}},
            "mish",
            "hardswish",
            {"hardtanh": {"min_val": -1.5, "max_val": 1.5}},
            {"clamp": {"min": -1.25}},
            "silu",
            {"softplus": {"beta": 2.0, "threshold": 1.0}},
            {"min": 1.1},
            {"max": -1.1},
            {"expr": "sqrt(x * x + 1) + log(1 + exp(x)) * gain + erf(x) - abs(x) * 0.1 + max(x, 0.2) "
                     "- min(x, -0.2) + sigmoid(x) * relu(x) + tanh(x) + x ** 2 - clamp(x, -1, 1) / 3"},
            "relu",
        ],
    },
    {
        "name": "transposed_batch_norm",
        "input": {"channels": 4, "size": [3, 4]},
        "conv": {"out_channels": 4, "kernel": 3, "stride": 2, "padding": 1, "output_padding": 1, "groups": 2,
                 "transposed": True},
        "epilogue": [{"batch_norm": {"eps": 0.1}}, "tanh", {"max_pool": 2}],
    },
    {
        "name": "pools_2d",
        "input": {"channels": 2, "size": [8, 9]},
        "conv": {"out_channels": 4, "kernel": 3, "groups": 2},
        "epilogue": [
            {"avg_pool": {"kernel": 3, "stride": 2, "padding": 1, "count_include_pad": False}},
            {"mul": {"param": "scale"}},
            {"max_pool": {"kernel": 2, "stride": 1}},
            {"sum": {"dims": [-1]}},
            {"logsumexp": {"dims": [1], "keepdim": True}},
        ],
    },
    {
        "name": "pools_3d",
        "input": {"channels": 2, "size": [4, 5, 5]},
        "conv": {"out_channels": 3, "kernel": 2, "bias": False},
        "epilogue": [
            {"max_pool": {"kernel": 2, "padding": 1, "dilation": 1}},
            {"avg_pool": {"kernel": 2, "stride": 1}},
            "global_avg_pool",
            {"mean": {"dims": [1], "keepdim": True}},
            "tanh",
        ],
    },
    {
        "name": "global_max_1d",
        "input": {"channels": 2, "size": [9]},
        "conv": {"out_channels": 3, "kernel": 3},
        "epilogue": ["global_max_pool", {"mul": {"param": "scale"}}, "sigmoid"],
    },
    {
        "name": "reductions",
        "input": {"channels": 2, "size": [5, 5]},
        "conv": {"out_channels": 4, "kernel": 2},
        "epilogue": [
            {"amax": {"dims": [2]}},
            {"amin": {"dims": [-1], "keepdim": True}},
            {"add": {"param": "shift"}},
            {"mean": {"dims": [1]}},
        ],
    },
    {
        "name": "norms",
        "input": {"channels": 2, "size": [4, 5]},
        "conv": {"out_channels": 4, "kernel": 2},
        "epilogue": [
            {"save": "pre"},  # read again after the norm: gradients flow through both uses
            {"group_norm": 2},
            "tanh",
            {"add": {"saved": "pre"}},
            {"instance_norm": {"affine": True}},
            {"layer_norm": 4},
            {"layer_norm_channels": {"name": "lnc"}},
            {"softmax": 1},
            {"mul": {"param": "scale"}},
            {"log_softmax": [2, 3]},
        ],
    },
    {
        "name": "batch_norm_training",
        "input": {"channels": 2, "size": [5, 5]},
        "conv": {"out_channels": 3, "kernel": 2},
        "epilogue": [{"batch_norm": {"training": True, "eps": 0.1}}, {"max_pool": 2}, {"softmax": -1}, {"center": [2, 3]}],
    },
]


def grad_specs():
    return [pytest.param(validate(d), id=d["name"]) for d in GRAD_SPECS]


def randomize(layer: torch.nn.Module, seed: int) -> None:
    """Random parameters; per-channel ones away from zero (some divide)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            value = torch.randn(p.shape, generator=gen, dtype=p.dtype)
            if p.dim() > 1 and not name.startswith("conv."):
                value = value.sign() * (0.5 + value.abs())
            p.copy_(value * (0.5 if name == "conv.weight" else 1.0))


def make_input(spec, batch: int, dtype=torch.float32, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((batch, spec.input.channels, *spec.input.size), generator=gen, dtype=dtype)


def test_grad_specs_cover_the_vocabulary():
    used, gelus = set(), set()
    for data in GRAD_SPECS:
        spec = validate(data)
        for stage in spec.epilogue:
            used.add(stage.op)
            if stage.op == "gelu":
                gelus.add(stage.args.approximate)
    assert used == set(ops.STAGE_KINDS), f"not covered: {sorted(set(ops.STAGE_KINDS) - used)}"
    assert gelus == {"none", "tanh"}


@pytest.mark.parametrize("spec", grad_specs())
def test_gradcheck_float64_through_the_op(spec):
    layer = FusedLayer(spec).double()
    randomize(layer, seed=3)
    x = make_input(spec, 1, torch.float64).requires_grad_()
    args = layer.op.arguments(x, layer.conv.weight, layer.conv.bias, layer.spec_params())
    args = tuple(t.detach().requires_grad_() for t in args)
    if layer.op.stats_size:  # (output, batch statistics): the statistics have no gradient
        def output(*a):
            return layer.op.overload(*a)[0]
    else:
        output = layer.op.overload
    assert torch.autograd.gradcheck(output, args, eps=1e-6, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("spec", grad_specs())
def test_module_gradients_match_the_reference(spec):
    fused = FusedLayer(spec)
    randomize(fused, seed=5)
    plain = reference.Reference(spec)
    plain.load_state_dict(fused.state_dict())
    x1 = make_input(spec, 3).requires_grad_()
    x2 = x1.detach().clone().requires_grad_()
    g = torch.randn(spec.output_shape(3), generator=torch.Generator().manual_seed(9))
    (fused(x1) * g).sum().backward()
    (plain(x2) * g).sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad, rtol=0, atol=0)
    fused_grads = dict(fused.named_parameters())
    for name, p in plain.named_parameters():
        assert fused_grads[name].grad is not None, f"no gradient for {name}"
        torch.testing.assert_close(fused_grads[name].grad, p.grad, rtol=0, atol=0, msg=f"gradient of {name}")


def test_only_the_needed_gradients_are_computed():
    spec = validate(GRAD_SPECS[0])
    layer = FusedLayer(spec)
    layer.conv.weight.requires_grad_(False)
    x = make_input(spec, 2)  # no grad
    layer(x).sum().backward()
    assert layer.conv.weight.grad is None
    assert layer.conv.bias.grad is not None and layer.scale.grad is not None


@pytest.mark.parametrize("spec", grad_specs()[:3])
def test_training_matches_the_plain_model(spec):
    """A few SGD steps on one batch of random data: the same losses as the plain PyTorch model."""
    fused = FusedLayer(spec)
    randomize(fused, seed=11)
    plain = reference.Reference(spec)
    plain.load_state_dict(fused.state_dict())
    x = make_input(spec, 4, seed=100)
    target = torch.randn(spec.output_shape(4), generator=torch.Generator().manual_seed(13))
    losses = {}
    for label, model in (("fused", fused), ("plain", plain)):
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        losses[label] = []
        for _ in range(5):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), target)
            loss.backward()
            opt.step()
            losses[label].append(loss.item())
    assert losses["fused"] == pytest.approx(losses["plain"], rel=1e-6, abs=1e-7)
    assert losses["fused"][-1] < losses["fused"][0]
    for (name, p), q in zip(fused.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=f"parameter {name} after training")


def test_compiled_training_step_matches_eager():
    torch._dynamo.reset()
    spec = validate(GRAD_SPECS[2])
    fused = FusedLayer(spec)
    randomize(fused, seed=17)
    plain = reference.Reference(spec)
    plain.load_state_dict(fused.state_dict())
    compiled = torch.compile(fused, fullgraph=True, backend="aot_eager")
    x = make_input(spec, 4)
    for model in (compiled, plain):
        model(x).square().sum().backward()
    for (name, p), q in zip(fused.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=f"gradient of {name}")
    torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------
# Inference: nothing saved
# ---------------------------------------------------------------------------------------------


class SaveCounter:
    """Counts tensors packed for backward (every save_for_backward goes through the pack hook)."""

    def __init__(self):
        self.count = 0

    def __enter__(self):
        def pack(t):
            self.count += 1
            return t

        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_nothing_saved_for_backward_in_inference(mode):
    spec = validate(GRAD_SPECS[0])
    layer = FusedLayer(spec)
    x = make_input(spec, 2).requires_grad_()
    context = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
    with SaveCounter() as saved, context:
        y = layer(x)
    assert saved.count == 0
    assert y.grad_fn is None and not y.requires_grad
    if mode == "inference_mode":
        assert y.is_inference()
    with SaveCounter() as saved:  # the control: with grad, the op saves its inputs (no copies)
        y = layer(x)
    assert y.grad_fn is not None
    assert saved.count == 2 + spec.conv.bias + len(spec.params())


def test_double_backward_is_not_supported_silently():
    """The backward recomputes with the reference detached from the graph: first order only."""
    spec = validate(GRAD_SPECS[4])
    layer = FusedLayer(spec).double()
    x = make_input(spec, 2, torch.float64).requires_grad_()
    (gx,) = torch.autograd.grad(layer(x).sum(), x, create_graph=True)
    assert not gx.requires_grad
