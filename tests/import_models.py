"""Small PyTorch models written in the many styles `specgen.importer` must recognize.

`CASES` lists models that must fuse completely (no fallback), each with the ops expected in
each spec; `FALLBACKS` lists models that must (partly) fall back, with a phrase the reason must
contain. Shapes are tiny so the whole suite runs in seconds on a CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

C_IN, C = 3, 4
IMG = (2, C_IN, 8, 8)
VOL = (2, C_IN, 5, 6, 6)
SEQ = (2, C_IN, 16)
TOKENS = (2, 17, 32)  # [N, L, C]: a transformer's tokens


def conv2d(**kw) -> nn.Conv2d:
    return nn.Conv2d(C_IN, C, kw.pop("kernel_size", 3), **kw)


# -- pointwise ops, one model per op and its spellings ------------------------------------------


class ReluForms(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = conv2d()
        self.act = nn.ReLU()

    def forward(self, x):
        x = self.act(self.conv(x))
        x = F.relu(x - 0.1)
        x = torch.relu(x - 0.1)
        return (x - 0.1).relu()


class ReluInplace(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = conv2d()
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        x = self.act(self.conv(x))
        x = x.sub_(0.2).relu_()
        return F.relu(x, inplace=True)


class LeakyForms(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = conv2d()
        self.default = nn.LeakyReLU()
        self.custom = nn.LeakyReLU(0.3, inplace=True)

    def forward(self, x):
        x = self.default(self.conv(x))
        x = F.leaky_relu(x - 0.5, negative_slope=0.2)
        return self.custom(x - 0.5)


class GeluForms(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = conv2d()
        self.gelu = nn.GELU(approximate="tanh")

    def forward(self, x):
        return F.gelu(self.gelu(self.conv(x)))


class SigmoidTanhForms(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = conv2d()
        self.sig = nn.Sigmoid()
        self.tanh = nn.Tanh()

    def forward(self, x):
        x = self.conv(x)
        x = torch.sigmoid(self.sig(x) * 4).sigmoid() * 4 - 2
        x = F.sigmoid(x)
        return torch.tanh(F.tanh(self.tanh(x)).tanh())


class MishSiluHardswish(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = conv2d()
        self.mish, self.silu, self.hs = nn.Mish(), nn.SiLU(), nn.Hardswish()

    def forward(self, x):
        x = F.mish(self.mish(self.conv(x)))
        x = F.silu(self.silu(x))
        return F.hardswish(self.hs(x * 3))


class HardswishByHand(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = conv2d()

    def forward(self, x):
        x = self.conv(x)
        return x * torch.clamp((x + 3) / 6, 0, 1)


class HardtanhForms(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = conv2d()
        self.ht = nn.Hardtanh(-2.0, 2.0)
        self.relu6 = nn.ReLU6()

    def forward(self, x):
        x = self.ht(self.conv(x) * 3)
        x = F.hardtanh(x, -1.5, 1.5)
        x = self.relu6(x * 5)
        return F.relu6(x - 1)


class ClampForms(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = conv2d()

    def forward(self, x):
        x = torch.clamp(self.conv(x), min=-1.0, max=1.0)
        x = x.clamp(min=-0.5)
        x = x.clip(max=0.8)
        x = torch.clamp_min(x, -0.4)
        return x.clamp_max(0.7)


class SoftplusForms(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = conv2d()
        self.sp = nn.Softplus(beta=2.0, threshold=3.0)

    def forward(self, x):
        return F.softplus(self.sp(self.conv(x) * 3))


class ConstArith(nn.Module):
    """Operator, torch.* and method forms of arithmetic with numbers and float attributes."""

    def __init__(self, divisor=2.5, value=0.75):
        super().__init__()
        self.conv = conv2d()
        self.divisor = divisor
        self.value = value

    def forward(self, x):
        x = self.conv(x)
        x = x * 2
        x = x / self.divisor
        x = x - self.value
        x = 0.5 + x
        x = torch.add(x, 0.25)
        x = torch.mul(x, 1.5)
        x = x.div(3.0)
        x = x.sub(0.1)
        x = torch.sub(x, 0.1, alpha=2)
        return 3 * x


class ParamArith(nn.Module):
    """Per-channel parameters shaped (C, 1, 1), (1, C, 1, 1), and (C,) viewed in forward."""

    def __init__(self):
        super().__init__()
        self.conv = conv2d()
        self.bias = nn.Parameter(torch.randn(C, 1, 1))
        self.scale = nn.Parameter(torch.randn(1, C, 1, 1))
        self.shift = nn.Parameter(torch.randn(C))
        self.register_buffer("denominator", torch.rand(C, 1, 1) + 1.0)

    def forward(self, x):
        x = self.conv(x)
        x = x + self.bias
        x = self.scale * x
        x = x - self.shift.view(1, -1, 1, 1)
        return x / self.denominator


class ParamMethods(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = conv2d()
        self.a = nn.Parameter(torch.randn(C, 1, 1))
        self.b = nn.Parameter(torch.randn(C, 1, 1))

    def forward(self, x):
        x = self.conv(x).add(self.a).mul(self.b)
        return torch.sub(x, self.a).div(self.b.abs() + 1)


class ParamIndexed(nn.Module):
    """Per-channel parameters shaped for broadcasting by indexing: p[None, :, None, None], p[:, None, None]."""

    def __init__(self):
        super().__init__()
        self.conv = conv2d()
        self.g = nn.Parameter(torch.randn(C))
        self.b = nn.Parameter(torch.randn(C))

    def forward(self, x):
        return self.conv(x) * self.g[None, :, None, None] + self.b[:, None, None]


class InplaceStatements(nn.Module):
    """In-place ops written as statements on the conv's output, which the trace records as several
    uses of one value (each returns that very tensor)."""

    def __init__(self):
        super().__init__()
        self.conv = conv2d()

    def forward(self, x):
        y = self.conv(x)
        y.mul_(0.5)
        y.add_(1.0)
        torch.sigmoid_(y)
        F.relu(y, inplace=True)
        return y


class InplaceAfterARead(nn.Module):
    """A value read before an in-place op sees it unmutated (z), after it mutated (the sum): the
    conv's output has two users, so the chain ends there and the in-place op runs as PyTorch."""

    def __init__(self):
        super().__init__()
        self.conv = conv2d()

    def forward(self, x):
        y = self.conv(x)
        z = torch.tanh(y)
        y.mul_(2.0)
        return z + y


class PReLUForms(nn.Module):
    """PReLU with a slope per channel (along dim 1), with one slope, and functional."""

    def __init__(self):
        super().__init__()
        self.conv = conv2d()
        self.per_channel = nn.PReLU(C, init=0.1)
        self.single = nn.PReLU()
        self.slope = nn.Parameter(torch.rand(C))

    def forward(self, x):
        return F.prelu(self.single(self.per_channel(self.conv(x)) - 0.5), self.slope)


