"""The core classes the DiT's MODEL is made of, the MODEL's patcher, and where a MODEL holds the DiT's blocks
(for every feature that patches them: LoRA, Cache-DiT, compile), on the running core.

Where the core has native ERNIE-Image (``comfy.model_base.ErnieImage``, ComfyUI >= 0.19), the pack's model is
one too: core's LoRA mapping adds diffusers' ``transformer.*`` names for that class (comfy/lora.py @17358c8f), and
packs that support ERNIE-Image recognise it by that class. The pack's own sampling (shift 4.0, the text mask,
its conds) stays, since the pack's class comes first.
"""

from __future__ import annotations

import functools

import comfy.conds
import comfy.latent_formats
import comfy.model_base
import comfy.model_management as mm
import comfy.supported_models_base
import torch

from ..errors import ErnieImageError
from . import host_copy
from .patchers import place

BaseModel = comfy.model_base.BaseModel
FLOW = comfy.model_base.ModelType.FLOW
SupportedModel = comfy.supported_models_base.BASE
Flux2LatentFormat = comfy.latent_formats.Flux2
CONDRegular = comfy.conds.CONDRegular
CONDConstant = comfy.conds.CONDConstant


@functools.cache
def _on_base(model_class: type, base: type) -> type:
    return type(model_class.__name__, (model_class, base), {"__module__": model_class.__module__})


def on_core_ernie_base(model_class: type) -> type:
    """``model_class`` (a BaseModel) as a subclass of core's native ``ErnieImage`` too, where the core has it."""
    native = getattr(comfy.model_base, "ErnieImage", None)
    return model_class if native is None else _on_base(model_class, native)


def model_patcher(model_class: type, config: SupportedModel, diffusion_model: torch.nn.Module, patcher_class: type):
    """A MODEL: ``model_class(config, diffusion_model)`` on ComfyUI's offload device, managed by ``patcher_class``
    (``patchers.dit_patcher_class`` or ``WholeModelPatcher``)."""
    load_device, offload_device = mm.get_torch_device(), mm.unet_offload_device()
    model = on_core_ernie_base(model_class)(config, place(diffusion_model, offload_device), device=offload_device)
    archive = getattr(mm, "archive_model_dtypes", None)
    if archive is not None:  # current cores: the dtypes dynamic VRAM casts each weight back to (core's models do so)
        archive(model.diffusion_model)
    return host_copy.track(patcher_class(model, load_device=load_device, offload_device=offload_device))


def dit_blocks(model) -> tuple[torch.nn.Module, str]:
    """The module that holds the DiT's repeated blocks, and the attribute they are in: ``diffusion_model.layers``,
    for this pack's MODEL and for ComfyUI's native ERNIE-Image alike."""
    diffusion_model = getattr(model.model, "diffusion_model", None)
    if isinstance(getattr(diffusion_model, "layers", None), torch.nn.ModuleList) and len(diffusion_model.layers) > 0:
        return diffusion_model, "layers"
    raise ErnieImageError(
        f"This MODEL ({type(model.model).__name__}) is not an ERNIE-Image DiT: its diffusion model has no "
        "'layers' block list. Connect the MODEL of an ERNIE-Image loader (or ComfyUI's native ERNIE-Image)."
    )
