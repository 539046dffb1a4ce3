"""The host a PE engine runs in: devices, weight placement, stop requests, progress.

``Runtime`` is plain torch, the engines' default (scripts, tests without ComfyUI); ComfyUI's host
(``comfy_runtime.ComfyRuntime``) is built by the nodes and handed to the engines, which never look for it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class Runtime:
    """The host the engine runs in. This base is plain torch (scripts, tests without ComfyUI)."""

    # The host's own interrupt exceptions: raised from inside generation (ComfyUI's progress hook raises its
    # interrupt), they pass through untouched, never mistaken for a failure of the fast path.
    interrupts: tuple[type[BaseException], ...] = ()

    def device(self, name: str) -> torch.device:
        """``"default"``: the host's main device; otherwise a torch device name (``"cuda:1"``, ``"cpu"``)."""
        if name == "default":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(name)

    def dtype(self, device: torch.device) -> torch.dtype:
        """The PE's dtype on ``device`` when the loader says ``auto``: the rule of ComfyUI's host
        (``host.memory.text_model_dtype``) as torch alone can tell it, bf16 on GPUs with bf16 math (sm80+), float32
        elsewhere."""
        if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 8:
            return torch.bfloat16
        return torch.float32

    def manage(
        self, model: torch.nn.Module, device: torch.device, on_unload: Callable[[], None]
    ) -> Callable[[int], None]:
        """Register the weights; returns ``load(memory_required)``, called before each generation."""
        return lambda memory_required: model.to(device)

    def release(self, model: torch.nn.Module) -> None:
        """The engine drops ``model`` (to read it again for another device or form): nothing holds it here."""

    def free_memory(self, device: torch.device) -> int | None:
        """Bytes free for work on ``device`` now (what the PE's batches are sized by); None where unknown, the CPU
        here, and a fixed cap applies."""
        if device.type != "cuda":
            return None
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)

    def should_stop(self) -> bool:
        return False

    def on_stopped(self) -> None:
        """Called when generation stopped on request; a host raises its own interrupt exception here."""

    def progress(self, total: int) -> Callable[[int], None]:
        return lambda done: None

