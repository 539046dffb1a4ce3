"""Out-of-memory faults a CPU cannot produce, injected where a GPU would raise them."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode


class OutOfMemoryOnMoves(TorchFunctionMode):
    """A GPU that is full: every move to it fails (injected: the CPU cannot run out of GPU memory)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.to:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB")
        return func(*args, **(kwargs or {}))


class OutOfMemoryInAttention(TorchFunctionMode):
    """A GPU that fills up during sampling (injected: the CPU cannot run out of GPU memory)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.nn.functional.scaled_dot_product_attention:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 198.00 MiB")
        return func(*args, **(kwargs or {}))