class WhereForms(nn.Module):
    """torch.where over comparisons, and a comparison as a 0 / 1 factor (continuous at their
    thresholds, so that rounding cannot flip a branch into a visible difference)."""

    def __init__(self):
        super().__init__()
        self.conv = conv2d()

    def forward(self, x):
        y = self.conv(x)
        y = torch.where(y > 0, y, 0.1 * y)
        return torch.where(0.5 <= y, torch.tanh(y - 0.5) + 0.5, y) * (y > -1)


class MoreFunctions(nn.Module):
    """Functions written as exprs: logsigmoid, softshrink, a threshold (continuous: value =
    threshold), log1p, expm1, and expit as sigmoid."""

    def __init__(self):
        super().__init__()
        self.conv = conv2d()

    def forward(self, x):
        y = F.softshrink(F.logsigmoid(self.conv(x)) + 1.0, 0.25)
        y = F.threshold(torch.log1p(y.abs()), 0.5, 0.5)
        return torch.special.expit(torch.expm1(y) - 0.5)


class DtypeKeepingConversions(nn.Module):
    """Conversions to the dtype the value already has (mixed-precision code's habit) are the value."""

    def __init__(self):
        super().__init__()
        self.conv = conv2d()

    def forward(self, x):
        y = torch.relu(self.conv(x)).to(torch.float32)
        return torch.tanh(y.to(dtype=y.dtype)).float()


class _ResidualBlock(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.bn = nn.BatchNorm2d(c)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x))) + x


