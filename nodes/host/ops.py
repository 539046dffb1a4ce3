"""Which of core's layers (``comfy.ops``) hold the DiT's weights, for the layouts the running core can load.

- Weights as computed: ``disable_weight_init``; fp8 storage cast per layer: ``manual_cast``.
- Quantized layers (``quant_layout.py``): core's ``mixed_precision_ops``, in the form the core reads:
  0.3.75 takes the layers' configurations as a map by layer name (``layer_quant_config``) and only
  ``float8_e4m3fn``; current cores take ``quant_config={"mixed_ops": True}`` and a ``<layer>.comfy_quant`` tensor
  per layer in the state dict (comfy/ops.py @0271a469), with more formats. A format the core's
  ``comfy.quant_ops.QUANT_ALGOS`` lacks is refused by name.
- A scaled fp8 file, where the core still has ``scaled_fp8_ops`` (0.3.75; removed in current cores): those
  layers, which multiply each weight's ``scale_weight`` in at run time.
"""

from __future__ import annotations

import inspect

import comfy.ops
import comfy.quant_ops
import torch

from ..errors import ErnieImageError, quoted
from ..quant_layout import CONFIG_SUFFIX, QuantLayers, config_tensor

NEWEST_CHECKED = "0.38.1"  # the newest core whose QUANT_ALGOS was read (comfy/quant_ops.py @0271a469)
NEWEST_FORMATS = ("float8_e4m3fn", "float8_e5m2", "nvfp4", "mxfp8", "int8_tensorwise", "convrot_w4a4",
                  "asym_w4a8_int8", "awq_w4a16")


def _core_version() -> str:
    try:
        from comfyui_version import __version__
    except ImportError:
        return "of unknown version"
    return __version__


def plain_operations(storage: torch.dtype, dtype: torch.dtype):
    """Core's layers for weights stored in ``storage`` and computed in ``dtype``."""
    return comfy.ops.manual_cast if storage != dtype else comfy.ops.disable_weight_init


def has_scaled_fp8_layers() -> bool:
    return getattr(comfy.ops, "scaled_fp8_ops", None) is not None


def scaled_fp8_operations(weights: dict[str, torch.Tensor], quantized: QuantLayers):
    """``scaled_fp8_ops`` and the weights under its names (``scale_weight``; the input scales it does not use)."""
    renamed = {}
    for key, value in weights.items():
        layer = key.rsplit(".", 1)[0]
        if layer in quantized.layers and key.endswith(".weight_scale"):
            renamed[f"{layer}.scale_weight"] = value.float()
        elif not (layer in quantized.layers and key.endswith(".input_scale")):
            renamed[key] = value
    return comfy.ops.scaled_fp8_ops(), renamed


def _refuse_missing_formats(quantized: QuantLayers) -> None:
    missing = sorted(quantized.formats - set(getattr(comfy.quant_ops, "QUANT_ALGOS", {})))
    if not missing:
        return
    layer = next(name for name, conf in quantized.layers.items() if conf["format"] == missing[0])
    newer = (f"ComfyUI {NEWEST_CHECKED} loads it" if missing[0] in NEWEST_FORMATS
             else f"no ComfyUI up to {NEWEST_CHECKED} knows it")
    raise ErnieImageError(
        f"This DiT file stores layers as {missing[0]} (first: {quoted(layer)}), a quantization format this ComfyUI "
        f"({_core_version()}) cannot load; {newer}. Update ComfyUI, or use an fp8 or bf16 file of the model.")


def mixed_operations(weights: dict[str, torch.Tensor], quantized: QuantLayers, dtype: torch.dtype,
                     load_device: torch.device | None = None):
    """Core's mixed-precision layers for ``quantized``'s layers, and the weights in the form the core reads."""
    _refuse_missing_formats(quantized)
    parameters = inspect.signature(comfy.ops.mixed_precision_ops).parameters
    if "layer_quant_config" in parameters:  # 0.3.75: the configurations by layer name
        return comfy.ops.mixed_precision_ops(quantized.layers, dtype), weights
    options = {}
    disabled = getattr(comfy.ops, "get_disabled_quant_formats", None)
    if "disabled" in parameters and disabled is not None and load_device is not None:
        options["disabled"] = disabled(load_device)  # formats the GPU has no kernels for
    tagged = dict(weights)
    tagged.update({layer + CONFIG_SUFFIX: config_tensor(conf) for layer, conf in quantized.layers.items()})
    return comfy.ops.mixed_precision_ops({"mixed_ops": True}, dtype, **options), tagged
