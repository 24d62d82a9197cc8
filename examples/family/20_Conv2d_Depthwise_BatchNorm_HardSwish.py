"""A depthwise 3x3 Conv2d, BatchNorm, HardSwish (MobileNetV3's middle layer)."""
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, channels, kernel_size):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, kernel_size, padding=kernel_size // 2, groups=channels, bias=False)
        self.bn = nn.BatchNorm2d(channels)

    def forward(self, x):
        return nn.functional.hardswish(self.bn(self.conv(x)))


def get_inputs():
    return [torch.rand(64, 240, 28, 28)]


def get_init_inputs():
    return [240, 3]
