"""The public KernelBench level-2 problems, for the import tests (CPU) and their GPU checks.

The problems live outside the repository: `SPECGEN_KERNELBENCH_DIR` names their folder, else
`../shared/kernelbench/level2` beside the checkout is used; tests that need them skip without."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Problems that import into one spec with no fallback in eval mode (a test keeps this true).
FUSED = {
    "2_ConvTranspose2d_BiasAdd_Clamp_Scaling_Clamp_Divide",
    "3_ConvTranspose3d_Sum_LayerNorm_AvgPool_GELU",
    "5_ConvTranspose2d_Subtract_Tanh",
    "6_Conv3d_Softmax_MaxPool_MaxPool",
    "10_ConvTranspose2d_MaxPool_Hardtanh_Mean_Tanh",
    "11_ConvTranspose2d_BatchNorm_Tanh_MaxPool_GroupNorm",
    "13_ConvTranspose3d_Mean_Add_Softmax_Tanh_Scaling",
    "15_ConvTranspose3d_BatchNorm_Subtract",
    "16_ConvTranspose2d_Mish_Add_Hardtanh_Scaling",
    "17_Conv2d_InstanceNorm_Divide",
    "19_ConvTranspose2d_GELU_GroupNorm",
    "20_ConvTranspose3d_Sum_ResidualAdd_Multiply_ResidualAdd",
    "21_Conv2d_Add_Scale_Sigmoid_GroupNorm",
    "23_Conv3d_GroupNorm_Mean",
    "24_Conv3d_Min_Softmax",
    "26_ConvTranspose3d_Add_HardSwish",
    "27_Conv3d_HardSwish_GroupNorm_Mean",
    "31_Conv2d_Min_Add_Multiply",
    "34_ConvTranspose3d_LayerNorm_GELU_Scaling",
    "36_ConvTranspose2d_Min_Sum_GELU_Add",
    "42_ConvTranspose2d_GlobalAvgPool_BiasAdd_LogSumExp_Sum_Multiply",
    "43_Conv3d_Max_LogSumExp_ReLU",
    "44_ConvTranspose2d_Multiply_GlobalAvgPool_GlobalAvgPool_Mean",
    "49_ConvTranspose3d_Softmax_Sigmoid",
    "50_ConvTranspose3d_Scaling_AvgPool_BiasAdd_Scaling",
    "52_Conv2d_Activation_BatchNorm",
    "58_ConvTranspose3d_LogSumExp_HardSwish_Subtract_Clamp",
    "60_ConvTranspose3d_Swish_GroupNorm_HardSwish",
    "61_ConvTranspose3d_ReLU_GroupNorm",
    "65_Conv2d_AvgPool_Sigmoid_Sum",
    "72_ConvTranspose3d_BatchNorm_AvgPool_AvgPool",
    "73_Conv2d_BatchNorm_Scaling",
    "74_ConvTranspose3d_LeakyReLU_Multiply_LeakyReLU_Max",
    "77_ConvTranspose3d_Scale_BatchNorm_GlobalAvgPool",
    "78_ConvTranspose3d_Max_Max_Sum",
    "79_Conv3d_Multiply_InstanceNorm_Clamp_Multiply_Max",
    "83_Conv3d_GroupNorm_Min_Clamp_Dropout",
    "85_Conv2d_GroupNorm_Scale_MaxPool_Clamp",
    "89_ConvTranspose3d_MaxPool_Softmax_Subtract_Swish_Max",
    "90_Conv3d_LeakyReLU_Sum_Clamp_GELU",
    "91_ConvTranspose2d_Softmax_BiasAdd_Scaling_Sigmoid",
    "92_Conv2d_GroupNorm_Tanh_HardSwish_ResidualAdd_LogSumExp",
    "93_ConvTranspose2d_Add_Min_GELU_Multiply",
    "96_ConvTranspose3d_Multiply_Max_GlobalAvgPool_Clamp",
    "100_ConvTranspose3d_Clamp_Min_Divide",
}
# The same in training mode, as KernelBench runs them (batch norms normalize with the batch's
# statistics and update their running ones; dropout would be random).
FUSED_TRAIN = FUSED - {"83_Conv3d_GroupNorm_Min_Clamp_Dropout"}  # its dropout is random in training mode
# Before the statistic stages (normalizations, softmax, training-mode batch norm) were imported: the
# eval-mode count before them, and every problem then fused in training mode.
FUSED_BEFORE_NORMS = 19
FUSED_TRAIN_BEFORE_NORMS = {
    "2_ConvTranspose2d_BiasAdd_Clamp_Scaling_Clamp_Divide",
    "5_ConvTranspose2d_Subtract_Tanh",
    "10_ConvTranspose2d_MaxPool_Hardtanh_Mean_Tanh",
    "16_ConvTranspose2d_Mish_Add_Hardtanh_Scaling",
    "31_Conv2d_Min_Add_Multiply",
    "36_ConvTranspose2d_Min_Sum_GELU_Add",
    "42_ConvTranspose2d_GlobalAvgPool_BiasAdd_LogSumExp_Sum_Multiply",
    "43_Conv3d_Max_LogSumExp_ReLU",
    "44_ConvTranspose2d_Multiply_GlobalAvgPool_GlobalAvgPool_Mean",
    "58_ConvTranspose3d_LogSumExp_HardSwish_Subtract_Clamp",
    "65_Conv2d_AvgPool_Sigmoid_Sum",
    "74_ConvTranspose3d_LeakyReLU_Multiply_LeakyReLU_Max",
    "78_ConvTranspose3d_Max_Max_Sum",
    "90_Conv3d_LeakyReLU_Sum_Clamp_GELU",
    "96_ConvTranspose3d_Multiply_Max_GlobalAvgPool_Clamp",
    "100_ConvTranspose3d_Clamp_Min_Divide",
}
# Before transposed convolutions and the batch_norm stage: the count must never drop below this.
FUSED_BEFORE = {
    "31_Conv2d_Min_Add_Multiply",
    "43_Conv3d_Max_LogSumExp_ReLU",
    "65_Conv2d_AvgPool_Sigmoid_Sum",
    "73_Conv2d_BatchNorm_Scaling",
    "90_Conv3d_LeakyReLU_Sum_Clamp_GELU",
}


# Problems of the same family that are not public, written for specgen in the same file format
# (examples/family/README.md): every one must import whole, in eval and in training mode.
FAMILY_DIR = ROOT / "examples" / "family"


def family() -> list[Path]:
    return sorted(FAMILY_DIR.glob("*.py"), key=lambda p: int(p.name.split("_")[0]))


def folder() -> Path | None:
    env = os.environ.get("SPECGEN_KERNELBENCH_DIR")
    path = Path(env) if env else ROOT.parent / "shared" / "kernelbench" / "level2"
    return path if path.is_dir() else None


def problems() -> list[Path]:
    path = folder()
    if path is None:
        return []
    return sorted(path.glob("*.py"), key=lambda p: int(p.name.split("_")[0]))


def load(path: Path, training: bool = False, batch: int = 1):
    """(model in eval mode, or in training mode as KernelBench constructs it, and its example inputs
    cut to `batch` samples; more samples than the problem gives are drawn at random)."""
    import torch

    spec = importlib.util.spec_from_file_location(f"kernelbench_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    model = module.Model(*module.get_init_inputs()).train(training)
    inputs = [_batch(t, batch) if isinstance(t, torch.Tensor) else t for t in module.get_inputs()]
    return model, inputs


def _batch(t, batch: int):
    import torch

    if t.shape[0] >= batch:
        return t[:batch].clone()
    return torch.randn((batch, *t.shape[1:]), dtype=t.dtype)


def randomize_batch_norms(model):
    """Batch norms with running statistics and affine parameters drawn at random (variances in
    [0.5, 1.5)), so that both are really tested, and the affine parameters of group, instance and
    layer norms too (at their defaults, weight 1 and bias 0, a norm followed by a mean over all of
    its group computes exactly 0, and any rounding is an infinite relative error); returns the model."""
    import torch

    norms = (torch.nn.GroupNorm, torch.nn.LayerNorm, torch.nn.modules.instancenorm._InstanceNorm)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                if m.running_mean is not None:
                    m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=g))
                    m.running_var.copy_(torch.rand(m.running_var.shape, generator=g) + 0.5)
            if isinstance(m, (torch.nn.modules.batchnorm._BatchNorm, *norms)):
                if getattr(m, "weight", None) is not None:
                    m.weight.copy_(torch.randn(m.weight.shape, generator=g))
                if getattr(m, "bias", None) is not None:
                    m.bias.copy_(torch.randn(m.bias.shape, generator=g))
    return model
