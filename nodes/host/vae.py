"""Core's VAE (``comfy.sd.VAE``): it recognises the Flux.2 VAE that ERNIE-Image uses from its weights."""

from __future__ import annotations

import comfy.sd
import torch


def core_vae(state_dict: dict[str, torch.Tensor]) -> comfy.sd.VAE:
    """Core's VAE for these weights (diffusers' or ComfyUI's keys)."""
    return comfy.sd.VAE(sd=state_dict)
