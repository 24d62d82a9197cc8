"""A 4x4 Conv2d with padding, GroupNorm, SiLU (a diffusion UNet's block)."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, num_groups):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size, padding=1)
        self.norm = nn.GroupNorm(num_groups, out_channels)

    def forward(self, x):
        return F.silu(self.norm(self.conv(x)))


def get_inputs():
    return [torch.rand(32, 64, 64, 64)]


def get_init_inputs():
    return [64, 128, 4, 32]
