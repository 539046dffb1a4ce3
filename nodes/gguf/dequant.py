"""GGUF's block formats, turned back into floats in torch (engine: torch only, no ComfyUI, no ``gguf`` package).

A quantized GGUF tensor is a run of blocks, each ``size`` bytes holding ``values`` numbers: fp16 scales and small
integers. The layouts are llama.cpp's (ggml-common.h), as the ``gguf`` package's numpy ``quants`` module decodes them;
the tests hold every function here to that module, bit for bit in float32. This runs where the layer runs (on the
GPU at sampling time), one layer at a time: the model keeps only the blocks.

- ``Q8_0``: 32 values, an fp16 scale ``d`` and 32 int8: ``d * q``.
- ``Q4_K`` / ``Q5_K``: 256 values in 8 sub-blocks of 32, fp16 ``d`` and ``dmin``, a 6-bit scale and a 6-bit minimum
  per sub-block (12 bytes), 4-bit quants (Q5_K: a fifth bit in 32 more bytes): ``d * sc * q - dmin * m``.
- ``Q6_K``: 256 values in 16 sub-blocks of 16, an int8 scale each, an fp16 ``d``, 6-bit quants less 32:
  ``d * sc * q``.
- ``Q3_K``: 256 values in 16 sub-blocks of 16, a 6-bit scale less 32 each (12 bytes), an fp16 ``d``, 2-bit quants
  and a third bit in a 32-byte mask, 4 taken off where that bit is 0: ``d * sc * q``.

``F32``, ``F16`` and ``BF16`` tensors are plain numbers and need no decoding. Any other GGUF type is refused by the
reader (``UNSUPPORTED_ADVICE``).
"""

from __future__ import annotations

import torch

