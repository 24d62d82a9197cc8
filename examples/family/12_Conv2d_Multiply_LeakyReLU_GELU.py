"""Conv2d times a learnable per-channel multiplier, LeakyReLU, GELU."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, multiplier_shape):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size)
        self.multiplier = nn.Parameter(torch.randn(multiplier_shape))
        self.leaky_relu = nn.LeakyReLU()

    def forward(self, x):
        x = self.conv(x) * self.multiplier
        return F.gelu(self.leaky_relu(x))


def get_inputs():
    return [torch.rand(128, 64, 128, 128)]


def get_init_inputs():
    return [64, 64, 3, (64, 1, 1)]
