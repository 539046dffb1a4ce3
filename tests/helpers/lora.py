"""Tiny LoRA files in the layouts found in the wild, and the same deltas merged into the tiny DiT's weights."""

from __future__ import annotations

from collections.abc import Callable

import torch

from helpers.accel import tiny_patcher

RANK = 4
LAYERS = ("layers.0.self_attention.to_q", "layers.3.mlp.up_proj", "layers.5.self_attention.to_out.0")
OTHER_LAYERS = ("layers.1.mlp.linear_fc2", "layers.2.self_attention.to_v")
LAYOUTS = ("ai-toolkit", "peft", "peft-base-model", "onetrainer", "kohya")
ALPHA = {"onetrainer": 8.0, "kohya": 2.0}  # OneTrainer and kohya write alpha; scale = alpha / rank
BLOCK_LINEARS = {"self_attention.to_q": (64, 64), "self_attention.to_k": (64, 64), "self_attention.to_v": (64, 64),
                 "self_attention.to_out.0": (64, 64), "mlp.gate_proj": (128, 64), "mlp.up_proj": (128, 64),
                 "mlp.linear_fc2": (64, 128)}  # the tiny DiT's 7 linear layers in each of its 10 blocks


def deltas(layers: tuple[str, ...], seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(down [rank, in], up [out, rank]) per layer of the tiny DiT (64 wide, MLP 128)."""
    generator = torch.Generator().manual_seed(seed)
    shapes = {"to_q": (64, 64), "to_v": (64, 64), "to_out.0": (64, 64), "up_proj": (128, 64), "linear_fc2": (64, 128)}
    out = {}
    for layer in layers:
        rows, cols = next(shape for name, shape in shapes.items() if layer.endswith(name))
        out[layer] = (torch.randn(RANK, cols, generator=generator) * 0.6,
                      torch.randn(rows, RANK, generator=generator) * 0.6)
    return out


def lora_file(layout: str, lora: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The tensors of a LoRA file in ``layout``'s key pattern."""
    tensors = {}
    for layer, (down, up) in lora.items():
        if layout == "kohya":
            name, a, b = "lora_unet_" + layer.replace(".", "_"), "lora_down", "lora_up"
        else:
            prefix = {"ai-toolkit": "diffusion_model.", "peft": "transformer.", "peft-base-model": "base_model.model.",
                      "onetrainer": "transformer."}[layout]
            name = prefix + layer
            a, b = ("lora_down", "lora_up") if layout == "onetrainer" else ("lora_A", "lora_B")
        tensors[f"{name}.{a}.weight"], tensors[f"{name}.{b}.weight"] = down, up
        if layout in ALPHA:
            tensors[f"{name}.alpha"] = torch.tensor(ALPHA[layout])
    return tensors


def rewrite(patcher, changes: dict[str, Callable[[torch.Tensor], torch.Tensor]]):
    """``patcher`` with each named layer's weight replaced, in place, by ``change(weight)``."""
    parameters = dict(patcher.model.diffusion_model.named_parameters())
    with torch.no_grad():
        for layer, change in changes.items():
            parameters[f"{layer}.weight"].copy_(change(parameters[f"{layer}.weight"].clone()))
    return patcher


def merged(snapshot, *loras: tuple[dict, float, float]):
    """The tiny DiT with each (deltas, strength, scale) merged into its weights."""
    patcher = tiny_patcher(snapshot)
    for lora, strength, scale in loras:
        rewrite(patcher, {layer: lambda w, d=up @ down, k=strength * scale: w + k * d
                          for layer, (down, up) in lora.items()})
    return patcher
