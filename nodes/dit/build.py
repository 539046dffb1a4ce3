"""Build the pack's DiT from the tensors the loader read, in the dtypes asked, with ComfyUI's own layers.

Ways to hold the weights (``host/ops.py`` picks core's layers for each, on the running core):
- as computed (bf16 on recent GPUs, fp32 on the CPU);
- fp8 storage (``weight_dtype`` fp8_*, or a file whose block weights are fp8): the block linear layers keep fp8
  weights and cast them to the compute dtype as each layer runs; half of bf16's memory;
- quantized files (``quant_layout.py``: the community's scaled fp8, ComfyUI's comfy_quant layouts): the weights
  stay in their format, held by core's quantized layers. Asked for another dtype (bf16, fp32, or a quantization
  method that starts from plain weights), fp8 layers are unpacked with their scales instead.

Everything else (embeddings, norms, the shared modulation, the final layers: 2 % of the DiT) is held as computed.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ..errors import ErnieImageError
from ..host import attention, ops
from ..model_files import builds_weights, dit_folder
from ..quant_layout import FP8_FORMATS, QuantLayers, fold_quantization, header_metadata, split_quantization
from .attention import AttentionPlan
from .model import ErnieImageDiffusionModel
from .precision import Precision
from .weights import dit_config, expected_shapes, read_dit

SCALE = ".scale_weight"


def _operations(weights: dict[str, torch.Tensor], quantized: QuantLayers, precision: Precision,
                load_device: torch.device | None):
    """Core's layers for these weights, the weights in the form those layers load, and the formats core's
    mixed-precision layers hold."""
    if not quantized.layers:
        return ops.plain_operations(precision.storage, precision.compute), weights, frozenset()
    if quantized.scaled_fp8 and ops.has_scaled_fp8_layers() and quantized.formats <= set(FP8_FORMATS):
        return *ops.scaled_fp8_operations(weights, quantized), frozenset()
    operations, tensors = ops.mixed_operations(weights, quantized, precision.compute, load_device)
    logging.info("ERNIE-Image: %d DiT layers stay in %s, held by ComfyUI's mixed-precision layers",
                 len(quantized.layers), ", ".join(sorted(quantized.formats)))
    return operations, tensors, frozenset(quantized.formats)


@builds_weights
def build_diffusion_model(state_dict: dict[str, torch.Tensor], config: dict, dtype: torch.dtype,
                          storage: torch.dtype | None = None, metadata: dict[str, str] | None = None,
                          load_device: torch.device | None = None, *,
                          consume: bool = False) -> ErnieImageDiffusionModel:
    """The DiT with ``config``'s architecture holding ``state_dict``'s weights, computing in ``dtype``.

    ``storage``: the block linear layers' weights' dtype; None keeps an fp8 or quantized file's format, else
    ``dtype`` (resolved once, by ``Precision.resolve``; the DiT keeps the result as ``precision``). ``metadata``:
    the file's safetensors header metadata (0.3.75's quantization layout lives there).
    ``load_device``: where ComfyUI will run it (core leaves out quantized formats its GPU has no kernels for).
    ``consume``: ``state_dict`` is the caller's to give away (read from a file for this model alone); it is emptied,
    so that each tensor read is released once cast: a DiT cast to fp8 storage holds one source tensor at a time
    beside its weights, not the file's every page (the bf16 Turbo DiT on an 8 GB card: 14.2 GiB of mapped file
    beside 10.6 GiB of the process's own at the first load, bench/RESULTS.md, 2026-12-06)."""
    weights, quantized = split_quantization(state_dict, metadata)
    if consume:
        state_dict.clear()  # ``weights`` holds what is built from
    precision = Precision.resolve(dtype, storage, weights)
    if quantized.layers and precision.unpacks:
        weights, quantized = fold_quantization(weights, quantized, precision.compute), QuantLayers()
    operations, tensors, mixed_formats = _operations(weights, quantized, precision, load_device)
    with torch.device("meta"):
        model = ErnieImageDiffusionModel(**config, dtype=precision.storage, operations=operations,
                                         attention=AttentionPlan(*attention.core_attention_choice()))
    block_linear = {f"{name}.weight" for name, module in model.named_modules()
                    if isinstance(module, torch.nn.Linear) and name.startswith("layers.")}

    def cast(key: str, value: torch.Tensor) -> torch.Tensor:
        layer, name = key.rsplit(".", 1)
        if not value.is_floating_point() or (layer in quantized.layers and name != "bias"):
            return value  # a quantized weight and its scales stay in their formats
        return value.to(precision.storage if key in block_linear else precision.compute)

    del weights  # ``tensors`` holds what is built from
    tensors = {key: cast(key, tensors.pop(key)) for key in list(tensors)}  # a source tensor released once cast
    missing, unexpected = model.load_state_dict(tensors, strict=False, assign=True)
    missing = [k for k in missing if not k.endswith(SCALE)]  # a scaled layer the file holds no scale for: 1 below
    if missing or unexpected:
        raise ErnieImageError(
            f"These weights do not match the ERNIE-Image architecture (missing {missing[:3]}, unexpected "
            f"{unexpected[:3]}). The file is from another model version or damaged: download it again."
        )
    for module in model.modules():
        if isinstance(getattr(module, "scale_weight", None), torch.Tensor) and module.scale_weight.is_meta:
            module.scale_weight = torch.nn.Parameter(torch.ones(()), requires_grad=False)
    model.precision = precision  # what its MODEL is configured by (model.py)
    model.dtype = precision.storage  # what ComfyUI reads as the model's weight dtype
    model.quant_formats = mixed_formats  # the quantized formats core's layers hold (none: plain or scaled fp8)
    return model.eval()


def load_dit(path: Path, dtype: torch.dtype, storage: torch.dtype | None = None,
             load_device: torch.device | None = None) -> ErnieImageDiffusionModel:
    """The DiT from a snapshot folder, its ``transformer/`` folder or a single file."""
    folder = dit_folder(path)
    state_dict, config = read_dit(path, dtype)
    dit = build_diffusion_model(state_dict, config, dtype, storage, header_metadata(folder), load_device, consume=True)
    dit.source = str(path)
    return dit


def dit_skeleton(path: Path, dtype: torch.dtype) -> ErnieImageDiffusionModel:
    """The DiT of the architecture at ``path`` (its headers alone) with every weight on the meta device, held in
    ``dtype`` as plain weights are: for a loader that puts weights made elsewhere in place (a saved quantized DiT,
    ``quant/torchao_file.py``). Nothing is read or allocated."""
    config = dit_config(path)
    empty = {name: torch.empty(shape, dtype=dtype, device="meta") for name, shape in expected_shapes(config).items()}
    return build_diffusion_model(empty, config, dtype, dtype)
