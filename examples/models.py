"""Whole models to try specgen on: plain PyTorch, written out here (no downloads, no torchvision).

    from models import ResNet18
    model = ResNet18.make()                     # eval mode, seeded weights, non-trivial batch norm
    x = ResNet18.example_input(batch=8)         # (8, 3, 224, 224), float32
    fast = specgen.from_module(model.cuda(), x.cuda())

or from the command line, `specgen bench --model examples/models.py:ResNet18 --input-shape 8,3,224,224`.

| class | what | input (C, spatial) |
| --- | --- | --- |
| `ResNet18` | ResNet-18: 7x7 stem, 4 stages of 2 basic blocks, global pool, classifier | 3 x 224 x 224 |
| `ResNet50Stage` | the second stage of ResNet-50: 4 bottleneck blocks, 256 -> 512 channels, stride 2 | 256 x 56 x 56 |
| `MobileNetV2` | MobileNetV2: 17 inverted-residual blocks (1x1 expand, 3x3 depthwise, 1x1 project) | 3 x 224 x 224 |
| `VGG11` | VGG-11 convolution stack (3x3 conv + ReLU, max pools), global pool, classifier | 3 x 224 x 224 |
| `UNet` | a small 2D U-Net: 3 levels of double 3x3 conv + BN + ReLU, upsampling, skip concatenation | 3 x 128 x 128 |
| `Conv3dStack` | 3D conv + BN + ReLU blocks with two stride-2 steps, global pool, classifier | 3 x 16 x 64 x 64 |
| `ConvNeXtT` | ConvNeXt-T: 4x4 patch stem, 18 blocks (7x7 depthwise conv, LayerNorm over the channels, MLP, layer scale), LayerNorm + 2x2 downsampling | 3 x 224 x 224 |
| `ViTS16` | ViT-S/16: 16x16 patch conv, 12 pre-norm transformer blocks over 196 tokens of 384 features (attention by `F.scaled_dot_product_attention`, MLP 384 -> 1536 -> 384, residuals), LayerNorm, mean over tokens, classifier | 3 x 224 x 224 |

Every model also runs at `SMALL_SHAPE` (quick CPU checks). `make()` draws batch-norm statistics and
affine parameters at random, so no batch norm is an identity.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class _Example(nn.Module):
    INPUT_SHAPE: tuple = ()
    SMALL_SHAPE: tuple = ()

    @classmethod
    def make(cls, seed: int = 0, **kwargs) -> nn.Module:
        """The model in eval mode, with seeded weights and random batch-norm statistics."""
        generator = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)
        model = cls(**kwargs)
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, nn.modules.batchnorm._BatchNorm):
                    n = m.num_features
                    m.running_mean.copy_(0.2 * torch.randn(n, generator=generator))
                    m.running_var.copy_(0.5 + torch.rand(n, generator=generator))
                    m.weight.copy_(0.8 + 0.4 * torch.rand(n, generator=generator))
                    m.bias.copy_(0.1 * torch.randn(n, generator=generator))
        return model.eval()

    @classmethod
    def example_input(cls, batch: int = 1, small: bool = False, device=None, seed: int = 0) -> torch.Tensor:
        """A float32 normal random input of `batch` samples (SMALL_SHAPE when `small`)."""
        shape = cls.SMALL_SHAPE if small else cls.INPUT_SHAPE
        generator = torch.Generator().manual_seed(seed)
        return torch.randn((batch, *shape), generator=generator).to(device or "cpu")


def _conv_bn(cin, cout, kernel, stride=1, groups=1, nd=2) -> list[nn.Module]:
    conv = (nn.Conv2d, nn.Conv3d)[nd - 2](cin, cout, kernel, stride, kernel // 2, groups=groups, bias=False)
    return [conv, (nn.BatchNorm2d, nn.BatchNorm3d)[nd - 2](cout)]


# -- ResNet ----------------------------------------------------------------------------------------


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1, self.bn1 = _conv_bn(cin, cout, 3, stride)
        self.conv2, self.bn2 = _conv_bn(cout, cout, 3)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = nn.Sequential(*_conv_bn(cin, cout, 1, stride)) if stride != 1 or cin != cout else None

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    def __init__(self, cin: int, mid: int, stride: int = 1, expansion: int = 4):
        super().__init__()
        cout = mid * expansion
        self.conv1, self.bn1 = _conv_bn(cin, mid, 1)
        self.conv2, self.bn2 = _conv_bn(mid, mid, 3, stride)
        self.conv3, self.bn3 = _conv_bn(mid, cout, 1)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = nn.Sequential(*_conv_bn(cin, cout, 1, stride)) if stride != 1 or cin != cout else None

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet18(_Example):
    INPUT_SHAPE = (3, 224, 224)
    SMALL_SHAPE = (3, 32, 32)

    def __init__(self, num_classes: int = 1000):
        super().__init__()
        self.conv1, self.bn1 = _conv_bn(3, 64, 7, 2)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        blocks, cin = [], 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            blocks += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout)]
            cin = cout
        self.layers = nn.Sequential(*blocks)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.avgpool(self.layers(x))
        return self.fc(torch.flatten(x, 1))


class ResNet50Stage(_Example):
    """ResNet-50's second stage (conv3_x): the first block halves the resolution."""

    INPUT_SHAPE = (256, 56, 56)
    SMALL_SHAPE = (256, 8, 8)

    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(Bottleneck(256, 128, 2), *(Bottleneck(512, 128) for _ in range(3)))

    def forward(self, x):
        return self.blocks(x)


