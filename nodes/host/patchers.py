"""The ModelPatcher classes the pack's models are managed by, on every core.

- The DiT in bf16, fp32, fp8 storage or core's quantized layouts is built from ``comfy.ops`` layers: core's own
  patcher class manages it. On cores with dynamic VRAM (``comfy.model_patcher.CoreModelPatcher``, which current
  cores' ``main.py`` makes ``ModelPatcherDynamic`` on NVIDIA GPUs) its weights stay in RAM and are cast to the GPU
  per layer; elsewhere core's partial loading keeps part of them on the GPU. ``dit_patcher_class`` says which.
- The text encoder, the Prompt Enhancer and a torchao/SVDQuant-quantized DiT are foreign modules (transformers',
  torchao's, SVDQuant's layers) that core's partial and dynamic loading neither move nor cast, so they are loaded
  whole or not at all (``WholeModelPatcher``): ComfyUI unloads other models to make room, and when it needs the
  memory back, the model is unloaded whole.

Models move between devices outside inference mode, although ComfyUI runs every node inside it: there, ``.to``
reaches torchao's quantized weights undecomposed and their aliasing fix-up fails ("Attempted to set the storage of
a tensor on device cpu to a storage on different device cuda:0", torchao 0.17 on the H200). Every weight the pack
makes is a normal tensor, never an inference tensor (``model_files.builds_weights``), so it moves either way.

A model that cannot be loaded whole raises out-of-memory advice that fits the state (``oom.load_advice``): what
is chosen for each of the pack's models ComfyUI holds, and the next step that would fit.

Every override here takes and passes on keyword arguments it does not know: core adds them across versions.
"""

from __future__ import annotations

import collections
import functools
import inspect
import logging
import os
import time

import comfy.lora
import comfy.model_patcher
import comfy.utils
import torch
from comfy.patcher_extension import CallbacksMP

from ..errors import ErnieImageError
from . import host_copy
from .memory import capacity, fits_whole
from .oom import load_advice
from .sizes import module_bytes

ModelPatcher = comfy.model_patcher.ModelPatcher
# ERNIE_IMAGE_DYNAMIC_VRAM=on puts a DiT that does not fit the GPU whole on core's dynamic patcher where the core
# has dynamic VRAM. Off by default until a run shows it: on the H200 (2026-12-01) the only runnable core with
# dynamic VRAM, the 0.12.1 fork, failed in its own ModelPatcherDynamic.partially_load for every dynamic model, its
# own VAE included (it reads model.current_weight_patches_uuid, which the fork keeps on the patcher).
DYNAMIC_VRAM_ENV = "ERNIE_IMAGE_DYNAMIC_VRAM"


class ManagedModule(torch.nn.Module):
    """A plain container: ModelPatcher writes ``.device`` and bookkeeping attributes onto the module it manages,
    which transformers' models do not allow (their ``device`` is a read-only property)."""

    def __init__(self, module: torch.nn.Module, device: torch.device):
        super().__init__()
        self.module = module
        self.device = device


def out_of_memory(error: torch.OutOfMemoryError, advice: str) -> torch.OutOfMemoryError:
    """ERNIE-Image's ``advice``, then ``error``'s own text: still an out-of-memory error, so that ComfyUI frees its
    models as for any other (its own tip is about batch sizes). The advice comes first because CUDA's text is long
    and views of an error (a dialog, a log line) are cut from the end."""
    return torch.OutOfMemoryError(f"ERNIE-Image: {advice}\n{error}")


def is_dynamic(patcher) -> bool:
    """Whether core streams ``patcher``'s weights with dynamic VRAM (``ModelPatcherDynamic``; False on cores
    without it)."""
    return bool(getattr(patcher, "is_dynamic", lambda: False)())


def core_has_dynamic_vram() -> bool:
    """Whether the running core manages models with dynamic VRAM (its ``CoreModelPatcher`` is not the classic
    ModelPatcher)."""
    return getattr(comfy.model_patcher, "CoreModelPatcher", ModelPatcher) is not ModelPatcher


def dynamic_vram() -> bool:
    """Whether the core has dynamic VRAM and ``ERNIE_IMAGE_DYNAMIC_VRAM=on`` asks the pack to use it for the DiT."""
    return core_has_dynamic_vram() and os.environ.get(DYNAMIC_VRAM_ENV, "off").strip().lower() == "on"


def dit_patcher_class(resident: bool, subclass_weights: bool = False) -> type:
    """Core's patcher for the DiT: its dynamic one where ``dynamic_vram()`` says so, unless the DiT stays
    ``resident`` on the GPU and is compiled there, which the dynamic patcher's per-layer casts do not allow (core's
    compile node gives such a model the classic patcher too: ``model.clone(disable_dynamic=True)``).
    ``subclass_weights``: weights held as tensor subclasses (core's quantized layers): ``OutsideInferenceMode``."""
    core = comfy.model_patcher.CoreModelPatcher if dynamic_vram() and not resident else ModelPatcher
    return _outside_inference_mode(core) if subclass_weights else core


