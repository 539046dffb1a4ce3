"""A LoRA file on the pack's MODEL with core's weight adapters and patching (ComfyUI adapter).

Core reads the adapters (LoRA, DoRA, LoHa, LoKr, diffs) and patches the weights when the model loads, with its
strength and stacking semantics; this module maps the file's layer names in all layouts (``keys.py``), refuses
files with NaN or infinite values or changes past the weights' range, hands core only the patches whose shapes fit
the DiT, and says how many of the DiT's layers it applied.
Core itself accepts a patch of the wrong shape and, when the model loads, logs an ERROR line for it and leaves the
weight as it was: a LoRA one column too wide was reported "applied 70 of its 70 layers" with none applied.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cancel import check_cancel
from ..errors import ErnieImageError, quoted
from ..host.gguf_layers import weight_shapes
from ..host.lora import convert_lora, largest_change, lora_patches, misfit
from ..host.model import dit_blocks
from ..structure import first_non_finite, natural
from .keys import is_text_encoder, key_map, layer_name, layer_names, made_for


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


def _check_alphas(lora: dict[str, torch.Tensor], name: str) -> None:
    """Every ``alpha`` one number: core reads each with ``.item()`` (a raw RuntimeError for one of shape [3])."""
    for key, tensor in lora.items():
        if key.endswith(".alpha") and tensor.numel() != 1:
            raise ErnieImageError(f"LoRA {name}: {quoted(key)} has shape {list(tensor.shape)}; a LoRA's alpha is one "
                                  "number (its layer's scale is alpha / rank). The file is damaged: pick another LoRA.")


# The largest change a LoRA may make to one number of a weight: the largest number half precision holds, the
# narrowest dtype ComfyUI computes a DiT in. A trained LoRA changes a weight by well under 1 (at most some hundreds at
# the node's strength 100); a change past this range is infinite in half precision, and in bf16 or float32 it makes
# the activations overflow: LoRA values of 1e20, or an alpha of 3e38, were reported "applied 3 of 3", every output NaN.
MAX_CHANGE = torch.finfo(torch.float16).max


def _check_changes(patches: dict, lora: dict[str, torch.Tensor], strength: float, layer_of: dict[str, str],
                   name: str) -> None:
    """Every patch's largest change to its weight at most ``MAX_CHANGE``, or an error naming the layer and the key
    that holds the file's largest number there."""
    for key, patch in patches.items():
        check_cancel()
        change = largest_change(patch, strength)
        if change is None or change <= MAX_CHANGE:
            continue
        layer = layer_of.get(key, key)
        keys = [k for k in lora if layer_name(k) == layer] or list(lora)
        largest = {k: float(lora[k].double().abs().max()) if lora[k].numel() else 0.0 for k in keys}
        worst = max(largest, key=largest.get)
        raise ErnieImageError(
            f"LoRA {name}: {quoted(layer)} would change its weight by up to {change:.3g} at strength {strength:g}, "
            f"past the largest number half precision holds ({MAX_CHANGE:g}; a LoRA changes a weight by well under "
            f"1): the image would be black or noise. Its largest number is {largest[worst]:.3g}, in {quoted(worst)}. "
            "The file is damaged or its training diverged: pick another LoRA.")


def _layers(keys) -> set[str]:
    """The DiT layers (``diffusion_model.layers.0.mlp.up_proj``) of patch keys: a layer's ``diff`` and ``diff_b``
    patch its weight and its bias, one layer."""
    return {key.rpartition(".")[0] for key in keys}


def apply_lora(model, lora: dict[str, torch.Tensor], strength: float, name: str) -> tuple[object, LoraReport]:
    """A clone of ``model`` with ``lora`` patched in at ``strength``, and what was applied. A torchao DiT takes them
    (each patched layer quantized again when it loads), a GGUF DiT too (applied to each decoded weight as it runs,
    ``host.gguf_layers``), an SVDQuant DiT refuses them
    (``host.patchers.WholeModelPatcher``); a file with NaN or infinite values, an alpha that is not one number, or
    a change past the weights' range is refused."""
    diffusion_model, _ = dit_blocks(model)  # a clear error for a MODEL that is not an ERNIE-Image DiT
    bad = first_non_finite(lora)
    if bad is not None:
        raise ErnieImageError(f"LoRA {name}: {quoted(bad)} holds NaN or infinite values, which would make a black "
                              "image. The file is damaged (or its training diverged): pick another LoRA.")
    _check_alphas(lora, name)
    lora = convert_lora(lora)
    mapping = key_map([k for k, _ in diffusion_model.named_parameters()])
    patches = lora_patches(lora, mapping)
    # As the DiT computes with them: a GGUF weight's true shape, not its blocks'.
    shapes = {f"diffusion_model.{k}": shape for k, shape in weight_shapes(diffusion_model).items()}
    names = layer_names(list(lora))
    layer_of = {target: layer for layer, target in mapping.items() if layer in names}  # the file's own name
    misfits = {}
    for key, patch in patches.items():
        check_cancel()
        why = misfit(patch, shapes[key]) if key in shapes else None
        if why is not None:
            misfits[key] = f"{quoted(layer_of.get(key, key))}: {why}"
    fitting = {k: p for k, p in patches.items() if k not in misfits}
    _check_changes(fitting, lora, strength, layer_of, name)
    text_encoder = {n for n in names if is_text_encoder(n)}
    unmatched = {n for n in names - text_encoder if n not in mapping}
    patched = model.clone()
    applied = _layers(patched.add_patches(fitting, strength))
    first = misfits[min(misfits, key=natural)] if misfits else None
    report = LoraReport(name, len(applied), len(names - text_encoder), len(text_encoder), made_for(unmatched),
                        len(_layers(misfits) - applied), first)
    return patched, report
