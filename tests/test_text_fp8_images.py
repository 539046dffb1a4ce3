"""Turbo images with the text encoder in fp8 change no more than the DiT's own fp8 storage already changes them: the
same prompt, seed and tiny models through a running ComfyUI (CPU), each against the all-bf16 image."""

from __future__ import annotations

import numpy as np
from PIL import Image

from helpers.workflows import text_to_image

PROMPT = "a red cat sits on a blue mat, watercolor"


def _image(server, seed: int, prefix: str, **loader_inputs) -> np.ndarray:
    graph = text_to_image(snapshot="ERNIE-Image-Turbo-tiny", prompt=PROMPT, steps=4, seed=seed, prefix=prefix)
    graph["loader"]["inputs"].update(loader_inputs)
    result = server.run(graph)
    assert result.status == "success", result.messages
    (path,) = server.output_images(result)
    return np.asarray(Image.open(path).convert("RGB"), dtype=np.float64)


def test_the_fp8_text_encoder_moves_the_image_less_than_the_dits_fp8(comfy_server):
    for seed in (3, 4):
        reference = _image(comfy_server, seed, f"te_ref_{seed}")
        text_fp8 = _image(comfy_server, seed, f"te_fp8_{seed}", text_encoder_weight_dtype="fp8_e4m3fn")
        dit_fp8 = _image(comfy_server, seed, f"dit_fp8_{seed}", weight_dtype="fp8_e4m3fn")
        text_error, dit_error = (float(np.abs(image - reference).mean()) for image in (text_fp8, dit_fp8))
        print(f"seed {seed}: mean |Δ| (0–255) vs bf16: text encoder fp8 {text_error:.2f}, DiT fp8 {dit_error:.2f}")
        assert 0 < text_error <= dit_error
