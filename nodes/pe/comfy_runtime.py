"""The local PE inside ComfyUI: its weights are a model of ComfyUI's model management (loaded on demand, offloaded
under memory pressure, unloaded by ``/free``), ComfyUI's interrupt stops generation, progress shows on the node."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from ..host.memory import load_whole, text_devices, text_model_dtype, torch_device, usable_memory
from ..host.patchers import ManagedModule, on_detach, text_model_patcher
from ..host.sampling import Interrupted, interrupted, progress_bar, raise_if_interrupted
from ..host.streaming import unload
from ..memory_advice import PROMPT_ENHANCER, PackModel, ministral_choices
from .runtime import Runtime


class PromptEnhancerModule(ManagedModule):
    """The PE language model as ComfyUI's model management holds it (the class name shows in ComfyUI's log)."""

    def memory_choices(self) -> PackModel:
        """Its dtype and bytes, for the out-of-memory advice (``host/oom.py`` adds its device)."""
        return ministral_choices(PROMPT_ENHANCER, self.module)


class ComfyRuntime(Runtime):
    """ComfyUI's devices, model management, interrupt flag and progress bar."""

    interrupts = (Interrupted,)

    def __init__(self):
        self._patchers: dict[int, object] = {}  # the patcher of each model this host manages, by the model's id

    def device(self, name: str) -> torch.device:
        return torch_device() if name == "default" else torch.device(name)

    def dtype(self, device: torch.device) -> torch.dtype:
        """The text encoder's rule (``text_model_dtype``): one for both Ministral models."""
        return text_model_dtype(device)

    def manage(
        self, model: torch.nn.Module, device: torch.device, on_unload: Callable[[], None]
    ) -> Callable[[int], None]:
        """The text encoder's route: loaded whole on demand, as ``text_model_patcher`` makes it. ``chosen``: the PE
        stays on the device it was read for, since its dtype, decode path and cache identity follow from it."""
        offload = text_devices()[1]
        patcher = text_model_patcher(PromptEnhancerModule(model, offload), device, offload, "prompt enhancer",
                                     chosen=True)
        on_detach(patcher, on_unload)
        self._patchers[id(model)] = patcher
        return lambda memory_required: load_whole(patcher, memory_required)

    def release(self, model: torch.nn.Module) -> None:
        """ComfyUI unloads ``model`` from its device and forgets it."""
        patcher = self._patchers.pop(id(model), None)
        if patcher is not None:
            unload(patcher)

    def free_memory(self, device: torch.device) -> int | None:
        """What ComfyUI counts as free on ``device`` (its driver view plus torch's cached blocks; the CPU's available
        RAM), less the VRAM it keeps for other programs (``--reserve-vram``)."""
        return usable_memory(device)

    def should_stop(self) -> bool:
        return interrupted()

    def on_stopped(self) -> None:
        raise_if_interrupted()

    def progress(self, total: int) -> Callable[[int], None]:
        """Token progress on the node, at most ten updates a second (each one is a websocket message)."""
        bar = progress_bar(total)
        last = [0.0]

        def update(done: int) -> None:
            now = time.monotonic()
            if now - last[0] >= 0.1:
                last[0] = now
                bar.update_absolute(done)

        return update
