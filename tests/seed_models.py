"""The two seed workloads as plain PyTorch modules, as KernelBench writes them (level 2, 90 and 65)."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class KB90(nn.Module):
    """Conv3d -> LeakyReLU(0.2) -> + sum_tensor -> clamp(-1, 1) -> GELU."""

    def __init__(self, in_channels=8, out_channels=64, kernel_size=3, sum_tensor_shape=(64, 1, 1, 1)):
        super().__init__()
        self.conv = nn.Conv3d(in_channels, out_channels, kernel_size)
        self.sum_tensor = nn.Parameter(torch.randn(sum_tensor_shape))

    def forward(self, x):
        x = self.conv(x)
        x = F.leaky_relu(x, negative_slope=0.2)
        x = x + self.sum_tensor
        x = torch.clamp(x, min=-1.0, max=1.0)
        return F.gelu(x)


class KB65(nn.Module):
    """Conv2d -> AvgPool2d(4) -> Sigmoid -> sum over (C, H, W)."""

    def __init__(self, in_channels=8, out_channels=64, kernel_size=3, pool_kernel_size=4):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size)
        self.avg_pool = nn.AvgPool2d(pool_kernel_size)

    def forward(self, x):
        x = self.conv(x)
        x = self.avg_pool(x)
        x = torch.sigmoid(x)
        return torch.sum(x, dim=[1, 2, 3])


SEEDS = {"kb90": (KB90, (1, 8, 16, 64, 64)), "kb65": (KB65, (1, 8, 384, 384))}
