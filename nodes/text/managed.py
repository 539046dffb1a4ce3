"""The text encoder under ComfyUI's model management (the ComfyUI adapter of ``encoder.py``)."""

from __future__ import annotations

from pathlib import Path

import torch

from ..host.memory import intermediate_device, load_whole, text_devices, text_model_dtype
from ..host.patchers import ManagedModule, place, text_model_patcher
from ..host.sizes import CacheSized
from ..memory_advice import TEXT_ENCODER, PackModel, ministral_choices
from .encoder import ErnieTextEncoder


class TextEncoderModule(ManagedModule):
    """The text encoder as ComfyUI's model management holds it (the class name shows in ComfyUI's log)."""

    def memory_choices(self) -> PackModel:
        """Its weight dtype and bytes, for the out-of-memory advice (``host/oom.py`` adds its device)."""
        return ministral_choices(TEXT_ENCODER, self.module)


class ManagedTextEncoder(CacheSized):
    """What flows through the ``ERNIE_TEXT_ENCODER`` socket: the encoder and the patcher that places it.

    ``device``: ``default`` (where ComfyUI runs text encoders, or its offload device when that GPU cannot hold the
    encoder at all), ``cpu`` or a GPU (``cuda:1``)."""

    def __init__(self, encoder: ErnieTextEncoder, device: str = "default"):
        self.encoder = encoder
        load, offload = text_devices(device)
        container = TextEncoderModule(place(encoder.language_model, offload), offload)
        self.patcher = text_model_patcher(container, load, offload, "text encoder", chosen=device != "default")

    @classmethod
    def from_snapshot(cls, snapshot: Path, device: str = "default", fp8: bool = False) -> ManagedTextEncoder:
        return cls(ErnieTextEncoder.from_snapshot(snapshot, text_model_dtype(text_devices(device)[0]), fp8), device)

    @classmethod
    def from_single_file(cls, path: Path, device: str = "default", fp8: bool = False) -> ManagedTextEncoder:
        return cls(ErnieTextEncoder.from_single_file(path, text_model_dtype(text_devices(device)[0]), fp8), device)

    def cache_tensors(self) -> list[torch.Tensor]:
        return [*self.encoder.language_model.parameters(), *self.encoder.language_model.buffers()]

    def encode(self, text: str) -> torch.Tensor:
        """``[1, T, D]`` embeddings of ``text``, computed where ComfyUI places the text encoder."""
        load_whole(self.patcher)
        embedding = self.encoder.encode(text, self.patcher.load_device)
        return embedding.unsqueeze(0).to(intermediate_device())
