"""GGUF's block formats, turned back into floats in torch (engine: torch only, no ComfyUI, no ``gguf`` package).

A quantized GGUF tensor is a run of blocks, each ``size`` bytes holding ``values`` numbers: fp16 scales and small
integers. The layouts are llama.cpp's (ggml-common.h), as the ``gguf`` package's numpy ``quants`` module decodes them;
the tests hold every function here to that module, bit for bit in float32 (ComfyUI-GGUF's ``dequant.py`` decodes
the same types in torch, its shifts and IQ4 table copied to the device at every call). This runs where the layer runs
(on the GPU at sampling time), one layer at a time: the model keeps only the blocks.

- ``Q8_0``: 32 values, an fp16 scale ``d`` and 32 int8: ``d * q``.
- ``Q4_0`` / ``Q5_0``: 32 values, an fp16 ``d``, 4-bit quants (values 0-15 in the low, 16-31 in the high nibbles of
  16 bytes; Q5_0: a fifth bit each in a 32-bit word before them) less 8 (Q5_0: 16): ``d * q``.
- ``Q4_1`` / ``Q5_1``: as Q4_0 / Q5_0 with a minimum: fp16 ``d`` and ``m``, unsigned quants: ``d * q + m``.
- ``IQ4_NL``: 32 values laid out as Q4_0, each 4-bit quant an index into llama.cpp's 16 non-linear levels
  (``kvalues_iq4nl``): ``d * level[q]``.
- ``IQ4_XS``: 256 values in 8 sub-blocks of 32, an fp16 ``d``, a 6-bit scale less 32 each (low 4 bits in 4 bytes,
  top 2 in a 16-bit word), quants as IQ4_NL's: ``d * sc * level[q]``.
- ``Q4_K`` / ``Q5_K``: 256 values in 8 sub-blocks of 32, fp16 ``d`` and ``dmin``, a 6-bit scale and a 6-bit minimum
  per sub-block (12 bytes), 4-bit quants (Q5_K: a fifth bit in 32 more bytes): ``d * sc * q - dmin * m``.
- ``Q6_K``: 256 values in 16 sub-blocks of 16, an int8 scale each, an fp16 ``d``, 6-bit quants less 32:
  ``d * sc * q``.
- ``Q3_K``: 256 values in 16 sub-blocks of 16, a 6-bit scale less 32 each (12 bytes), an fp16 ``d``, 2-bit quants
  and a third bit in a 32-byte mask, 4 taken off where that bit is 0: ``d * sc * q``.
- ``Q2_K``: 256 values in 16 sub-blocks of 16, a 4-bit scale and a 4-bit minimum each (16 bytes), 2-bit quants laid
  out as Q3_K's, fp16 ``d`` and ``dmin`` last: ``d * sc * q - dmin * m``.

``F32``, ``F16`` and ``BF16`` tensors are plain numbers and need no decoding. Any other GGUF type is refused by the
reader (``UNSUPPORTED_ADVICE``).
"""

from __future__ import annotations

import torch

QK_K = 256
# type → (values per block, bytes per block), as GGML_QUANT_SIZES says.
# The one list of the block types the pack reads (ComfyUI-GGUF's), from the most bits a weight to the fewest.
BLOCKS = {"Q8_0": (32, 34), "Q6_K": (QK_K, 210), "Q5_1": (32, 24), "Q5_K": (QK_K, 176), "Q5_0": (32, 22),
          "Q4_1": (32, 20), "Q4_K": (QK_K, 144), "IQ4_NL": (32, 18), "Q4_0": (32, 18), "IQ4_XS": (QK_K, 136),
          "Q3_K": (QK_K, 110), "Q2_K": (QK_K, 84)}
PLAIN = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
SUPPORTED = (*BLOCKS, *PLAIN)
# Where each block keeps its fp16 scales (byte offsets): what must be finite for the block to mean numbers.
# (IQ4_XS's sub-block scales are 6-bit integers, finite whatever their bits.)
SCALE_OFFSETS = {"Q8_0": (0,), "Q6_K": (208,), "Q5_1": (0, 2), "Q5_K": (0, 2), "Q5_0": (0,), "Q4_1": (0, 2),
                 "Q4_K": (0, 2), "IQ4_NL": (0,), "Q4_0": (0,), "IQ4_XS": (0,), "Q3_K": (108,), "Q2_K": (80, 82)}
# IQ4_NL's and IQ4_XS's 16 levels (llama.cpp's kvalues_iq4nl, as gguf.quants.IQ4_NL.kvalues).
IQ4_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
# The block types in words, from the one list above (``BLOCKS``): every message and description names them so.
BLOCK_TYPE_NAMES = ", ".join(list(BLOCKS)[:-1]) + f" and {list(BLOCKS)[-1]}"
UNSUPPORTED_ADVICE = (f"The pack reads the GGUF types {BLOCK_TYPE_NAMES} (community files such as Q4_K_M mix "
                      "several of them) and F16, BF16, F32: pick a file of those types, or the safetensors file.")
