"""A 4x4 stride-2 ConvTranspose2d without bias, BatchNorm, ReLU (a DCGAN generator block)."""
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, in_channels, out_channels):
        super().__init__()
        self.conv = nn.ConvTranspose2d(in_channels, out_channels, 4, stride=2, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(out_channels)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)))


def get_inputs():
    return [torch.rand(64, 256, 16, 16)]


def get_init_inputs():
    return [256, 128]
