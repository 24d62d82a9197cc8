"""`specgen.FusedLayer`: a drop-in nn.Module that runs one specialized kernel per forward.

Its parameters have the names and shapes of the plain PyTorch model (`conv.weight`,
`conv.bias`, one parameter per per-channel name), so `load_state_dict` works both ways.
On CUDA tensors it launches the kernel on torch's current stream; on CPU tensors it runs the
PyTorch reference, so a model stays portable.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from specgen import pipeline, reference, runtime
from specgen.spec import LayerSpec, load


class FusedLayer(nn.Module):
    def __init__(self, spec_or_path, *, arch: str | None = None):
        super().__init__()
        self.spec: LayerSpec = load(spec_or_path)
        self.arch = arch
        self.conv = reference.make_conv(self.spec)
        for name, shape in self.spec.params().items():
            self.register_parameter(name, nn.Parameter(torch.randn(shape)))
        self._specialized: pipeline.Specialized | None = None
        if torch.cuda.is_available():
            self.specialize()

    # -- specialization ------------------------------------------------------------------------

    def specialize(self) -> pipeline.Specialized:
        """Compile the kernel, or load it from the cache (microseconds once done in this process)."""
        if self._specialized is None:
            self._specialized = pipeline.specialize(self.spec, self.arch)
        return self._specialized

    @property
    def key(self) -> str | None:
        return None if self._specialized is None else self._specialized.key

    def extra_repr(self) -> str:
        key = self.key[:16] if self.key else "not yet specialized"
        return f"spec={self.spec.name!r}, key={key}"

    def spec_params(self) -> dict:
        return {name: getattr(self, name) for name in self.spec.params()}

    # -- forward -------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The layer on `x`. On CUDA, `out` may be a preallocated contiguous float32 output to fill."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{self.spec.name}: expected a torch.Tensor input, got {type(x).__name__}")
        if not x.is_cuda:
            return reference.forward(self.spec, x, self.conv.weight, self.conv.bias, self.spec_params())
        self._check_input(x)
        return self._launch(x.contiguous(), out)

    def _check_input(self, x: torch.Tensor) -> None:
        name = self.spec.name
        if x.dtype != torch.float32:
            raise ValueError(f"{name}: expected a float32 input, got {x.dtype}")
        weight = self.conv.weight
        if weight.dtype != torch.float32:
            raise ValueError(
                f"{name}: specgen kernels are float32-only; the layer's parameters are {weight.dtype} "
                f"(undo .half()/.bfloat16() with .float())"
            )
        if weight.device != x.device:
            raise ValueError(f"{name}: expected the input on the layer's device {weight.device}, got {x.device}")
        want = (self.spec.input.channels, *self.spec.input.size)
        if x.dim() != 2 + self.spec.ndim or tuple(x.shape[1:]) != want:
            raise ValueError(
                f"{name}: expected an input of shape [batch, {', '.join(map(str, want))}], got {list(x.shape)}"
            )

    def _launch(self, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        sp = self.specialize()
        plan = sp.plan
        batch = x.shape[0]
        shape = (batch, *plan["out_shape"])
        if out is None:
            out = torch.empty(shape, device=x.device, dtype=torch.float32)
        elif tuple(out.shape) != shape or out.dtype != torch.float32 or out.device != x.device or not out.is_contiguous():
            raise ValueError(
                f"{self.spec.name}: out must be a contiguous float32 tensor of shape {list(shape)} on {x.device}, "
                f"got {out.dtype} {list(out.shape)} on {out.device}"
            )
        if batch == 0:
            return out
        device_index = x.device.index if x.device.index is not None else torch.cuda.current_device()
        kernel = runtime.load(
            sp.key, _cubin_bytes(sp), plan["kernel_name"], plan["threads"], plan["smem_bytes"], device_index
        )
        tensors = [x, self.conv.weight]
        if self.spec.conv.bias:
            tensors.append(self.conv.bias)
        tensors.extend(getattr(self, p["name"]) for p in plan["params"])
        tensors = [t if t.is_contiguous() else t.contiguous() for t in tensors]
        pointers = [t.data_ptr() for t in tensors] + [out.data_ptr()]
        strides = [4 * plan["in_per_sample"]] + [0] * (len(tensors) - 1) + [4 * plan["out_per_sample"]]
        stream = torch.cuda.current_stream(x.device).cuda_stream
        runtime.launch(kernel, plan["blocks_per_sample"], pointers, strides, batch, stream)
        return out


_cubins: dict[str, bytes] = {}


def _cubin_bytes(sp: pipeline.Specialized) -> bytes:
    data = _cubins.get(sp.key)
    if data is None:
        from specgen import cache

        data = _cubins[sp.key] = cache.load_cubin_bytes(sp.build)
    return data
