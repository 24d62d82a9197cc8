"""Conv2d, subtract, tanh, subtract, then a 2x2 average pool."""
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, subtract1_value, subtract2_value, kernel_size_pool):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size)
        self.subtract1_value = subtract1_value
        self.subtract2_value = subtract2_value
        self.avgpool = nn.AvgPool2d(kernel_size_pool)

    def forward(self, x):
        x = self.conv(x) - self.subtract1_value
        x = torch.tanh(x) - self.subtract2_value
        return self.avgpool(x)


def get_inputs():
    return [torch.rand(128, 64, 128, 128)]


def get_init_inputs():
    return [64, 128, 3, 0.5, 0.2, 2]
