"""Models loaded by core's own patcher and ``LoadedModel`` on the CPU device, listed as core lists loaded models:
what the GPU-only counts of loaded models (the plan's, the GPU check's) read, on a machine without a GPU. The
tests' ``loaded_models`` fixture (conftest.py) gives each test core's list, empty."""

from __future__ import annotations

import comfy.model_management as mm
import comfy.model_patcher
import torch

CPU = torch.device("cpu")


def hold(module: torch.nn.Module, loaded_models: list) -> comfy.model_patcher.ModelPatcher:
    """``module`` loaded on the CPU device by core's own patcher and ``LoadedModel``, listed as core lists them."""
    patcher = comfy.model_patcher.ModelPatcher(module, load_device=CPU, offload_device=CPU)
    loaded = mm.LoadedModel(patcher)
    loaded.model_load()
    loaded_models.insert(0, loaded)
    return patcher