# -- MobileNetV2 -----------------------------------------------------------------------------------


class InvertedResidual(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, expand: int):
        super().__init__()
        hidden = cin * expand
        layers: list[nn.Module] = []
        if expand != 1:
            layers += [*_conv_bn(cin, hidden, 1), nn.ReLU6(inplace=True)]
        layers += [*_conv_bn(hidden, hidden, 3, stride, groups=hidden), nn.ReLU6(inplace=True)]
        layers += _conv_bn(hidden, cout, 1)
        self.conv = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x):
        return x + self.conv(x) if self.residual else self.conv(x)


class MobileNetV2(_Example):
    INPUT_SHAPE = (3, 224, 224)
    SMALL_SHAPE = (3, 32, 32)
    SETTINGS = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1))

    def __init__(self, num_classes: int = 1000):
        super().__init__()
        layers: list[nn.Module] = [*_conv_bn(3, 32, 3, 2), nn.ReLU6(inplace=True)]
        cin = 32
        for expand, cout, repeats, stride in self.SETTINGS:
            for i in range(repeats):
                layers.append(InvertedResidual(cin, cout, stride if i == 0 else 1, expand))
                cin = cout
        layers += [*_conv_bn(cin, 1280, 1), nn.ReLU6(inplace=True)]
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(1280, num_classes))

    def forward(self, x):
        x = self.pool(self.features(x))
        return self.classifier(torch.flatten(x, 1))


# -- VGG -------------------------------------------------------------------------------------------


