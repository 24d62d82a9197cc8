"""Conv2d, a softmax over channels, times a per-channel weight, then the sum over channels."""
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size, padding=1)
        self.weight = nn.Parameter(torch.randn(out_channels, 1, 1))

    def forward(self, x):
        x = torch.softmax(self.conv(x), dim=1) * self.weight
        return x.sum(dim=1, keepdim=True)


def get_inputs():
    return [torch.rand(64, 32, 128, 128)]


def get_init_inputs():
    return [32, 64, 3]
