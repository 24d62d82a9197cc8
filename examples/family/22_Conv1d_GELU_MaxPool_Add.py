"""Conv1d, GELU (tanh approximation), a stride-2 max pool and a per-channel bias."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size):
        super().__init__()
        self.conv = nn.Conv1d(in_channels, out_channels, kernel_size, padding=kernel_size // 2)
        self.bias = nn.Parameter(torch.randn(out_channels, 1))

    def forward(self, x):
        x = F.gelu(self.conv(x), approximate="tanh")
        x = F.max_pool1d(x, kernel_size=2, stride=2)
        return x + self.bias


def get_inputs():
    return [torch.rand(32, 128, 4096)]


def get_init_inputs():
    return [128, 256, 5]
