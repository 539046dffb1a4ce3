"""The loader's VAE tells ComfyUI what a decode needs (``nodes/dit/vae.decode_memory``), not core's 4.25 GiB at
1024², so that a resident DiT and text encoder are not pushed off a 16 or 24 GB card for every decode."""

from __future__ import annotations

import comfy.model_management
import torch

from comfyui_ernie_image.nodes.dit.vae import DECODE_BYTES_1024_BF16, decode_memory, load_vae

GIB = 2**30


def test_the_estimate_is_the_measured_decode_scaled_by_pixels_and_dtype():
    at_1024 = decode_memory((1, 128, 64, 64), torch.bfloat16)
    assert at_1024 == DECODE_BYTES_1024_BF16
    assert 1.25 * GIB < at_1024 < 2 * GIB  # above the activations' 1.25 GiB, well below core's 4.25 GiB
    assert decode_memory((1, 128, 128, 128), torch.bfloat16) == 4 * at_1024  # 2048²
    assert decode_memory((1, 128, 64, 64), torch.float32) == 2 * at_1024
    assert decode_memory((1, 128, 48, 80), torch.bfloat16) == int(at_1024 * 48 * 80 / 64**2)
    assert decode_memory((4, 128, 64, 64), torch.bfloat16) == at_1024  # per image, as core's estimates are


def test_core_decodes_with_the_packs_estimate(tiny_models, monkeypatch):
    """A spy on core's ``load_models_gpu`` (it still runs): VAE.decode asks it for room by the VAE's estimate."""
    vae = load_vae(tiny_models["vae_file"])
    asked = []
    real = comfy.model_management.load_models_gpu

    def spy(models, memory_required=0, *args, **kwargs):
        asked.append(memory_required)
        return real(models, memory_required, *args, **kwargs)

    monkeypatch.setattr(comfy.model_management, "load_models_gpu", spy)
    latent = torch.randn(1, vae.latent_channels, 4, 4)
    with torch.inference_mode():
        image = vae.decode(latent)
    assert image.shape[1:3] == (4 * vae.upscale_ratio, 4 * vae.upscale_ratio)
    assert asked == [decode_memory(latent.shape, vae.vae_dtype)]
    core_estimate = 2178 * 64 * 64 * 64 * 2 * 4.0  # core 0.3.75's for this VAE at 1024² in bf16 (comfy/sd.py)
    assert decode_memory((1, 128, 64, 64), torch.bfloat16) < core_estimate / 2

