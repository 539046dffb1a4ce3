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

Every scale is checked against its layer's format before the weights are read: its shape from the header alone
(``check_layout``: one number per weight where the format has one, a block scale no larger than its weight's
blocks, the weight stored in the format's dtype), then its values (``check_scale_values``): a scale the weights are
multiplied by must be positive, normal and small enough that the format's largest value times it stays within the
compute dtype, else the image is black or garbage with no error. Block scales (NVFP4's) may be zero: an all-zero
block.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from . import bounded_json
from .bounded_json import NestedTooDeeply
from .errors import ErnieImageError, quoted
from .model_files import TensorInfo
from .structure import SCALE_SUFFIXES, natural

FP8_FORMATS = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}
CONFIG_SUFFIX = ".comfy_quant"
SCALED_MARKER = "scaled_fp8"  # an empty tensor whose dtype names the fp8 format; nothing to load
HEADER_KEY = "_quantization_metadata"
_MAX_CONFIG_BYTES = 4096  # one layer's JSON; real ones are tens of bytes
# Scaled fp8's names → comfy_quant's.
_RENAMED = {".scale_weight": ".weight_scale", ".scale_input": ".input_scale"}
# What each format stores a weight as (safetensors' dtype name), the largest magnitude of a stored value times its
# block scale (what a per-tensor scale multiplies: NVFP4's e2m1 reaches 6, its fp8 block scale 448), and which of
# its scales hold one number and which one per block of values (NVFP4's, per 16 values of a row). Other formats of
# newer cores are left to the core that loads them, but for the bound of a one-number scale (newer cores' int8: 127).
STORED = {"float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "nvfp4": "U8"}
LARGEST = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0, "int8_tensorwise": 127.0, "nvfp4": 6.0 * 448.0}
PER_TENSOR = {"float8_e4m3fn": ("weight_scale", "input_scale"), "float8_e5m2": ("weight_scale", "input_scale"),
              "nvfp4": ("weight_scale_2", "input_scale")}
BLOCK = {"nvfp4": ("weight_scale", 16)}  # the scale's name and the values per block
PACKED = frozenset({"nvfp4"})  # two values a byte: the weight has half the columns
SMALLEST_NORMAL = torch.finfo(torch.float32).tiny  # a smaller scale is subnormal: 1e-45 zeroes every weight
_FP8_NAMES = {"F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


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


def is_config_tensor(info: TensorInfo) -> bool:
    """Whether a header's tensor can be a layer's configuration (a short uint8 vector), so that reading it is cheap."""
    return info.dtype == "U8" and len(info.shape) == 1 and info.numel <= _MAX_CONFIG_BYTES


def _json(text: str | bytes) -> object:
    """JSON's value; deep nesting is refused as ValueError in this file's words, as other bad JSON."""
    try:
        return bounded_json.loads(text)
    except NestedTooDeeply:
        raise ValueError("nested deeper than any quantization configuration") from None


def decode_config(tensor: torch.Tensor, key: str) -> dict:
    """The configuration a ``<layer>.comfy_quant`` tensor holds, or an error naming ``key``."""
    key = quoted(key)  # a name from the file, for the messages
    if tensor.dtype != torch.uint8 or tensor.ndim != 1 or tensor.numel() > _MAX_CONFIG_BYTES:
        raise ErnieImageError(f"{key} is not a quantization configuration (a short uint8 tensor of JSON): the file "
                              "is damaged. Download it again.")
    try:
        value = _json(tensor.numpy().tobytes().decode("utf-8"))
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
        layers = _json(text)["layers"]
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
            layers[key[: -len(CONFIG_SUFFIX)]] = decode_config(value, key)
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
                raise _not_fp8(layer, weight.dtype)
            layers[layer] = {"format": fmt}
    return weights, QuantLayers(layers, scaled_fp8=True)


def fold_quantization(weights: dict[str, torch.Tensor], quantized: QuantLayers,
                      dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The weights with every quantized layer's scale multiplied in, in ``dtype``: the file as plain weights (to
    compute in bf16/fp32, or to quantize otherwise). Only fp8 layers can be unpacked so."""
    folded = dict(weights)
    for layer, conf in quantized.layers.items():
        if conf["format"] not in FP8_FORMATS:
            layer, conf = quoted(layer), {"format": quoted(conf["format"])}  # from the file, for the message
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


def _scale_suffix(key: str) -> tuple[str, str]:
    """A scale's layer and its name in comfy_quant's words (scaled fp8's ``scale_weight`` is a ``weight_scale``)."""
    layer, _, suffix = key.rpartition(".")
    return layer, _RENAMED.get(f".{suffix}", f".{suffix}")[1:]


def _not_fp8(layer: str, dtype: object) -> ErnieImageError:
    layer = quoted(layer)  # a name from the file, for the message
    return ErnieImageError(f"{layer}.scale_weight scales a {dtype} weight: scaled fp8 files hold fp8 weights. The file "
                           "is damaged or of another kind.")


def header_formats(header: Mapping[str, TensorInfo], configs: Mapping[str, dict]) -> dict[str, str]:
    """Each quantized layer's format, from the header alone: ``configs`` by layer name (the ``.comfy_quant``
    tensors' and the header metadata's), and in a scaled fp8 file the fp8 dtype of each weight a ``scale_weight``
    scales."""
    formats = {layer: conf["format"] for layer, conf in configs.items()}
    for key in header:
        if key.endswith(".scale_weight") and key[: -len(".scale_weight")] not in formats:
            layer = key[: -len(".scale_weight")]
            weight = header.get(f"{layer}.weight")
            if weight is not None and weight.dtype not in _FP8_NAMES:
                raise _not_fp8(layer, weight.dtype)
            if weight is not None:
                formats[layer] = _FP8_NAMES[weight.dtype]
    return formats


def layer_formats(header: Mapping[str, TensorInfo], read: Callable[[list[str]], Mapping[str, torch.Tensor]],
                  metadata: dict[str, str], source: str, advice: str, error: type[ErnieImageError] = ErnieImageError,
                  prefix: str = "") -> dict[str, str]:
    """Each quantized layer's format (``header_formats``), by its name in ``header``: the configurations of the
    header ``metadata`` (its names under the file's ``prefix``) and of the ``.comfy_quant`` tensors, which
    ``read(keys)`` reads once each is known to be a short uint8 vector. Errors name ``source``, in ``error``'s type."""
    keys = [k for k in header if k.endswith(CONFIG_SUFFIX)]
    bad = next((k for k in keys if not is_config_tensor(header[k])), None)
    if bad is not None:
        raise error(f"{source}: {quoted(bad)} is not a quantization configuration (a short uint8 tensor of JSON): the "
                    f"file is damaged. {advice}")
    try:
        configs = {name[len(prefix):]: conf for name, conf in header_layers(metadata).items()
                   if name.startswith(prefix)}
        if keys:  # a plain file is not opened again
            configs.update({k[: -len(CONFIG_SUFFIX)]: decode_config(v, k) for k, v in read(keys).items()})
        return header_formats(header, configs)
    except ErnieImageError as e:  # said in the pack's words; here in the caller's error type, naming the file
        raise error(f"{source}: {e}") from e


def _check_block_scale(key: str, info: TensorInfo, weight: TensorInfo, fmt: str, source: str, advice: str,
                       error: type[ErnieImageError]) -> None:
    """As many block scales as the weight has blocks, at most padded as ComfyUI's kernels pad them (to 128 rows and
    4 columns of scales; stored swizzled, so only their count is checked)."""
    rows, columns = weight.shape[0], weight.shape[-1] * (2 if fmt in PACKED else 1)
    size = BLOCK[fmt][1]
    blocks = -(-columns // size)
    most = -(-rows // 128) * 128 * -(-blocks // 4) * 4
    if not rows * blocks <= info.numel <= most:
        raise error(f"{source}: {key} holds {info.numel} scales (shape {list(info.shape)}); a {quoted(fmt)} layer of "
                    f"{rows} rows of {columns} values has one scale per {size} values of a row, {rows * blocks} "
                    f"(padded: up to {most}): the file is damaged. {advice}")


def check_layout(header: Mapping[str, TensorInfo], formats: Mapping[str, str], source: str, advice: str,
                 error: type[ErnieImageError] = ErnieImageError, per_row: bool = False) -> None:
    """From the header alone: every quantized layer's weight is stored as its format says (an int8 weight under a
    float8 configuration, or fp8 weights packed two a byte, are refused by key), and every scale has the shape its
    format gives it: one number per weight (``per_row``: or one per row, for layers that apply it per row), one per
    block of values. A per-row scale of shape ``[out]`` would be multiplied along the wrong axis of a square
    weight, silently."""
    for layer in sorted(formats, key=natural):
        fmt, weight = formats[layer], header.get(f"{layer}.weight")
        layer, fmt = quoted(layer), quoted(fmt)  # names from the file, for the messages (STORED knows none cut)
        if weight is None:
            raise error(f"{source}: the quantization configuration names {layer}, which has no weight in the file: "
                        f"the file is damaged. {advice}")
        if fmt in STORED and weight.dtype != STORED[fmt]:
            raise error(f"{source}: {layer}.weight is stored as {weight.dtype}, but its quantization configuration "
                        f"says {fmt}, stored as {STORED[fmt]}: the file is damaged or its weights are of another "
                        f"format. {advice}")
    for key in sorted((k for k in header if k.rpartition(".")[2] in SCALE_SUFFIXES), key=natural):
        layer, suffix = _scale_suffix(key)
        info, fmt, weight = header[key], formats.get(layer), header.get(f"{layer}.weight")
        key, layer = quoted(key), quoted(layer)  # names from the file, for the messages
        if fmt is None or weight is None:
            raise error(f"{source}: {key} scales no quantized weight (no quantization configuration names {layer}): "
                        f"the file is damaged. {advice}")
        if fmt in BLOCK and suffix == BLOCK[fmt][0]:
            _check_block_scale(key, info, weight, fmt, source, advice, error)
        elif suffix in PER_TENSOR.get(fmt, ()):
            rows = weight.shape[0]
            if info.numel == 1 or (per_row and suffix == "weight_scale" and list(info.shape) in ([rows], [rows, 1])):
                continue
            kind = "scaled fp8 files" if key.endswith((".scale_weight", ".scale_input")) else f"{quoted(fmt)} layers"
            raise error(f"{source}: {key} has shape {list(info.shape)}, but this pack loads {kind} with one scale per "
                        f"weight (a single number){' or one per row' if per_row else ''}; other scales are not loaded "
                        f"(one along the wrong axis would change the image silently). {advice}")
        elif fmt in PER_TENSOR:
            raise error(f"{source}: {key} is no scale a {fmt} layer has: the file is damaged. {advice}")
        elif info.numel > weight.numel:
            raise error(f"{source}: {key} has shape {list(info.shape)}, more scales than {layer}.weight has values: "
                        f"the file is damaged. {advice}")


def check_scale(name: str, values: torch.Tensor, fmt: str | None, compute: torch.dtype, source: str, advice: str,
                error: type[ErnieImageError] = ErnieImageError) -> None:
    """A scale of one number per weight or per row of ``fmt``, which the weights are multiplied by: finite, normal
    and small enough that the format's largest value times it stays within ``compute``."""
    values = values.float()
    largest = LARGEST.get(fmt or "", 1.0)
    top = torch.finfo(compute).max / largest
    bad = values[~(torch.isfinite(values) & (values >= SMALLEST_NORMAL) & (values <= top))]
    if bad.numel():
        name = quoted(name)  # a name from the file, for the message
        bound = f" ({fmt}'s largest value {largest:g} times it must stay within {str(compute).removeprefix('torch.')})"
        raise error(f"{source}: the scale {name} is {bad.flatten()[0].item():g}; a scale must be a finite positive "
                    f"number from {SMALLEST_NORMAL:.3g} (smaller ones are subnormal) to {top:.3g}"
                    f"{bound if fmt in LARGEST else ''}: the weights are multiplied by it, so this one would make a "
                    f"black or garbage image. {advice}")


def check_scale_values(scales: Mapping[str, torch.Tensor], formats: Mapping[str, str], compute: torch.dtype,
                       source: str, advice: str, error: type[ErnieImageError] = ErnieImageError) -> None:
    """Every scale's values (read alone, before the weights), for its layer's format, computing in ``compute``.
    A block scale may be zero (an all-zero block) but not negative or non-finite."""
    for name in sorted(scales, key=natural):
        layer, suffix = _scale_suffix(name)
        fmt, values = formats.get(layer), scales[name].float()
        if (fmt in BLOCK and suffix == BLOCK[fmt][0]) or (fmt not in LARGEST and values.numel() > 1):
            bad = values[~(torch.isfinite(values) & (values >= 0))]
            if bad.numel():
                name = quoted(name)  # a name from the file, for the message
                raise error(f"{source}: the block scale {name} holds {bad.flatten()[0].item():g}; block scales must "
                            f"be finite and not negative (zero: an all-zero block). The weights are multiplied by "
                            f"them, so this one would make a black or garbage image. {advice}")
        else:
            check_scale(name, values, fmt, compute, source, advice, error)
