"""A 5x5 stride-2 Conv2d without bias, BatchNorm, ReLU6 (a downsampling stem block)."""
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, stride, padding):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size, stride=stride, padding=padding, bias=False)
        self.bn = nn.BatchNorm2d(out_channels)
        self.act = nn.ReLU6()

    def forward(self, x):
        return self.act(self.bn(self.conv(x)))


def get_inputs():
    return [torch.rand(64, 32, 128, 128)]


def get_init_inputs():
    return [32, 96, 5, 2, 2]