QK_K = 256
# type → (values per block, bytes per block), as GGML_QUANT_SIZES says.
# The one list of the block types the pack reads, from the most bits a weight to the fewest.
BLOCKS = {"Q8_0": (32, 34), "Q6_K": (QK_K, 210), "Q5_K": (QK_K, 176), "Q4_K": (QK_K, 144), "Q3_K": (QK_K, 110)}
PLAIN = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
SUPPORTED = (*BLOCKS, *PLAIN)
# Where each block keeps its fp16 scales (byte offsets): what must be finite for the block to mean numbers.
SCALE_OFFSETS = {"Q8_0": (0,), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
# The block types in words, from the one list above (``BLOCKS``): every message and description names them so.
BLOCK_TYPE_NAMES = ", ".join(list(BLOCKS)[:-1]) + f" and {list(BLOCKS)[-1]}"
UNSUPPORTED_ADVICE = (f"The pack reads the GGUF types {BLOCK_TYPE_NAMES} (community files such as Q4_K_M mix "
                      "several of them) and F16, BF16, F32: pick a file of those types, or the safetensors file.")
# Values decoded per step when eager: the float32 temporaries stay at 64 MiB however large the layer.
CHUNK_VALUES = 1 << 24


def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 number at ``offset`` of every block, as float32 ``[n, 1]``."""
    return blocks[:, offset:offset + 2].contiguous().view(torch.float16).float()


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return blocks[:, 2:].contiguous().view(torch.int8).float() * _f16(blocks, 0)


def _scales_and_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The K-quants' 8 six-bit scales and 8 six-bit minimums from 12 bytes: bytes 0-3 hold scales 0-3 in their low
    6 bits, 4-7 the minimums 0-3; 8-11 the low 4 bits of scales and minimums 4-7, whose high 2 bits are the top
    bits of bytes 0-3 and 4-7."""
    low, mid, high = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = torch.cat([low & 0x3F, (high & 0x0F) | ((low >> 2) & 0x30)], dim=1)
    mins = torch.cat([mid & 0x3F, (high >> 4) | ((mid >> 2) & 0x30)], dim=1)
    return scales.float(), mins.float()


# The bit fields are taken apart with shifts by Python numbers and stacked, not by broadcasting a tensor of shifts:
# such a tensor made on the GPU at every call would be a host-to-device copy that waits for the GPU.
def _fields(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Each byte's ``bits``-wide fields, lowest first, stacked along a new ``dim``."""
    mask = (1 << bits) - 1
    return torch.stack([(packed >> shift) & mask for shift in range(0, 8, bits)], dim=dim)


def _nibbles(quants: torch.Tensor) -> torch.Tensor:
    """128 bytes → 8 sub-blocks of 32 four-bit values: each 32 bytes give a sub-block of low, then one of high
    nibbles."""
    n = quants.shape[0]
    quants = quants.reshape(n, 4, 32)
    return _fields(quants, 4, dim=2).reshape(n, 8, 32)


def _k_quant(blocks: torch.Tensor, quants: torch.Tensor) -> torch.Tensor:
    """``d * sc * q - dmin * m`` over 8 sub-blocks of 32 (Q4_K, Q5_K): in this order, as the reference rounds."""
    scales, mins = _scales_and_mins(blocks[:, 4:16])
    scale = (_f16(blocks, 0) * scales).unsqueeze(-1)
    offset = (_f16(blocks, 2) * mins).unsqueeze(-1)
    return (scale * quants.float() - offset).reshape(blocks.shape[0], QK_K)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    return _k_quant(blocks, _nibbles(blocks[:, 16:144]))


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    high = blocks[:, 16:48]  # bit j of byte i: the fifth bit of value i of sub-block j
    fifth = _fields(high, 1, dim=1)
    return _k_quant(blocks, _nibbles(blocks[:, 48:176]) | (fifth << 4))


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    low = blocks[:, 0:128].reshape(n, 2, 64)  # per half of the block: 64 low, then 64 high nibbles
    low = _fields(low, 4, dim=2)
    high = blocks[:, 128:192].reshape(n, 2, 32)  # per half: four 2-bit fields of each byte, one per 32 values
    high = _fields(high, 2, dim=2)
    quants = (low.reshape(n, 8, 32) | (high.reshape(n, 8, 32) << 4)).to(torch.int8) - 32
    scale = (_f16(blocks, 208) * blocks[:, 192:208].contiguous().view(torch.int8).float()).unsqueeze(-1)
    return (scale * quants.reshape(n, 16, 16).float()).reshape(n, QK_K)


def _q3_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    # The 16 scales' low 4 bits: scales 0-7 in the low, 8-15 in the high nibbles of bytes 0-7; their top 2 bits:
    # bytes 8-11, byte b holding those of scales b, b + 4, b + 8 and b + 12 in its four 2-bit fields.
    packed = blocks[:, 96:108]
    low = _fields(packed[:, 0:8], 4, dim=1)
    top = _fields(packed[:, 8:12], 2, dim=1)
    scales = (low.reshape(n, 16) | (top.reshape(n, 16) << 4)).to(torch.int8) - 32
    quants = blocks[:, 32:96].reshape(n, 2, 32)  # per half of the block: four 2-bit fields of each byte
    quants = _fields(quants, 2, dim=2).reshape(n, 16, 16)
    mask = blocks[:, 0:32]  # bit j of byte i: value i of the j-th 32; where it is 0 the value is 4 lower
    lowered = (_fields(mask, 1, dim=1) ^ 1).reshape(n, 16, 16) << 2
    scale = (_f16(blocks, 108) * scales.float()).unsqueeze(-1)
    return (scale * (quants.to(torch.int8) - lowered.to(torch.int8)).float()).reshape(n, QK_K)


_DECODE = {"Q8_0": _q8_0, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


def dequantize(raw: torch.Tensor, kind: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The ``shape`` numbers, in ``dtype``, that the blocks ``raw`` (uint8, on any device) of type ``kind`` hold.
    Decoded in float32, as the reference does, then rounded once to ``dtype``."""
    values, size = BLOCKS[kind]
    blocks = raw.reshape(-1, size)
    decode = _DECODE[kind]
    if torch.compiler.is_compiling():  # inductor fuses the decode's steps: no float32 temporaries to bound
        return decode(blocks).to(dtype).view(shape)
    out = torch.empty(blocks.shape[0] * values, dtype=dtype, device=raw.device)
    step = max(1, CHUNK_VALUES // values)
    for start in range(0, blocks.shape[0], step):
        out[start * values:(start + step) * values] = decode(blocks[start:start + step]).flatten()
    return out.view(shape)


def block_bytes(kind: str, count: int) -> int:
    """How many bytes ``count`` values of the quantized ``kind`` take."""
    values, size = BLOCKS[kind]
    return count // values * size