class VGG11(_Example):
    INPUT_SHAPE = (3, 224, 224)
    SMALL_SHAPE = (3, 32, 32)
    CONFIG = (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M")

    def __init__(self, num_classes: int = 1000):
        super().__init__()
        layers: list[nn.Module] = []
        cin = 3
        for item in self.CONFIG:
            if item == "M":
                layers.append(nn.MaxPool2d(2, 2))
            else:
                layers += [nn.Conv2d(cin, item, 3, padding=1), nn.ReLU(inplace=True)]
                cin = item
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(512, num_classes)

    def forward(self, x):
        x = self.pool(self.features(x))
        return self.classifier(torch.flatten(x, 1))


# -- U-Net -----------------------------------------------------------------------------------------


def _double_conv(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(*_conv_bn(cin, cout, 3), nn.ReLU(inplace=True), *_conv_bn(cout, cout, 3), nn.ReLU(inplace=True))


class UNet(_Example):
    INPUT_SHAPE = (3, 128, 128)
    SMALL_SHAPE = (3, 16, 16)

    def __init__(self, base: int = 32, out_channels: int = 2):
        super().__init__()
        c1, c2, c3, c4 = base, 2 * base, 4 * base, 8 * base
        self.down1, self.down2, self.down3 = _double_conv(3, c1), _double_conv(c1, c2), _double_conv(c2, c3)
        self.bottom = _double_conv(c3, c4)
        self.pool = nn.MaxPool2d(2)
        self.up = nn.Upsample(scale_factor=2, mode="nearest")
        self.up3, self.up2, self.up1 = _double_conv(c4 + c3, c3), _double_conv(c3 + c2, c2), _double_conv(c2 + c1, c1)
        self.head = nn.Conv2d(c1, out_channels, 1)

    def forward(self, x):
        d1 = self.down1(x)
        d2 = self.down2(self.pool(d1))
        d3 = self.down3(self.pool(d2))
        b = self.bottom(self.pool(d3))
        u3 = self.up3(torch.cat([self.up(b), d3], 1))
        u2 = self.up2(torch.cat([self.up(u3), d2], 1))
        u1 = self.up1(torch.cat([self.up(u2), d1], 1))
        return torch.sigmoid(self.head(u1))


# -- 3D --------------------------------------------------------------------------------------------


class Conv3dStack(_Example):
    INPUT_SHAPE = (3, 16, 64, 64)
    SMALL_SHAPE = (3, 4, 8, 8)

    def __init__(self, num_classes: int = 10):
        super().__init__()
        layers: list[nn.Module] = []
        cin = 3
        for cout, stride in ((32, 1), (64, 2), (64, 1), (128, 2), (128, 1)):
            layers += [*_conv_bn(cin, cout, 3, stride, nd=3), nn.ReLU(inplace=True)]
            cin = cout
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool3d(1)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x):
        return self.fc(torch.flatten(self.pool(self.features(x)), 1))


# -- ConvNeXt --------------------------------------------------------------------------------------


class LayerNorm2d(nn.LayerNorm):
    """A LayerNorm over the channels of an NCHW tensor, written as timm writes it: the channels
    moved last, F.layer_norm, moved back."""

    def forward(self, x):
        x = F.layer_norm(x.permute(0, 2, 3, 1), self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class ConvNeXtBlock(nn.Module):
    """7x7 depthwise conv, LayerNorm over the channels (channels last), Linear C -> 4C, GELU,
    Linear 4C -> C, layer scale, residual."""

    def __init__(self, dim: int):
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(0.5 + 0.5 * torch.rand(dim))  # (ConvNeXt starts it at 1e-6: a trained model's is not)

    def forward(self, x):
        y = self.norm(self.dwconv(x).permute(0, 2, 3, 1))
        y = self.pwconv2(self.act(self.pwconv1(y)))
        return x + (self.gamma * y).permute(0, 3, 1, 2)


class ConvNeXtT(_Example):
    INPUT_SHAPE = (3, 224, 224)
    SMALL_SHAPE = (3, 32, 32)

    def __init__(self, depths=(3, 3, 9, 3), dims=(96, 192, 384, 768), num_classes: int = 1000):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, dims[0], 4, stride=4), LayerNorm2d(dims[0], eps=1e-6))
        stages: list[nn.Module] = []
        for i, (depth, dim) in enumerate(zip(depths, dims)):
            if i:
                stages += [LayerNorm2d(dims[i - 1], eps=1e-6), nn.Conv2d(dims[i - 1], dim, 2, stride=2)]
            stages += [ConvNeXtBlock(dim) for _ in range(depth)]
        self.stages = nn.Sequential(*stages)
        self.norm = nn.LayerNorm(dims[-1], eps=1e-6)
        self.head = nn.Linear(dims[-1], num_classes)

    def forward(self, x):
        x = self.stages(self.stem(x))
        return self.head(self.norm(x.mean([-2, -1])))


# -- ViT ------------------------------------------------------------------------------------------


class ViTBlock(nn.Module):
    """Pre-norm transformer block over tokens [N, L, C]: multi-head self-attention, then an MLP
    C -> 4C (GELU) -> C, each added to the residual stream."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x):
        n, tokens = x.shape[0], x.shape[1]
        qkv = self.qkv(self.norm1(x)).reshape(n, tokens, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])
        x = x + self.proj(attn.transpose(1, 2).reshape(n, tokens, -1))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class ViTS16(_Example):
    INPUT_SHAPE = (3, 224, 224)
    SMALL_SHAPE = (3, 32, 32)

    def __init__(self, dim: int = 384, depth: int = 12, heads: int = 6, patch: int = 16, num_classes: int = 1000):
        super().__init__()
        self.patch = nn.Conv2d(3, dim, patch, stride=patch)
        tokens = (self.INPUT_SHAPE[-1] // patch) ** 2
        self.pos = nn.Parameter(0.02 * torch.randn(1, tokens, dim))  # (a smaller input takes the first ones)
        self.blocks = nn.Sequential(*[ViTBlock(dim, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = x + self.pos[:, : x.shape[1]]
        x = self.blocks(x)
        return self.head(self.norm(x).mean(1))


MODELS = (ResNet18, ResNet50Stage, MobileNetV2, VGG11, UNet, Conv3dStack, ConvNeXtT, ViTS16)
