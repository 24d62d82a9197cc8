"""Conv2d scaled by a constant, then the minimum over channels."""
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, scale_factor):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size)
        self.scale_factor = scale_factor

    def forward(self, x):
        x = self.conv(x) * self.scale_factor
        return torch.min(x, dim=1, keepdim=True)[0]


def get_inputs():
    return [torch.rand(64, 64, 128, 128)]


def get_init_inputs():
    return [64, 128, 3, 2.0]
