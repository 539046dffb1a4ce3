"""The text encoder under ComfyUI's model management (the ComfyUI adapter of ``encoder.py``)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from ..host.memory import intermediate_device, load_whole, text_devices, text_model_dtype
from ..host.patchers import ManagedModule, place, text_model_patcher, whole_load_device
from ..host.sizes import CacheSized
from ..host.streaming import make_room, pin_weights, unload, unpin_weights
from ..memory_advice import TEXT_ENCODER, PackModel, ministral_choices
from .encoder import ErnieTextEncoder
from .streaming import LayerStream


class TextEncoderModule(ManagedModule):
    """The text encoder as ComfyUI's model management holds it (the class name shows in ComfyUI's log)."""

    def memory_choices(self) -> PackModel:
        """Its weight dtype and bytes, for the out-of-memory advice (``host/oom.py`` adds its device)."""
        return ministral_choices(TEXT_ENCODER, self.module)


class ManagedTextEncoder(CacheSized):
    """What flows through the ``ERNIE_TEXT_ENCODER`` socket: the encoder and the patcher that places it.

    ``device``: ``default`` (where ComfyUI runs text encoders, or its offload device when that GPU cannot hold the
    encoder at all), ``cpu`` or a GPU (``cuda:1``).

    ``streamed``: the weights stay on the offload device (host RAM, pinned where core allows) and pass through the
    device a decoder layer at a time for each prompt (``streaming.LayerStream``); ComfyUI never loads the encoder
    whole, and makes room for two layers and the activations only. The encoder is read in the dtype it computes in
    on that device (bf16 on GPUs that compute in it), whichever place it has.

    ``follows_plan``: its device input was ``auto``: each prompt it streams or not as the graph's latest memory plan
    says (``plan.session``). ``on_host``: it runs on ComfyUI's offload device (the CPU) in the dtype it computes in on
    the GPU (bf16 holds half of fp32's RAM), as core's choice does where the GPU cannot hold it."""

    def __init__(self, encoder: ErnieTextEncoder, device: str = "default", streamed: bool = False,
                 follows_plan: bool = False, on_host: bool = False):
        self.encoder = encoder
        self.follows_plan = follows_plan
        self.chosen = device != "default" or on_host
        load, offload = text_devices(device)
        load = offload if on_host else load
        container = TextEncoderModule(place(encoder.language_model, offload), offload)
        self.patcher = text_model_patcher(container, offload if streamed else load, offload, "text encoder",
                                          self.chosen)
        self.stream = LayerStream(encoder.language_model, load)
        self.streamed = False
        self.set_streamed(streamed)

    @classmethod
    def from_snapshot(cls, snapshot: Path, device: str = "default", fp8: bool = False, streamed: bool = False,
                      follows_plan: bool = False, on_host: bool = False) -> ManagedTextEncoder:
        dtype = text_model_dtype(text_devices(device)[0])
        return cls(ErnieTextEncoder.from_snapshot(snapshot, dtype, fp8), device, streamed, follows_plan, on_host)

    @classmethod
    def from_single_file(cls, path: Path, device: str = "default", fp8: bool = False, streamed: bool = False,
                         follows_plan: bool = False, on_host: bool = False) -> ManagedTextEncoder:
        dtype = text_model_dtype(text_devices(device)[0])
        return cls(ErnieTextEncoder.from_single_file(path, dtype, fp8), device, streamed, follows_plan, on_host)

    @classmethod
    def from_gguf(cls, path: Path, device: str = "default", streamed: bool = False, follows_plan: bool = False,
                  on_host: bool = False) -> ManagedTextEncoder:
        """A llama.cpp GGUF text encoder: its quantized layers stay in their blocks (no fp8: the file keeps its
        own types)."""
        dtype = text_model_dtype(text_devices(device)[0])
        return cls(ErnieTextEncoder.from_gguf(path, dtype), device, streamed, follows_plan, on_host)

    def set_streamed(self, streamed: bool) -> None:
        """Stream the encoder through its device from the next prompt on, or load it whole again (the plan may
        change between prompts)."""
        if streamed == self.streamed:
            return
        self.streamed = streamed
        patcher = self.patcher
        if streamed:
            unload(patcher)  # loaded whole before: its weights go back to the offload device
            patcher.load_device = patcher.offload_device
            pinned = pin_weights(patcher, self._layer_keys())
            logging.info("ERNIE-Image: the text encoder streams through %s a layer at a time (%.1f MB pinned)",
                         self.stream.device, pinned / 1e6)
        else:
            unpin_weights(patcher)
            patcher.load_device = whole_load_device(patcher.model, self.stream.device, patcher.offload_device,
                                                    "text encoder", self.chosen)

    def _layer_keys(self) -> list[str]:
        return [f"module.layers.{name}" for name, _ in self.encoder.language_model.layers.named_parameters()]

    def cache_tensors(self) -> list[torch.Tensor]:
        return [*self.encoder.language_model.parameters(), *self.encoder.language_model.buffers()]

    def encode(self, text: str) -> torch.Tensor:
        """``[1, T, D]`` embeddings of ``text``, computed where ComfyUI places the text encoder, or streamed."""
        if self.streamed:
            embedding = self._encode_streamed(text)
        else:
            load_whole(self.patcher)
            embedding = self.encoder.encode(text, self.patcher.load_device)
        return embedding.unsqueeze(0).to(intermediate_device())

    def _encode_streamed(self, text: str) -> torch.Tensor:
        stream = self.stream
        make_room(stream.device_bytes() + stream.working_bytes(len(self.encoder.token_ids(text))), stream.device)
        start = time.perf_counter()
        embedding = self.encoder.encode(text, stream.device, stream)
        logging.info("ERNIE-Image: text encoder streamed through %s: %.1f MB copied, %.2f s", stream.device,
                     stream.copied_bytes / 1e6, time.perf_counter() - start)
        return embedding