class ControlFlowOnValues(nn.Module):
    """torch.fx cannot trace it (an if on a tensor's value); its children are imported one by one:
    the stem and the two blocks fuse, the ReLU called twice (a shared module) stays as it is."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(conv2d(padding=1), nn.ReLU())
        self.block1 = _ResidualBlock(C)
        self.block2 = _ResidualBlock(C)
        self.act = nn.ReLU()
        self.head = nn.Conv2d(C, 2, 1)

    def forward(self, x):
        y = self.act(self.block1(self.stem(x)))
        if y.mean() > -1e9:  # always true: a branch on a value
            y = self.block2(y)
        return torch.sigmoid(self.head(self.act(y)))


class SizesInForward(nn.Module):
    """A pool's window and a divisor read from the value's sizes in forward (fixed for the layer:
    they do not involve the batch)."""

    def __init__(self):
        super().__init__()
        self.conv = conv2d(padding=1)

    def forward(self, x):
        y = torch.relu(self.conv(x))
        y = F.avg_pool2d(y, y.size()[2:])  # a global average, written with the sizes
        return y.sum(dim=1) / (y.shape[1] * 2)


class DividedByTheBatch(nn.Module):
    """A divisor that is the batch size: it varies per call, so the fused layer must not bake it in."""

    def __init__(self):
        super().__init__()
        self.conv = conv2d()

    def forward(self, x):
        y = torch.relu(self.conv(x))
        return y / y.size(0)


class ReverseArith(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = conv2d()

    def forward(self, x):
        x = 1 - self.conv(x)
        return 2 / (x * x + 1)


class MinMaxScalar(nn.Module):
    """KernelBench style: torch.min(x, torch.tensor(c)); also torch.minimum/maximum and method forms."""

    def __init__(self):
        super().__init__()
        self.conv = conv2d()
        self.constant = 0.5

    def forward(self, x):
        x = torch.min(self.conv(x), torch.tensor(self.constant))
        x = torch.maximum(x, torch.tensor(-0.5))
        x = x.minimum(torch.tensor(0.25))
        return torch.max(x, torch.tensor(-0.25))


class ExprFunctions(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = conv2d()

    def forward(self, x):
        x = self.conv(x)
        y = torch.exp(-x.abs()) * torch.log(x * x + 1) + torch.sqrt(x * x + 1.0)
        return y - torch.erf(x) + torch.tanh(x) * torch.sigmoid(x) + x ** 2


class ParamExpr(nn.Module):
    """A DAG over x and per-channel parameters: one expr stage naming them."""

    def __init__(self):
        super().__init__()
        self.conv = conv2d()
        self.beta = nn.Parameter(torch.rand(C, 1, 1) + 0.5)
        self.gate = nn.Parameter(torch.randn(C, 1, 1))

    def forward(self, x):
        x = self.conv(x)
        return x * torch.sigmoid(x * self.beta) + torch.sigmoid(self.gate) * x


class PowForms(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = conv2d()

    def forward(self, x):
        x = self.conv(x) ** 2
        x = x.pow(0.5)
        x = torch.pow(x + 1, -1)
        x = torch.square(x)
        return x.rsqrt() + torch.reciprocal(x)


class MoreActivations(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = conv2d()
        self.acts = nn.Sequential(
            nn.ELU(0.5), nn.SELU(), nn.Identity(), nn.CELU(1.5), nn.Hardsigmoid(), nn.Softsign(), nn.Tanhshrink()
        )

    def forward(self, x):
        return self.acts(self.conv(x) * 3)


class ResidualExpr(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = conv2d()

    def forward(self, x):
        x = self.conv(x)
        return torch.relu(x) + x * 0.5


# -- pools ---------------------------------------------------------------------------------------


class PoolModules(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = conv2d(padding=1)
        self.avg = nn.AvgPool2d(2)
        self.max = nn.MaxPool2d(3, stride=1, padding=1)

    def forward(self, x):
        return self.max(torch.relu(self.avg(self.conv(x))))


class PoolFunctional3d(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv3d(C_IN, C, 2)

    def forward(self, x):
        x = F.avg_pool3d(self.conv(x), 2, stride=1, padding=1, count_include_pad=False)
        return F.max_pool3d(x, kernel_size=2, stride=2, dilation=1)


class MaxPool1dFunctional(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(C_IN, C, 3)

    def forward(self, x):
        return F.max_pool1d(F.avg_pool1d(self.conv(x), 2), 3, 1, 1, 2)


class GlobalPools3d(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv3d(C_IN, C, 3)
        self.gap = nn.AdaptiveAvgPool3d((1, 1, 1))

    def forward(self, x):
        return torch.sigmoid(self.gap(self.conv(x)))


class GlobalPools2d(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = conv2d()
        self.gmp = nn.AdaptiveMaxPool2d(1)

    def forward(self, x):
        a = F.adaptive_avg_pool2d(self.conv(x), 1)
        return self.gmp(a * 2)


class GlobalMaxPool1d(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(C_IN, C, 5, padding="valid", dilation=2)
        self.gap = nn.AdaptiveAvgPool1d(1)

    def forward(self, x):
        return self.gap(F.adaptive_max_pool1d(self.conv(x), 1))


# -- reductions and shape ops ------------------------------------------------------------------


class SumForms(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = conv2d()

    def forward(self, x):
        x = torch.sum(self.conv(x), dim=1, keepdim=True)
        return x.sum(dim=[2, 3])


class MeanAmaxForms(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = conv2d()

    def forward(self, x):
        x = torch.amax(self.conv(x), dim=-1, keepdim=True)
        x = x.mean([2, 3])
        return x.amin(dim=1)


class LogSumExpForms(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv3d(C_IN, C, 3)

    def forward(self, x):
        x = torch.logsumexp(self.conv(x), dim=1, keepdim=True)
        return x.logsumexp(dim=(2, 3, 4))


class MinMaxReductions(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = conv2d()

    def forward(self, x):
        x = torch.min(self.conv(x), dim=1, keepdim=True)[0]
        x = x.max(dim=2).values
        return torch.amin(x, 2)


class FlattenAfterPool(nn.Module):
    """Global pool, flatten to (N, C), then per-channel ops on the flat tensor and a final sum."""

    def __init__(self):
        super().__init__()
        self.conv = conv2d()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.bias = nn.Parameter(torch.randn(C))

    def forward(self, x):
        x = self.flatten(self.pool(self.conv(x)))
        x = torch.sigmoid(x + self.bias)
        return x.sum(dim=1)


class ViewAfterMean(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = conv2d()

    def forward(self, x):
        x = self.conv(x).contiguous().mean(dim=(2, 3), keepdim=True)
        x = x.view(x.size(0), -1).float()
        x = torch.relu(x).unsqueeze(-1)
        return torch.flatten(x, 1).squeeze()


class SqueezeAfterSum(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = conv2d()

    def forward(self, x):
        x = self.conv(x).sum(dim=1, keepdim=True)
        x = x.reshape(x.shape[0], x.shape[2], x.shape[3])
        return torch.amax(x, dim=[1, 2])


# -- convolutions --------------------------------------------------------------------------------


class ConvGeometry(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 8, (3, 2), stride=(2, 1), padding=(1, 2), dilation=(1, 2), groups=2, bias=False)

    def forward(self, x):
        return torch.tanh(self.conv(x))


class ConvSamePadding(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(C_IN, C, 3, padding="same")

    def forward(self, x):
        return F.silu(self.conv(x))


class Conv1dChain(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(C_IN, C, 5, stride=2, padding=2, dilation=1, bias=False)

    def forward(self, x):
        return F.gelu(self.conv(x)).mean(-1)


class FunctionalConv(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(C, C_IN, 3, 3) * 0.2)
        self.bias = nn.Parameter(torch.randn(C))
        self.weight2 = nn.Parameter(torch.randn(C, C, 1, 1) * 0.2)

    def forward(self, x):
        x = F.conv2d(x, self.weight, self.bias, stride=1, padding=1)
        x = F.relu(x)
        x = torch.conv2d(x, self.weight2)  # second chain: no bias
        return torch.sigmoid(x)


class FunctionalConv3d(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(C, C_IN, 2, 2, 2) * 0.2)

    def forward(self, x):
        return F.conv3d(x, self.w, None, 1, 0, 1, 1).clamp(min=0.0)


class TwoChains(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = conv2d(padding=1)
        self.conv2 = nn.Conv2d(C, C, 3)

    def forward(self, x):
        x = torch.relu(self.conv1(x))
        return torch.sigmoid(self.conv2(x)).mean(dim=[2, 3])


class Block(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))

    def forward(self, x):
        return self.body(x)


class NestedBlocks(nn.Module):
    """Submodules inside Sequentials; eval-mode batch norm fuses as an expression."""

    def __init__(self):
        super().__init__()
        self.stem = Block(C_IN, C)
        self.stages = nn.Sequential(Block(C, C), nn.Dropout(0.3))

    def forward(self, x):
        return self.stages(self.stem(x))


class FunctionalBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = conv2d()
        self.bn = nn.BatchNorm2d(C, affine=False)

    def forward(self, x):
        x = self.conv(x)
        x = F.batch_norm(x, self.bn.running_mean, self.bn.running_var, training=False, eps=1e-3)
        return F.dropout(x, p=0.5, training=False)


def _randomize_bn(model: nn.Module) -> nn.Module:
    """Non-trivial running statistics and affine parameters, so batch norm is really tested."""
    g = torch.Generator().manual_seed(1)
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.running_mean.copy_(torch.randn(m.num_features, generator=g))
            m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
            if m.affine:
                m.weight.data.copy_(torch.randn(m.num_features, generator=g))
                m.bias.data.copy_(torch.randn(m.num_features, generator=g))
    return model.eval()


# -- statistic stages: normalizations and softmax, in every spelling -------------------------------


class _Affine(nn.Module):
    """A conv, and a per-channel weight and bias for the functional norms (a (C,) shape, as nn's)."""

    def __init__(self, shape=(C,)):
        super().__init__()
        self.conv = conv2d()
        g = torch.Generator().manual_seed(2)
        self.w = nn.Parameter(torch.rand(shape, generator=g) + 0.5)
        self.b = nn.Parameter(torch.randn(shape, generator=g))


class GroupNormForms(_Affine):
    def __init__(self):
        super().__init__()
        self.gn = nn.GroupNorm(2, C)
        self.plain = nn.GroupNorm(4, C, eps=1e-3, affine=False)

    def forward(self, x):
        x = torch.relu(self.gn(self.conv(x)))
        x = F.group_norm(x, 4, self.w, self.b, eps=1e-3)
        return self.plain(F.group_norm(x, 1))


class InstanceNormForms(_Affine):
    def __init__(self):
        super().__init__()
        self.inorm = nn.InstanceNorm2d(C)
        self.affine = nn.InstanceNorm2d(C, affine=True, eps=1e-3)

    def forward(self, x):
        x = torch.sigmoid(self.inorm(self.conv(x)))
        x = self.affine(x)
        return F.instance_norm(x, weight=self.w, bias=self.b, eps=1e-4)


class InstanceNorm3dModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv3d(C_IN, C, 3)
        self.inorm = nn.InstanceNorm3d(C, affine=True)

    def forward(self, x):
        return self.inorm(self.conv(x)) * 2


class LayerNormForms(_Affine):
    """nn.LayerNorm over the last dim (KernelBench's), F.layer_norm over the last two with a weight
    of that shape, and one without affine."""

    def __init__(self):
        super().__init__(shape=(6, 6))
        self.ln = nn.LayerNorm(6)
        self.plain = nn.LayerNorm([6], elementwise_affine=False, eps=1e-3)

    def forward(self, x):
        x = self.ln(self.conv(x))
        x = F.layer_norm(torch.tanh(x), (6, 6), self.w, self.b)
        return self.plain(x)


class SoftmaxForms(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = conv2d()
        self.softmax = nn.Softmax(dim=1)
        self.softmax2d = nn.Softmax2d()

    def forward(self, x):
        x = self.softmax(self.conv(x))
        x = F.softmax(x * 4, dim=-1)
        x = torch.softmax(x * 4, 2)
        x = (x * 4).softmax(1)
        x = torch.special.softmax(x * 4, dim=3)
        return self.softmax2d(x * 4)


class ChannelsLayerNormForms(nn.Module):
    """A LayerNorm over the channels as ConvNeXt and timm's LayerNorm2d write it: the channels moved
    last (permute, movedim), nn.LayerNorm(C) / F.layer_norm, moved back."""

    def __init__(self):
        super().__init__()
        self.conv = conv2d()
        self.ln = nn.LayerNorm(C, eps=1e-6)
        self.w = nn.Parameter(torch.randn(C))
        self.b = nn.Parameter(torch.randn(C))

    def forward(self, x):
        x = self.ln(self.conv(x).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        x = torch.relu(x)
        x = F.layer_norm(x.movedim(1, -1), (C,), self.w, self.b).movedim(-1, 1)
        return x * 2


class ChannelsLayerNorm3d(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv3d(C_IN, C, 3)
        self.ln = nn.LayerNorm(C, elementwise_affine=False)

    def forward(self, x):
        return torch.tanh(self.ln(self.conv(x).permute(0, 2, 3, 4, 1)).permute(0, 4, 1, 2, 3))


class WrittenLayerNormForms(nn.Module):
    """A LayerNorm over the channels written out, as ConvNeXt's reference code (its stem and
    downsampling layers), SAM's and detectron2's LayerNorm2d write it, then other spellings."""

    def __init__(self):
        super().__init__()
        self.conv = conv2d()
        self.weight = nn.Parameter(torch.rand(C) + 0.5)
        self.bias = nn.Parameter(torch.randn(C))

    def forward(self, x):
        x = self.conv(x)
        u = x.mean(1, keepdim=True)
        s = (x - u).pow(2).mean(1, keepdim=True)
        x = (x - u) / torch.sqrt(s + 1e-6)
        x = torch.relu(self.weight[:, None, None] * x + self.bias[:, None, None])
        d = x - torch.mean(x, dim=1, keepdim=True)  # one deviation, squared by a product, rsqrt
        x = torch.rsqrt((d * d).mean(1, keepdim=True) + 1e-5) * d
        d = x - x.mean(-3, keepdim=True)
        return 2 * (d / (d ** 2).mean(dim=1, keepdim=True).add(1e-5).sqrt())


class ConvNeXtBlock(nn.Module):
    """ConvNeXt's block: its LayerNorm over the channels feeds Linear layers in channels-last order,
    so the channels are not moved back: the fused layer's output is permuted as the model reads it."""

    def __init__(self):
        super().__init__()
        self.dw = nn.Conv2d(C_IN, C_IN, 7, padding=3, groups=C_IN)
        self.norm = nn.LayerNorm(C_IN, eps=1e-6)
        self.pw = nn.Linear(C_IN, C_IN)

    def forward(self, x):
        y = self.pw(self.norm(self.dw(x).permute(0, 2, 3, 1)))
        return x + y.permute(0, 3, 1, 2)


class ConvNeXtMLP(nn.Module):
    """ConvNeXt's whole block: after the depthwise conv and the LayerNorm, its MLP's Linear layers
    over the channels-last values are 1x1 convs (`chains._start_linear`), the first with its GELU,
    the second with the layer scale (a [C] parameter along the last dim), the permute back and the
    residual add."""

    def __init__(self, dim: int = 32):
        super().__init__()
        self.dw = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pw1 = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.pw2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(0.5 + 0.5 * torch.rand(dim))

    def forward(self, x):
        y = self.norm(self.dw(x).permute(0, 2, 3, 1))
        y = self.pw2(self.act(self.pw1(y)))
        return x + (self.gamma * y).permute(0, 3, 1, 2)


class FunctionalLinear(nn.Module):
    """F.linear over the input moved channels-last, pointwise ops on both sides of the permute
    back: one 1x1 conv chain, which reads the input where it lies (the permute joins it)."""

    def __init__(self, dim: int = 32):
        super().__init__()
        self.w = nn.Parameter(torch.randn(2 * dim, dim) / dim ** 0.5)
        self.b = nn.Parameter(torch.randn(2 * dim))
        self.shift = nn.Parameter(torch.randn(2 * dim))

    def forward(self, x):
        y = F.linear(x.permute(0, 2, 3, 1), self.w, self.b)
        y = torch.sigmoid(y * 2.0 + self.shift)
        return torch.relu(y.permute(0, 3, 1, 2) - 0.5)


class LinearOverTokens(nn.Module):
    """A Linear over a conv's positions flattened into tokens ([N, L, C]): a 1x1 conv over L x 1
    positions (`_Chain.tokens`), reading the conv's output as it lies."""

    def __init__(self):
        super().__init__()
        self.conv = conv2d()
        self.proj = nn.Linear(C, 8)

    def forward(self, x):
        return torch.relu(self.proj(self.conv(x).flatten(2).transpose(1, 2)))


class TransformerMLP(nn.Module):
    """A transformer block's MLP over tokens [N, L, C] (its pre-norm left out: a model input starts
    no chain): the first Linear with its GELU, the second with the layer scale and the residual
    add (the block's input, an extra input read permuted as the spec lays it out)."""

    def __init__(self, dim: int = 32):
        super().__init__()
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(0.5 + 0.5 * torch.rand(dim))

    def forward(self, x):
        return x + self.gamma * self.fc2(F.gelu(self.fc1(x)))


class LinearClassifier(nn.Module):
    """A classifier's Linear over pooled features [N, C]: PyTorch's, said but not warned about."""

    def __init__(self):
        super().__init__()
        self.conv = conv2d()
        self.head = nn.Linear(C, 10)

    def forward(self, x):
        return self.head(torch.relu(self.conv(x)).mean((2, 3)))


class LogSoftmaxForms(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = conv2d()
        self.log_softmax = nn.LogSoftmax(dim=1)

    def forward(self, x):
        x = self.log_softmax(self.conv(x))
        x = F.log_softmax(x, 2)
        x = torch.log_softmax(x, dim=-1)
        return x.log_softmax(1)


class SoftmaxAfterRelu(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = conv2d()
        self.softmax = nn.Softmax(dim=1)

    def forward(self, x):
        return self.softmax(F.relu(self.conv(x)) * 2)


class SoftmaxOverPositions(nn.Module):
    """KernelBench's spatial softmax: the positions flattened, softmax over them, the view undone."""

    def __init__(self):
        super().__init__()
        self.conv = conv2d()
        self.scale = nn.Parameter(torch.rand(1, C, 1, 1) + 0.5)

    def forward(self, x):
        x = torch.clamp(self.conv(x), 0.0, 1.0)
        b, c, h, w = x.shape
        x = torch.softmax(x.view(b, c, -1), dim=2)
        return x.view(b, c, h, w) * self.scale


class BatchNormTraining(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.conv = conv2d()
        self.bn = nn.BatchNorm2d(C, **kw)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)))


class BatchNormUntracked(nn.Module):
    """Batch statistics in either mode: a module without running statistics, and F.batch_norm given none."""

    def __init__(self):
        super().__init__()
        self.conv = conv2d()
        self.bn = nn.BatchNorm2d(C, track_running_stats=False)

    def forward(self, x):
        x = self.bn(self.conv(x))
        return F.batch_norm(torch.tanh(x), None, None, self.bn.weight, self.bn.bias, training=True, eps=1e-3)


class FunctionalBatchNormTraining(_Affine):
    """F.batch_norm in training mode over buffers of the model: it updates them, counting nothing."""

    def __init__(self):
        super().__init__()
        self.register_buffer("mean", torch.zeros(C))
        self.register_buffer("var", torch.ones(C))

    def forward(self, x):
        return F.batch_norm(self.conv(x), self.mean, self.var, self.w, self.b, training=True, momentum=0.25)


# -- models that must (partly) fall back ---------------------------------------------------------


class TwoBranches(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = conv2d()

    def forward(self, x):
        y = self.conv(x)
        return torch.cat([torch.relu(y), torch.sigmoid(y)], dim=1)


class IntermediateReturned(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = conv2d()

    def forward(self, x):
        y = torch.relu(self.conv(x))
        return y, torch.sigmoid(y)


class CumsumAfterConv(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = conv2d()

    def forward(self, x):
        return torch.cumsum(self.conv(x), dim=1)


class TensorConstants(nn.Module):
    """Numbers made into tensors in forward (on the value's device, as KernelBench writes them)."""

    def __init__(self, data=0.5, dtype=None):
        super().__init__()
        self.conv = conv2d()
        self.data, self.dtype = data, dtype

    def forward(self, x):
        x = torch.relu(self.conv(x))
        x = torch.min(x, torch.tensor(self.data, dtype=self.dtype, device=x.device))
        return x * torch.tensor(2.0, device=x.device)


class Norms(nn.Module):
    """A conv, a relu, then `make(self)` (a norm module) or `call(self, x)`: norms the importer refuses."""

    def __init__(self, make=None, call=None):
        super().__init__()
        self.conv = conv2d()
        self.norm = make() if make is not None else None
        self.call = call
        self.w = nn.Parameter(torch.ones(C))
        self.register_buffer("mean", torch.zeros(C))
        self.register_buffer("var", torch.ones(C))

    def forward(self, x):
        x = torch.relu(self.conv(x))
        return self.norm(x) if self.norm is not None else self.call(self, x)


def _norms(name, make=None, call=None):
    def build():
        return Norms(make, call)

    build.__name__ = name
    return build


class CeilModePool(nn.Module):
    """An average pool in ceil mode (a max pool in ceil mode runs as specgen's pool kernel)."""

    def __init__(self):
        super().__init__()
        self.conv = conv2d()
        self.pool = nn.AvgPool2d(4, ceil_mode=True)

    def forward(self, x):
        return self.pool(torch.relu(self.conv(x)))


class ReflectPadding(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = conv2d(padding=1, padding_mode="reflect")

    def forward(self, x):
        return torch.relu(self.conv(x))


class OtherPaddingModes(nn.Module):
    """Replicate and circular padding, 3-D and 1-D: each conv runs unpadded after its padded copy."""

    def __init__(self, nd: int = 3):
        super().__init__()
        conv = {1: nn.Conv1d, 3: nn.Conv3d}[nd]
        self.a = conv(C_IN, C, 3, padding=1, padding_mode="replicate")
        self.b = conv(C, C, 3, padding=2, dilation=2, padding_mode="circular", bias=False)

    def forward(self, x):
        return F.silu(self.b(torch.tanh(self.a(x))))


class ZeroPadIntoConv(nn.Module):
    """An explicit zero F.pad, even per dim, before a conv: taken into the conv's padding."""

    def __init__(self):
        super().__init__()
        self.conv = conv2d(padding=1)
        self.w = nn.Parameter(torch.randn(C, C, 3, 3))

    def forward(self, x):
        y = torch.relu(self.conv(F.pad(x, (2, 2, 1, 1))))
        return torch.sigmoid(F.conv2d(F.pad(y, [1, 1], mode="constant", value=0.0), self.w))


class UnevenZeroPad(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = conv2d()

    def forward(self, x):
        return torch.relu(self.conv(F.pad(x, (1, 0, 1, 1))))


class DoubleModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = conv2d()

    def forward(self, x):
        return torch.relu(self.conv(x))


class ScalarParam(nn.Module):
    """Scalar tensors as operands: a one-element parameter and a 0-dim one (KernelBench 3, 50)."""

    def __init__(self):
        super().__init__()
        self.conv = conv2d()
        self.scale = nn.Parameter(torch.tensor([2.0]))
        self.shift = nn.Parameter(torch.tensor(0.5))

    def forward(self, x):
        return torch.relu(self.conv(x)) * self.scale + self.shift


class SizeOfIntermediate(nn.Module):
    """The size of a fused intermediate is read outside the chain (a stand-in tensor provides it):
    its batch, which varies per call (a size free of the batch would be read as a number)."""

    def __init__(self):
        super().__init__()
        self.conv = conv2d()

    def forward(self, x):
        y = self.conv(x)
        z = torch.relu(y)
        return z * y.shape[0]


class AdaptiveToTwo(nn.Module):
    """An adaptive pool whose output divides the input (6 x 6 -> 2 x 2): a 3 x 3 window, stride 3."""

    def __init__(self):
        super().__init__()
        self.conv = conv2d()
        self.pool = nn.AdaptiveAvgPool2d(2)

    def forward(self, x):
        return self.pool(torch.relu(self.conv(x)))


class AdaptiveUneven(nn.Module):
    """An adaptive pool whose output does not divide the input (6 x 6 -> 4 x 4): windows of two sizes."""

    def __init__(self):
        super().__init__()
        self.conv = conv2d()
        self.pool = nn.AdaptiveMaxPool2d((4, None))

    def forward(self, x):
        return self.pool(torch.relu(self.conv(x)))


class PoolWithIndices(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = conv2d()
        self.pool = nn.MaxPool2d(2, return_indices=True)

    def forward(self, x):
        values, indices = self.pool(torch.relu(self.conv(x)))
        return values


class EvenKernelSame(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = conv2d(kernel_size=2, padding="same")

    def forward(self, x):
        return torch.relu(self.conv(x))


class SoftplusInsideExpr(nn.Module):
    """Mish written out (KernelBench 52), and softplus with another beta, inside expressions."""

    def __init__(self, threshold: float = 20.0):
        super().__init__()
        self.conv = conv2d()
        self.threshold = threshold

    def forward(self, x):
        x = self.conv(x)
        x = torch.multiply(torch.tanh(F.softplus(x)), x)
        return x * F.softplus(x, beta=2.0, threshold=self.threshold)


class Centering(nn.Module):
    """x - mean(x, spatial dims, keepdim) (KernelBench 15), as a function and as a method."""

    def __init__(self, dims=(2, 3)):
        super().__init__()
        self.conv = conv2d()
        self.dims = dims

    def forward(self, x):
        x = torch.relu(self.conv(x))
        x = x - torch.mean(x, dim=self.dims, keepdim=True)
        y = torch.sigmoid(x)
        return y - y.mean([-1], keepdim=True)


class CloneDetachResidual(nn.Module):
    """A copy of the conv's value, detached, used three times (KernelBench 20)."""

    def __init__(self):
        super().__init__()
        self.conv = conv2d()
        self.bias = nn.Parameter(torch.randn(C, 1, 1))

    def forward(self, x):
        x = self.conv(x)
        original = x.clone().detach()
        x = x + self.bias
        x = x + original
        x = x * original
        return (x + original).clone()


class UnpackedMax(nn.Module):
    """`values, indices = torch.max(...)` with the indices unused fuses; using them does not."""

    def __init__(self, use_indices=False):
        super().__init__()
        self.conv = conv2d()
        self.use_indices = use_indices

    def forward(self, x):
        values, indices = torch.max(torch.relu(self.conv(x)), dim=1)
        return values + indices if self.use_indices else values


class ResidualBlock(nn.Module):
    """conv-bn-relu twice with a skip connection: two chains, the second adding the block's input
    (an extra input of its fused layer) before its relu."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(C, C, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(C)
        self.conv2 = nn.Conv2d(C, C, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(C)

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return torch.relu(y + x)


class DownsampleBlock(nn.Module):
    """ResNet's basic block with a projection shortcut computed after the main branch, added in
    place: the shortcut's conv + bn is a chain of its own, whose output the main chain reads."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(C, 2 * C, 3, stride=2, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(2 * C)
        self.conv2 = nn.Conv2d(2 * C, 2 * C, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(2 * C)
        self.down = nn.Sequential(nn.Conv2d(C, 2 * C, 1, stride=2, bias=False), nn.BatchNorm2d(2 * C))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        identity = self.down(x)
        out += identity
        return F.relu(out)


class ShortcutScaled(nn.Module):
    """The other operand computed by the model in PyTorch (x * 0.5), then added: still one extra input."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(C, C, 3, padding=1)

    def forward(self, x):
        return torch.sigmoid(self.conv(x) - x * 0.5)


class ShortcutInsideExpr(nn.Module):
    def __init__(self, gate_shape=None):
        super().__init__()
        self.conv = nn.Conv2d(C, C, 3, padding=1)
        self.gate_shape = gate_shape

    def forward(self, x):
        y = self.conv(x)
        if self.gate_shape == "spatial":  # a spatial attention map, [N, 1, H, W]: not fused
            return y * torch.sigmoid(x.mean(1, keepdim=True))
        if self.gate_shape is not None:  # a squeeze-and-excitation style gate, [N, C, 1, 1]: an extra input
            return y * torch.sigmoid(x.mean((2, 3), keepdim=True))
        return y * torch.sigmoid(y + x)


class ControlFlow(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = conv2d()

    def forward(self, x):
        x = self.conv(x)
        if x.sum() > 0:
            return torch.relu(x)
        return x


class TimeEmbedding(nn.Module):
    """A diffusion block's time embedding: a per-sample vector, projected to the conv's channels
    and added at every position ([N, C] viewed as [N, C, 1, 1]), then SiLU; in 3-D, a gate of the
    same shape (`view`) multiplies. The operand is an extra input of one value per sample and channel.
    (Not a Case: the embedding's mean and Linear run as PyTorch.)"""

    def __init__(self, nd: int = 2):
        super().__init__()
        conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[nd]
        self.nd = nd
        self.conv = conv(C_IN, C, 3, padding=1)
        self.emb = nn.Linear(C_IN, C)

    def forward(self, x):
        t = self.emb(x.mean(tuple(range(2, 2 + self.nd))))
        if self.nd == 2:
            return F.silu(self.conv(x) + t[:, :, None, None])
        return torch.tanh(self.conv(x) * torch.sigmoid(t).view(t.shape[0], C, *([1] * self.nd)) - 0.5)


# (model, input shape, the conv chain's epilogue ops)
TIME_EMBEDDINGS = {
    "2d": (lambda: TimeEmbedding(2), IMG, ["add", "silu"]),
    "3d": (lambda: TimeEmbedding(3), VOL, ["mul", "sub", "tanh"]),
    "1d": (lambda: TimeEmbedding(1), SEQ, ["mul", "sub", "tanh"]),
}


# -- the suite -----------------------------------------------------------------------------------


@dataclass
class Case:
    """A model, the input shape to run it on, and the epilogue ops of each spec it must become."""

    make: Callable[[], nn.Module]
    shape: tuple
    ops: list[list[str]]
    id: str = ""
    params: dict = field(default_factory=dict)  # spec name suffix -> expected per-channel param names

    def __post_init__(self):
        self.id = self.id or getattr(self.make, "__name__", "model")


def _bn(cls):
    def make():
        return _randomize_bn(cls())

    make.__name__ = cls.__name__
    return make


CASES: list[Case] = [
    Case(ReluForms, IMG, [["relu", "sub", "relu", "sub", "relu", "sub", "relu"]]),
    Case(ReluInplace, IMG, [["relu", "sub", "relu", "relu"]]),
    Case(LeakyForms, IMG, [["leaky_relu", "sub", "leaky_relu", "sub", "leaky_relu"]]),
    Case(GeluForms, IMG, [["gelu", "gelu"]]),
    Case(SigmoidTanhForms, IMG, [["sigmoid", "mul", "sigmoid", "sigmoid", "mul", "sub", "sigmoid", "tanh", "tanh", "tanh", "tanh"]]),
    Case(MishSiluHardswish, IMG, [["mish", "mish", "silu", "silu", "mul", "hardswish", "hardswish"]]),
    Case(HardswishByHand, IMG, [["expr"]]),
    Case(HardtanhForms, IMG, [["mul", "hardtanh", "hardtanh", "mul", "hardtanh", "sub", "hardtanh"]]),
    Case(ClampForms, IMG, [["clamp"] * 5]),
    Case(SoftplusForms, IMG, [["mul", "softplus", "softplus"]]),
    Case(ConstArith, IMG, [["mul", "div", "sub", "add", "add", "mul", "div", "sub", "sub", "mul"]]),
    Case(ParamArith, IMG, [["add", "mul", "sub", "div"]]),
    Case(ParamMethods, IMG, [["add", "mul", "sub", "expr"]]),
    Case(ParamIndexed, IMG, [["mul", "add"]]),
    Case(PReLUForms, IMG, [["expr", "sub", "expr", "expr"]]),
    Case(SizesInForward, IMG, [["relu", "avg_pool", "sum", "div"]]),
    Case(DtypeKeepingConversions, IMG, [["relu", "tanh"]]),
    Case(WhereForms, IMG, [["expr", "expr"]]),
    Case(AdaptiveToTwo, IMG, [["relu", "avg_pool"]]),
    Case(ZeroPadIntoConv, IMG, [["relu"], ["sigmoid"]]),
    Case(MoreFunctions, IMG, [["expr", "add", "expr", "expr", "expr", "expr", "expr", "sub", "sigmoid"]]),
    Case(InplaceStatements, IMG, [["mul", "add", "sigmoid", "relu"]]),
    Case(ReverseArith, IMG, [["expr", "expr", "add", "expr"]]),
    Case(MinMaxScalar, IMG, [["min", "max", "min", "max"]]),
    Case(ExprFunctions, IMG, [["expr"]]),
    Case(ParamExpr, IMG, [["expr"]]),
    Case(PowForms, IMG, [["expr", "expr", "add", "expr", "expr", "expr"]]),
    Case(MoreActivations, IMG, [["mul", "expr", "expr", "expr", "expr", "expr", "expr"]]),
    Case(ResidualExpr, IMG, [["expr"]]),
    Case(ScalarParam, IMG, [["relu", "mul", "add"]]),
    Case(SoftplusInsideExpr, IMG, [["expr", "expr"]]),
    Case(CloneDetachResidual, IMG, [["expr"]]),
    Case(Centering, IMG, [["relu", "center", "sigmoid", "center"]]),
    Case(_bn(ResidualBlock), (2, C, 8, 8), [["batch_norm", "relu"], ["batch_norm", "add", "relu"]]),
    Case(_bn(DownsampleBlock), (2, C, 8, 8), [["batch_norm", "relu"], ["batch_norm", "add", "relu"], ["batch_norm"]]),
    Case(PoolModules, IMG, [["avg_pool", "relu", "max_pool"]]),
    Case(PoolFunctional3d, VOL, [["avg_pool", "max_pool"]]),
    Case(MaxPool1dFunctional, SEQ, [["avg_pool", "max_pool"]]),
    Case(GlobalPools3d, VOL, [["global_avg_pool", "sigmoid"]]),
    Case(GlobalPools2d, IMG, [["global_avg_pool", "mul", "global_max_pool"]]),
    Case(GlobalMaxPool1d, SEQ, [["global_max_pool", "global_avg_pool"]]),
    Case(SumForms, IMG, [["sum", "sum"]]),
    Case(MeanAmaxForms, IMG, [["amax", "mean", "amin"]]),
    Case(LogSumExpForms, VOL, [["logsumexp", "logsumexp"]]),
    Case(MinMaxReductions, IMG, [["amin", "amax", "amin"]]),
    Case(FlattenAfterPool, IMG, [["global_avg_pool", "add", "sigmoid", "sum"]]),
    Case(ViewAfterMean, IMG, [["mean", "relu"]]),
    Case(SqueezeAfterSum, IMG, [["sum", "amax"]]),
    Case(ConvGeometry, (2, 4, 9, 8), [["tanh"]]),
    Case(ConvSamePadding, IMG, [["silu"]]),
    Case(Conv1dChain, SEQ, [["gelu", "mean"]]),
    Case(FunctionalConv, IMG, [["relu"], ["sigmoid"]]),
    Case(FunctionalConv3d, VOL, [["clamp"]]),
    Case(TwoChains, IMG, [["relu"], ["sigmoid", "mean"]]),
    Case(_bn(NestedBlocks), IMG, [["batch_norm", "relu"], ["batch_norm", "relu"]]),
    Case(_bn(FunctionalBatchNorm), IMG, [["batch_norm"]]),
    Case(UnpackedMax, IMG, [["relu", "amax"]]),
    Case(TensorConstants, IMG, [["relu", "min", "mul"]]),
    Case(GroupNormForms, IMG, [["group_norm", "relu", "group_norm", "group_norm", "group_norm"]]),
    Case(InstanceNormForms, IMG, [["instance_norm", "sigmoid", "instance_norm", "instance_norm"]]),
    Case(InstanceNorm3dModule, VOL, [["instance_norm", "mul"]]),
    Case(LayerNormForms, IMG, [["layer_norm", "tanh", "layer_norm", "layer_norm"]]),
    Case(SoftmaxForms, IMG, [["softmax", "mul", "softmax", "mul", "softmax", "mul", "softmax", "mul", "softmax", "mul", "softmax"]]),
    Case(LogSoftmaxForms, IMG, [["log_softmax"] * 4]),
    Case(ChannelsLayerNormForms, IMG, [["layer_norm_channels", "relu", "layer_norm_channels", "mul"]]),
    Case(ChannelsLayerNorm3d, VOL, [["layer_norm_channels", "tanh"]]),
    Case(WrittenLayerNormForms, IMG, [["layer_norm_channels", "mul", "add", "relu", "layer_norm_channels", "layer_norm_channels",
                                       "mul"]]),
    Case(ConvNeXtMLP, (2, 32, 8, 8), [["layer_norm_channels"], ["gelu"], ["mul", "add"]]),
    Case(FunctionalLinear, (2, 32, 8, 8), [["mul", "add", "sigmoid", "sub", "relu"]]),
    Case(TransformerMLP, TOKENS, [["gelu"], ["mul", "add"]]),
    Case(SoftmaxAfterRelu, IMG, [["relu", "mul", "softmax"]]),
    Case(SoftmaxOverPositions, IMG, [["clamp", "softmax", "mul"]]),
    Case(BatchNormTraining, IMG, [["batch_norm", "relu"]]),
    Case(lambda: BatchNormTraining(momentum=None), IMG, [["batch_norm", "relu"]], id="BatchNormCumulative"),
    Case(BatchNormUntracked, IMG, [["batch_norm", "tanh", "batch_norm"]]),
    Case(FunctionalBatchNormTraining, IMG, [["batch_norm"]]),
]


@dataclass
class FallbackCase:
    """A model that falls back: the ops of the specs it still yields, and (node, phrase) pairs
    that must appear among its fallbacks."""

    make: Callable[[], nn.Module]
    shape: tuple
    ops: list[list[str]]
    expect: list[tuple[str, str]]
    id: str = ""

    def __post_init__(self):
        self.id = self.id or getattr(self.make, "__name__", "model")


def _double():
    return DoubleModel().double()


FALLBACKS: list[FallbackCase] = [
    FallbackCase(DividedByTheBatch, IMG, [["relu"]], [("truediv", "computed by the model")]),
    # (the depthwise conv and the LayerNorm fuse, their output permuted channels-last for the Linear)
    # (3 channels: the Linear's 1x1 conv plans for the FFMA engine, which reads no residual)
    FallbackCase(ConvNeXtBlock, IMG, [["layer_norm_channels"]], [("pw", "with an extra input the layer cannot be planned")]),
    FallbackCase(LinearOverTokens, IMG, [["relu"]], [("flatten", "only size-1 dims may be dropped")]),
    FallbackCase(LinearClassifier, IMG, [["relu", "mean"]], [("head", "a Linear over a 2-D tensor runs as PyTorch")]),
    FallbackCase(TwoBranches, IMG, [], [("conv", "is used by 2 nodes"), ("relu", "used more than once")]),
    FallbackCase(IntermediateReturned, IMG, [["relu"]], [("sigmoid", "also returned by the model")]),
    FallbackCase(CumsumAfterConv, IMG, [], [("cumsum", "torch.cumsum is not a supported op"), ("conv", "nothing to fuse")]),
    FallbackCase(
        _norms("InstanceNormTracked", make=lambda: nn.InstanceNorm2d(C, track_running_stats=True)), IMG, [["relu"]],
        [("norm", "running statistics (track_running_stats=True)")],
    ),
    FallbackCase(
        _norms("InstanceNormStats", call=lambda m, x: F.instance_norm(x, m.mean, m.var, use_input_stats=False)), IMG, [["relu"]],
        [("instance_norm", "use_input_stats=False normalizes with the running statistics")],
    ),
    FallbackCase(
        _norms("InstanceNormStatsGiven", call=lambda m, x: F.instance_norm(x, m.mean, m.var)), IMG, [["relu"]],
        [("instance_norm", "running statistics (running_mean passed in)")],
    ),
    FallbackCase(
        _norms("LayerNormNoBias", make=lambda: nn.LayerNorm(6, bias=False)), IMG, [["relu"]],
        [("norm", "weight without bias: the layer_norm stage has both or neither")],
    ),
    FallbackCase(
        _norms("GroupNormWeightOnly", call=lambda m, x: F.group_norm(x, 2, m.w)), IMG, [["relu"]],
        [("group_norm", "weight without bias: the group_norm stage has both or neither")],
    ),
    FallbackCase(
        _norms("GroupNormComputedWeight", call=lambda m, x: F.group_norm(x, 2, m.w * 2, m.w)), IMG, [["relu"]],
        [("group_norm", "operand mul is computed in forward")],
    ),
    FallbackCase(
        _norms("SoftmaxDtype", call=lambda m, x: F.softmax(x, 1, dtype=torch.float64)), IMG, [["relu"]],
        [("softmax", "dtype=torch.float64 (only float32 is fused)")],
    ),
    FallbackCase(
        _norms("SoftmaxOfTheBatch", call=lambda m, x: x.softmax(0)), IMG, [["relu"]], [("softmax", "dim 0 is the batch")],
    ),
    FallbackCase(
        lambda: Norms(lambda: nn.GroupNorm(2, C)).bfloat16(), IMG, [["relu"]],
        [("norm", "a bf16 layer with it cannot be planned: precision: the tail engine's kernels compute in float32")],
        id="GroupNormBf16",
    ),
    FallbackCase(
        # (over the positions: a softmax over the channels runs in the TMA epilogue, in any precision)
        lambda: Norms(lambda: nn.Softmax(dim=2)).half(), IMG, [["relu"]],
        [("norm", "a fp16 layer with it cannot be planned")], id="SoftmaxFp16",
    ),
    FallbackCase(CeilModePool, IMG, [["relu"]], [("pool", "ceil_mode=True is not supported")]),
    FallbackCase(AdaptiveUneven, IMG, [["relu"]], [("pool", "output_size=(4, None) does not divide the input's [6, 6]")]),
    FallbackCase(PoolWithIndices, IMG, [["relu"]], [("pool", "return_indices=True is not supported")]),
    # (padding other than zeros on both sides: the padded copy stays PyTorch, the conv after it fuses)
    FallbackCase(EvenKernelSame, IMG, [["relu"]], [("pad", "for conv's padding='same' over an even kernel span")]),
    FallbackCase(ReflectPadding, IMG, [["relu"]], [("pad", "for conv's padding_mode='reflect'")]),
    FallbackCase(OtherPaddingModes, VOL, [["tanh"], ["silu"]],
                 [("pad", "for a's padding_mode='replicate'"), ("pad_1", "for b's padding_mode='circular'")]),
    FallbackCase(lambda: OtherPaddingModes(nd=1), SEQ, [["tanh"], ["silu"]],
                 [("pad_1", "for b's padding_mode='circular'")], id="OtherPaddingModes1d"),
    FallbackCase(UnevenZeroPad, IMG, [["relu"]], [("pad", "F.pad is not a supported op")]),
    FallbackCase(_double, IMG, [], [("conv", "only float32, bfloat16 and float16 layers are fused")], id="DoubleModel"),
    FallbackCase(SizeOfIntermediate, IMG, [["relu"]], [("mul", "operand getitem is computed by the model")]),
    FallbackCase(lambda: Centering(dims=(1,)), IMG, [["relu"]],
                 [("mean", "center subtracts the mean over trailing dims")], id="CenteringOverChannels"),
    FallbackCase(
        lambda: SoftplusInsideExpr(threshold=10.0), IMG, [["expr"]],
        [("softplus_1", "softplus inside a larger pointwise expression has no expr form")], id="SoftplusThreshold",
    ),
    FallbackCase(lambda: UnpackedMax(use_indices=True), IMG, [["relu"]], [("max_1", "its indices are used")], id="UsedIndices"),
    FallbackCase(ShortcutScaled, (2, C, 8, 8), [["sub", "sigmoid"]], [("mul", "it does not follow a convolution")]),
    FallbackCase(ShortcutInsideExpr, (2, C, 8, 8), [], [("add", "fused only as the other operand of one add, sub, mul or div")]),
    FallbackCase(lambda: ShortcutInsideExpr(gate_shape=True), (2, C, 8, 8), [["mul"]],
                 [("mean", "it does not follow a convolution")], id="SqueezeExciteGate"),
    FallbackCase(lambda: ShortcutInsideExpr(gate_shape="spatial"), (2, C, 8, 8), [],
                 [("mul", "computed by the model with shape [2, 1, 8, 8]")], id="SpatialGate"),
    FallbackCase(ControlFlow, IMG, [], [("ControlFlow", "torch.fx cannot trace")]),
    FallbackCase(lambda: TensorConstants(data=[[[0.5]]] * C), IMG, [["relu"]],
                 [("tensor", "only a number made into a tensor is read as a constant")], id="TensorOfAList"),
    FallbackCase(lambda: TensorConstants(dtype=torch.float16), IMG, [["relu"]],
                 [("tensor", "dtype=torch.float16: a constant is read as a float32 number")], id="HalfConstant"),
]
