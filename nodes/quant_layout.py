"""The quantized layouts a DiT file may hold its block weights in, read into one form (engine: no ComfyUI here).

- Scaled fp8, the community's ``*_fp8_scaled`` files: fp8 weights, a per-tensor ``<layer>.scale_weight`` (and
  ``scale_input``) beside each, and a ``scaled_fp8`` marker.
- ComfyUI's mixed precision ("comfy_quant", current cores): per quantized layer a ``<layer>.comfy_quant`` uint8
  tensor holding the JSON of its configuration (``{"format": "float8_e4m3fn"}``, ``nvfp4``, …) beside its
  ``weight_scale`` (and ``input_scale``, ``weight_scale_2``).
- ComfyUI 0.3.75's form of the same: the configurations in the safetensors header's ``_quantization_metadata``
  (``{"layers": {<layer>: {"format": …}}}``) instead of per-layer tensors.

``split_quantization`` turns each into ``QuantLayers``: the layers' configurations by layer name, with the scales
under comfy_quant's names (``weight_scale``, ``input_scale``), as current cores' ``convert_old_quants`` does
(comfy/utils.py @09708eae). Which of core's layers then hold them is the host's choice (``host/ops.py``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from .errors import ErnieImageError, quoted

FP8_FORMATS = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}
CONFIG_SUFFIX = ".comfy_quant"
SCALED_MARKER = "scaled_fp8"  # an empty tensor whose dtype names the fp8 format; nothing to load
HEADER_KEY = "_quantization_metadata"
_MAX_CONFIG_BYTES = 4096  # one layer's JSON; real ones are tens of bytes
# Scaled fp8's names → comfy_quant's.
_RENAMED = {".scale_weight": ".weight_scale", ".scale_input": ".input_scale"}


@dataclass(frozen=True)
class QuantLayers:
    """The quantized layers of a DiT file: each one's configuration (``format`` and its options) by layer name."""

    layers: dict[str, dict] = field(default_factory=dict)
    scaled_fp8: bool = False  # read from a scaled fp8 file (0.3.75 has layers made for those)

    @property
    def formats(self) -> set[str]:
        return {conf["format"] for conf in self.layers.values()}


def header_metadata(path: Path) -> dict[str, str]:
    """The safetensors header's metadata of a file, or of every shard of a folder (merged)."""
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    metadata: dict[str, str] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                metadata.update(f.metadata() or {})
        except (SafetensorError, OSError):
            continue  # reading the weights names the damaged file
    return metadata


def _config(value: object, where: str) -> dict:
    if not isinstance(value, dict) or not isinstance(value.get("format"), str):
        raise ErnieImageError(f"{where} is not a quantization configuration (a JSON object with a 'format'): the "
                              "file is damaged or not a ComfyUI quantized model. Download it again.")
    return value


def _decode(tensor: torch.Tensor, key: str) -> dict:
    key = quoted(key)  # a name from the file, for the messages
    if tensor.dtype != torch.uint8 or tensor.ndim != 1 or tensor.numel() > _MAX_CONFIG_BYTES:
        raise ErnieImageError(f"{key} is not a quantization configuration (a short uint8 tensor of JSON): the file "
                              "is damaged. Download it again.")
    try:
        value = json.loads(tensor.numpy().tobytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as error:
        raise ErnieImageError(f"{key} holds no readable JSON ({error}): the file is damaged. Download it again.") \
            from error
    return _config(value, key)


def header_layers(metadata: dict[str, str]) -> dict[str, dict]:
    """The quantized layers 0.3.75's header form declares (``_quantization_metadata``), by layer name."""
    text = metadata.get(HEADER_KEY)
    if text is None:
        return {}
    try:
        layers = json.loads(text)["layers"]
    except (ValueError, KeyError, TypeError) as error:
        raise ErnieImageError(f"The file's {HEADER_KEY} header is not ComfyUI's quantization metadata ({error!r}): "
                              "the file is damaged. Download it again.") from error
    if not isinstance(layers, dict):
        raise ErnieImageError(f"The file's {HEADER_KEY} header has no layer map: the file is damaged.")
    return {name: _config(conf, f"{HEADER_KEY}[{quoted(name)!r}]") for name, conf in layers.items()}


def split_quantization(state_dict: dict[str, torch.Tensor],
                       metadata: dict[str, str] | None = None) -> tuple[dict[str, torch.Tensor], QuantLayers]:
    """The weights (configuration tensors and markers taken out, scales under comfy_quant's names) and the
    quantized layers of a DiT file in any of the three layouts."""
    layers = header_layers(metadata or {})
    weights: dict[str, torch.Tensor] = {}
    marker = state_dict.get(SCALED_MARKER)
    for key, value in state_dict.items():
        if key.endswith(CONFIG_SUFFIX):
            layers[key[: -len(CONFIG_SUFFIX)]] = _decode(value, key)
        elif key != SCALED_MARKER:
            weights[key] = value
    if marker is None and not any(k.endswith(".scale_weight") for k in weights):
        return weights, QuantLayers(layers)
    for key in [k for k in weights if k.endswith(tuple(_RENAMED))]:
        suffix = next(s for s in _RENAMED if key.endswith(s))
        layer = key[: -len(suffix)]
        value = weights.pop(key)
        if suffix == ".scale_input" and value.numel() == 1 and float(value) == 1.0:
            continue  # an input scale of 1 changes nothing (convert_old_quants drops it too)
        weights[layer + _RENAMED[suffix]] = value
        weight = weights.get(layer + ".weight")
        if suffix == ".scale_weight" and weight is not None:
            fmt = next((name for name, dtype in FP8_FORMATS.items() if dtype == weight.dtype), None)
            if fmt is None:
                raise ErnieImageError(f"{layer}.scale_weight scales a {weight.dtype} weight: scaled fp8 files hold "
                                      "fp8 weights. The file is damaged or of another kind.")
            layers[layer] = {"format": fmt}
    return weights, QuantLayers(layers, scaled_fp8=True)


def fold_quantization(weights: dict[str, torch.Tensor], quantized: QuantLayers,
                      dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The weights with every quantized layer's scale multiplied in, in ``dtype``: the file as plain weights (to
    compute in bf16/fp32, or to quantize otherwise). Only fp8 layers can be unpacked so."""
    folded = dict(weights)
    for layer, conf in quantized.layers.items():
        if conf["format"] not in FP8_FORMATS:
            raise ErnieImageError(
                f"{layer} is stored as {conf['format']}, which the pack cannot unpack into plain weights: load the "
                "file with weight_dtype default and quantization none (ComfyUI's own layers run it), or use the bf16 "
                "file.")
        scale = folded.pop(f"{layer}.weight_scale", None)
        folded.pop(f"{layer}.input_scale", None)
        weight = folded[f"{layer}.weight"].float()
        folded[f"{layer}.weight"] = (weight if scale is None else weight * scale.float()).to(dtype)
    return folded


def config_tensor(conf: dict) -> torch.Tensor:
    """A layer's configuration as current cores read it from the state dict: its JSON as a uint8 tensor."""
    return torch.tensor(list(json.dumps(conf).encode("utf-8")), dtype=torch.uint8)
