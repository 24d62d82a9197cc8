"""Conv3d, HardSwish, ReLU, a softmax over channels and the mean over space."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size):
        super().__init__()
        self.conv = nn.Conv3d(in_channels, out_channels, kernel_size, bias=True)

    def forward(self, x):
        x = F.relu(F.hardswish(self.conv(x)))
        x = torch.softmax(x, dim=1)
        return torch.mean(x, dim=[2, 3, 4])


def get_inputs():
    return [torch.rand(128, 3, 16, 32, 32)]


def get_init_inputs():
    return [3, 16, 3]
