"""The text encoder under ComfyUI's model management (the ComfyUI adapter of ``encoder.py``)."""

from __future__ import annotations

import collections
import functools
import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ..host.memory import intermediate_device, load_whole, text_devices, text_model_dtype
from ..host.patchers import ManagedModule, place, text_model_patcher, whole_load_device
from ..host.sizes import CacheSized
from ..host.streaming import make_room, pin_weights, unload, unpin_weights
from ..memory_advice import TEXT_ENCODER, PackModel, ministral_choices
from .encoder import ErnieTextEncoder
from .streaming import LayerStream

# The encodings of the latest distinct texts (a few MB each): a text met again (a workflow alternating prompts, a queue
# of variations and their originals) costs no encode, which matters where the plan runs the encoder on the CPU.
# ComfyUI's own cache keeps one text per encode node.
ENCODINGS_KEPT = 16


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

    ``on_host``: it runs on ComfyUI's offload device (the CPU) in the dtype it computes in on the GPU (bf16 holds half
    of fp32's RAM), as core's choice does where the GPU cannot hold it.

    ``follows_plan``: its device input was ``auto``: before each prompt it takes the place the graph's latest memory
    plan gives it (``set_place``): loaded whole on the GPU, streamed through it, or on the CPU, and back. Its weights
    are read in the GPU's dtype whatever the place, so a new place moves them and reads nothing again; a new form
    (fp8 or as stored, where its weight_dtype was ``auto`` too: ``set_form``) reads them again."""

    def __init__(self, encoder: ErnieTextEncoder, device: str = "default", streamed: bool = False,
                 follows_plan: bool = False, on_host: bool = False, fp8: bool = False,
                 reread: Callable[[bool], ErnieTextEncoder] | None = None):
        self.follows_plan, self.fp8, self.reread = follows_plan, fp8, reread
        self.chosen = device != "default"
        self.devices = text_devices(device)
        self._hold(encoder, streamed, on_host)

    def _hold(self, encoder: ErnieTextEncoder, streamed: bool, on_host: bool) -> None:
        gpu, offload = self.devices
        self.encoder = encoder
        self.encodings: collections.OrderedDict[tuple, torch.Tensor] = collections.OrderedDict()
        container = TextEncoderModule(place(encoder.language_model, offload), offload)
        self.patcher = text_model_patcher(container, offload if streamed or on_host else gpu, offload, "text encoder",
                                          self.chosen)
        self.stream = LayerStream(encoder.language_model, gpu)
        self.streamed, self.on_host = False, on_host
        self.set_place(streamed, on_host)

    @classmethod
    def _read(cls, read, path: Path, device: str, fp8: bool, form_follows_plan: bool, **place) -> ManagedTextEncoder:
        """``read(path, dtype, fp8)`` in the dtype the encoder computes in on its GPU; ``form_follows_plan``: its
        weight_dtype was ``auto``, so a later plan may ask for the other form (``set_form``)."""
        dtype = text_model_dtype(text_devices(device)[0])
        reread = functools.partial(read, path, dtype) if form_follows_plan else None
        return cls(read(path, dtype, fp8), device, fp8=fp8, reread=reread, **place)

    @classmethod
    def from_snapshot(cls, snapshot: Path, device: str = "default", fp8: bool = False,
                      form_follows_plan: bool = False, **place) -> ManagedTextEncoder:
        """``place``: ``streamed``, ``follows_plan``, ``on_host``."""
        return cls._read(ErnieTextEncoder.from_snapshot, snapshot, device, fp8, form_follows_plan, **place)

    @classmethod
    def from_single_file(cls, path: Path, device: str = "default", fp8: bool = False,
                         form_follows_plan: bool = False, **place) -> ManagedTextEncoder:
        return cls._read(ErnieTextEncoder.from_single_file, path, device, fp8, form_follows_plan, **place)

    @classmethod
    def from_gguf(cls, path: Path, device: str = "default", **place) -> ManagedTextEncoder:
        """A llama.cpp GGUF text encoder: its quantized layers stay in their blocks (no fp8: the file keeps its
        own types, its one form)."""
        return cls._read(lambda p, dtype, fp8: ErnieTextEncoder.from_gguf(p, dtype), path, device, False, False,
                         **place)

    def set_form(self, fp8: bool) -> None:
        """Hold the decoder layers in fp8 or not from the next prompt on, read again from the file: the graph's plan
        changed its form after the loader ran, which ComfyUI does not run again while its inputs stay. A file whose
        form is not the plan's (a GGUF, an explicit weight_dtype) keeps it."""
        if self.reread is None or (fp8 == self.fp8 and self.encoder is not None):
            return
        streamed, on_host = self.streamed, self.on_host
        if self.encoder is not None:  # None: the last read failed and left nothing held
            self._unload()
            self.encoder = self.patcher = self.stream = None  # the weights held now go before the new ones are read
        logging.info("ERNIE-Image: the memory plan holds the text encoder %s now: reading it again",
                     "in fp8" if fp8 else "as stored")
        self._hold(self.reread(fp8), streamed, on_host)
        self.fp8 = fp8

    def set_place(self, streamed: bool, on_host: bool = False) -> None:
        """From the next prompt on, stream the encoder through its GPU (``streamed``), run it on the offload device
        (``on_host``), or load it whole on the GPU again: the plan may change between prompts."""
        if (streamed, on_host) == (self.streamed, self.on_host):
            return
        self._unload()
        patcher = self.patcher
        self.streamed, self.on_host = streamed, on_host
        if streamed:
            patcher.load_device = patcher.offload_device
            pinned = pin_weights(patcher, self._layer_keys())
            logging.info("ERNIE-Image: the text encoder streams through %s a layer at a time (%.1f MB pinned)",
                         self.stream.device, pinned / 1e6)
        elif on_host:
            patcher.load_device = patcher.offload_device
            logging.info("ERNIE-Image: the text encoder runs on %s", patcher.offload_device)
        else:
            patcher.load_device = whole_load_device(patcher.model, self.stream.device, patcher.offload_device,
                                                    "text encoder", self.chosen)

    def _unload(self) -> None:
        """Loaded whole before: its weights go back to the offload device; streamed: unpinned."""
        unload(self.patcher)
        if self.streamed:
            unpin_weights(self.patcher)

    def _layer_keys(self) -> list[str]:
        return [f"module.layers.{name}" for name, _ in self.encoder.language_model.layers.named_parameters()]

    def cache_tensors(self) -> list[torch.Tensor]:
        return [*self.encoder.language_model.parameters(), *self.encoder.language_model.buffers()]

    def encode(self, text: str) -> torch.Tensor:
        """``[1, T, D]`` embeddings of ``text``, computed where ComfyUI places the text encoder, or streamed; kept
        for the latest distinct texts per kind of device (a text met again after a move to another device is
        encoded there, as a fresh process would)."""
        if self.encoder is None:  # set_form's read failed (the file deleted or changed): read it again, or say why
            self.set_form(self.fp8)
        key = (text, (self.stream.device if self.streamed else self.patcher.load_device).type)
        if key in self.encodings:
            self.encodings.move_to_end(key)
            return self.encodings[key]
        if self.streamed:
            embedding = self._encode_streamed(text)
        else:
            load_whole(self.patcher)
            embedding = self.encoder.encode(text, self.patcher.load_device)
        self.encodings[key] = embedding = embedding.unsqueeze(0).to(intermediate_device())
        while len(self.encodings) > ENCODINGS_KEPT:
            self.encodings.popitem(last=False)
        return embedding

    def _encode_streamed(self, text: str) -> torch.Tensor:
        stream = self.stream
        make_room(stream.device_bytes() + stream.working_bytes(len(self.encoder.token_ids(text))), stream.device)
        start = time.perf_counter()
        embedding = self.encoder.encode(text, stream.device, stream)
        logging.info("ERNIE-Image: text encoder streamed through %s: %.1f MB copied, %.2f s", stream.device,
                     stream.copied_bytes / 1e6, time.perf_counter() - start)
        return embedding
