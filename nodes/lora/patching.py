"""A LoRA file on the pack's MODEL with core's weight adapters and patching (ComfyUI adapter).

Core reads the adapters (LoRA, DoRA, LoHa, LoKr, diffs) and patches the weights when the model loads, with its
strength and stacking semantics; this module only maps the file's layer names in all layouts (``keys.py``) and
says what it applied.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..accel.patching import dit_blocks
from ..host.lora import convert_lora, lora_patches
from .keys import is_text_encoder, key_map, layer_names, made_for


@dataclass(frozen=True)
class LoraReport:
    """What a LoRA file held and what of it was applied."""

    name: str
    applied: int  # layers of the DiT patched
    dit_layers: int  # the file's layers that are not the text encoder's
    text_encoder_layers: int
    looks_made_for: str | None

    @property
    def few(self) -> bool:
        """Fewer than half of the file's diffusion-model layers applied: likely a LoRA for another model."""
        return self.applied * 2 < self.dit_layers

    def text(self) -> str:
        words = f"LoRA {self.name}: applied {self.applied} of its {self.dit_layers} diffusion-model layers"
        if self.text_encoder_layers:
            words += (f"; {self.text_encoder_layers} text-encoder layers not applied (the pack's text encoder "
                      "takes no LoRA)")
        if self.few:
            words += (f". Few or none match ERNIE-Image: this LoRA looks made for {self.looks_made_for}"
                      if self.looks_made_for else ". Few or none match ERNIE-Image's DiT: is it an ERNIE-Image LoRA?")
        return words


def apply_lora(model, lora: dict[str, torch.Tensor], strength: float, name: str) -> tuple[object, LoraReport]:
    """A clone of ``model`` with ``lora`` patched in at ``strength``, and what was applied. A quantized DiT refuses
    the patches (``host.patchers.WholeModelPatcher.add_patches``)."""
    diffusion_model, _ = dit_blocks(model)  # a clear error for a MODEL that is not an ERNIE-Image DiT
    lora = convert_lora(lora)
    mapping = key_map([k for k, _ in diffusion_model.named_parameters()])
    patches = lora_patches(lora, mapping)
    names = layer_names(list(lora))
    text_encoder = {n for n in names if is_text_encoder(n)}
    unmatched = {n for n in names - text_encoder if n not in mapping}
    patched = model.clone()
    applied = len(patched.add_patches(patches, strength))
    report = LoraReport(name, applied, len(names - text_encoder), len(text_encoder), made_for(unmatched))
    return patched, report
