"""What a parallel DiT needs of ComfyUI's model management: the loader's recipe of a MODEL and its patches (for a
worker process to build the same DiT), loading it there, and the workers' memory as this process's model
management counts it.

Each worker holds a copy of the DiT on its own GPU. ComfyUI counts that memory as a ``WorkerMemory`` entry on the
worker's device, loaded (so ComfyUI makes room for it there first) before the worker starts: a text encoder or PE
put on that GPU with their ``device`` input is then unloaded or loaded beside it as for any model, and ComfyUI
unloading the entry (to make room, or ``/free``) stops the workers.
"""

from __future__ import annotations

from collections.abc import Callable

import comfy.model_management as mm
import comfy.model_patcher
import torch
from comfy.patcher_extension import CallbacksMP

ModelPatcher = comfy.model_patcher.ModelPatcher


def loader_recipe(patcher: ModelPatcher) -> tuple[Callable, tuple] | None:
    """``(make, args)``: how the loader built ``patcher``'s model (``make(*args)`` gives a new MODEL), from it or
    the MODEL it was cloned from (0.3.75's ``clone`` does not copy ``cached_patcher_init``); None for a MODEL no
    ERNIE-Image loader made."""
    while patcher is not None:
        recipe = getattr(patcher, "cached_patcher_init", None)
        if recipe is not None:
            return recipe
        patcher = patcher.parent
    return None


def replay_patches(patcher: ModelPatcher, patches: dict) -> None:
    """Add another MODEL's ``patches`` (its LoRAs, as core keeps them: key → [(strength, patch, strength_model,
    offset, function)]) to ``patcher``, as they were added there."""
    for key, entries in patches.items():
        for strength_patch, patch, strength_model, offset, function in entries:
            patcher.add_patches({(key, offset, function): patch}, strength_patch, strength_model)


def load_for_run(patchers: list[ModelPatcher]) -> None:
    """Load ``patchers`` as ComfyUI loads a model for sampling (in part, where the device is short)."""
    mm.load_models_gpu(patchers)


def on_unload(patcher: ModelPatcher, callback: Callable[[], None]) -> None:
    """Call ``callback()`` when ComfyUI unloads ``patcher``'s model (``/free``, or room made for others); not when it
    only swaps one clone of the model for another."""
    patcher.add_callback(CallbacksMP.ON_DETACH, lambda _, unpatch_all=True: unpatch_all and callback())


class WorkerMemory(ModelPatcher):
    """A worker's DiT as this process's model management counts it: ``size`` bytes on ``device``, all or nothing.
    Unloading it calls ``on_unload`` (which stops the worker). ``release`` makes it count nothing: entries stay in
    ComfyUI's list until they are dropped (outside its unloading loop, which an entry gone midway would upset)."""

    def __init__(self, size: int, device: torch.device, on_unload: Callable[[], None]):
        super().__init__(torch.nn.Module(), load_device=device, offload_device=torch.device("cpu"), size=size)
        self._on_unload = on_unload

    def partially_load(self, device_to, extra_memory=0, force_patch_weights=False, **kwargs) -> int:
        self.model.device = device_to
        self.model.model_loaded_weight_memory = self.size
        return self.size

    def partially_unload(self, *args, **kwargs) -> int:
        return 0  # a worker's DiT cannot shrink: ComfyUI then unloads it whole

    def detach(self, unpatch_all=True):
        if unpatch_all:  # not when ComfyUI loads it again (it detaches a loaded model without unpatching first)
            self.release()
            self._on_unload()
        return self.model

    def release(self) -> None:
        self.size = self.model.model_loaded_weight_memory = 0
