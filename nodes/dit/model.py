"""The pack's ERNIE-Image DiT (``dit.py``) as a real ComfyUI MODEL (the ComfyUI adapter).

Shaped like core's own models: a supported-model config (latent format, flow sampling with shift 4.0), a
``BaseModel`` subclass whose ``diffusion_model`` is the DiT built from ``comfy.ops`` layers behind ComfyUI's
calling convention, and core's ``ModelPatcher`` for model management (partial loading, LoRA patches by key:
``diffusion_model.`` + the released keys).

Text conditioning keeps each prompt's true length: ``ErnieTextCond`` pads with zeros when ComfyUI batches
cond and uncond, and ``text_lens`` carries the true lengths as host integers (``ErnieTextLengths``), which is
what the forward needs (masked padding, image RoPE positions start after the true text). Core's
``CONDCrossAttn`` would instead repeat the text, which the model would read as a different, longer prompt.
"""

from __future__ import annotations

import weakref

import torch

from ..errors import ErnieImageError
from ..host.gguf_layers import GGUFModelPatcher
from ..host.memory import allocated_memory, make_room_beside
from ..host.model import FLOW, BaseModel, CONDConstant, CONDRegular, Flux2LatentFormat, SupportedModel, model_patcher
from ..host.oom import sampling_advice
from ..host.patchers import WholeModelPatcher, dit_patcher_class, out_of_memory
from ..host.sampling import run_diffusion_model
from ..host.sizes import module_bytes, tensor_bytes
from ..memory_advice import DIT, PackModel, dtype_name, one_byte_saving, q4_k_m_bytes
from ..plan import session
from .attention import say_unapplied_patches
from .dit import ErnieImageDiT
from .precision import Precision
from .schedule import DEFAULT_SHIFT

# The sampling runs whose first step was checked, by core's ``sample_sigmas`` (a new tensor per run): held weakly and
# outside the module, which a run must leave as it found it. Keyed by id: a tensor compares by its values.
_CHECKED_RUNS: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
PIXELS_PER_LATENT = 16  # Flux.2 latents: one latent pixel per 16 x 16 image pixels (EmptyFlux2LatentImage's step)


class ErnieImageConfig(SupportedModel):
    """What ComfyUI needs to know about the model besides its weights."""

    unet_config = {"disable_unet_model_creation": True}  # the loader builds the DiT (build.py)
    unet_extra_config = {}
    latent_format = Flux2LatentFormat  # 128 channels at H/16 x W/16, BN-normalised, as diffusers'
    sampling_settings = {"shift": DEFAULT_SHIFT, "multiplier": 1000}
    supported_inference_dtypes = [torch.bfloat16, torch.float32]
    # Activation memory per latent pixel, in core's formula. ComfyUI batches cond and uncond only where 1.5x this
    # estimate is free. Core's Flux value (2.8) said 0.45 GiB for a CFG step at 1024², where the DiT peaked at
    # up to 0.73 GiB above its loaded weights (H200, emulated 16 GB card); beside a partly loaded DiT ComfyUI batched
    # them and, with Cache-DiT's stores on top, ran out of memory. With 6.0 (0.96 GiB) it runs them apart there, and
    # the run completes (bench/RESULTS.md, 2026-12-01 session 9).
    memory_usage_factor = 6.0


class ErnieTextCond(CONDRegular):
    """Text embeddings ``[B, T, D]`` that batch with other lengths by zero padding (masked via ``text_lens``)."""

    def can_concat(self, other: CONDRegular) -> bool:
        a, b = self.cond.shape, other.cond.shape
        return a[0] == b[0] and a[2] == b[2] and self.cond.device == other.cond.device

    def concat(self, others: list[CONDRegular]) -> torch.Tensor:
        conds = [self.cond] + [o.cond for o in others]
        longest = max(c.shape[1] for c in conds)
        return torch.cat([torch.nn.functional.pad(c, (0, 0, 0, longest - c.shape[1])) for c in conds])


