"""Conv2d, HardSwish, ReLU."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size)

    def forward(self, x):
        return torch.relu(F.hardswish(self.conv(x)))


def get_inputs():
    return [torch.rand(128, 8, 128, 128)]


def get_init_inputs():
    return [8, 64, 3]
