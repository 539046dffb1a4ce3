"""Build the pack's DiT from the tensors the loader read, in the dtypes asked (ComfyUI adapter: ``comfy.ops``).

Three ways to hold the weights, all with ComfyUI's own layers:
- as computed (bf16 on recent GPUs, fp32 on the CPU): ``comfy.ops.disable_weight_init``;
- fp8 storage (``weight_dtype`` fp8_*, or a file whose block weights are fp8): the block linear layers keep fp8
  weights and cast them to the compute dtype as each layer runs (``comfy.ops.manual_cast``); half of bf16's memory;
- scaled fp8 files (a per-tensor ``scale_weight`` beside each fp8 weight, the community's ``*_fp8_scaled`` files):
  ComfyUI's ``scaled_fp8_ops``, which multiply the scale in at run time, so the weights stay fp8 too.

Everything else (embeddings, norms, the shared modulation, the final layers: 2 % of the DiT) is held as computed.
"""

from __future__ import annotations

import logging
from pathlib import Path

import comfy.ops
import torch

from ..errors import ErnieImageError
from ..model_files import builds_weights
from .model import ErnieImageDiffusionModel
from .weights import read_dit

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
SCALE = ".scale_weight"
_SCALED_MARKERS = ("scaled_fp8",)  # an empty tensor whose dtype names the fp8 format; nothing to load


def _split_scales(state_dict: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The weights, and the per-tensor scales by layer name (``layers.0.mlp.up_proj``)."""
    scales = {k[: -len(SCALE)]: v for k, v in state_dict.items() if k.endswith(SCALE)}
    weights = {k: v for k, v in state_dict.items()
               if not k.endswith((SCALE, ".scale_input")) and k not in _SCALED_MARKERS}
    return weights, scales


def _fold_scales(weights: dict[str, torch.Tensor], scales: dict[str, torch.Tensor], dtype: torch.dtype) -> dict:
    """Weights times their scales, in ``dtype``: a scaled fp8 file as plain weights (to quantize, or to upcast)."""
    return {k: (v.float() * scales[k[: -len(".weight")]].float()).to(dtype) if k[: -len(".weight")] in scales
            else v for k, v in weights.items()}


def _operations(storage: torch.dtype, dtype: torch.dtype, scaled: bool):
    if scaled:
        return comfy.ops.scaled_fp8_ops()
    return comfy.ops.manual_cast if storage != dtype else comfy.ops.disable_weight_init


@builds_weights
def build_diffusion_model(state_dict: dict[str, torch.Tensor], config: dict, dtype: torch.dtype,
                          storage: torch.dtype | None = None) -> ErnieImageDiffusionModel:
    """The DiT with ``config``'s architecture holding ``state_dict``'s weights, computing in ``dtype``.

    ``storage``: the block linear layers' weights' dtype; None keeps an fp8 file's fp8, else ``dtype``."""
    weights, scales = _split_scales(state_dict)
    if storage is None:
        storage = next((v.dtype for k, v in weights.items() if k.startswith("layers.") and v.dtype in FP8_DTYPES),
                       dtype)
    if scales and (storage not in FP8_DTYPES or not hasattr(comfy.ops, "scaled_fp8_ops")):
        if storage in FP8_DTYPES:  # a ComfyUI without scaled fp8 layers: held as computed
            logging.warning("ERNIE-Image: this ComfyUI has no scaled fp8 layers; the scaled fp8 DiT is held in %s",
                            dtype)
            storage = dtype
        weights, scales = _fold_scales(weights, scales, dtype), {}
    with torch.device("meta"):
        model = ErnieImageDiffusionModel(**config, dtype=storage, operations=_operations(storage, dtype, bool(scales)))
    block_linear = {f"{name}.weight" for name, module in model.named_modules()
                    if isinstance(module, torch.nn.Linear) and name.startswith("layers.")}
    tensors = {k: v.to(storage if k in block_linear else dtype) for k, v in weights.items()}
    tensors.update({name + SCALE: scale.float() for name, scale in scales.items()})
    missing, unexpected = model.load_state_dict(tensors, strict=False, assign=True)
    missing = [k for k in missing if not k.endswith(SCALE)]  # a layer the file holds no scale for: scale 1 below
    if missing or unexpected:
        raise ErnieImageError(
            f"These weights do not match the ERNIE-Image architecture (missing {missing[:3]}, unexpected "
            f"{unexpected[:3]}). The file is from another model version or damaged: download it again."
        )
    for module in model.modules():
        if isinstance(getattr(module, "scale_weight", None), torch.Tensor) and module.scale_weight.is_meta:
            module.scale_weight = torch.nn.Parameter(torch.ones(()), requires_grad=False)
    model.dtype = storage  # what ComfyUI reads as the model's weight dtype
    return model.eval()


def load_dit(path: Path, dtype: torch.dtype, storage: torch.dtype | None = None) -> ErnieImageDiffusionModel:
    """The DiT from a snapshot folder, its ``transformer/`` folder or a single file."""
    return build_diffusion_model(*read_dit(path), dtype, storage)