class ErnieTextLengths(CONDConstant):
    """Each prompt's true text length as a list of host integers, batched by concatenation. On the host, so the
    forward can tell without a GPU round trip whether the batch has padding to mask."""

    def __init__(self, lengths: list[int]):
        super().__init__(lengths)

    def process_cond(self, batch_size: int, **kwargs) -> ErnieTextLengths:
        repeats = -(-batch_size // len(self.cond))  # as comfy.utils.repeat_to_batch_size does for tensors
        return ErnieTextLengths((self.cond * repeats)[:batch_size])

    def can_concat(self, other: CONDConstant) -> bool:
        return True

    def concat(self, others: list[CONDConstant]) -> list[int]:
        return [n for c in [self, *others] for n in c.cond]

    def size(self) -> list[int]:
        return [len(self.cond)]


class ErnieImageDiffusionModel(ErnieImageDiT):
    """The pack's DiT behind ComfyUI's ``diffusion_model(x, t, context=..., **conds)`` convention, with core's
    diffusion-model wrappers, a check of the latent, and out-of-memory advice."""

    precision: Precision  # its dtypes, as build.py resolved them
    # What the loader chose and could choose (loaders.py sets them), for the out-of-memory advice: its quantization
    # input, and the method that would hold its block weights in one byte on its GPU (None: none runs there).
    quantization: str = "none"
    quantize_to: str | None = None
    source: str = "the DiT file"  # the file or folder its weights came from (the loaders set it), named in errors
    quant_formats: frozenset[str] = frozenset()  # core's quantized layer formats its blocks hold (build.py)
    gguf_types: frozenset[str] = frozenset()  # the GGUF types its linear layers hold as blocks (gguf.py)

    def forward(self, x, timestep, context, text_lens, transformer_options={}, **kwargs):
        started = allocated_memory(x.device)  # what was held before this step: the advice counts the step's own
        for attempt in range(2):
            retry = False
            try:
                out = run_diffusion_model(self._forward, self, transformer_options, x, timestep, context, text_lens,
                                          transformer_options, **kwargs)
                break
            except torch.OutOfMemoryError as error:
                # A step the memory plan said fits: plan again with what it held when it ran out (its tensors are
                # alive here, held by the error's traceback; torch's peak statistic is the process's since it
                # started, other graphs' prompts included), make room, retry once (outside this block).
                retry = attempt == 0 and session.out_of_memory(allocated_memory(x.device))
                if not retry:
                    image = (x.shape[-1] * PIXELS_PER_LATENT, x.shape[-2] * PIXELS_PER_LATENT)
                    raise out_of_memory(error, sampling_advice(self, list(x.shape), context.shape[1], x.device,
                                                               image, PIXELS_PER_LATENT, transformer_options,
                                                               started)) from error
            if retry:
                make_room_beside(self, x.device)
        self._check_first_step(out, transformer_options)
        return out

    def _check_first_step(self, out: torch.Tensor, transformer_options: dict) -> None:
        """The first step of each sampling run gives finite values (one check per run: ``sample_sigmas`` is core's
        new tensor per run): weights that are each within bounds can still overflow together, and a NaN there made a
        black image with no message."""
        run = transformer_options.get("sample_sigmas")
        if run is None or _CHECKED_RUNS.get(id(run)) is run:
            return
        _CHECKED_RUNS[id(run)] = run
        session.prompt_started()  # where the text encode was cached, the prompt's time starts with sampling
        if not bool(torch.isfinite(out).all()):
            raise ErnieImageError(
                f"The DiT's first sampled step gave values that are not finite (NaN or infinity): the weights of "
                f"{self.source} (or a LoRA applied to them) hold values no image can be made from, so the image "
                "would be black. Download the file again, or sample without the LoRA.")

    def _forward(self, x, timestep, context, text_lens, transformer_options={}, **kwargs):
        if x.ndim != 4 or x.shape[1] != self.in_channels:
            raise ErnieImageError(
                f"ERNIE-Image needs a {self.in_channels}-channel latent (Flux.2 format), got shape {tuple(x.shape)}. "
                "Start from EmptyFlux2LatentImage, or encode images with the ERNIE-Image (Flux.2) VAE."
            )
        say_unapplied_patches(transformer_options)
        return super().forward(x, timestep, context, text_lens)


class ErnieImageModel(BaseModel):
    """A ComfyUI ``BaseModel`` (flow prediction, Flux.2 latents) around the pack's ERNIE-Image DiT; also a core
    ``ErnieImage`` where the core has one (``host.model.on_core_ernie_base``)."""

    def __init__(self, model_config: ErnieImageConfig, diffusion_model: ErnieImageDiffusionModel, device=None):
        super().__init__(model_config, FLOW, device=device)
        self.diffusion_model = diffusion_model

    def apply_model(self, *args, **kwargs):
        _refuse_replaced_forwards(self.diffusion_model)
        return super().apply_model(*args, **kwargs)

    def memory_choices(self) -> PackModel:
        """The DiT's loader choices and bytes, for the out-of-memory advice (``host/oom.py`` adds its device and
        what it holds there): the savings of one-byte block weights are measured from its block linears."""
        dit = self.diffusion_model
        blocks = [m.weight for name, m in dit.named_modules()
                  if isinstance(m, torch.nn.Linear) and name.startswith("layers.")]
        # A GGUF DiT's blocks are quantized already (4 to 8 bits): no fp8 or quantization step saves anything there.
        gguf = dit.gguf_types
        saving = 0 if gguf else one_byte_saving(blocks)
        gguf_saving = 0 if gguf else sum(max(tensor_bytes(w) - q, 0) for w in blocks
                                         if (q := q4_k_m_bytes(w)) is not None)
        return PackModel(DIT, module_bytes(dit), dtype_name(dit.precision.storage), fp8_saving=saving,
                         quantization=dit.quantization,
                         quantize_to=dit.quantize_to, quantize_saving=saving,
                         gguf_saving=gguf_saving)

    def extra_conds(self, **kwargs) -> dict:
        cross_attn = kwargs.get("cross_attn")
        if cross_attn is None:
            raise ErnieImageError("ERNIE-Image needs text conditioning: connect an ErnieImageTextEncode output.")
        needed = self.diffusion_model.text_in_dim
        if cross_attn.shape[-1] != needed:
            raise ErnieImageError(
                f"This conditioning has {cross_attn.shape[-1]}-wide embeddings; ERNIE-Image needs {needed}-wide ones "
                "from its own text encoder (Ministral 3 3B), so the text encoder that made it is another model. "
                "Load ministral-3-3b.safetensors or an ERNIE-Image snapshot with ErnieImageTextEncoderLoader (or "
                "ErnieImageLoader) and encode with ErnieImageTextEncode."
            )
        lengths = [cross_attn.shape[1]] * cross_attn.shape[0]
        return {"c_crossattn": ErnieTextCond(cross_attn), "text_lens": ErnieTextLengths(lengths)}


def _refuse_replaced_forwards(dit: ErnieImageDiffusionModel) -> None:
    """Packs for ComfyUI's native ERNIE-Image recognise the pack's model as one (``model_base.ErnieImage``) and
    may swap its forwards for their own, written for the native model's modules: raylight's sequence parallelism
    replaces the DiT's ``forward`` and ``_forward`` and each block's ``self_attention.forward``
    (raylight src/raylight/distributed_modules/usp.py @03e199f4), which would fail on the pack's DiT deep inside
    (it has no ``pos_embed``) or sample without the text mask. Refused in words instead."""
    replaced = ["_forward"] * ("_forward" in vars(dit))  # not ``forward``: cache-dit swaps it for each run
    first = vars(getattr(dit.layers[0], "self_attention", None) or torch.nn.Module())  # each block alike
    replaced += ["layers.N.self_attention.forward"] * ("forward" in first)
    if replaced:
        raise ErnieImageError(
            f"Another node pack replaced the ERNIE-Image DiT's {', '.join(replaced)} (raylight's multi-GPU "
            "parallelism does so), which the pack's DiT does not support: it samples like diffusers with its own "
            "forward. Use that pack with ComfyUI's native ERNIE-Image loaders, or run this model without it."
        )


def make_model_patcher(diffusion_model: ErnieImageDiffusionModel, shift: float = DEFAULT_SHIFT,
                       whole: bool = False, resident: bool = False):
    """A ComfyUI MODEL around ``diffusion_model``, placed, offloaded and freed by ComfyUI's model management.

    Core's own patcher: the DiT's layers are ``comfy.ops`` layers, so a card too small for it loads part of it
    and casts the rest per layer (or, under dynamic VRAM, streams every layer unless ``resident``: see
    ``host.patchers.dit_patcher_class``). ``whole``: quantized (torchao, SVDQuant) weights, which core's partial
    loading neither moves nor casts, so the model is loaded whole (``WholeModelPatcher``). A DiT holding GGUF blocks
    (``dit/gguf.py``) streams like any other, on core's classic patcher with LoRAs kept off the blocks
    (``host.gguf_layers.GGUFModelPatcher``)."""
    config = ErnieImageConfig(ErnieImageConfig.unet_config)
    config.sampling_settings["shift"] = shift
    precision = diffusion_model.precision
    config.set_inference_dtype(precision.storage, precision.manual_cast)
    subclass_weights = bool(diffusion_model.quant_formats)  # core's QuantizedTensor weights
    if whole:
        patcher = WholeModelPatcher
    elif diffusion_model.gguf_types:
        patcher = GGUFModelPatcher
    else:
        patcher = dit_patcher_class(resident, subclass_weights)
    return model_patcher(ErnieImageModel, config, diffusion_model, patcher)
