"""Conv2d, tanh, scaled, a per-channel bias, then a 4x4 max pool."""
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, scaling_factor, bias_shape, pool_kernel_size):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size)
        self.scaling_factor = scaling_factor
        self.bias = nn.Parameter(torch.randn(bias_shape))
        self.max_pool = nn.MaxPool2d(pool_kernel_size)

    def forward(self, x):
        x = torch.tanh(self.conv(x)) * self.scaling_factor + self.bias
        return self.max_pool(x)


def get_inputs():
    return [torch.rand(128, 8, 256, 256)]


def get_init_inputs():
    return [8, 64, 3, 2.0, (64, 1, 1), 4]
