"""GGUF files of the ERNIE-Image DiT as the community's are made (city96's converter, then llama.cpp's quantizer), with
random weights: the tests' tiny files (``tests/helpers/gguf_files.py``) and the GPU end-to-end check's true-size one
(``checks/gpu/e2e_models.py``) come from here.

The ``gguf`` package quantizes Q8_0, Q5_1, Q5_0, Q4_1 and Q4_0 but cannot write K-quants or IQ4: those tensors are
random valid blocks (random bytes with finite fp16 scales, sized so the weights stay small), as llama.cpp lays them
out; the weights' own values are not read for them, so a true-size file costs random bytes, not quantization. Names
are the released keys; 1-D tensors are F32; tensors whose rows do not fill whole blocks are stored as rows of 256 with
their shape in ``comfy.gguf.orig_shape.<name>`` (ComfyUI-GGUF's tools/convert.py).

A file is written tensor by tensor: the header first, from the shapes alone, then each tensor's bytes as they are
made, so host memory holds one tensor's at a time (an 8B DiT's largest is 41 MB in Q6_K) whatever the model's size.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path

import gguf
import numpy as np
import torch

T = gguf.GGMLQuantizationType
# Where llama.cpp's blocks keep their fp16 scales (ggml-common.h: block_q4_0 … block_q8_0, block_q2_K … block_q6_K,
# block_iq4_nl, block_iq4_xs), and, for the types written as random blocks, the largest |integer × sub-block scale|
# each multiplies them by: scales are drawn so that |weight| < 0.15 (a spread of about 0.03, near the normal(0, 0.02)
# of the check's other random models).
SCALES = {"Q8_0": (0,), "Q5_1": (0, 2), "Q5_0": (0,), "Q4_1": (0, 2), "Q4_0": (0,), "Q2_K": (80, 82), "Q3_K": (108,),
          "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,)}
SPAN = {"Q2_K": 3 * 15, "Q3_K": 32 * 4, "Q4_K": 63 * 15, "Q5_K": 63 * 31, "Q6_K": 127 * 32, "IQ4_NL": 127,
        "IQ4_XS": 32 * 127}
# The same for the types the package quantizes: written as random blocks only for weights without values (meta).
QUANTIZER_SPAN = {"Q8_0": 127, "Q5_1": 31, "Q5_0": 16, "Q4_1": 15, "Q4_0": 8}
ORIG_SHAPE = "comfy.gguf.orig_shape."
# The types the writer takes as numpy numbers; the others it takes as GGML bytes.
NUMPY = {"F32": np.dtype(np.float32), "F16": np.dtype(np.float16)}

# A Q4_K_M-like mix: most linear layers Q4_K, the value and down projections Q6_K, the modulation Q5_K; the patch
# embedding (a 1x1 conv) Q4_K too, and the text projection BF16, the time embedding F16.
MIXED = {"to_v": "Q6_K", "linear_fc2": "Q6_K", "adaLN_modulation": "Q5_K", "time_embedding": "F16",
         "text_proj": "BF16"}
# A Q3_K_M-like mix: most linear layers Q3_K, the value and down projections Q4_K, the rest as above.
MIXED_Q3 = {**MIXED, "to_v": "Q4_K", "linear_fc2": "Q4_K"}


def random_blocks(kind: str, count: int, rng: np.random.Generator) -> np.ndarray:
    """``count`` values' worth of random valid ``kind`` blocks, uint8 ``[blocks, bytes]``."""
    values, size = gguf.GGML_QUANT_SIZES[T[kind]]
    n = count // values
    # The generator's raw 64-bit words seen as bytes: three times as fast as drawing bytes, for gigabytes of them.
    blocks = rng.bit_generator.random_raw(-(-n * size // 8)).view(np.uint8)[:n * size].reshape(n, size)
    for offset in SCALES[kind]:
        scale = rng.uniform(-0.15, 0.15, (n, 1)) / {**SPAN, **QUANTIZER_SPAN}[kind]
        blocks[:, offset:offset + 2] = scale.astype(np.float16).view(np.uint8)
    return blocks


def mixed_kind(name: str, value: torch.Tensor, mix: Mapping[str, str] = MIXED, default: str = "Q4_K") -> str:
    """The type of each tensor in the Q4_K_M-like file (with ``MIXED_Q3`` and ``Q3_K``: the Q3_K_M-like one)."""
    if value.ndim == 1:
        return "F32"
    return next((kind for part, kind in mix.items() if part in name), default)


def q3_mixed_kind(name: str, value: torch.Tensor) -> str:
    return mixed_kind(name, value, MIXED_Q3, "Q3_K")


def uniform_kind(kind: str) -> Callable[[str, torch.Tensor], str]:
    """Every 2-D (and 4-D) weight in ``kind``, 1-D tensors in F32."""
    return lambda name, value: "F32" if value.ndim == 1 else kind


def stored_shape(kind: str, shape: tuple[int, ...]) -> tuple[tuple[int, ...], bool]:
    """The shape of the values a tensor of ``shape`` is stored with as ``kind``, and whether that is rows of 256
    instead of its own (its rows do not fill whole blocks)."""
    if kind in NUMPY or shape[-1] % gguf.GGML_QUANT_SIZES[T[kind]][0] == 0:
        return shape, False
    return (math.prod(shape) // 256, 256), True


def encode(kind: str, value: torch.Tensor, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """The data GGUFWriter takes for ``value`` stored as ``kind`` with the values' ``shape`` (``stored_shape``): its
    numbers, quantized, or random blocks for a K-quant or IQ4 (``value`` is then not read: it may be on any device), and
    for any quantized type where ``value`` is on the meta device (a weight without values: a true-size file whose
    values do not matter, written in seconds)."""
    if kind in SPAN or (value.is_meta and kind in QUANTIZER_SPAN):
        return random_blocks(kind, math.prod(shape), rng).reshape(*shape[:-1], -1)
    array = value.detach().float().cpu().numpy().reshape(shape)
    if kind in NUMPY:
        return array.astype(NUMPY[kind])
    return gguf.quants.quantize(array, T[kind])


def write_gguf(path: Path, tensors: Mapping[str, torch.Tensor], kind: Callable[[str, torch.Tensor], str],
               arch: str = "flux", prefix: str = "", seed: int = 0,
               extra: Callable[[gguf.GGUFWriter], None] | None = None,
               endianess: gguf.GGUFEndian = gguf.GGUFEndian.LITTLE) -> Path:
    """``tensors`` as a GGUF file, each stored as ``kind(name, tensor)``, names under ``prefix``; ``extra`` may add
    fields (it runs before the header is written); ``endianess`` BIG: as the writer lays a file out for big-endian
    machines (numbers byte-swapped, K-quant blocks as they are)."""
    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), arch, endianess=endianess)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    layout = {}
    for name, value in tensors.items():
        stored = kind(name, value)
        shape, flat = stored_shape(stored, tuple(value.shape))
        layout[name] = stored, shape
        if flat:
            writer.add_array(ORIG_SHAPE + prefix + name, [int(d) for d in value.shape])
        if stored in NUMPY:
            writer.add_tensor_info(prefix + name, shape, NUMPY[stored], math.prod(shape) * NUMPY[stored].itemsize)
        else:  # bytes of a GGML type: the writer takes their shape and works out the values'
            byte_shape = gguf.quant_shape_to_byte_shape(shape, T[stored])
            writer.add_tensor_info(prefix + name, byte_shape, np.dtype(np.uint8), math.prod(byte_shape), T[stored])
    if extra is not None:
        extra(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, value in tensors.items():  # in the order of the header's tensor entries, as the writer expects
        stored, shape = layout[name]
        writer.write_tensor_data(encode(stored, value, shape, rng))
    writer.close()
    return path
