"""Tiny GGUF files of the tiny DiT, written with the ``gguf`` package as city96's converter writes them, and the
weights they hold as ``gguf.quants.dequantize`` reads them back (the reference).

The ``gguf`` package quantizes Q8_0 but cannot write K-quants: those tensors are random valid blocks (random bytes
with finite fp16 scales, sized so the weights stay small), as llama.cpp lays them out. Names are the released keys;
1-D tensors are F32; tensors whose rows do not fill whole 256-value blocks are stored as rows of 256 with their
shape in ``comfy.gguf.orig_shape.<name>`` (ComfyUI-GGUF's tools/convert.py).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import torch
from diffusers import ErnieImageTransformer2DModel

from scripts.tiny_models import TINY_DIT, randomise_zero_init

T = gguf.GGMLQuantizationType
# Where llama.cpp's blocks keep their fp16 scales (ggml-common.h: block_q8_0, block_q4_K, block_q5_K, block_q6_K),
# and the largest |integer × sub-block scale| each multiplies them by: scales are drawn so that |weight| < 0.15.
SCALES = {"Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
SPAN = {"Q4_K": 63 * 15, "Q5_K": 63 * 31, "Q6_K": 127 * 32}
ORIG_SHAPE = "comfy.gguf.orig_shape."

# A Q4_K_M-like mix: most linear layers Q4_K, the value and down projections Q6_K, the modulation Q5_K; the patch
# embedding (a 1x1 conv) Q4_K too, and the text projection BF16, the time embedding F16.
MIXED = {"to_v": "Q6_K", "linear_fc2": "Q6_K", "adaLN_modulation": "Q5_K", "time_embedding": "F16",
         "text_proj": "BF16"}


def tiny_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """The tiny DiT's weights (diffusers' class, zero-initialised layers randomised), float32."""
    torch.manual_seed(seed)
    transformer = ErnieImageTransformer2DModel(**TINY_DIT)
    randomise_zero_init(transformer, torch.Generator().manual_seed(seed))
    return {k: v.detach().contiguous() for k, v in transformer.state_dict().items()}


def random_blocks(kind: str, count: int, rng: np.random.Generator) -> np.ndarray:
    """``count`` values' worth of random valid ``kind`` blocks, uint8 ``[blocks, bytes]``."""
    values, size = gguf.GGML_QUANT_SIZES[T[kind]]
    blocks = rng.integers(0, 256, (count // values, size), dtype=np.uint8)
    for offset in SCALES[kind]:
        scale = rng.uniform(-0.15, 0.15, (len(blocks), 1)) / SPAN[kind]
        blocks[:, offset:offset + 2] = scale.astype(np.float16).view(np.uint8)
    return blocks


def mixed_kind(name: str, value: torch.Tensor) -> str:
    """The type of each tensor in the Q4_K_M-like file."""
    if value.ndim == 1:
        return "F32"
    return next((kind for part, kind in MIXED.items() if part in name), "Q4_K")


def uniform_kind(kind: str) -> Callable[[str, torch.Tensor], str]:
    """Every 2-D (and 4-D) weight in ``kind``, 1-D tensors in F32."""
    return lambda name, value: "F32" if value.ndim == 1 else kind


def encode(kind: str, value: torch.Tensor, rng: np.random.Generator) -> tuple[np.ndarray, bool]:
    """The data GGUFWriter takes for ``value`` stored as ``kind`` (its values quantized, or random blocks for a
    K-quant), and whether it is flattened into rows of 256 values (its rows do not fill whole blocks)."""
    array = value.float().numpy()
    if kind == "F32":
        return array, False
    if kind == "F16":
        return array.astype(np.float16), False
    flat = array.shape[-1] % gguf.GGML_QUANT_SIZES[T[kind]][0] != 0
    if flat:
        array = array.reshape(-1, 256)
    if kind in SPAN:
        return random_blocks(kind, array.size, rng).reshape(*array.shape[:-1], -1), flat
    return gguf.quants.quantize(array, T[kind]), flat


def write_gguf(path: Path, tensors: dict[str, torch.Tensor], kind: Callable[[str, torch.Tensor], str],
               arch: str = "flux", prefix: str = "", seed: int = 0,
               extra: Callable[[gguf.GGUFWriter], None] | None = None) -> Path:
    """``tensors`` as a GGUF file, each stored as ``kind(name, tensor)``, names under ``prefix``."""
    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for name, value in tensors.items():
        stored = kind(name, value)
        data, flat = encode(stored, value, rng)
        if flat:
            writer.add_array(ORIG_SHAPE + prefix + name, [int(d) for d in value.shape])
        writer.add_tensor(prefix + name, data, raw_dtype=None if stored in ("F32", "F16") else T[stored])
    if extra is not None:
        extra(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def reference_state(path: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    """The float32 weights a GGUF file holds, read with ``gguf.GGUFReader`` and ``gguf.quants.dequantize``."""
    reader = gguf.GGUFReader(str(path))
    state = {}
    for tensor in reader.tensors:
        field = reader.get_field(ORIG_SHAPE + tensor.name)
        shape = (tuple(int(field.parts[i][0]) for i in field.data) if field is not None
                 else tuple(int(d) for d in reversed(tensor.shape)))
        values = gguf.quants.dequantize(np.array(tensor.data), tensor.tensor_type)
        state[tensor.name.removeprefix(prefix)] = torch.from_numpy(np.array(values, dtype=np.float32)).reshape(shape)
    return state


def gguf_bytes(path: Path) -> dict[str, tuple[str, int]]:
    """Each tensor's type and the bytes its data takes in the file."""
    return {t.name: (t.tensor_type.name, int(t.n_bytes)) for t in gguf.GGUFReader(str(path)).tensors}


def set_tensor_type(path: Path, name: str, type_id: int) -> None:
    """Rewrite the type number of tensor ``name`` in the file's header (a type the gguf package cannot write)."""
    data = bytearray(path.read_bytes())
    encoded = name.encode()
    at = data.index(struct.pack("<Q", len(encoded)) + encoded) + 8 + len(encoded)
    rank = struct.unpack_from("<I", data, at)[0]
    struct.pack_into("<I", data, at + 4 + 8 * rank, type_id)
    path.unlink()
    path.write_bytes(bytes(data))


def scale_offset(path: Path, name: str) -> int:
    """Where in the file the first block scale of tensor ``name`` lies."""
    reader = gguf.GGUFReader(str(path))
    tensor = next(t for t in reader.tensors if t.name == name)
    return int(tensor.data_offset) + SCALES[tensor.tensor_type.name][0]


def raw_header(fields: bytes = b"", field_count: int = 0, tensor_count: int = 0) -> bytes:
    """The start of a GGUF file (version 3) with the counts given and ``fields`` after them, nothing else."""
    return b"GGUF" + struct.pack("<IQQ", 3, tensor_count, field_count) + fields


def gguf_string(text: str) -> bytes:
    encoded = text.encode()
    return struct.pack("<Q", len(encoded)) + encoded
