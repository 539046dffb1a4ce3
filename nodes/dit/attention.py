"""How the DiT attends: PyTorch's SDPA and which of its kernels, or the attention a ComfyUI switch asks for
(engine: no ComfyUI here; ``host.attention`` reads the switches, ``build`` makes them an ``AttentionPlan``).

``auto`` keeps PyTorch's own order everywhere except on Hopper (sm90) CUDA GPUs, where cuDNN's attention comes
first: at ERNIE-Image's shapes (32 heads of 128, 4k+ tokens, no mask) it is the fastest kernel PyTorch has there
(bench/RESULTS.md, "Fast path on Hopper"). Each other backend stays in the list after it, so a shape or mask that
cuDNN does not take still runs. The override is the ``ERNIE_IMAGE_ATTENTION`` environment variable: ``cudnn``,
``flash``, ``efficient`` or ``math`` put that kernel first; ``auto`` (or unset) is the rule above.

The choice applies around each DiT forward (``sdpa_kernel`` is a context manager, nothing global changes), and a
compiled block records the kernel chosen when it was traced, so the choice is made once per process.

ComfyUI's attention switches reach the DiT as an ``AttentionPlan``, fixed when the DiT is built (core reads its
switches once, at start): core's own attention function in place of SDPA, or the SDPA kernel to put first where
``ERNIE_IMAGE_ATTENTION`` is unset. Which switches are followed, and why the others are not: ``host.attention``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
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


def attention_choice(default: str = "auto") -> str:
    """The ``ERNIE_IMAGE_ATTENTION`` setting, checked: ``auto`` or one of ``BACKENDS``; ``default`` where it is
    unset."""
    choice = os.environ.get(ATTENTION_ENV, default).strip().lower() or default
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


def attention_backend(device: torch.device, default: str = "auto") -> contextlib.AbstractContextManager:
    """A context in which ``scaled_dot_product_attention`` on ``device`` prefers the chosen kernel (``default``
    where ``ERNIE_IMAGE_ATTENTION`` is unset)."""
    order = backend_order(device, attention_choice(default))
    if order is None:
        return contextlib.nullcontext()
    return sdpa_kernel([BACKENDS[name] for name in order], set_priority=True)


# Core's convention: (q, k, v, heads, mask=, skip_reshape=, skip_output_reshape=) on [B, heads, S, head_dim] when
# both skips are set; an additive float mask (core's split and sub-quadratic attention add it to the scores).
CoreAttention = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class AttentionPlan:
    """How the DiT attends: ``function`` is core's attention (None: PyTorch's SDPA); ``kernel`` the SDPA kernel
    to put first where ``ERNIE_IMAGE_ATTENTION`` is unset (``auto``: the rule above)."""

    function: CoreAttention | None = None
    kernel: str = "auto"

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Attention over ``[B, heads, S, head_dim]``; ``mask`` is boolean (True: attend) or None."""
        if self.function is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        if mask is not None:  # finite: -inf would turn a slice of keys that are all padding into NaN where core
            # computes attention slice by slice (sub-quadratic attention's key chunks)
            mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, torch.finfo(q.dtype).min)
        return self.function(q, k, v, q.shape[1], mask=mask, skip_reshape=True, skip_output_reshape=True)

    def backend(self, device: torch.device) -> contextlib.AbstractContextManager:
        """The SDPA kernel context for one forward on ``device`` (none where core's function attends)."""
        return attention_backend(device, self.kernel) if self.function is None else contextlib.nullcontext()


SDPA = AttentionPlan()
# What in a run's transformer_options would change a core model's attention or blocks; the DiT applies none of
# them (see ErnieImageDiT), as core's own ERNIE-Image applies none.
_PATCH_KEYS = ("patches", "patches_replace", "optimized_attention_override")


def say_unapplied_patches(transformer_options: Mapping) -> None:
    """Say in the log, once per kind, which attention or block patches in ``transformer_options`` the DiT does not
    apply."""
    for key in _PATCH_KEYS:
        value = transformer_options.get(key)
        if value is not None and (not isinstance(value, Mapping) or any(value.values())):
            _say_unapplied(key)


@functools.cache  # once per process and kind: a run calls the DiT at every step
def _say_unapplied(key: str) -> None:
    logging.warning("ERNIE-Image: the DiT does not apply transformer_options['%s'] (another node's attention or "
                    "block patch): it runs its own blocks and attention, as ComfyUI's own ERNIE-Image does.", key)
