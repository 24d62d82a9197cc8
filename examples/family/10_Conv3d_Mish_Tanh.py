"""Conv3d with padding, then Mish and tanh."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0):
        super().__init__()
        self.conv = nn.Conv3d(in_channels, out_channels, kernel_size, stride=stride, padding=padding)

    def forward(self, x):
        return torch.tanh(F.mish(self.conv(x)))


def get_inputs():
    return [torch.rand(16, 32, 32, 64, 64)]


def get_init_inputs():
    return [32, 64, 3, 1, 1]
