"""Parity: the pack's graph in a real headless ComfyUI equals diffusers' ErnieImagePipeline.

Same tiny random model (HF snapshot layout), same prompts and initial noise; float32 on the CPU.
SaveImage quantises to 8 bits, so "equal" means within one 8-bit level everywhere.
"""

from __future__ import annotations

import numpy as np
import pytest

from helpers.reference import max_level_difference, reference_image, saved_image
from helpers.workflows import text_to_image

SNAPSHOT = "ERNIE-Image-Turbo-tiny"
PROMPT = "a red cat sits on a blue mat under the moon"
NEGATIVE = "dark"  # shorter than the prompt: cond and uncond batch with padding


def _run(server, **kwargs):
    result = server.run(text_to_image(snapshot=SNAPSHOT, **kwargs))
    assert result.status == "success", result.messages
    (path,) = server.output_images(result)
    return saved_image(path)


CASES = {
    "turbo_cfg1_square": dict(width=128, height=128, steps=4, cfg=1.0, seed=11, negative=""),
    "base_cfg4_negative_nonsquare": dict(width=176, height=112, steps=5, cfg=4.0, seed=12, negative=NEGATIVE),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
@pytest.mark.parametrize("sampler", ["custom", "ksampler"])
def test_graph_matches_diffusers_pipeline(comfy_server, tiny_models, case, sampler):
    settings = dict(CASES[case])
    if sampler == "ksampler":
        settings["steps"] = 4  # core's "simple" schedule equals the reference when the steps divide 1000
    image = _run(comfy_server, prompt=PROMPT, sampler=sampler, prefix=f"{case}_{sampler}", **settings)
    reference = reference_image(tiny_models["snapshot"], prompt=PROMPT, **settings)

    assert image.shape == (settings["height"], settings["width"], 3)
    assert image.std() > 5.0, "a flat image proves nothing"
    assert max_level_difference(image, reference) <= 1.0


def test_single_file_dit_gives_the_same_image(comfy_server):
    settings = dict(width=128, height=128, steps=3, cfg=4.0, seed=5, negative=NEGATIVE, prompt=PROMPT)
    from_snapshot = _run(comfy_server, prefix="snapshot_dit", **settings)
    from_file = _run(comfy_server, prefix="file_dit", dit_file="ernie-image-turbo-tiny.safetensors", **settings)
    assert np.abs(from_snapshot - from_file).max() <= 1.0


def test_single_files_give_the_snapshot_image(comfy_server, tiny_models):
    """The ComfyUI-repack layout: DiT, text encoder (tokenizer inside) and VAE each as one file."""
    settings = dict(width=128, height=128, steps=3, cfg=4.0, seed=8, negative=NEGATIVE, prompt=PROMPT)
    from_snapshot = _run(comfy_server, prefix="snapshot_parts", **settings)
    graph = text_to_image(snapshot=SNAPSHOT, dit_file=tiny_models["single_file"].name, prefix="single_files",
                          **settings)
    del graph["loader"]
    graph["te"] = {"class_type": "ErnieImageTextEncoderLoader",
                   "inputs": {"model_name": "text_encoders/" + tiny_models["text_encoder_file"].name}}
    graph["vae"] = {"class_type": "ErnieImageVAELoader", "inputs": {"vae_name": tiny_models["vae_file"].name}}
    for key in ("positive", "negative"):
        graph[key]["inputs"]["text_encoder"] = ["te", 0]
    graph["decode"]["inputs"]["vae"] = ["vae", 0]
    result = comfy_server.run(graph)
    assert result.status == "success", result.messages
    (path,) = comfy_server.output_images(result)
    assert np.abs(saved_image(path) - from_snapshot).max() <= 1.0
