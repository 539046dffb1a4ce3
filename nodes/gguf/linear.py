"""Layers holding a GGUF weight's blocks, decoded where they run at each call (engine: torch only).

transformers' language models (the Ministral 3 text encoder and PE) are built of ``torch.nn.Linear``; their GGUF
twins swap in ``GGUFBlockLinear``, which keeps the file's blocks (uint8) as its weight and decodes them into the
input's dtype on the input's device as it runs (``dequant.dequantize``), as the DiT's core layers do
(``host/gguf_layers.py``): only the blocks are held and moved, a layer's decoded weight lives for one call.
``GGUFBlockEmbedding`` looks up a token table's rows the same way: a row is whole blocks, so only the rows asked for
are decoded (the text encoder's 131,072 x 3072 table: 0.33 GB of Q6_K blocks held instead of 0.8 GB of bf16).
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


class GGUFBlockEmbedding(torch.nn.Module):
    """An ``Embedding`` of ``shape`` (``[tokens, width]``) whose table is GGUF blocks of type ``kind``; rows come
    out in ``dtype``, on the table's device."""

    def __init__(self, blocks: torch.Tensor, kind: str, shape: tuple[int, int], dtype: torch.dtype):
        super().__init__()
        self.weight = torch.nn.Parameter(blocks, requires_grad=False)
        self.kind, self.weight_shape, self.dtype = kind, tuple(shape), dtype
        self.num_embeddings, self.embedding_dim = shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight.view(self.num_embeddings, -1)[ids.reshape(-1).to(self.weight.device)]
        return dequantize(rows, self.kind, (ids.numel(), self.embedding_dim), self.dtype).reshape(
            *ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, kind={self.kind}"
