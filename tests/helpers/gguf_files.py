"""Tiny GGUF files of the tiny DiT (written by ``scripts/gguf_writer.py`` as city96's converter writes them), the
weights they hold as ``gguf.quants.dequantize`` reads them back (the reference), and byte-level edits for hostile
files.
"""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import torch

from scripts.gguf_writer import ORIG_SHAPE, SCALES


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
