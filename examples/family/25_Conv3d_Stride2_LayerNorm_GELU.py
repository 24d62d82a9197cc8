"""A stride-2 Conv3d, LayerNorm over the last dim, GELU."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    def __init__(self, in_channels, out_channels, width):
        super().__init__()
        self.conv = nn.Conv3d(in_channels, out_channels, 3, stride=2, padding=1)
        self.norm = nn.LayerNorm(width // 2)

    def forward(self, x):
        return F.gelu(self.norm(self.conv(x)))


def get_inputs():
    return [torch.rand(16, 16, 32, 64, 64)]


def get_init_inputs():
    return [16, 32, 64]
