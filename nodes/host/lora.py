"""Core's LoRA reading: its key conversions and weight adapters (LoRA, DoRA, LoHa, LoKr, diffs)."""

from __future__ import annotations

import comfy.lora
import comfy.lora_convert
import torch


def convert_lora(lora: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``lora`` with the key layouts core converts (e.g. BFL's) in core's names."""
    return comfy.lora_convert.convert_lora(lora)


def lora_patches(lora: dict[str, torch.Tensor], key_map: dict[str, str]) -> dict:
    """The patches core's adapters read from ``lora`` for the model keys ``key_map`` names (layer → model key)."""
    return comfy.lora.load_lora(lora, key_map, log_missing=False)
