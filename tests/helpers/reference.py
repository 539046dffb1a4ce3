"""The diffusers reference: ``ErnieImagePipeline`` on the same snapshot, noise and prompts as ComfyUI."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image


def comfy_noise(seed: int, width: int, height: int) -> torch.Tensor:
    """The initial noise ComfyUI draws for a 1-image Flux.2 latent (``comfy.sample.prepare_noise``)."""
    return torch.randn((1, 128, height // 16, width // 16), generator=torch.manual_seed(seed), device="cpu")


def reference_image(
    snapshot: Path, *, prompt: str, negative: str, width: int, height: int, steps: int, cfg: float, seed: int,
    lora: Path | None = None,
) -> np.ndarray:
    """``[H, W, 3]`` float image in [0, 1] from diffusers' pipeline (no PE), float32 on the CPU; ``lora`` is loaded
    with diffusers' own ``load_lora_weights``."""
    from diffusers import ErnieImagePipeline

    pipe = ErnieImagePipeline.from_pretrained(snapshot, dtype=torch.float32)
    if lora is not None:
        pipe.load_lora_weights(str(lora.parent), weight_name=lora.name)
    result = pipe(
        prompt=prompt, negative_prompt=negative, width=width, height=height, num_inference_steps=steps,
        guidance_scale=cfg, latents=comfy_noise(seed, width, height), output_type="np", use_pe=False,
    )
    return result.images[0]


def saved_image(path: Path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB"), dtype=np.float64)


def max_level_difference(png: np.ndarray, reference: np.ndarray) -> float:
    """Largest difference in 8-bit levels between a saved PNG and the float reference quantised the way
    SaveImage quantises (``uint8(clip(255 * x))``, a floor)."""
    expected = np.floor(np.clip(reference * 255.0, 0, 255))
    return float(np.abs(png - expected).max())
