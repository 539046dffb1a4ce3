"""The DiT's precision, decided here only: the dtypes the loaders' inputs and ComfyUI's unet dtype flags ask for
(``asked_dtypes``), and the ``Precision`` the DiT is built in, resolved once from that and the dtypes the file holds
(``build.py``); the MODEL reads it back from the DiT (``model.py``)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..errors import ErnieImageError
from ..host.memory import compute_dtype, core_unet_dtype, torch_device

WEIGHT_DTYPES = {"default": None, "bf16": torch.bfloat16, "fp32": torch.float32,
                 "fp8_e4m3fn": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
RUNNABLE_DTYPES = [torch.bfloat16, torch.float32]  # what the pack's DiT computes in
STORAGE_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]  # what it may keep its block weights in, cast per layer


@dataclass(frozen=True)
class Precision:
    """The dtypes the DiT is built in.

    ``compute``: what it computes in, and holds its embeddings, norms and final layers in; ``storage``: what its
    block linear layers keep their weights in, cast to ``compute`` as each layer runs where the two differ;
    ``unpacks``: a quantized file's layers are unpacked into plain ``storage`` weights with their scales (asked
    for bf16 or fp32, or to quantize otherwise) instead of staying in their formats."""

    compute: torch.dtype
    storage: torch.dtype
    unpacks: bool = False

    @classmethod
    def resolve(cls, compute: torch.dtype, storage: torch.dtype | None,
                weights: Mapping[str, torch.Tensor]) -> Precision:
        """The precision of a DiT with these ``weights`` (as read from its file) asked for ``compute`` and
        ``storage``; ``storage`` None: the file's fp8 where its block weights are fp8, else ``compute``."""
        if storage is not None:
            return cls(compute, storage, unpacks=storage not in STORAGE_DTYPES)
        held = (v.dtype for k, v in weights.items() if k.startswith("layers.") and v.dtype in STORAGE_DTYPES)
        return cls(compute, next(held, compute))

    @property
    def manual_cast(self) -> torch.dtype | None:
        """Core's ``manual_cast_dtype``: the dtype the weights are cast to as each layer runs (None: they compute
        in the dtype they are stored in)."""
        return None if self.storage == self.compute else self.compute


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


def asked_dtypes(weight_dtype: str, quantization: str, quantizes: bool) -> tuple[torch.dtype, torch.dtype | None]:
    """What a DiT loader's ``weight_dtype`` and ``quantization`` inputs ask for, as ``weight_dtypes``. A method that
    ``quantizes`` starts from the compute dtype's weights, also where the file holds fp8 ones; fp8 storage beside
    it is refused, before any file is read."""
    dtype, storage = weight_dtypes(weight_dtype)
    if not quantizes:
        return dtype, storage
    if storage not in (None, dtype):
        raise ErnieImageError(f"weight_dtype {weight_dtype} and quantization {quantization} are two ways of storing "
                              "the DiT's weights: pick one (set the other to default / none).")
    return dtype, dtype


@functools.cache  # once per process and dtype pair
def _say_dtype_fallback(asked: torch.dtype, used: torch.dtype) -> None:
    logging.warning(
        "ERNIE-Image: ComfyUI's unet dtype flag asks for %s, which the ERNIE-Image DiT does not run in; loading it "
        "in %s. For FP8 weights, pick weight_dtype fp8_e4m3fn or the loader's quantization input (fp8_per_row).",
        asked, used)
