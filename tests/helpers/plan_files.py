"""Model files of ERNIE-Image's true sizes whose data is a hole: headers as the real files have them, data never
written (sparse files take no disk). The memory plan reads headers only, so it sees the true sizes; no test loads
their weights."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

from helpers.gguf_files import gguf_string, raw_header
from helpers.plan_records import dit_tensors, lm_tensors

Q4_K = 12  # GGML's type id (gguf.GGMLQuantizationType.Q4_K)
F32 = 0


def sparse_gguf_dit(path: Path) -> Path:
    """The 8B DiT as a Q4_K GGUF: its block linears in Q4_K (144 bytes per 256 values), the rest F32."""
    infos, offset = b"", 0
    for tensor in dit_tensors("Q4_K"):
        kind = Q4_K if tensor.stored is not None else F32
        size = tensor.stored if tensor.stored is not None else tensor.numel * 4
        infos += gguf_string(tensor.name) + struct.pack(f"<I{len(tensor.shape)}QIQ", len(tensor.shape),
                                                        *reversed(tensor.shape), kind, offset)
        offset += size + (-size % 32)
    header = raw_header(tensor_count=len(dit_tensors("Q4_K"))) + infos
    header += bytes(-len(header) % 32)
    with open(path, "wb") as file:
        file.write(header)
        file.truncate(len(header) + offset)
    return path


def sparse_safetensors(path: Path, shapes: dict[str, tuple[int, ...]], dtype: str = "BF16") -> Path:
    """A safetensors file of ``shapes`` in ``dtype`` (2 bytes a value) whose data is a hole."""
    header, offset = {}, 0
    for name, shape in shapes.items():
        size = math.prod(shape) * 2
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", len(text)) + text)
        file.truncate(8 + len(text) + offset)
    return path


def sparse_text_encoder(path: Path) -> Path:
    """ComfyUI's repack of the text encoder (``ministral-3-3b.safetensors``): the language model in bf16."""
    return sparse_safetensors(path, {t.name: t.shape for t in lm_tensors()})


def sparse_vae(path: Path) -> Path:
    """The Flux.2 VAE's 84 M values in bf16 (0.16 GiB)."""
    return sparse_safetensors(path, {"decoder.conv_in.weight": (84_000_000,)})
