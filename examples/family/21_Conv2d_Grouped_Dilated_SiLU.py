"""A grouped, dilated Conv2d, then SiLU written as x * sigmoid(x)."""
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, dilation, groups):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size, padding=dilation, dilation=dilation, groups=groups)

    def forward(self, x):
        x = self.conv(x)
        return x * torch.sigmoid(x)


def get_inputs():
    return [torch.rand(32, 64, 64, 64)]


def get_init_inputs():
    return [64, 128, 3, 2, 4]