def can_demote(patcher) -> bool:
    """Whether ``patcher`` is dynamic and its core can give a classic copy: ``clone(disable_dynamic=True)`` loads
    the model again through the loader recorded in ``cached_patcher_init`` (model_patcher.py @08d0e510)."""
    return (is_dynamic(patcher) and "disable_dynamic" in inspect.signature(patcher.clone).parameters
            and getattr(patcher, "cached_patcher_init", None) is not None)


class OutsideInferenceMode:
    """Core's patcher methods that read or move the weights, run outside inference mode (ComfyUI runs nodes
    inside it). A tensor-subclass weight (torchao's, core's ``QuantizedTensor``) made or moved outside inference
    mode cannot be detached inside it ("Cannot set version_counter for inference tensor"), and core detaches
    every weight to size a model (``model_management.module_size`` reads ``state_dict()``); sizes here come from
    the tensors themselves."""

    def model_size(self) -> int:
        if self.size == 0:
            self.size = module_bytes(self.model)
        return self.size

    def load(self, *args, **kwargs):
        with torch.inference_mode(False):
            return super().load(*args, **kwargs)

    def partially_load(self, *args, **kwargs):
        with torch.inference_mode(False):
            return super().partially_load(*args, **kwargs)

    def partially_unload(self, *args, **kwargs):
        with torch.inference_mode(False):
            return super().partially_unload(*args, **kwargs)

    def unpatch_model(self, *args, **kwargs):
        with torch.inference_mode(False):
            return super().unpatch_model(*args, **kwargs)

    def add_patches(self, *args, **kwargs):
        # Core reads state_dict() here to match the patches' keys (a LoRA loader runs inside inference mode).
        with torch.inference_mode(False):
            return super().add_patches(*args, **kwargs)


@functools.cache
def _outside_inference_mode(patcher_class: type) -> type:
    return type(patcher_class.__name__, (OutsideInferenceMode, patcher_class), {})


CoreBackup = collections.namedtuple("Dimension", ["weight", "inplace_update"])  # core's backup record, as it makes them


class HostCopyPatcher(ModelPatcher):
    """Core's classic patcher for a model ComfyUI loads and unloads whole: once core has unloaded it without
    patches, it keeps its host copy (``host_copy``): loaded per prompt from pinned memory, unloaded without a copy
    back. Core asking for part of its memory gets none (``partially_unload``) and unloads the whole model, which
    then costs no copy. A subclass of core's alone: a core patcher (the VAE's) becomes one in place, which a mixin
    before core's class would refuse where core's patcher derives from ``typing.Protocol`` classes ("object layout
    differs": the 0.12.1 fork)."""

    def load(self, device_to=None, *args, **kwargs):
        if not self.patches and (device_to or self.load_device) != self.offload_device:
            pinned = host_copy.before_load(self.model)
            if pinned:
                logging.info("ERNIE-Image: %s is loaded for each prompt: its host copy is kept, %.1f MB pinned",
                             type(self.model).__name__, pinned / 1e6)
        return super().load(device_to, *args, **kwargs)

    def partially_unload(self, *args, **kwargs) -> int:
        return 0  # frees nothing: ComfyUI then unloads the whole model

    def unpatch_model(self, device_to=None, unpatch_weights=True, **kwargs):
        if (unpatch_weights and device_to is not None and not self.patches
                and any(p.device != torch.device(device_to) for p in self.model.parameters())):
            host_copy.before_unload(self.model, device_to)
        return super().unpatch_model(device_to, unpatch_weights, **kwargs)


def keeps_host_copy(patcher: ModelPatcher) -> ModelPatcher:
    """``patcher``, its model keeping its host copy when ComfyUI loads it per prompt (the VAE on a small card, which
    otherwise core copies back to new pageable memory and in again each prompt), and counted in ``held_on_host``.
    Only on core's classic patcher: a dynamic-VRAM patcher keeps the weights in host RAM itself."""
    if type(patcher) is ModelPatcher:
        patcher.__class__ = HostCopyPatcher
    return host_copy.track(patcher)


