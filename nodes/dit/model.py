"""diffusers' ``ErnieImageTransformer2DModel`` as a real ComfyUI MODEL (the ComfyUI adapter).

Shaped like core's own models and ComfyUI-nunchaku's: a supported-model config (latent format, flow
sampling with shift 4.0), a ``BaseModel`` subclass whose ``diffusion_model`` is the diffusers module behind
a thin forward that speaks ComfyUI's calling convention, and a ``ModelPatcher`` for model management.

Text conditioning keeps each prompt's true length: ``ErnieTextCond`` pads with zeros when ComfyUI batches
cond and uncond, and ``text_lens`` carries the true lengths as host integers (``ErnieTextLengths``), which is
what the forward needs (masked padding, image RoPE positions start after the true text). Core's
``CONDCrossAttn`` would instead repeat the text, which the model would read as a different, longer prompt.
The forward itself is the pack's (``forward.py``): diffusers' math without an all-true attention mask.
"""

from __future__ import annotations

import types

import comfy.conds
import comfy.latent_formats
import comfy.model_base
import comfy.model_management
import comfy.model_patcher
import comfy.patcher_extension
import comfy.supported_models_base
import torch

from ..errors import ErnieImageError
from ..managed import WholeModelPatcher, out_of_memory, place
from .forward import ernie_forward
from .schedule import DEFAULT_SHIFT

# The DiT is loaded whole, so what is left for sampling is the card less its weights (15 GiB in bf16).
SAMPLING_ADVICE = (
    "sampling ran out of GPU memory beside the DiT's weights. Make room: quantize the DiT in its loader "
    "(fp8_per_row halves its weights), bypass ERNIE-Image Cache-DiT (its caches take memory at every step), make the "
    "image smaller, or close other programs that use the GPU."
)


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


class ErnieTextLengths(comfy.conds.CONDConstant):
    """Each prompt's true text length as a list of host integers, batched by concatenation. On the host, so the
    forward can tell without a GPU round trip whether the batch has padding to mask."""

    def __init__(self, lengths: list[int]):
        super().__init__(lengths)

    def process_cond(self, batch_size: int, **kwargs) -> ErnieTextLengths:
        repeats = -(-batch_size // len(self.cond))  # as comfy.utils.repeat_to_batch_size does for tensors
        return ErnieTextLengths((self.cond * repeats)[:batch_size])

    def can_concat(self, other: comfy.conds.CONDConstant) -> bool:
        return True

    def concat(self, others: list[comfy.conds.CONDConstant]) -> list[int]:
        return [n for c in [self, *others] for n in c.cond]

    def size(self) -> list[int]:
        return [len(self.cond)]


class ErnieImageDiffusionModel(torch.nn.Module):
    """The diffusers DiT behind ComfyUI's ``diffusion_model(x, t, context=..., **conds)`` convention."""

    def __init__(self, transformer: torch.nn.Module):
        super().__init__()
        # The pack's forward becomes the module's own: cache-dit wraps ``transformer.forward`` for a cached run,
        # so the forward must be reached through that attribute.
        transformer.forward = types.MethodType(ernie_forward, transformer)
        self.transformer = transformer

    @property
    def dtype(self) -> torch.dtype:
        # diffusers' answer (the first floating-point parameter's dtype; quantized weights report their original
        # one) without its walk over all 558 modules, which ComfyUI's model call paid at every step (0.75 ms).
        return next(p.dtype for p in self.transformer.parameters() if p.is_floating_point())

    def forward(self, x, timestep, context, text_lens, transformer_options={}, **kwargs):
        # diffusers modules never call ComfyUI's per-op interrupt check: do it once per model call.
        comfy.model_management.throw_exception_if_processing_interrupted()
        try:
            return comfy.patcher_extension.WrapperExecutor.new_class_executor(
                self._forward,
                self,
                comfy.patcher_extension.get_all_wrappers(
                    comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, transformer_options
                ),
            ).execute(x, timestep, context, text_lens, transformer_options, **kwargs)
        except torch.OutOfMemoryError as error:
            raise out_of_memory(error, SAMPLING_ADVICE) from error

    def _forward(self, x, timestep, context, text_lens, transformer_options={}, **kwargs):
        expected = self.transformer.config.in_channels
        if x.ndim != 4 or x.shape[1] != expected:
            raise ErnieImageError(
                f"ERNIE-Image needs a {expected}-channel latent (Flux.2 format), got shape {tuple(x.shape)}. "
                "Start from EmptyFlux2LatentImage, or encode images with the ERNIE-Image (Flux.2) VAE."
            )
        # The reference pipeline hands the timestep to the DiT in the model's dtype.
        return self.transformer(x, timestep.to(x.dtype), context, text_lens)


class ErnieImageModel(comfy.model_base.BaseModel):
    """A ComfyUI ``BaseModel`` (flow prediction, Flux.2 latents) around an ERNIE-Image DiT."""

    def __init__(self, model_config: ErnieImageConfig, transformer: torch.nn.Module, device=None):
        super().__init__(model_config, comfy.model_base.ModelType.FLOW, device=device)
        self.diffusion_model = ErnieImageDiffusionModel(transformer)

    def extra_conds(self, **kwargs) -> dict:
        cross_attn = kwargs.get("cross_attn")
        if cross_attn is None:
            raise ErnieImageError("ERNIE-Image needs text conditioning: connect an ErnieImageTextEncode output.")
        needed = self.diffusion_model.transformer.config.text_in_dim
        if cross_attn.shape[-1] != needed:
            raise ErnieImageError(
                f"This conditioning has {cross_attn.shape[-1]}-wide embeddings; ERNIE-Image needs {needed}-wide ones "
                "from its own text encoder (Ministral 3 3B), so the text encoder that made it is another model. "
                "Load ministral-3-3b.safetensors or an ERNIE-Image snapshot with ErnieImageTextEncoderLoader (or "
                "ErnieImageLoader) and encode with ErnieImageTextEncode."
            )
        lengths = [cross_attn.shape[1]] * cross_attn.shape[0]
        return {"c_crossattn": ErnieTextCond(cross_attn), "text_lens": ErnieTextLengths(lengths)}


def make_model_patcher(transformer: torch.nn.Module, shift: float = DEFAULT_SHIFT) -> comfy.model_patcher.ModelPatcher:
    """A ComfyUI MODEL around ``transformer``: placed, offloaded and freed by ComfyUI's model management, always
    whole (``managed.WholeModelPatcher`` says why)."""
    config = ErnieImageConfig(ErnieImageConfig.unet_config)
    config.sampling_settings["shift"] = shift
    load_device = comfy.model_management.get_torch_device()
    offload_device = comfy.model_management.unet_offload_device()
    model = ErnieImageModel(config, place(transformer, offload_device), device=offload_device)
    return WholeModelPatcher(model, load_device=load_device, offload_device=offload_device)
