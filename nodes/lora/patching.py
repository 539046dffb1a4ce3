"""A LoRA file on the pack's MODEL with core's weight adapters and patching (ComfyUI adapter).

Core reads the adapters (LoRA, DoRA, LoHa, LoKr, diffs) and patches the weights when the model loads, with its
strength and stacking semantics; this module maps the file's layer names in all layouts (``keys.py``), refuses
files with NaN or infinite values, hands core only the patches whose shapes fit the DiT, and says what it applied.
Core itself accepts a patch of the wrong shape and, when the model loads, logs an ERROR line for it and leaves the
weight as it was: a LoRA one column too wide was reported "applied 70 of its 70 layers" with none applied.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ErnieImageError
from ..host.gguf_layers import weight_shapes
from ..host.lora import convert_lora, lora_patches, misfit
from ..host.model import dit_blocks
from ..structure import first_non_finite, natural
from .keys import is_text_encoder, key_map, layer_names, made_for


@dataclass(frozen=True)
class LoraReport:
    """What a LoRA file held and what of it was applied."""

    name: str
    applied: int  # layers of the DiT patched
    dit_layers: int  # the file's layers that are not the text encoder's
    text_encoder_layers: int
    looks_made_for: str | None
    misfits: int = 0  # layers of the DiT the file names but whose patch does not fit the weight's shape
    first_misfit: str | None = None  # the first of them, and why, in words

    @property
    def few(self) -> bool:
        """Fewer than half of the file's diffusion-model layers applied: likely a LoRA for another model."""
        return self.applied * 2 < self.dit_layers

    def text(self) -> str:
        words = f"LoRA {self.name}: applied {self.applied} of its {self.dit_layers} diffusion-model layers"
        if self.misfits:
            words += (f"; {self.misfits} layers do not fit the DiT's shapes (first: {self.first_misfit}), so they "
                      "are not applied: the LoRA is for another size of model, or damaged")
        if self.text_encoder_layers:
            words += (f"; {self.text_encoder_layers} text-encoder layers not applied (the pack's text encoder "
                      "takes no LoRA)")
        if self.few:
            words += (f". Few or none match ERNIE-Image: this LoRA looks made for {self.looks_made_for}"
                      if self.looks_made_for else ". Few or none match ERNIE-Image's DiT: is it an ERNIE-Image LoRA?")
        return words


def apply_lora(model, lora: dict[str, torch.Tensor], strength: float, name: str) -> tuple[object, LoraReport]:
    """A clone of ``model`` with ``lora`` patched in at ``strength``, and what was applied. A torchao DiT takes them
    (each patched layer quantized again when it loads), a GGUF DiT too (applied to each decoded weight as it runs,
    ``host.gguf_layers``), an SVDQuant DiT refuses them
    (``host.patchers.WholeModelPatcher``); a file with NaN or infinite values is refused."""
    diffusion_model, _ = dit_blocks(model)  # a clear error for a MODEL that is not an ERNIE-Image DiT
    bad = first_non_finite(lora)
    if bad is not None:
        raise ErnieImageError(f"LoRA {name}: {bad} holds NaN or infinite values, which would make a black image. "
                              "The file is damaged (or its training diverged): pick another LoRA.")
    lora = convert_lora(lora)
    mapping = key_map([k for k, _ in diffusion_model.named_parameters()])
    patches = lora_patches(lora, mapping)
    # As the DiT computes with them: a GGUF weight's true shape, not its blocks'.
    shapes = {f"diffusion_model.{k}": shape for k, shape in weight_shapes(diffusion_model).items()}
    names = layer_names(list(lora))
    layer_of = {target: layer for layer, target in mapping.items() if layer in names}  # the file's own name
    misfits = {}
    for key, patch in patches.items():
        why = misfit(patch, shapes[key]) if key in shapes else None
        if why is not None:
            misfits[key] = f"{layer_of.get(key, key)}: {why}"
    text_encoder = {n for n in names if is_text_encoder(n)}
    unmatched = {n for n in names - text_encoder if n not in mapping}
    patched = model.clone()
    applied = len(patched.add_patches({k: p for k, p in patches.items() if k not in misfits}, strength))
    first = misfits[min(misfits, key=natural)] if misfits else None
    report = LoraReport(name, applied, len(names - text_encoder), len(text_encoder), made_for(unmatched),
                        len(misfits), first)
    return patched, report
