"""Conv2d minus a constant, HardSwish, a 2x2 max pool, then Mish."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, subtract_value, pool_kernel_size):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size)
        self.subtract_value = subtract_value
        self.pool = nn.MaxPool2d(pool_kernel_size)

    def forward(self, x):
        x = self.conv(x) - self.subtract_value
        x = F.hardswish(x)
        x = self.pool(x)
        return F.mish(x)


def get_inputs():
    return [torch.rand(128, 64, 128, 128)]


def get_init_inputs():
    return [64, 128, 3, 0.5, 2]
