"""Sizes of weights, and the sizes the executor's RAM-pressure cache reads (plain torch: engines use it too).

The cache sizes a node's outputs by ``get_ram_usage()`` (0.3.75's ``--cache-ram``, comfy_execution/caching.py
``RAMPressureCache.poll``) or by their ``.patcher`` and ``_comfy_cache_tensors()`` (current cores, where it is
the default cache: caching.py @0c5058b9 ``ram_release``). An output that reports neither counts as 0 bytes and is
evicted last. ``CacheSized`` gives an output both.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


def plain_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors that hold ``tensor``'s data: itself, or a tensor subclass's (torchao's) inner ones."""
    if not is_traceable_wrapper_subclass(tensor):
        return [tensor]
    return [inner for name in tensor.__tensor_flatten__()[0] for inner in plain_tensors(getattr(tensor, name))]


def tensor_bytes(tensor: torch.Tensor) -> int:
    """The memory a tensor holds. A quantized (torchao) weight reports its original dtype, so count what it wraps."""
    return sum(t.nelement() * t.element_size() for t in plain_tensors(tensor))


def module_bytes(module: torch.nn.Module) -> int:
    """The memory a module's parameters and buffers hold (quantized weights at their true size)."""
    return sum(tensor_bytes(t) for t in (*module.parameters(), *module.buffers()))


class CacheSized:
    """An output the executor's RAM-pressure cache can size: ``cache_tensors()`` lists the tensors it holds."""

    def cache_tensors(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def get_ram_usage(self) -> int:
        """Bytes held in RAM (0.3.75's cache)."""
        return sum(tensor_bytes(t) for t in self.cache_tensors() if t.device.type == "cpu")

    def _comfy_cache_tensors(self) -> list[torch.Tensor]:
        """The tensors held (current cores' cache counts those in RAM)."""
        return self.cache_tensors()
