"""Devices, dtypes and memory as ComfyUI chooses and counts them, and the sizes its caches read.

- Free memory: where the core has ``ModelPatcher.get_free_memory`` (current cores), it counts the VRAM that
  idle dynamic-VRAM models hold as free, since core evicts them on demand; ``model_management.get_free_memory``
  alone (0.3.75) does not know of them.
- The text encoder's device: under dynamic VRAM core's ``text_encoder_device()`` is always the GPU, also with
  ``--lowvram`` (its weights are meant to stream), but the pack's text encoder loads whole: where the card could
  not hold it even with every other model unloaded, it runs on the offload device instead, and the log says so
  (``patchers.text_model_patcher``, sized by ``fits_whole`` here).
"""

from __future__ import annotations

import comfy.cli_args
import comfy.model_management as mm
import comfy.model_patcher
import psutil  # ComfyUI's own dependency (its model management imports it)
import torch

# Not from ``patchers``: it builds on this module (``text_model_patcher`` sizes a model against the card).
ModelPatcher = comfy.model_patcher.ModelPatcher

# ComfyUI's flags that fix the diffusion model's weight dtype for every model.
UNET_DTYPE_FLAGS = ("fp32_unet", "fp64_unet", "bf16_unet", "fp16_unet", "fp8_e4m3fn_unet", "fp8_e5m2_unet",
                    "fp8_e8m0fnu_unet")
LOAD_MARGIN = 1.1  # core sizes a load at 1.1x the model (model_management.load_models_gpu)
# Host RAM the pack leaves to the system and other programs when it keeps a model's host copy: kept copies (often
# pinned, never swapped out) must not take the last of it. The H200 check's PE workflow on 12 GB held 27 GiB with
# the PE's, the DiT's and the streamed text encoder's copies (2026-12-05).
HOST_RESERVE_SHARE, HOST_RESERVE_MIN = 0.1, 4 * 2**30


def torch_device() -> torch.device:
    """The device ComfyUI samples on."""
    return mm.get_torch_device()


def device_options() -> list[str]:
    """A loader's ``device`` choices: ComfyUI's default, the CPU and each CUDA GPU."""
    return ["default", "cpu", *(f"cuda:{i}" for i in range(torch.cuda.device_count()))]


def usable_memory(device: torch.device) -> int:
    """Memory a model may take on ``device`` now, as ComfyUI counts it: free memory (torch's cache and, under
    dynamic VRAM, what idle models hold included) less ComfyUI's reserve (``--reserve-vram``)."""
    try:
        # Core's method reads only the device (model_patcher.py @53757775); the pack asks before any patcher exists.
        free = ModelPatcher.get_free_memory(None, device)
    except AttributeError:  # 0.3.75: no such method
        free = mm.get_free_memory(device)
    return max(int(free) - int(mm.extra_reserved_memory()), 0)


def capacity(device: torch.device) -> int:
    """What ``device`` can give one model with every other unloaded: its memory less core's inference minimum."""
    return int(mm.get_total_memory(device)) - int(mm.minimum_inference_memory())


def fits_whole(size: int, device: torch.device) -> bool:
    """Whether a model of ``size`` bytes fits on ``device`` with every other model unloaded, as core sizes it."""
    return size * LOAD_MARGIN <= capacity(device)


def compute_dtype(device: torch.device) -> torch.dtype:
    """bf16 where ComfyUI would run a model in it on ``device``, float32 elsewhere."""
    return torch.bfloat16 if mm.should_use_bf16(device) else torch.float32


def core_unet_dtype(device: torch.device, supported: list[torch.dtype]) -> tuple[torch.dtype, bool]:
    """ComfyUI's pick of a diffusion model's weight dtype, and whether a command-line flag forced it."""
    forced = any(getattr(comfy.cli_args.args, flag, False) for flag in UNET_DTYPE_FLAGS)
    return mm.unet_dtype(device, supported_dtypes=supported), forced


def text_model_dtype(device: torch.device) -> torch.dtype:
    """The dtype of both Ministral models, the text encoder and the local PE: bf16 (the released weights' dtype) on a
    GPU where ComfyUI computes in bf16 (``should_use_bf16``: NVIDIA from Ampere on), float32 elsewhere (the CPU, older
    GPUs). Float32 is what core's own text encoders compute in on every device: ``SDClipModel.forward`` runs them with
    ``dtype=torch.float32`` and ``comfy.ops.manual_cast`` casts each stored weight to it (sd1_clip.py, 0.3.75 and
    upstream @443393b4), whatever ``text_encoder_dtype()`` stores them in (fp16 unless a ``--*-text-enc`` flag says
    otherwise; model_management.py, 0.3.75 and upstream @02b2b388). A transformers model has no per-layer cast, so it
    is stored in the dtype it computes in. fp16, which the PE took on GPUs before Ampere, is not what core computes
    text models in, and the models were trained in bf16, whose range fp16 lacks."""
    if mm.is_device_cuda(device) and mm.should_use_bf16(device):
        return torch.bfloat16
    return torch.float32


def text_devices(choice: str = "default") -> tuple[torch.device, torch.device]:
    """The load and offload devices of a text model: ComfyUI's text-encoder devices for ``default``, else the
    device named (``cpu``, ``cuda:1``)."""
    offload = mm.text_encoder_offload_device()
    if choice == "default":
        return mm.text_encoder_device(), offload
    device = torch.device(choice)
    return device, offload if device.type != "cpu" else device


def load_whole(patcher: ModelPatcher, memory_required: int = 0) -> None:
    """Load ``patcher`` on its device with ``memory_required`` bytes beside it, making room as ComfyUI does."""
    mm.load_models_gpu([patcher], memory_required=memory_required, force_full_load=True)


def spare_host_memory() -> int:
    """Host RAM available now beyond what is left to the system (``HOST_RESERVE_*``): what copies kept on the host
    may still take."""
    memory = psutil.virtual_memory()
    return int(memory.available - max(HOST_RESERVE_MIN, memory.total * HOST_RESERVE_SHARE))


def intermediate_device() -> torch.device:
    """Where ComfyUI keeps what passes between nodes."""
    return mm.intermediate_device()


def dtype_size(dtype: torch.dtype) -> int:
    return mm.dtype_size(dtype)


def allocated_memory(device: torch.device) -> int:
    """Bytes torch's allocator has handed out on ``device`` now (0 but on CUDA, whose allocator counts them)."""
    return int(torch.cuda.memory_allocated(device)) if device.type == "cuda" else 0


def make_room_beside(diffusion_model: torch.nn.Module, device: torch.device) -> None:
    """Unload every model core holds on ``device`` but the one around ``diffusion_model``, and empty torch's cache:
    the room a retried step gets after an out-of-memory error."""
    keep = [m for m in mm.current_loaded_models
            if getattr(getattr(m.model, "model", None), "diffusion_model", None) is diffusion_model]
    mm.free_memory(mm.get_total_memory(device), device, keep_loaded=keep)
    mm.soft_empty_cache()
