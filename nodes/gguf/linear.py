"""A linear layer holding a GGUF weight's blocks, decoded where it runs at each call (engine: torch only).

transformers' language models (the Ministral 3 text encoder and PE) are built of ``torch.nn.Linear``; their GGUF
twins swap in this layer, which keeps the file's blocks (uint8) as its weight and decodes them into the input's dtype
on the input's device as it runs (``dequant.dequantize``), as the DiT's core layers do (``host/gguf_layers.py``):
only the blocks are held and moved, a layer's decoded weight lives for one call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .dequant import dequantize


class GGUFBlockLinear(torch.nn.Module):
    """A bias-free ``Linear`` of ``shape`` (``[out, in]``) whose weight is GGUF blocks of type ``kind``."""

    def __init__(self, blocks: torch.Tensor, kind: str, shape: tuple[int, int]):
        super().__init__()
        self.weight = torch.nn.Parameter(blocks, requires_grad=False)
        self.kind, self.weight_shape = kind, tuple(shape)
        self.out_features, self.in_features = shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        blocks = self.weight.to(x.device, non_blocking=True)
        return F.linear(x, dequantize(blocks, self.kind, self.weight_shape, x.dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kind={self.kind}"