# Values decoded per step when eager: the float32 temporaries stay at 64 MiB however large the layer.
CHUNK_VALUES = 1 << 24


def bytes_per_value(kind: str) -> float:
    """What one number of a tensor of block type ``kind`` takes in the file."""
    values, size = BLOCKS[kind]
    return size / values


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


def _low_then_high(packed: torch.Tensor) -> torch.Tensor:
    """16 bytes → the 32 four-bit quants of a 32-value block: values 0-15 the low nibbles, 16-31 the high ones."""
    return _fields(packed, 4, dim=1).reshape(packed.shape[0], 32)


def _fifth_bits(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """Q5_0's and Q5_1's fifth bits: bit i of the little-endian 32-bit word at ``offset``, for value i, as ``<< 4``."""
    return _fields(blocks[:, offset:offset + 4], 1, dim=2).reshape(blocks.shape[0], 32) << 4


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    return _f16(blocks, 0) * (_low_then_high(blocks[:, 2:18]).to(torch.int8) - 8).float()


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:  # ``d * q``, then ``+ m``: in this order, as the reference rounds
    return _f16(blocks, 0) * _low_then_high(blocks[:, 4:20]).float() + _f16(blocks, 2)


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    quants = _low_then_high(blocks[:, 6:22]) | _fifth_bits(blocks, 2)
    return _f16(blocks, 0) * (quants.to(torch.int8) - 16).float()


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    quants = _low_then_high(blocks[:, 8:24]) | _fifth_bits(blocks, 4)
    return _f16(blocks, 0) * quants.float() + _f16(blocks, 2)


# The levels are kept on each device they were used on: made there at every call, they would be a host-to-device
# copy that waits for the GPU (as a tensor of shifts would: ``_fields``). Compiled, they are a constant of the graph.
_LEVELS: dict[torch.device, torch.Tensor] = {}


def _iq4_levels(quants: torch.Tensor) -> torch.Tensor:
    """The IQ4 level of each 4-bit quant, as float32 (the package's int8 levels, exact in float32)."""
    if torch.compiler.is_compiling():
        return torch.tensor(IQ4_LEVELS, dtype=torch.float32, device=quants.device)[quants.int()]
    levels = _LEVELS.get(quants.device)
    if levels is None:
        levels = _LEVELS[quants.device] = torch.tensor(IQ4_LEVELS, dtype=torch.float32, device=quants.device)
    return levels[quants.int()]


def _iq4_nl(blocks: torch.Tensor) -> torch.Tensor:
    return _f16(blocks, 0) * _iq4_levels(_low_then_high(blocks[:, 2:18]))


def _iq4_xs(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    # Sub-block j's scale: its low 4 bits in nibble j of bytes 4-7 (low nibble first), its top 2 in bits 2j, 2j + 1
    # of the little-endian 16-bit word at byte 2.
    low = _fields(blocks[:, 4:8], 4, dim=2).reshape(n, 8)
    top = _fields(blocks[:, 2:4], 2, dim=2).reshape(n, 8)
    scales = (low | (top << 4)).to(torch.int8) - 32
    scale = (_f16(blocks, 0) * scales.float()).unsqueeze(-1)
    quants = _fields(blocks[:, 8:136].reshape(n, 8, 16), 4, dim=2)  # per sub-block: 16 low, then 16 high nibbles
    return (scale * _iq4_levels(quants.reshape(n, 8, 32))).reshape(n, QK_K)


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


def _q2_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    packed = blocks[:, 0:16]  # per sub-block: its scale in the low, its minimum in the high nibble
    scale = (_f16(blocks, 80) * (packed & 0x0F).float()).unsqueeze(-1)
    offset = (_f16(blocks, 82) * (packed >> 4).float()).unsqueeze(-1)
    quants = blocks[:, 16:80].reshape(n, 2, 32)  # as Q3_K's: per half of the block, four 2-bit fields of each byte
    quants = _fields(quants, 2, dim=2).reshape(n, 16, 16)
    return (scale * quants.float() - offset).reshape(n, QK_K)


_DECODE = {"Q8_0": _q8_0, "Q6_K": _q6_k, "Q5_1": _q5_1, "Q5_K": _q5_k, "Q5_0": _q5_0, "Q4_1": _q4_1, "Q4_K": _q4_k,
           "IQ4_NL": _iq4_nl, "Q4_0": _q4_0, "IQ4_XS": _iq4_xs, "Q3_K": _q3_k, "Q2_K": _q2_k}


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
