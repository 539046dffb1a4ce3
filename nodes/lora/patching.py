"""A LoRA file on the pack's MODEL with core's weight adapters and patching (ComfyUI adapter).

Core reads the adapters (LoRA, DoRA, LoHa, LoKr, diffs) and patches the weights when the model loads, with its
strength and stacking semantics; this module maps the file's layer names in all layouts (``keys.py``), refuses
files with NaN or infinite values, hands core only the patches whose shapes fit the DiT, and says what it applied.
Core itself accepts a patch of the wrong shape and, when the model loads, logs an ERROR line for it and leaves the
weight as it was: a LoRA one column too wide was reported "applied 70 of its 70 layers" with none applied.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..accel.patching import dit_blocks
from ..errors import ErnieImageError
from ..host.lora import convert_lora, lora_patches
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


# Core's weight adapters are told apart by their class names (``comfy.weight_adapter``), so that this module reads
# what ``host.lora`` returns without importing core. The orthogonal ones rotate blocks of rows: no product to make.
_BLOCK_ADAPTERS = ("OFTAdapter", "BOFTAdapter")
_DORA_INDEX = {"LoRAAdapter": 4, "LoHaAdapter": 7, "LoKrAdapter": 8}  # where each keeps its DoRA scale


def _meta(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """The tensor's shape alone: core's formulas run on the meta device give the shape of the weight a patch makes,
    with no arithmetic done."""
    return None if tensor is None else torch.empty(tensor.shape, device="meta")


def _product(a: torch.Tensor | None, b: torch.Tensor | None, tucker: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b``, or with a Tucker core as LyCORIS writes it (core's ``einsum``)."""
    if tucker is not None:
        return torch.einsum("i j k l, j r, i p -> p r k l", tucker, b, a)
    return torch.mm(a, b)


def _made(patch) -> torch.Tensor | None:
    """What ``patch`` adds to (or sets as) its weight, on the meta device, by core's own formula for each kind; None
    for the kinds this does not model (GLoRA: core's own handling stands)."""
    if isinstance(patch, tuple):  # ("diff", (tensor,)) or ("set", (tensor,))
        return _meta(patch[1][0])
    v = [_meta(t) if isinstance(t, torch.Tensor) else t for t in patch.weights]
    kind = type(patch).__name__
    if kind == "LoRAAdapter":
        up, down, _, mid, _, reshape = v
        if reshape is not None:
            raise ValueError(f"it pads the weight to {list(reshape)}")
        if mid is not None:  # LoCon's middle weight, as core folds it into the down weight
            down = (torch.mm(down.transpose(0, 1).flatten(1), mid.transpose(0, 1).flatten(1))
                    .reshape(down.shape[1], down.shape[0], *mid.shape[2:]).transpose(0, 1))
        return torch.mm(up.flatten(1), down.flatten(1))
    if kind == "LoHaAdapter":
        w1a, w1b, _, w2a, w2b, t1, t2 = v[:7]
        return _product(w1a, w1b, t1) * _product(w2a, w2b, t2)
    if kind == "LoKrAdapter":
        w1, w2, _, w1a, w1b, w2a, w2b, t2 = v[:8]
        w1 = w1 if w1 is not None else _product(w1a, w1b)
        w2 = w2 if w2 is not None else _product(w2a, w2b, t2)
        return torch.kron(w1.unsqueeze(2).unsqueeze(2) if w2.dim() == 4 else w1, w2)
    return None


def _dora_scale(patch) -> torch.Tensor | None:
    weights = getattr(patch, "weights", ())
    index = _DORA_INDEX.get(type(patch).__name__)
    return _meta(weights[index]) if index is not None and len(weights) > index else None


def misfit(patch, shape: tuple[int, ...]) -> str | None:
    """Why core could not apply ``patch`` exactly to a weight of ``shape`` (None: it fits). A patch fits when it
    makes a matrix of the weight's rows by the weight's other sides (so a conv's ``[out, in, k, k]`` takes
    ``[out, in·k·k]``), where core would merely reshape whatever has as many numbers, or fail and log."""
    try:
        if type(patch).__name__ in _BLOCK_ADAPTERS:
            blocks = patch.weights[0].shape  # OFT [n, b, b], BOFT [m, n, b, b]: n blocks of b rows
            made, needs = blocks[-3] * blocks[-1], shape[0]
            return None if made == needs else f"its {blocks[-3]} blocks of {blocks[-1]} rows make {made} rows"
        made = _made(patch)
        if made is None:
            return None
        if isinstance(patch, tuple) and tuple(made.shape) != tuple(shape):
            return f"the LoRA makes {list(made.shape)}, the weight is {list(shape)}"
        if made.shape[0] != shape[0] or made[0].numel() != math.prod(shape[1:]):
            return (f"the LoRA makes {[made.shape[0], made[0].numel()]}, the weight is "
                    f"{[shape[0], math.prod(shape[1:])]}")
        dora = _dora_scale(patch)
        if dora is not None:  # DoRA rescales the patched weight by its magnitudes, axis by axis (core's formula)
            norm = (shape[0], *[1] * (len(shape) - 1)) if dora.shape[0] == shape[0] else (1, *shape[1:2],
                                                                                         *[1] * (len(shape) - 2))
            weight = torch.empty(shape, device="meta")
            weight *= dora / torch.empty(norm, device="meta")
    except (RuntimeError, ValueError) as e:
        return f"{e}".split("\n")[0]
    return None


def apply_lora(model, lora: dict[str, torch.Tensor], strength: float, name: str) -> tuple[object, LoraReport]:
    """A clone of ``model`` with ``lora`` patched in at ``strength``, and what was applied. A quantized DiT refuses
    the patches (``host.patchers.WholeModelPatcher.add_patches``); a file with NaN or infinite values is refused."""
    diffusion_model, _ = dit_blocks(model)  # a clear error for a MODEL that is not an ERNIE-Image DiT
    bad = first_non_finite(lora)
    if bad is not None:
        raise ErnieImageError(f"LoRA {name}: {bad} holds NaN or infinite values, which would make a black image. "
                              "The file is damaged (or its training diverged): pick another LoRA.")
    lora = convert_lora(lora)
    mapping = key_map([k for k, _ in diffusion_model.named_parameters()])
    patches = lora_patches(lora, mapping)
    shapes = {f"diffusion_model.{k}": tuple(p.shape) for k, p in diffusion_model.named_parameters()}
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
