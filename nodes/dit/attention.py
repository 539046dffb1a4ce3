"""Which PyTorch SDPA kernel the DiT's attention runs on (engine: no ComfyUI here).

``auto`` keeps PyTorch's own order everywhere except on Hopper (sm90) CUDA GPUs, where cuDNN's attention comes
first: at ERNIE-Image's shapes (32 heads of 128, 4k+ tokens, no mask) it is the fastest kernel PyTorch has there
(bench/RESULTS.md, "Fast path on Hopper"). Each other backend stays in the list after it, so a shape or mask that
cuDNN does not take still runs. The override is the ``ERNIE_IMAGE_ATTENTION`` environment variable: ``cudnn``,
``flash``, ``efficient`` or ``math`` put that kernel first; ``auto`` (or unset) is the rule above.

The choice applies around each DiT forward (``sdpa_kernel`` is a context manager, nothing global changes), and a
compiled block records the kernel chosen when it was traced, so the choice is made once per process.
"""

from __future__ import annotations

import contextlib
import os

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..errors import ErnieImageError

ATTENTION_ENV = "ERNIE_IMAGE_ATTENTION"
BACKENDS = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}
_TORCH_ORDER = ("flash", "efficient", "cudnn", "math")  # PyTorch's own order on CUDA


def attention_choice() -> str:
    """The ``ERNIE_IMAGE_ATTENTION`` setting, checked: ``auto`` or one of ``BACKENDS``."""
    choice = os.environ.get(ATTENTION_ENV, "auto").strip().lower() or "auto"
    if choice != "auto" and choice not in BACKENDS:
        raise ErnieImageError(
            f"{ATTENTION_ENV}={choice!r} is not an attention kernel: use auto, {', '.join(BACKENDS)}, or unset it."
        )
    return choice


def backend_order(device: torch.device, choice: str, capability: tuple[int, int] | None = None) -> list[str] | None:
    """The SDPA backends in the order to try on ``device`` (None: PyTorch's own order). ``capability`` is the CUDA
    device's compute capability (read from the device when not given)."""
    if device.type != "cuda":
        return None  # the CPU has one fused kernel and the math one; PyTorch picks
    if choice == "auto":
        if capability is None:
            capability = torch.cuda.get_device_capability(device)
        if capability[0] != 9:
            return None
        choice = "cudnn"
    return [choice, *(name for name in _TORCH_ORDER if name != choice)]


def attention_backend(device: torch.device) -> contextlib.AbstractContextManager:
    """A context in which ``scaled_dot_product_attention`` on ``device`` prefers the chosen kernel."""
    order = backend_order(device, attention_choice())
    if order is None:
        return contextlib.nullcontext()
    return sdpa_kernel([BACKENDS[name] for name in order], set_priority=True)
