"""The base of the layers that run one generated kernel of their own, outside a fused layer's spec
(`specgen.concat.ConcatLayer`, `specgen.maxpool.MaxPoolLayer`): a frozen plan, the kernel built
once (at construction where CUDA is there: never during a graph capture) and loaded per device,
and the plan's custom op (what torch.compile traces), bound again when the layer is unpickled or
copied."""

from __future__ import annotations

import torch
import torch.nn as nn

THREADS = 256  # every standalone kernel's block


class StandaloneLayer(nn.Module):
    """Subclasses give `_request(plan, arch)` (the plan's cache.BuildRequest) and
    `_custom_op(plan)` (its custom op, registered once per plan)."""

    @staticmethod
    def _request(plan, arch):
        raise NotImplementedError

    @staticmethod
    def _custom_op(plan):
        raise NotImplementedError

    def __init__(self, plan, arch: str | None = None, built=None):
        """`built`: the kernel's build result where the caller built it already (`cache.build_many`)."""
        super().__init__()
        self.plan = plan
        self.arch = arch
        self._kernels: dict[int, object] = {}
        self._result = built
        self._op = self._custom_op(plan)
        if torch.cuda.is_available():
            self.build()

    def __getstate__(self):
        # (the custom op and the loaded kernels are bound to this process: bound again on unpickling)
        state = dict(self.__dict__)
        state["_op"], state["_kernels"] = None, {}
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._op = self._custom_op(self.plan)

    def build(self):
        """Compile (or find in the cache) the kernel; returns the build result."""
        if self._result is None:
            from specgen import cache

            self._result = cache.get_or_build(self._request(self.plan, self.arch))
        return self._result

    def _kernel(self, device_index: int):
        """The kernel loaded on CUDA device `device_index`."""
        kernel = self._kernels.get(device_index)
        if kernel is None:
            from specgen import cache, runtime

            result = self.build()
            kernel = self._kernels[device_index] = runtime.load(
                result.key, cache.load_cubin_bytes(result), self.plan.kernel_name, THREADS, 0, device_index)
        return kernel
