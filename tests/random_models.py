"""Random small conv nets for the importer's fuzz tests: a hypothesis strategy that draws a model
from what users write around convolutions (1-3 D convs, transposed convs, norms, activations as
modules and functions, constants, max and average pools, skips added back or joined after an
upsample, softmax and reductions over the channels), with an input that fits it.

Each draw keeps every shape valid as it goes (the steps know the running shape), so a failure is
always the importer's, never the model's."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import strategies as st

from kernelbench_problems import randomize_batch_norms

CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
CONV_T = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}
BATCH_NORM = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}
MAX_POOL = {1: nn.MaxPool1d, 2: nn.MaxPool2d, 3: nn.MaxPool3d}
AVG_POOL = {1: nn.AvgPool1d, 2: nn.AvgPool2d, 3: nn.AvgPool3d}
ACTIVATIONS = {
    "ReLU": nn.ReLU, "GELU": nn.GELU, "SiLU": nn.SiLU, "Sigmoid": nn.Sigmoid, "Tanh": nn.Tanh,
    "Hardswish": nn.Hardswish, "ReLU6": nn.ReLU6, "Mish": nn.Mish, "LeakyReLU": lambda: nn.LeakyReLU(0.1),
    "ELU": nn.ELU, "CELU": lambda: nn.CELU(0.5), "SELU": nn.SELU, "Softplus": lambda: nn.Softplus(2.0, 5.0),
    "Hardsigmoid": nn.Hardsigmoid, "LogSigmoid": nn.LogSigmoid, "Softsign": nn.Softsign, "Tanhshrink": nn.Tanhshrink,
    "Softshrink": lambda: nn.Softshrink(0.3), "Hardshrink": lambda: nn.Hardshrink(0.3),
    "Threshold": lambda: nn.Threshold(0.1, -1.0), "Hardtanh": lambda: nn.Hardtanh(-0.5, 0.5),
    "GELU_tanh": lambda: nn.GELU(approximate="tanh"), "Identity": nn.Identity,
}
FUNCTIONS = {
    "relu": torch.relu, "gelu": F.gelu, "sigmoid": torch.sigmoid, "tanh": torch.tanh, "silu": F.silu,
    "hardtanh": lambda x: F.hardtanh(x, -0.5, 0.75), "leaky_relu": lambda x: F.leaky_relu(x, 0.2),
    "elu": lambda x: F.elu(x, 0.7), "abs": torch.abs, "square": torch.square, "pow2": lambda x: x.pow(2),
    "erf": torch.erf, "where": lambda x: torch.where(x > 0, x, 0.1 * x), "maximum": lambda x: torch.maximum(x, 0.2 * x),
    "neg": lambda x: -x, "exp_scaled": lambda x: torch.exp(0.5 * x), "relu_method": lambda x: x.relu(),
    "swish_by_hand": lambda x: x * torch.sigmoid(x), "hardswish_by_hand": lambda x: x * F.relu6(x + 3) / 6,
    "log1p_abs": lambda x: torch.log1p(x.abs()), "clamp_min": lambda x: x.clamp_min(-0.25),
    "log_softmax": lambda x: F.log_softmax(x, dim=1),
}
CONSTANTS = {
    "mul": lambda x: x * 1.5, "add": lambda x: x + 0.25, "sub": lambda x: x - 0.5, "div": lambda x: x / 2.0,
    "clamp": lambda x: torch.clamp(x, min=-0.5, max=0.75),
}
INSTANCE_NORM = {1: nn.InstanceNorm1d, 2: nn.InstanceNorm2d, 3: nn.InstanceNorm3d}
ADAPTIVE_AVG = {1: nn.AdaptiveAvgPool1d, 2: nn.AdaptiveAvgPool2d, 3: nn.AdaptiveAvgPool3d}
ADAPTIVE_MAX = {1: nn.AdaptiveMaxPool1d, 2: nn.AdaptiveMaxPool2d, 3: nn.AdaptiveMaxPool3d}
CAP = {1: 24, 2: 14, 3: 7}  # largest extent drawn per spatial dim
KINDS = ["conv", "conv", "convT", "bn", "gn", "act", "act", "function", "constant", "param", "maxpool", "avgpool",
         "save", "add", "down", "upcat", "upcat", "softmax", "reduce", "unet", "fconv", "up", "pad", "se",
         "channel_linear", "channel_layer_norm", "instance_norm", "adaptive", "head", "block"]


class RandomNet(nn.Module):
    """Runs `steps`, a list of (kind, argument) the strategy drew; modules live in `self.mods`."""

    def __init__(self, nd: int, steps: list, mods: list[nn.Module], params: list[torch.Tensor], outputs: int):
        super().__init__()
        self.nd = nd  # spatial dims (a plain int: torch.fx traces the loop over the steps as constants)
        self.steps = steps
        self.mods = nn.ModuleList(mods)
        self.params = nn.ParameterList([nn.Parameter(p) for p in params])
        self.outputs = outputs

    def forward(self, x):
        saved = []
        for kind, arg in self.steps:
            if kind == "module":
                x = self.mods[arg](x)
            elif kind == "function":
                x = FUNCTIONS[arg](x)
            elif kind == "constant":
                x = CONSTANTS[arg](x)
            elif kind == "param":
                x = x + self.params[arg]
            elif kind == "save":
                saved.append(x)
            elif kind == "add":
                x = x + saved[arg]
            elif kind == "upcat":
                x = torch.cat([F.interpolate(x, scale_factor=2.0, mode="nearest"), saved[arg]], dim=1)
            elif kind == "softmax":
                x = torch.softmax(x, dim=1)
            elif kind == "fconv":  # (a conv written as a function of the model's own weight and bias)
                weight, bias, stride, padding = arg
                conv = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[self.nd]
                x = conv(x, self.params[weight], self.params[bias], stride, padding)
            elif kind == "up":
                x = F.interpolate(x, scale_factor=2.0, mode="nearest")
            elif kind == "pad":
                x = F.pad(x, [arg] * (2 * self.nd))
            elif kind == "se":  # (squeeze and excite, without its two small layers)
                x = x * torch.sigmoid(x.mean(dim=list(range(2, 2 + self.nd)), keepdim=True))
            elif kind == "channel_linear":  # (a Linear over the channels of [N, C, H, W], ConvNeXt's way)
                x = self.mods[arg](x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
            elif kind == "channel_layer_norm":
                x = self.mods[arg](x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
            elif kind == "head":  # (the classifier: flattened, then a Linear)
                x = self.mods[arg](torch.flatten(x, 1))
            elif kind == "block":  # (a residual block: conv, norm, ReLU, conv, added to its input)
                first, norm, second = arg
                x = torch.relu(x + self.mods[second](torch.relu(self.mods[norm](self.mods[first](x)))))
            elif kind == "reduce":
                op, dims = arg
                if op == "mean":
                    x = torch.mean(x, dim=dims, keepdim=True)
                elif op == "amax":
                    x = torch.amax(x, dim=dims, keepdim=True)
                elif op == "sum":
                    x = torch.sum(x, dim=dims, keepdim=True)
                else:
                    x = torch.logsumexp(x, dim=dims, keepdim=True)
        return (x, saved[0]) if self.outputs == 2 and saved else x

    def describe(self) -> str:
        return " -> ".join(f"{kind}:{arg}" if kind != "module" else repr(self.mods[arg]) for kind, arg in self.steps)


def _conv_out(n: int, k: int, s: int, p: int, d: int) -> int:
    return (n + 2 * p - d * (k - 1) - 1) // s + 1


def _pool_out(n: int, k: int, s: int, p: int, ceil: bool) -> int:
    """PyTorch's pooled extent (ceil mode: a last window may start in the padding on the right
    only if it starts inside the input or the left padding)."""
    if not ceil:
        return (n + 2 * p - k) // s + 1
    out = -(-(n + 2 * p - k) // s) + 1
    return out - 1 if (out - 1) * s >= n + p else out


@st.composite
def random_nets(draw, max_steps: int = 7, max_channels: int = 12):
    """(model in eval mode, its input): a conv first, then up to `max_steps` more steps."""
    nd = draw(st.integers(1, 3))
    batch = draw(st.integers(1, 3))
    c = draw(st.integers(1, 6))
    size = [2 * draw(st.integers(2, CAP[nd] // 2)) if draw(st.booleans()) else draw(st.integers(4, CAP[nd])) for _ in range(nd)]
    shape = [c, *size]
    steps, mods, params, saved = [], [], [], []

    def add_module(m):
        mods.append(m)
        steps.append(("module", len(mods) - 1))

    def conv(transposed: bool = False):
        cin = shape[0]
        groups = draw(st.sampled_from([1, 1, 1, cin] if cin > 1 else [1]))
        cout = groups * draw(st.integers(1, max(1, max_channels // groups)))
        k = draw(st.integers(1, 3) if not transposed else st.integers(2, 3))
        s = draw(st.integers(1, 2))
        if transposed:
            p = draw(st.integers(0, k - 1))
            out = [(n - 1) * s - 2 * p + k for n in shape[1:]]
            if min(out) < 1 or max(out) > 2 * CAP[nd]:
                return
            add_module(CONV_T[nd](cin, cout, k, s, p, groups=groups, bias=draw(st.booleans())))
        else:
            d = draw(st.integers(1, 2)) if k > 1 else 1
            p = draw(st.integers(0, d * (k - 1) // 2 + 1)) if k > 1 else 0
            out = [_conv_out(n, k, s, p, d) for n in shape[1:]]
            if min(out) < 1:
                return
            add_module(CONV[nd](cin, cout, k, s, p, d, groups=groups, bias=draw(st.booleans())))
        shape[:] = [cout, *out]

    conv()
    if not steps:  # (the first conv must fit: a 1x1 always does)
        add_module(CONV[nd](shape[0], 8, 1))
        shape[0] = 8
    first_unet = draw(st.booleans())
    for i in range(draw(st.integers(1, max_steps))):
        kind = "unet" if i == 0 and first_unet else draw(st.sampled_from(KINDS))
        if kind == "fconv":
            cin, cout, k = shape[0], draw(st.integers(1, max_channels)), draw(st.integers(1, 3))
            stride, padding = draw(st.integers(1, 2)), draw(st.integers(0, k // 2))
            out = [_conv_out(n, k, stride, padding, 1) for n in shape[1:]]
            if min(out) < 1:
                continue
            params.append(torch.randn(cout, cin, *([k] * nd)) / math.sqrt(cin * k**nd))
            params.append(0.1 * torch.randn(cout))
            steps.append(("fconv", (len(params) - 2, len(params) - 1, stride, padding)))
            shape[:] = [cout, *out]
        elif kind == "up":
            if max(shape[1:]) * 2 > 2 * CAP[nd]:
                continue
            steps.append(("up", None))
            shape[1:] = [2 * n for n in shape[1:]]
        elif kind == "pad":
            p = draw(st.integers(1, 2))
            steps.append(("pad", p))
            shape[1:] = [n + 2 * p for n in shape[1:]]
        elif kind == "se":
            steps.append(("se", None))
        elif kind in ("channel_linear", "channel_layer_norm"):
            if nd != 2:
                continue
            if kind == "channel_linear":
                cout = draw(st.integers(1, max_channels))
                mods.append(nn.Linear(shape[0], cout, bias=draw(st.booleans())))
                shape[0] = cout
            else:
                mods.append(nn.LayerNorm(shape[0], eps=1e-6))
            steps.append((kind, len(mods) - 1))
        elif kind == "instance_norm":
            if math.prod(shape[1:]) < 2:  # (PyTorch refuses to normalize over one position)
                continue
            add_module(INSTANCE_NORM[nd](shape[0], affine=draw(st.booleans())))
        elif kind == "adaptive":
            add_module((ADAPTIVE_AVG if draw(st.booleans()) else ADAPTIVE_MAX)[nd](1))
            shape[1:] = [1] * nd
        elif kind == "head":
            cout = draw(st.integers(1, max_channels))
            mods.append(nn.Linear(math.prod(shape), cout))
            steps.append(("head", len(mods) - 1))
            break  # (a [N, classes] output: nothing convolves after it)
        elif kind == "block":
            width = shape[0]
            mods.extend([CONV[nd](width, width, 3, 1, 1, bias=False), BATCH_NORM[nd](width),
                         CONV[nd](width, width, 3, 1, 1, bias=False)])
            steps.append(("block", (len(mods) - 3, len(mods) - 2, len(mods) - 1)))
        elif kind == "unet":  # (a UNet level: keep, pool by 2, conv + ReLU, upsample and join what was kept)
            if min(shape[1:]) < 2 or any(n % 2 for n in shape[1:]):
                continue
            saved.append(tuple(shape))
            steps.append(("save", None))
            add_module(MAX_POOL[nd](2))
            add_module(CONV[nd](shape[0], draw(st.integers(1, max_channels)), 3, 1, 1))
            add_module(nn.ReLU())
            steps.append(("upcat", len(saved) - 1))
            shape[0] = mods[-2].out_channels + shape[0]
        elif kind == "down":  # (a UNet encoder step: the value kept for a later join, then pooled by 2)
            if min(shape[1:]) < 2 or any(n % 2 for n in shape[1:]):
                continue
            saved.append(tuple(shape))
            steps.append(("save", None))
            add_module(MAX_POOL[nd](2))
            shape[1:] = [n // 2 for n in shape[1:]]
        elif kind == "conv":
            conv()
        elif kind == "convT":
            conv(transposed=True)
        elif kind == "bn":
            add_module(BATCH_NORM[nd](shape[0]))
        elif kind == "gn":
            # (PyTorch refuses a group of one value: a group norm after a pool to one position)
            fits = [g for g in (1, 2, 3, 4) if shape[0] % g == 0 and shape[0] // g * math.prod(shape[1:]) > 1]
            if not fits:
                continue
            groups = draw(st.sampled_from(fits))
            add_module(nn.GroupNorm(groups, shape[0]))
        elif kind == "act":
            add_module(ACTIVATIONS[draw(st.sampled_from(sorted(ACTIVATIONS)))]())
        elif kind == "function":
            steps.append(("function", draw(st.sampled_from(sorted(FUNCTIONS)))))
        elif kind == "constant":
            steps.append(("constant", draw(st.sampled_from(sorted(CONSTANTS)))))
        elif kind == "param":
            params.append(0.1 * torch.randn(shape[0], *([1] * nd)))
            steps.append(("param", len(params) - 1))
        elif kind in ("maxpool", "avgpool"):
            k = draw(st.integers(2, 3)) if kind == "maxpool" else 2
            if min(shape[1:]) < k:
                continue
            stride = draw(st.sampled_from([None, 1, 2]))
            p = draw(st.integers(0, k // 2)) if kind == "maxpool" else 0
            ceil = draw(st.sampled_from([False, False, True]))
            if kind == "maxpool":
                add_module(MAX_POOL[nd](k, stride, p, ceil_mode=ceil))
            else:
                add_module(AVG_POOL[nd](k, stride, p, ceil_mode=ceil, count_include_pad=draw(st.booleans())))
            pooled = [_pool_out(n, k, stride or k, p, ceil) for n in shape[1:]]
            shape[1:] = pooled
        elif kind == "save":
            saved.append(tuple(shape))
            steps.append(("save", None))
        elif kind == "add":
            match = [i for i, s in enumerate(saved) if s == tuple(shape)]
            if match:
                steps.append(("add", draw(st.sampled_from(match))))
        elif kind == "upcat":
            match = [i for i, s in enumerate(saved) if list(s[1:]) == [2 * n for n in shape[1:]]]
            if match:
                i = draw(st.sampled_from(match))
                steps.append(("upcat", i))
                shape[:] = [shape[0] + saved[i][0], *saved[i][1:]]
        elif kind == "softmax":
            steps.append(("softmax", None))
        elif kind == "reduce":
            op = draw(st.sampled_from(["mean", "amax", "sum", "logsumexp"]))
            dims = [1] if draw(st.booleans()) else list(range(2, 2 + nd))
            steps.append(("reduce", (op, dims)))
            shape[:] = [1 if 1 in dims else shape[0], *([1] * nd if 1 not in dims else shape[1:])]
            if 1 not in dims:
                break  # (nothing spatial is left to convolve)
    model = RandomNet(nd, steps, mods, params, draw(st.sampled_from([1, 1, 1, 2])))
    _randomize(model, draw(st.integers(0, 2**16)))
    x = torch.randn(batch, c, *size, generator=torch.Generator().manual_seed(draw(st.integers(0, 2**16))))
    return model.eval(), x


def _randomize(model: nn.Module, seed: int) -> None:
    """Conv weights at a scale that keeps values near 1 through a few layers; norms with random
    statistics and affine parameters (`randomize_batch_norms`: the defaults would hide a wrong formula)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.conv._ConvNd):
                fan = m.weight[0].numel()
                m.weight.copy_(torch.randn(m.weight.shape, generator=g) / math.sqrt(fan))
                if m.bias is not None:
                    m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
    randomize_batch_norms(model)


