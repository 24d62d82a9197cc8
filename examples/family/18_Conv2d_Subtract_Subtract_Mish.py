"""Conv2d, two subtractions, Mish."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, subtract_value_1, subtract_value_2):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size)
        self.subtract_value_1 = subtract_value_1
        self.subtract_value_2 = subtract_value_2

    def forward(self, x):
        x = self.conv(x) - self.subtract_value_1 - self.subtract_value_2
        return F.mish(x)


def get_inputs():
    return [torch.rand(128, 8, 256, 256)]


def get_init_inputs():
    return [8, 64, 3, 0.5, 0.2]
