"""diffusers' ``ErnieImageTransformer2DModel`` as a real ComfyUI MODEL (the ComfyUI adapter).

Shaped like core's own models and ComfyUI-nunchaku's: a supported-model config (latent format, flow
sampling with shift 4.0), a ``BaseModel`` subclass whose ``diffusion_model`` is the diffusers module behind
a thin forward that speaks ComfyUI's calling convention, and a ``ModelPatcher`` for model management.

Text conditioning keeps each prompt's true length: ``ErnieTextCond`` pads with zeros when ComfyUI batches
cond and uncond, and ``text_lens`` carries the true lengths, which is what diffusers' forward expects
(masked padding, image RoPE positions start after the true text). Core's ``CONDCrossAttn`` would instead
repeat the text, which the model would read as a different, longer prompt.
"""

from __future__ import annotations

import comfy.conds
import comfy.latent_formats
import comfy.model_base
import comfy.model_management
import comfy.model_patcher
import comfy.patcher_extension
import comfy.supported_models_base
import torch

from ..errors import ErnieImageError
from .patcher import ErnieModelPatcher
from .schedule import DEFAULT_SHIFT


class ErnieImageConfig(comfy.supported_models_base.BASE):
    """What ComfyUI needs to know about the model besides its weights."""

    unet_config = {"disable_unet_model_creation": True}  # the DiT comes built from diffusers
    unet_extra_config = {}
    latent_format = comfy.latent_formats.Flux2  # 128 channels at H/16 x W/16, BN-normalised, as diffusers'
    sampling_settings = {"shift": DEFAULT_SHIFT, "multiplier": 1000}
    supported_inference_dtypes = [torch.bfloat16, torch.float32]
    memory_usage_factor = 2.8  # activation memory per latent pixel, like core's Flux (same width class)


class ErnieTextCond(comfy.conds.CONDRegular):
    """Text embeddings ``[B, T, D]`` that batch with other lengths by zero padding (masked via ``text_lens``)."""

    def can_concat(self, other: comfy.conds.CONDRegular) -> bool:
        a, b = self.cond.shape, other.cond.shape
        return a[0] == b[0] and a[2] == b[2] and self.cond.device == other.cond.device

    def concat(self, others: list[comfy.conds.CONDRegular]) -> torch.Tensor:
        conds = [self.cond] + [o.cond for o in others]
        longest = max(c.shape[1] for c in conds)
        return torch.cat([torch.nn.functional.pad(c, (0, 0, 0, longest - c.shape[1])) for c in conds])


class ErnieImageDiffusionModel(torch.nn.Module):
    """The diffusers DiT behind ComfyUI's ``diffusion_model(x, t, context=..., **conds)`` convention."""

    def __init__(self, transformer: torch.nn.Module):
        super().__init__()
        self.transformer = transformer

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.dtype

    def forward(self, x, timestep, context, text_lens, transformer_options={}, **kwargs):
        # diffusers modules never call ComfyUI's per-op interrupt check: do it once per model call.
        comfy.model_management.throw_exception_if_processing_interrupted()
        return comfy.patcher_extension.WrapperExecutor.new_class_executor(
            self._forward,
            self,
            comfy.patcher_extension.get_all_wrappers(
                comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, transformer_options
            ),
        ).execute(x, timestep, context, text_lens, transformer_options, **kwargs)

    def _forward(self, x, timestep, context, text_lens, transformer_options={}, **kwargs):
        expected = self.transformer.config.in_channels
        if x.ndim != 4 or x.shape[1] != expected:
            raise ErnieImageError(
                f"ERNIE-Image needs a {expected}-channel latent (Flux.2 format), got shape {tuple(x.shape)}. "
                "Start from EmptyFlux2LatentImage, or encode images with the ERNIE-Image (Flux.2) VAE."
            )
        # The reference pipeline hands the timestep to the DiT in the model's dtype.
        return self.transformer(
            hidden_states=x,
            timestep=timestep.to(x.dtype),
            text_bth=context,
            text_lens=text_lens,
            return_dict=False,
        )[0]


class ErnieImageModel(comfy.model_base.BaseModel):
    """A ComfyUI ``BaseModel`` (flow prediction, Flux.2 latents) around an ERNIE-Image DiT."""

    def __init__(self, model_config: ErnieImageConfig, transformer: torch.nn.Module, device=None):
        super().__init__(model_config, comfy.model_base.ModelType.FLOW, device=device)
        self.diffusion_model = ErnieImageDiffusionModel(transformer)

    def extra_conds(self, **kwargs) -> dict:
        cross_attn = kwargs.get("cross_attn")
        if cross_attn is None:
            raise ErnieImageError("ERNIE-Image needs text conditioning: connect an ErnieImageTextEncode output.")
        if cross_attn.shape[-1] != self.diffusion_model.transformer.config.text_in_dim:
            raise ErnieImageError(
                f"This conditioning has {cross_attn.shape[-1]}-wide embeddings; ERNIE-Image needs "
                f"{self.diffusion_model.transformer.config.text_in_dim}. Encode the prompt with ErnieImageTextEncode."
            )
        lengths = torch.full((cross_attn.shape[0],), cross_attn.shape[1], dtype=torch.long)
        return {"c_crossattn": ErnieTextCond(cross_attn), "text_lens": comfy.conds.CONDRegular(lengths)}


def make_model_patcher(transformer: torch.nn.Module, shift: float = DEFAULT_SHIFT) -> comfy.model_patcher.ModelPatcher:
    """A ComfyUI MODEL around ``transformer``: placed, offloaded and freed by ComfyUI's model management, always
    whole (``patcher.ErnieModelPatcher`` says why)."""
    config = ErnieImageConfig(ErnieImageConfig.unet_config)
    config.sampling_settings["shift"] = shift
    load_device = comfy.model_management.get_torch_device()
    offload_device = comfy.model_management.unet_offload_device()
    model = ErnieImageModel(config, transformer.to(offload_device), device=offload_device)
    return ErnieModelPatcher(model, load_device=load_device, offload_device=offload_device)
