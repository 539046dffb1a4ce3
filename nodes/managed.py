"""Hand foreign (transformers / diffusers) modules to ComfyUI's model management."""

from __future__ import annotations

import comfy.model_management
import comfy.model_patcher
import torch


class ManagedModule(torch.nn.Module):
    """A plain container: ModelPatcher writes ``.device`` and bookkeeping attributes onto the module it manages,
    which transformers' models do not allow (their ``device`` is a read-only property)."""

    def __init__(self, module: torch.nn.Module, device: torch.device):
        super().__init__()
        self.module = module
        self.device = device


def text_model_dtype(device: torch.device) -> torch.dtype:
    """bf16 where the GPU runs it well (the released weights' dtype), float32 elsewhere (CPU, old GPUs)."""
    if comfy.model_management.is_device_cuda(device) and comfy.model_management.should_use_bf16(device):
        return torch.bfloat16
    return torch.float32


def text_model_patcher(module: torch.nn.Module) -> comfy.model_patcher.ModelPatcher:
    """A ModelPatcher that keeps ``module`` where ComfyUI keeps text encoders and loads it on demand."""
    load_device = comfy.model_management.text_encoder_device()
    offload_device = comfy.model_management.text_encoder_offload_device()
    container = ManagedModule(module.to(offload_device), offload_device)
    return comfy.model_patcher.ModelPatcher(container, load_device=load_device, offload_device=offload_device)