class WholeModelPatcher(OutsideInferenceMode, HostCopyPatcher):
    """A ModelPatcher that never loads or unloads its model in part, and knows the true size of quantized weights.

    LoRAs: a torchao-quantized DiT carries a ``requantizer`` (``quant/requantize.py``). Core's patching adds a
    LoRA to a float copy of each weight, which torchao's weights cannot give; for those layers the original weight is
    read from the DiT's file, core merges the patches into it (``calculate_weight``: LoRA, DoRA, LoHa, LoKr as core
    reads them), and the result is quantized again with the same method. Core's backup keeps the quantized weight
    (on the offload device, as core keeps its backups), so unloading or a changed LoRA stack restores it exactly.
    Everything else (the text encoder, the PE, an SVDQuant DiT) refuses patches. Once core has unloaded a model
    without patches, it keeps its host copy (``HostCopyPatcher``)."""

    loads_whole = True  # read by the out-of-memory advice (oom.py), which cannot import this module

    def _requantizer(self):
        return getattr(getattr(self.model, "diffusion_model", None), "requantizer", None)

    def load(self, device_to=None, lowvram_model_memory=0, force_patch_weights=False, full_load=False, **kwargs):
        self.requantize_seconds: list[float] = []  # one per layer made again in this load
        try:
            loaded = super().load(device_to, lowvram_model_memory, force_patch_weights, full_load=True, **kwargs)
        except torch.OutOfMemoryError as error:
            raise out_of_memory(error, load_advice(self, device_to or self.load_device)) from error
        if self.requantize_seconds:
            logging.info("ERNIE-Image: merged LoRA patches into %d quantized layers (re-quantized in %.1f s)",
                         len(self.requantize_seconds), sum(self.requantize_seconds))
        return loaded

    def add_patches(self, patches, strength_patch=1.0, strength_model=1.0, **kwargs):
        # Core's LoRA loaders end here too: refuse before a load fails deep inside the patching.
        if patches and self._requantizer() is None:
            raise ErnieImageError(
                f"{type(self.model).__name__} cannot take LoRA patches: its weights are quantized with SVDQuant or "
                "are a transformers model's, which ComfyUI's patching cannot change. For a LoRA on the DiT, quantize "
                "it with fp8_per_row or int8_weight_only (the LoRA is merged before quantizing), or load it with "
                "quantization none (weight_dtype fp8_e4m3fn halves its memory and takes LoRAs)."
            )
        return super().add_patches(patches, strength_patch, strength_model, **kwargs)

    def patch_weight_to_device(self, key, device_to=None, inplace_update=False, **kwargs):
        requantizer = self._requantizer()
        weight = comfy.utils.get_attr(self.model, key) if key in self.patches else None
        if requantizer is None or weight is None or not requantizer.holds(weight):
            return super().patch_weight_to_device(key, device_to, inplace_update, **kwargs)
        start = time.perf_counter()
        if key not in self.backup:
            self.backup[key] = CoreBackup(weight.to(self.offload_device), False)
        original = requantizer.original(key.removeprefix("diffusion_model."))
        merged = comfy.lora.calculate_weight(self.patches[key], original.to(device_to or weight.device, torch.float32),
                                             key)
        comfy.utils.set_attr_param(self.model, key, requantizer.quantized(merged))
        getattr(self, "requantize_seconds", []).append(time.perf_counter() - start)


def whole_load_device(container: torch.nn.Module, load: torch.device, offload: torch.device, what: str,
                      chosen: bool) -> torch.device:
    """Where ``container`` is loaded whole: ``load``, but where the device was core's choice (``chosen`` False) and
    it cannot hold the model with everything else unloaded, ``offload``, where the model then runs in the dtype it
    was read in (bf16 on the CPU holds half of fp32's RAM); the log says so."""
    size = module_bytes(container)
    if not chosen and load != offload and not fits_whole(size, load):
        logging.warning("ERNIE-Image: the %s (%.1f GiB) does not fit on %s (%.1f GiB usable with nothing else "
                        "loaded); it runs on %s. Its loader's device input picks another device.", what,
                        size / 2**30, load, max(capacity(load), 0) / 2**30, offload)
        return offload
    return load


def text_model_patcher(container: torch.nn.Module, load: torch.device, offload: torch.device,
                       what: str, chosen: bool) -> WholeModelPatcher:
    """A patcher that loads ``container`` whole on demand, on ``whole_load_device``."""
    load = whole_load_device(container, load, offload, what, chosen)
    return host_copy.track(WholeModelPatcher(container, load_device=load, offload_device=offload))


def on_detach(patcher: ModelPatcher, callback) -> None:
    """Call ``callback()`` whenever ComfyUI unloads ``patcher``'s model from its device: a detach that unpatches.

    Core also detaches, weights left where they are (``unpatch_all=False``), every model it is asked to load, loaded
    already or not (``load_models_gpu`` in comfy/model_management.py, 0.3.75 and upstream's dynamic-VRAM version
    alike): that is no unload, and what the callback frees (the PE's KV caches and CUDA graphs) stays valid."""

    def detached(_patcher: ModelPatcher, unpatch_all: bool = True, *args, **kwargs) -> None:
        if unpatch_all:
            callback()

    patcher.add_callback(CallbacksMP.ON_DETACH, detached)


def place(module: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """``module`` on ``device``, moved outside inference mode, and only when some tensor is elsewhere: a move, even
    to where a torchao weight already is, detaches it, which inference mode refuses ("Cannot set version_counter
    for inference tensor", the FP8 loader inside ComfyUI on the H200)."""
    if all(t.device == device for t in (*module.parameters(), *module.buffers())):
        return module
    with torch.inference_mode(False):
        return module.to(device)
