"""Conv3d scaled per channel, tanh, multiplied by a per-channel parameter, sigmoid."""
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, scaling_factor, bias_shape):
        super().__init__()
        self.conv = nn.Conv3d(in_channels, out_channels, kernel_size)
        self.scaling_factor = nn.Parameter(torch.randn(bias_shape))
        self.bias = nn.Parameter(torch.randn(bias_shape))

    def forward(self, x):
        x = self.conv(x) * self.scaling_factor
        x = torch.tanh(x) * self.bias
        return torch.sigmoid(x)


def get_inputs():
    return [torch.rand(128, 3, 16, 64, 64)]


def get_init_inputs():
    return [3, 16, 3, 2.0, (16, 1, 1, 1)]
