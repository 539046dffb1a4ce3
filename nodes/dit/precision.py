"""The DiT's dtypes as the loaders' ``weight_dtype`` input and ComfyUI's unet dtype flags choose them."""

from __future__ import annotations

import functools
import logging

import torch

from ..host.memory import compute_dtype, core_unet_dtype, torch_device

WEIGHT_DTYPES = {"default": None, "bf16": torch.bfloat16, "fp32": torch.float32,
                 "fp8_e4m3fn": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
RUNNABLE_DTYPES = [torch.bfloat16, torch.float32]  # what the pack's DiT computes in
STORAGE_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]  # what it may keep its block weights in, cast per layer


def weight_dtypes(choice: str) -> tuple[torch.dtype, torch.dtype | None]:
    """The DiT's compute dtype and its block weights' dtype (None: an fp8 file's own fp8, else the compute dtype).

    ``default``: ComfyUI's pick for the device (bf16 on recent GPUs, fp32 on CPU), and a file's fp8 weights stay
    fp8. ComfyUI's global unet dtype flags (``--fp8_e4m3fn-unet``, ``--bf16-unet``, ...) make its pick a dtype
    whatever the model or file: an fp8 one becomes the storage; one the pack's DiT cannot run falls back to bf16
    (fp32 where bf16 is unsupported), said once."""
    device = torch_device()
    asked = WEIGHT_DTYPES[choice]
    if asked is None:
        asked, forced = core_unet_dtype(device, RUNNABLE_DTYPES)
        if asked not in RUNNABLE_DTYPES + STORAGE_DTYPES:
            _say_dtype_fallback(asked, compute_dtype(device))
            return compute_dtype(device), None
        if not forced:
            return asked, None
    if asked in STORAGE_DTYPES:
        return compute_dtype(device), asked
    return asked, asked


@functools.cache  # once per process and dtype pair
def _say_dtype_fallback(asked: torch.dtype, used: torch.dtype) -> None:
    logging.warning(
        "ERNIE-Image: ComfyUI's unet dtype flag asks for %s, which the ERNIE-Image DiT does not run in; loading it "
        "in %s. For FP8 weights, pick weight_dtype fp8_e4m3fn or the loader's quantization input (fp8_per_row).",
        asked, used)