def outputs(value) -> tuple:
    """A model's output as a tuple of tensors (one, or the several it returns)."""
    return value if isinstance(value, tuple) else (value,)


def force_choices(monkeypatch, fused_at, standalone_at=None) -> None:
    """from_module's choices forced to `fused_at` (chain index -> fused), as a timing could make
    them, with no GPU seen (the fused layers run their PyTorch references). `standalone_at`: the
    joins' and pools' choices forced too (index in the order they are decided -> run by their
    kernel), the whole-model check then "timed" in the fused model's favour; None: not decided."""
    import specgen.importer as importer
    from specgen import measured
    from specgen.importer import standalone_choice
    from specgen.importer.report import Choice

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def choices(imp, keep_slower):
        return [Choice(c.spec.name, fused_at(i), 1.0, 1.0, how="forced by the test") for i, c in enumerate(imp.chains)]

    monkeypatch.setattr(importer, "_choices", choices)
    if standalone_at is not None:
        decided = []

        def measure(imp, node, layer, reference, values, gpu_only=False):
            decided.append(node.name)
            fused = standalone_at(len(decided) - 1)
            return Choice(node.name, fused, 1.0 if fused else 2.0, 1.5, how="forced by the test")

        monkeypatch.setattr(importer, "_unmeasurable", lambda imp: None)
        monkeypatch.setattr(measured, "compare", lambda first, second, inputs, *a, **k: (1.0, 2.0))
        monkeypatch.setattr(standalone_choice, "measure", measure)
