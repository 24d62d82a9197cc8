"""Conv2d divided by a constant, LeakyReLU."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, divisor):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size)
        self.divisor = divisor

    def forward(self, x):
        return F.leaky_relu(self.conv(x) / self.divisor, negative_slope=0.01)


def get_inputs():
    return [torch.rand(128, 8, 128, 128)]


def get_init_inputs():
    return [8, 64, 3, 2]
