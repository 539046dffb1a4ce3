"""The text encoder under ComfyUI's model management (the ComfyUI adapter of ``encoder.py``)."""

from __future__ import annotations

from pathlib import Path

import comfy.model_management
import torch

from ..managed import text_model_dtype, text_model_patcher
from .encoder import ErnieTextEncoder


class ManagedTextEncoder:
    """What flows through the ``ERNIE_TEXT_ENCODER`` socket: the encoder and the patcher that places it."""

    def __init__(self, encoder: ErnieTextEncoder):
        self.encoder = encoder
        self.patcher = text_model_patcher(encoder.language_model)

    @classmethod
    def from_snapshot(cls, snapshot: Path) -> ManagedTextEncoder:
        dtype = text_model_dtype(comfy.model_management.text_encoder_device())
        return cls(ErnieTextEncoder.from_snapshot(snapshot, dtype))

    @classmethod
    def from_single_file(cls, path: Path) -> ManagedTextEncoder:
        dtype = text_model_dtype(comfy.model_management.text_encoder_device())
        return cls(ErnieTextEncoder.from_single_file(path, dtype))

    def encode(self, text: str) -> torch.Tensor:
        """``[1, T, D]`` embeddings of ``text``, computed where ComfyUI places the text encoder."""
        comfy.model_management.load_model_gpu(self.patcher)
        embedding = self.encoder.encode(text, self.patcher.load_device)
        return embedding.unsqueeze(0).to(comfy.model_management.intermediate_device())
