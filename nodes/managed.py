"""Hand foreign (transformers, torchao, SVDQuant) modules to ComfyUI's model management, whole or not at all.

Core's partial ("lowvram") loading keeps the weights of core ``ops`` layers on the CPU and casts them to the GPU at
each call. The text encoder and the Prompt Enhancer are made of transformers' plain torch modules, and a quantized
DiT of torchao's or SVDQuant's layers, which that loading neither moves nor casts: a partly loaded model would run
some layers on the wrong device. (The DiT in bf16, fp32 or fp8 storage is made of core's ``ops`` layers and loads in
part like core's models.) ComfyUI loads partly when the model does not fit in the free memory, and always under
``--novram``. So the rule here is: every load is a full load (ComfyUI first unloads other models to make room, as
for any model), and when ComfyUI needs the memory back, the model is unloaded whole.

Models move between devices outside inference mode, although ComfyUI runs every node inside it: there, ``.to``
reaches torchao's quantized weights undecomposed and their aliasing fix-up fails ("Attempted to set the storage of
a tensor on device cpu to a storage on different device cuda:0", torchao 0.17 on the H200).

Every weight the pack makes is a normal tensor, never an inference tensor, so it moves either way: the functions
that make weights run outside inference mode (``model_files.builds_weights`` says why).
"""

from __future__ import annotations

import comfy.model_management
import comfy.model_patcher
import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from .errors import ErnieImageError


class ManagedModule(torch.nn.Module):
    """A plain container: ModelPatcher writes ``.device`` and bookkeeping attributes onto the module it manages,
    which transformers' models do not allow (their ``device`` is a read-only property)."""

    def __init__(self, module: torch.nn.Module, device: torch.device):
        super().__init__()
        self.module = module
        self.device = device


class TextEncoderModule(ManagedModule):
    """The text encoder as ComfyUI's model management holds it (the class name shows in ComfyUI's log)."""


def tensor_bytes(tensor: torch.Tensor) -> int:
    """The memory a tensor holds. A quantized (torchao) weight reports its original dtype, so count what it wraps."""
    if is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        return sum(tensor_bytes(getattr(tensor, name)) for name in names)
    return tensor.nelement() * tensor.element_size()


def out_of_memory(error: torch.OutOfMemoryError, advice: str) -> torch.OutOfMemoryError:
    """ERNIE-Image's ``advice``, then ``error``'s own text: still an out-of-memory error, so that ComfyUI frees its
    models as for any other (its own tip is about batch sizes). The advice comes first because CUDA's text is long
    and views of an error (a dialog, a log line) are cut from the end."""
    return torch.OutOfMemoryError(f"ERNIE-Image: {advice}\n{error}")


class WholeModelPatcher(comfy.model_patcher.ModelPatcher):
    """A ModelPatcher that never loads or unloads its model in part, and knows the true size of quantized weights."""

    def model_size(self) -> int:
        # From the parameters and buffers themselves: ``state_dict()`` detaches each one, which torchao's weights
        # refuse inside inference mode (where ComfyUI runs every node; seen with torchao 0.17 on the H200).
        if self.size == 0:
            tensors = [*self.model.parameters(), *self.model.buffers()]
            self.size = sum(tensor_bytes(t) for t in tensors)
        return self.size

    def load(self, device_to=None, lowvram_model_memory=0, force_patch_weights=False, full_load=False):
        try:
            with torch.inference_mode(False):
                super().load(device_to, lowvram_model_memory, force_patch_weights, full_load=True)
        except torch.OutOfMemoryError as error:
            raise out_of_memory(
                error, f"{type(self.model).__name__} needs {self.model_size() / 2**30:.1f} GiB on "
                f"{device_to or self.load_device} as a whole (the pack's models cannot be loaded in part). Make room: "
                "quantize the DiT in its loader (fp8_per_row or int8_weight_only), put the Prompt Enhancer on "
                "another device, or close other programs that use the GPU."
            ) from error

    def add_patches(self, patches, strength_patch=1.0, strength_model=1.0):
        # Core's LoRA loaders end here too: refuse before a load fails deep inside the patching.
        if patches:
            raise ErnieImageError(
                f"{type(self.model).__name__} cannot take LoRA patches: its weights are quantized (torchao or "
                "SVDQuant) or a transformers model's, which ComfyUI's patching cannot change. For a LoRA on the DiT, "
                "load it with quantization none (weight_dtype fp8_e4m3fn halves its memory and takes LoRAs)."
            )
        return super().add_patches(patches, strength_patch, strength_model)

    def unpatch_model(self, device_to=None, unpatch_weights=True):
        with torch.inference_mode(False):
            return super().unpatch_model(device_to, unpatch_weights)

    def partially_unload(self, device_to, memory_to_free=0, force_patch_weights=False) -> int:
        return 0  # frees nothing: ComfyUI then unloads the whole model


def place(module: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """``module`` on ``device``, moved outside inference mode, and only when some tensor is elsewhere: a move, even
    to where a torchao weight already is, detaches it, which inference mode refuses ("Cannot set version_counter
    for inference tensor", the FP8 loader inside ComfyUI on the H200)."""
    if all(t.device == device for t in (*module.parameters(), *module.buffers())):
        return module
    with torch.inference_mode(False):
        return module.to(device)


def usable_memory(device: torch.device) -> int:
    """Memory a model may take on ``device`` now, as ComfyUI counts it: free memory (torch's cache included) less
    ComfyUI's reserve (``--reserve-vram``), never the driver's free memory alone."""
    mm = comfy.model_management
    return max(int(mm.get_free_memory(device)) - int(mm.extra_reserved_memory()), 0)


def text_model_dtype(device: torch.device) -> torch.dtype:
    """bf16 where the GPU runs it well (the released weights' dtype), float32 elsewhere (CPU, old GPUs)."""
    if comfy.model_management.is_device_cuda(device) and comfy.model_management.should_use_bf16(device):
        return torch.bfloat16
    return torch.float32


def text_model_patcher(module: torch.nn.Module) -> WholeModelPatcher:
    """A ModelPatcher that keeps ``module`` where ComfyUI keeps text encoders and loads it, whole, on demand."""
    load_device = comfy.model_management.text_encoder_device()
    offload_device = comfy.model_management.text_encoder_offload_device()
    container = TextEncoderModule(place(module, offload_device), offload_device)
    return WholeModelPatcher(container, load_device=load_device, offload_device=offload_device)
