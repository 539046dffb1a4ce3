"""What ComfyUI's attention switches ask of the DiT (``comfy.cli_args``, ``comfy.ldm.modules.attention``).

Core reads its switches once, at start, into ``optimized_attention``. The DiT follows a switch the user set where
the images stay diffusers' (``ErnieImagePipeline``) to rounding, as the parity tests hold it:

- ``--use-split-cross-attention``, ``--use-quad-cross-attention``: core's split or sub-quadratic attention, which
  compute the same softmax in slices (less memory, slower).
- ``--use-flash-attention``: PyTorch's own FlashAttention kernel first, the same FlashAttention-2 that core calls
  through the flash-attn package; that call takes no mask and warns at each call with one (a CFG batch of two prompt
  lengths), while PyTorch's kernel list moves on to the next kernel there.
- ``--use-sage-attention``: not followed. SageAttention rounds Q and K to 8-bit integers, so the images would drift
  from the reference by more than rounding; the DiT keeps PyTorch's SDPA and says so once in the log.

Without a switch, core's default choice (PyTorch's SDPA on NVIDIA, sub-quadratic attention on the CPU, xformers
where it is installed) leaves the DiT on PyTorch's SDPA, the reference's own attention, with the kernel order of
``dit.attention`` (the fastest at ERNIE-Image's shapes). ``ERNIE_IMAGE_ATTENTION`` still picks the SDPA kernel.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import comfy.ldm.modules.attention as core_attention
from comfy.cli_args import args

# Each switch (argparse's name) and the function of core's it selects: a switch took effect where core's choice is
# that function (xformers, where installed, comes before the split, quad and flash switches).
_SWITCHES = {"use_split_cross_attention": "attention_split", "use_quad_cross_attention": "attention_sub_quad",
             "use_flash_attention": "attention_flash", "use_sage_attention": "attention_sage"}


def core_attention_choice() -> tuple[Callable | None, str]:
    """How the DiT attends on this ComfyUI (the module's rule): core's attention function to call instead of
    PyTorch's SDPA (None: SDPA), and the SDPA kernel to put first (``auto``: the pack's own order); the fields of
    ``dit.attention.AttentionPlan``."""
    switch = next((name for name in _SWITCHES if getattr(args, name, False)), None)  # they exclude each other
    function = getattr(core_attention, _SWITCHES.get(switch, ""), None)
    if function is None or core_attention.optimized_attention is not function:
        return None, "auto"
    if switch == "use_sage_attention":
        _say_sage_not_followed()
        return None, "auto"
    if switch == "use_flash_attention":
        _say_followed(switch, "PyTorch's FlashAttention kernel")
        return None, "flash"
    _say_followed(switch, f"core's {function.__name__}")
    return function, "auto"


def _flag(switch: str) -> str:
    return "--" + switch.replace("_", "-")


@functools.cache  # once per process: every DiT load asks
def _say_followed(switch: str, what: str) -> None:
    logging.info("ERNIE-Image: the DiT follows %s (%s).", _flag(switch), what)


@functools.cache
def _say_sage_not_followed() -> None:
    logging.warning("ERNIE-Image: the DiT does not follow --use-sage-attention: SageAttention rounds Q and K to 8 "
                    "bits, so images would drift from the ERNIE-Image reference; it keeps PyTorch's attention.")
