"""Which layer of the ERNIE-Image DiT each LoRA key names, in every layout found in the wild (engine: no ComfyUI).

The MODEL holds the released keys under ``diffusion_model.`` (``diffusion_model.layers.0.self_attention.to_q``).
Core's key mapping already reaches two layouts: ComfyUI's own (ai-toolkit) and kohya's ``lora_unet_…`` names.
The others name the same layer another way:

| layout | a layer's name in the file |
|---|---|
| ComfyUI / ai-toolkit | ``diffusion_model.layers.0.self_attention.to_q`` (``lora_A`` / ``lora_B``) |
| diffusers PEFT, SimpleTuner | ``transformer.layers.0.self_attention.to_q`` (also ``base_model.model.…``) |
| OneTrainer | ``transformer.layers.0.self_attention.to_q`` (``lora_down`` / ``lora_up`` + ``alpha``) |
| kohya / musubi | ``lora_unet_layers_0_self_attention_to_q`` (``lora_down`` / ``lora_up`` + ``alpha``) |

The suffixes after the name (LoRA's A/B or down/up, alpha, DoRA's scale, LoHa, LoKr) are core's weight adapters'
business: this module only says which model weight each name patches, and counts what a file holds.
"""

from __future__ import annotations

import re

PREFIXES = ("diffusion_model.", "transformer.", "base_model.model.", "base_model.model.transformer.")
UNDERSCORE_PREFIXES = ("lora_unet_", "lora_transformer_")
TEXT_ENCODER_PREFIXES = ("text_encoder.", "text_encoders.", "lora_te", "te.", "te1.", "te2.", "cond_stage_model.")
# A key's layer name is what comes before the first of these parts (core's adapters read the rest).
_SUFFIX = re.compile(
    r"\.(lora_[A-Za-z]+|lora|alpha|dora_scale|hada_\w+|lokr_\w+|diff|diff_b|w_norm|b_norm|lora_linear_layer)(\.|$)"
    r"|_lora\.(up|down)\."
)
_FOREIGN = (  # (a part of a layer name, the model family it belongs to), most telling first
    ("double_blocks", "Flux"), ("single_transformer_blocks", "Flux (diffusers)"), ("joint_blocks", "SD3"),
    ("input_blocks", "Stable Diffusion 1.x / SDXL"), ("down_blocks", "Stable Diffusion 1.x / SDXL"),
    ("transformer_blocks", "another diffusion transformer (SD3, Flux, Qwen-Image, …)"),
    ("blocks.", "another diffusion transformer (Wan, HunyuanVideo, …)"),
)


def layer_name(key: str) -> str:
    """The layer a LoRA file's key belongs to (``transformer.layers.0.attn.to_q.lora_A.weight`` →
    ``transformer.layers.0.attn.to_q``)."""
    match = _SUFFIX.search(key)
    return key[: match.start()] if match else key


def layer_names(keys: list[str]) -> set[str]:
    """The layer names of a LoRA file's keys (each layer has several keys: A and B, alpha, …)."""
    return {layer_name(key) for key in keys}


def key_map(model_weight_keys: list[str]) -> dict[str, str]:
    """Every layer name a LoRA may use for each of the DiT's weights → the MODEL's key of that weight.

    ``model_weight_keys`` are the DiT's parameter names (``layers.0.self_attention.to_q.weight``)."""
    mapping = {}
    for key in model_weight_keys:
        if not key.endswith(".weight"):
            continue
        layer = key[: -len(".weight")]
        target = f"diffusion_model.{key}"
        for prefix in PREFIXES:
            mapping[prefix + layer] = target
        for prefix in UNDERSCORE_PREFIXES:
            mapping[prefix + layer.replace(".", "_")] = target
    return mapping


def is_text_encoder(name: str) -> bool:
    return name.startswith(TEXT_ENCODER_PREFIXES)


def made_for(names: set[str]) -> str | None:
    """The model family a LoRA's layer names suggest, or None when they say nothing telling."""
    for part, family in _FOREIGN:
        if any(part in name for name in names):
            return family
    return None
