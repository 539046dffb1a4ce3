"""The tiny DiT's weights in the quantized file layouts users download (safetensors, written by the tests)."""

from __future__ import annotations

import json

import torch

FP8_MAX = 448.0  # float8_e4m3fn's largest value


def _block_linear(key: str, value: torch.Tensor, prefix: str = "layers.") -> bool:
    """A 2-D weight of a block: the DiT's under ``layers.``, a Ministral file's decoder layers under another
    ``prefix`` (their norms are 1-D)."""
    return key.startswith(prefix) and key.endswith(".weight") and value.ndim == 2


def _fp8_and_scale(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = weight.abs().max().float() / FP8_MAX
    return (weight / scale).to(torch.float8_e4m3fn), scale


def scaled_fp8(source: dict[str, torch.Tensor], prefix: str = "layers.") -> dict[str, torch.Tensor]:
    """The community's scaled fp8 layout: each block linear weight as fp8 of weight / scale, its fp32
    ``scale_weight`` beside it (scaled to fp8's range), and the ``scaled_fp8`` marker."""
    scaled = {"scaled_fp8": torch.empty(0, dtype=torch.float8_e4m3fn)}
    for k, v in source.items():
        if _block_linear(k, v, prefix):
            scaled[k], scaled[k[: -len("weight")] + "scale_weight"] = _fp8_and_scale(v)
        else:
            scaled[k] = v
    return scaled


def comfy_quant_layers(source: dict[str, torch.Tensor],
                       prefix: str = "layers.") -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """ComfyUI's mixed-precision fp8 layout without its configurations: each block linear weight in fp8 with its
    ``weight_scale``; and the configurations by layer name."""
    tensors, layers = {}, {}
    for k, v in source.items():
        if _block_linear(k, v, prefix):
            layer = k[: -len(".weight")]
            tensors[k], tensors[f"{layer}.weight_scale"] = _fp8_and_scale(v)
            layers[layer] = {"format": "float8_e4m3fn"}
        else:
            tensors[k] = v
    return tensors, layers


def config_tensor(conf: dict) -> torch.Tensor:
    return torch.tensor(list(json.dumps(conf).encode()), dtype=torch.uint8)


def comfy_quant_fp8(source: dict[str, torch.Tensor], prefix: str = "layers.") -> dict[str, torch.Tensor]:
    """Current cores' form: a ``<layer>.comfy_quant`` JSON tensor per quantized layer (comfy/ops.py @0271a469)."""
    tensors, layers = comfy_quant_layers(source, prefix)
    tensors.update({f"{layer}.comfy_quant": config_tensor(conf) for layer, conf in layers.items()})
    return tensors


def header_fp8(source: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """0.3.75's form: the configurations in the ``_quantization_metadata`` header (comfy/model_detection.py)."""
    tensors, layers = comfy_quant_layers(source)
    return tensors, {"_quantization_metadata": json.dumps({"format_version": "1.0", "layers": layers})}


def nvfp4(source: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The NVFP4 comfy_quant layout: two 4-bit values per byte, fp8 scales per 16 values and a global scale."""
    tensors = {}
    for k, v in source.items():
        if _block_linear(k, v):
            layer, (rows, cols) = k[: -len(".weight")], v.shape
            tensors[k] = torch.zeros(rows, cols // 2, dtype=torch.uint8)
            tensors[f"{layer}.weight_scale"] = torch.ones(rows, cols // 16).to(torch.float8_e4m3fn)
            tensors[f"{layer}.weight_scale_2"] = torch.tensor(1.0)
            tensors[f"{layer}.comfy_quant"] = config_tensor({"format": "nvfp4"})
        else:
            tensors[k] = v
    return tensors
