"""The local PE inside ComfyUI: its weights are a model of ComfyUI's model management (loaded on demand, offloaded
under memory pressure, unloaded by ``/free``), ComfyUI's interrupt stops generation, progress shows on the node."""

from __future__ import annotations

import time
from collections.abc import Callable

import comfy.model_management as mm
import comfy.utils
import torch
from comfy.patcher_extension import CallbacksMP

from ..managed import ManagedModule, WholeModelPatcher, usable_memory
from .runtime import Runtime


class PromptEnhancerModule(ManagedModule):
    """The PE language model as ComfyUI's model management holds it (the class name shows in ComfyUI's log)."""


class ComfyRuntime(Runtime):
    """ComfyUI's devices, model management, interrupt flag and progress bar."""

    interrupts = (mm.InterruptProcessingException,)

    def device(self, name: str) -> torch.device:
        return mm.get_torch_device() if name == "default" else torch.device(name)

    def manage(
        self, model: torch.nn.Module, device: torch.device, on_unload: Callable[[], None]
    ) -> Callable[[int], None]:
        offload = mm.text_encoder_offload_device()
        patcher = WholeModelPatcher(PromptEnhancerModule(model, offload), load_device=device, offload_device=offload)
        patcher.add_callback(CallbacksMP.ON_DETACH, lambda *args: on_unload())

        def load(memory_required: int) -> None:
            mm.load_models_gpu([patcher], memory_required=memory_required, force_full_load=True)

        return load

    def free_memory(self, device: torch.device) -> int | None:
        """What ComfyUI counts as free on ``device`` (its driver view plus torch's cached blocks; the CPU's available
        RAM), less the VRAM it keeps for other programs (``--reserve-vram``)."""
        return usable_memory(device)

    def should_stop(self) -> bool:
        return mm.processing_interrupted()

    def on_stopped(self) -> None:
        mm.throw_exception_if_processing_interrupted()

    def progress(self, total: int) -> Callable[[int], None]:
        """Token progress on the node, at most ten updates a second (each one is a websocket message)."""
        bar = comfy.utils.ProgressBar(total)
        last = [0.0]

        def update(done: int) -> None:
            now = time.monotonic()
            if now - last[0] >= 0.1:
                last[0] = now
                bar.update_absolute(done)

        return update
