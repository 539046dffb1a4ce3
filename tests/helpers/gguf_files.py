"""Tiny GGUF files of the tiny DiT (written by ``scripts/gguf_writer.py`` as city96's converter writes them), the
weights they hold as ``gguf.quants.dequantize`` reads them back (the reference), byte-level edits for hostile files,
copies of a GGUF rewritten by the gguf package's writer, and the safetensors twin of a llama.cpp Ministral 3 file.
"""

from __future__ import annotations

import math
import struct
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file, save_file

from scripts.gguf_writer import ORIG_SHAPE, SCALES, random_blocks


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


def _rewrite_entry(path: Path, name: str, what: str, value: int) -> None:
    """Rewrite the ``what`` ("type" or "offset") of tensor ``name``'s entry in the file's header."""
    data = bytearray(path.read_bytes())
    encoded = name.encode()
    at = data.index(struct.pack("<Q", len(encoded)) + encoded) + 8 + len(encoded)
    rank = struct.unpack_from("<I", data, at)[0]
    at += 4 + 8 * rank  # the type number (u32), then the data offset (u64)
    struct.pack_into(*(("<I", data, at) if what == "type" else ("<Q", data, at + 4)), value)
    path.unlink()
    path.write_bytes(bytes(data))


def set_tensor_type(path: Path, name: str, type_id: int) -> None:
    """Rewrite the type number of tensor ``name`` in the file's header (a type the gguf package cannot write)."""
    _rewrite_entry(path, name, "type", type_id)


def set_tensor_offset(path: Path, name: str, offset: int) -> None:
    """Rewrite where tensor ``name``'s data starts (bytes after the data section's start) in the file's header."""
    _rewrite_entry(path, name, "offset", offset)


def tensor_offset(path: Path, name: str) -> int:
    """Where tensor ``name``'s data starts, in bytes after the data section's start."""
    reader = gguf.GGUFReader(str(path))
    return int(next(t for t in reader.tensors if t.name == name).data_offset) - reader.data_offset


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


def f32_gguf(path: Path, entries: dict[str, tuple[tuple[int, ...], int]], data_bytes: int) -> Path:
    """A GGUF file of ``data_bytes`` of zeros whose tensors are F32 and lie where ``entries`` says: each name's shape
    (torch's order) and data offset, written byte by byte (the gguf package lays tensors out one after another)."""
    infos = b"".join(gguf_string(name) + struct.pack(f"<I{len(shape)}QIQ", len(shape), *reversed(shape), 0, offset)
                     for name, (shape, offset) in entries.items())
    header = raw_header(tensor_count=len(entries)) + infos
    path.write_bytes(header + bytes(-len(header) % 32) + bytes(data_bytes))  # the data starts aligned to 32 bytes
    return path


def one_blob_gguf(path: Path, shapes: dict[str, tuple[int, ...]]) -> Path:
    """Every tensor of ``shapes`` at the start of one blob the size of the largest: each lies inside the file, together
    they declare far more bytes than it holds (issue 41's memory bomb)."""
    largest = max(math.prod(shape) for shape in shapes.values()) * 4
    return f32_gguf(path, {name: (shape, 0) for name, shape in shapes.items()}, largest)


def rewrite_gguf(source: Path, path: Path, fields: dict | None = None, drop: tuple[str, ...] = (),
                 tensors: dict | None = None, endianess=gguf.GGUFEndian.LITTLE) -> Path:
    """A copy of the GGUF file ``source`` written anew by the gguf package's writer: its fields, with ``fields``
    (key → value, of the field's own type where the file has it, else a string) put in and the ``drop`` keys left
    out; its tensors as they are, but those ``tensors`` names (name → (numpy array, GGML type)) given anew."""
    fields, tensors = fields or {}, tensors or {}
    reader = gguf.GGUFReader(str(source))
    architecture = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(path), architecture if "general.architecture" not in fields else None,
                             endianess=endianess)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in drop or (key == "general.architecture" and key not in fields):
            continue
        value = fields.get(key, field.contents())
        writer.add_key_value(key, value, field.types[0], field.types[-1] if len(field.types) > 1 else None)
    for key, value in fields.items():
        if key not in reader.fields:
            writer.add_key_value(key, value, gguf.GGUFValueType.STRING)
    for tensor in reader.tensors:
        data, kind = tensors.get(tensor.name, (np.array(tensor.data), tensor.tensor_type))
        writer.add_tensor(tensor.name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# llama.cpp's names of a Llama-like model's tensors and transformers' (gguf-py's tensor_mapping.py, read backwards).
LLAMA_CPP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
                   "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                   "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                   "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}


def transformers_name(name: str) -> str:
    """transformers' name of llama.cpp's tensor ``name`` (``blk.1.attn_q.weight`` → ``model.layers.1.self_attn
    .q_proj.weight``)."""
    parts = name.split(".")
    if parts[0] == "blk":
        return f"model.layers.{parts[1]}.{LLAMA_CPP_NAMES[parts[2]]}.weight"
    return f"{LLAMA_CPP_NAMES[parts[0]]}.weight"


def converter_permute(weights: torch.Tensor, n_head: int, n_head_kv: int | None) -> torch.Tensor:
    """llama.cpp's ``LlamaModel.permute`` (0c1e57098, ``conversion/llama.py``), as the converter applies it to the
    query (``n_head, n_head``) and key (``n_head, n_head_kv``) projections."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2)
            .reshape(weights.shape))


def dequantized_twin(source: Path, tekken_from: Path, path: Path) -> Path:
    """The GGUF file ``source`` as ComfyUI's single-file text encoder: every tensor decoded by
    ``gguf.quants.dequantize``, the query and key rows put back where the converter's permute took them from, and
    the tokenizer of ``tekken_from``."""
    reader = gguf.GGUFReader(str(source))
    heads = int(reader.fields["mistral3.attention.head_count"].contents())
    kv_heads = int(reader.fields["mistral3.attention.head_count_kv"].contents())
    state = {}
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(np.array(tensor.data), tensor.tensor_type)
        value = torch.from_numpy(np.array(values, dtype=np.float32)).reshape(tuple(reversed(tensor.shape.tolist())))
        if tensor.name.endswith(("attn_q.weight", "attn_k.weight")):
            order = converter_permute(torch.arange(value.shape[0]), heads,
                                      heads if "attn_q" in tensor.name else kv_heads)
            original = torch.empty_like(value)
            original[order] = value  # the converter wrote original[order]
            value = original
        state[transformers_name(tensor.name)] = value.contiguous()
    state["tekken_model"] = load_file(tekken_from)["tekken_model"]
    save_file(state, str(path))
    return path


def retyped(kind: str, name: str, reader: gguf.GGUFReader, rng: np.random.Generator) -> np.ndarray:
    """Tensor ``name`` of the file as ``kind``: its values quantized by ``gguf.quants`` where it can, else random
    valid blocks (the K-quants, which it cannot write)."""
    tensor = next(t for t in reader.tensors if t.name == name)
    values = gguf.quants.dequantize(np.array(tensor.data), tensor.tensor_type).reshape(tensor.shape[::-1])
    if kind in ("F32", "F16"):
        return values.astype(np.float32 if kind == "F32" else np.float16)
    try:
        return gguf.quants.quantize(values.astype(np.float32), gguf.GGMLQuantizationType[kind])
    except NotImplementedError:
        return random_blocks(kind, values.size, rng).reshape(values.shape[0], -1)
