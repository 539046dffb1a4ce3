"""The pack's DiT as a ComfyUI-native model: core's ModelPatcher, partial loading, core's LoRA key mapping."""

from __future__ import annotations

import comfy.lora
import comfy.model_patcher
import torch

from comfyui_ernie_image.nodes.dit.build import load_dit
from comfyui_ernie_image.nodes.dit.model import make_model_patcher
from helpers.accel import predict, tiny_patcher

CPU = torch.device("cpu")


def test_the_model_is_cores_own_patcher_and_loads_in_part(tiny_models):
    """A card too small for the whole DiT: core keeps part of the layers off the load device and casts them per call
    (here both devices are the CPU, so the cast path runs without a move); the prediction does not change."""
    whole, part = tiny_patcher(tiny_models["snapshot"]), tiny_patcher(tiny_models["snapshot"])
    assert type(whole) is comfy.model_patcher.ModelPatcher and type(part) is comfy.model_patcher.ModelPatcher
    whole.load(CPU, full_load=True)
    part.load(CPU, lowvram_model_memory=part.model_size() // 3)
    cast = [m for m in part.model.diffusion_model.modules() if getattr(m, "comfy_cast_weights", False)]
    assert 0 < len(cast) < len([m for m in part.model.diffusion_model.modules() if hasattr(m, "comfy_cast_weights")])
    torch.testing.assert_close(predict(part), predict(whole), rtol=1e-5, atol=1e-6)


def test_cores_lora_key_mapping_reaches_every_released_weight(tiny_models):
    """The MODEL holds the released keys under ``diffusion_model.``: core's LoRA loaders map both ComfyUI's
    (``diffusion_model.layers.0.…``) and kohya's (``lora_unet_layers_0_…``) names onto them."""
    patcher = make_model_patcher(load_dit(tiny_models["snapshot"], torch.float32))
    key_map = comfy.lora.model_lora_keys_unet(patcher.model, {})
    target = "diffusion_model.layers.0.self_attention.to_q.weight"
    assert target in patcher.model.state_dict()
    assert key_map["diffusion_model.layers.0.self_attention.to_q"] == target
    assert key_map["lora_unet_layers_0_self_attention_to_q"] == target
