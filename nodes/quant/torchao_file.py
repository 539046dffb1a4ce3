"""A torchao-quantized DiT in one safetensors file, in torchao's own layout for it (engine: no ComfyUI here).

torchao's quantized weights are tensor subclasses. Its safetensors support (``torchao.prototype.safetensors``) keeps
each as its plain tensors (``<layer>._weight_qdata``, ``<layer>._weight_scale``) with the subclass's attributes as
JSON in the header, and rebuilds only the classes on its allowlist. ``write`` writes that layout without torchao's
flatten, which clones every tensor (a second copy of the DiT in host memory). ``read_into`` reads it back into a DiT
skeleton after checking the file's every name, shape and dtype against the skeleton (a Float8Tensor's data in e4m3,
as the pack's methods make it, with one fp32 scale per row) and its scales' values as a downloaded file's are
(``quant_layout.check_scale``: positive, normal, 448 times each within the compute dtype): the file lies in the
models folder, so it is read as any model file is, untrusted.

Float8Tensor (``fp8_per_row``, ``fp8_weight_only``) is on torchao's allowlist. Its INT8 weight-only tensor (an
``AffineQuantizedTensor``) is not, so ``savable`` is false for ``int8_weight_only``, which quantizes at every load.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .. import bounded_json
from ..cancel import check_cancel
from ..errors import ErnieImageError, quoted
from ..model_files import read_header, read_safetensors
from ..quant_layout import check_scale

PLAIN = "Tensor"  # torchao's ``_type`` of a plain tensor
FP8, FORMAT = "F8_E4M3", "float8_e4m3fn"  # what the pack's fp8 methods hold a Float8Tensor's data in
_SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}


def _is_torchao(tensor: torch.Tensor) -> bool:
    from torchao.utils import TorchAOBaseTensor

    return isinstance(tensor, TorchAOBaseTensor)


def _allowed() -> list[str]:
    from torchao.prototype.safetensors.safetensors_utils import ALLOWED_TENSORS_SUBCLASSES

    return ALLOWED_TENSORS_SUBCLASSES


def savable(transformer: torch.nn.Module) -> bool:
    """Whether torchao can rebuild every quantized weight of ``transformer`` from this file layout."""
    return all(type(p).__name__ in _allowed() for p in transformer.parameters() if _is_torchao(p))


def _data_names(tensor: torch.Tensor) -> list[str]:
    return [*tensor.tensor_data_names, *(getattr(tensor, "optional_tensor_data_names", None) or [])]


def write(transformer: torch.nn.Module, path: Path) -> None:
    """``transformer``'s weights into ``path``: its torchao weights as their plain tensors and attributes, the rest
    as they are (``savable`` must hold)."""
    from torchao.prototype.safetensors.safetensors_utils import TensorSubclassAttributeJSONEncoder

    tensors: dict[str, torch.Tensor] = {}
    metadata: dict[str, str] = {}
    for name, tensor in transformer.state_dict().items():
        check_cancel()
        if _is_torchao(tensor):
            layer, attribute = name.rsplit(".", 1)
            for data in _data_names(tensor):
                if getattr(tensor, data) is not None:
                    tensors[f"{layer}._{attribute}_{data}"] = getattr(tensor, data).contiguous()
            metadata[name] = json.dumps(tensor, cls=TensorSubclassAttributeJSONEncoder)
        else:
            tensors[name] = tensor.contiguous()
            metadata[name] = json.dumps({"_type": PLAIN})
    metadata["tensor_names"] = json.dumps(list(metadata))
    save_file(tensors, str(path), metadata)


def _damaged(path: Path, what: str) -> ErnieImageError:
    return ErnieImageError(f"The saved quantized DiT {path} is damaged or from another version of the pack ({what}).")


def _description(metadata: dict[str, str], name: str, path: Path) -> dict:
    try:
        description = bounded_json.loads(metadata[name])
    except (KeyError, ValueError):
        raise _damaged(path, f"no readable description of {name}") from None
    if not isinstance(description, dict) or not (description.get("_type") == PLAIN or (
            description.get("_type") in _allowed() and isinstance(description.get("_tensor_data_names"), list))):
        raise _damaged(path, f"{name} is described as {str(description)[:80]}")
    return description


def _check(path: Path, metadata: dict[str, str], expected: dict[str, torch.Tensor]) -> dict[str, dict]:
    """Each tensor's description, once the header holds exactly the skeleton's names, shapes and dtypes."""
    try:
        names = bounded_json.loads(metadata.get("tensor_names", "null"))
    except ValueError:
        names = None
    if not isinstance(names, list) or set(names) != set(expected):
        missing = sorted(set(expected) - set(names or []))
        raise _damaged(path, f"its tensors are not the DiT's, e.g. missing {missing[:2]}")
    header = read_header(path)
    described, stored = {}, set()
    for name in names:
        described[name] = description = _description(metadata, name, path)
        want = tuple(expected[name].shape)
        if description["_type"] == PLAIN:
            stored.add(name)
            info = header.get(name)
            if info is None or tuple(info.shape) != want or info.dtype != _SAFETENSORS_DTYPES.get(expected[name].dtype):
                raise _damaged(path, f"{name} is {info and list(info.shape)} {info and info.dtype}, "
                               f"not {list(want)} {expected[name].dtype}")
            continue
        layer, attribute = name.rsplit(".", 1)
        parts = {data: header.get(f"{layer}._{attribute}_{data}") for data in description["_tensor_data_names"]}
        stored |= {f"{layer}._{attribute}_{data}" for data in parts}
        qdata, scale = parts.get("qdata"), parts.get("scale")
        data = description.get("_data")
        block_size = data.get("block_size") if isinstance(data, dict) else None  # [1, in]: one scale per row
        if qdata is None or tuple(qdata.shape) != want or qdata.dtype != FP8 or scale is None \
                or tuple(scale.shape) != (want[0], 1) or scale.dtype != "F32" or block_size != [1, want[-1]]:
            raise _damaged(path, f"{name}'s quantized data is not an e4m3 {list(want)} with one fp32 scale per row "
                           f"(it is {qdata and qdata.dtype} {qdata and list(qdata.shape)}, its scale "
                           f"{scale and scale.dtype} {scale and list(scale.shape)})")
    if set(header) != stored:
        others = [quoted(name) for name in sorted(set(header) - stored)[:2]]
        raise _damaged(path, f"it holds other tensors too, e.g. {others}")
    return described



def read_into(skeleton: torch.nn.Module, path: Path) -> torch.nn.Module:
    """``skeleton`` (a DiT whose weights are all on the meta device) holding the weights saved at ``path``."""
    from torchao.prototype.safetensors.safetensors_support import unflatten_tensor_state_dict

    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
    except (SafetensorError, OSError) as e:
        raise _damaged(path, str(e)) from e
    expected = skeleton.state_dict()
    described = _check(path, metadata, expected)  # before reading any weight
    scales = {f"{name.rsplit('.', 1)[0]}._{name.rsplit('.', 1)[1]}_scale": expected[name].dtype
              for name, description in described.items() if description["_type"] != PLAIN}
    tensors = {}
    for name in read_header(path):
        check_cancel()
        (tensors[name],) = read_safetensors(path, [name]).values()
        tensor = tensors[name]
        if tensor.is_floating_point() and tensor.dtype.itemsize > 1 and not torch.isfinite(tensor).all():
            raise _damaged(path, f"{name} holds values that are not finite")
        if name in scales:
            try:
                check_scale(name, tensor, FORMAT, scales[name], str(path), "")
            except ErnieImageError as e:
                raise _damaged(path, str(e).removeprefix(f"{path}: ").strip().rstrip(".")) from None
    weights, leftover = unflatten_tensor_state_dict(tensors, metadata)
    if leftover:
        raise _damaged(path, f"torchao did not take {sorted(leftover)[:2]}")
    plain = {name: w for name, w in weights.items() if not _is_torchao(w)}
    skeleton.load_state_dict(plain, strict=False, assign=True)
    for name, weight in weights.items():
        if name not in plain:
            layer, attribute = name.rsplit(".", 1)
            setattr(skeleton.get_submodule(layer), attribute, torch.nn.Parameter(weight, requires_grad=False))
    still_empty = [name for name, tensor in skeleton.state_dict().items() if tensor.is_meta]
    if still_empty:
        raise _damaged(path, f"no weights for {still_empty[:2]}")
    return skeleton
