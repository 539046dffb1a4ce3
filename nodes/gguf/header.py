"""A bounded walk over a GGUF file's header, before the ``gguf`` package parses it (engine: no ComfyUI here).

``gguf.GGUFReader`` trusts the lengths a header declares: an array said to hold 2^60 items of a file that ends first
makes it loop for ever, reading nothing past the end (gguf 0.19.0, ``_get_field_parts``); counts of tensors and
fields are taken as they are, and a tensor's element count is a numpy product that wraps around. This walk reads the
same header with every count, length and size held to what the file can hold, and refuses the first that is not,
in milliseconds, with words a user can act on. What it accepts, the reader parses in bounded time.

GGUF (versions 2 and 3): ``GGUF``, version u32, tensor count u64, field count u64; each field a string key, a
value type u32 and the value; each tensor a string name, a dimension count u32, the dimensions u64 (ggml's order,
innermost first), a type u32 and a data offset u64; the data follows, aligned (``general.alignment``, default 32).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # what gguf.GGUFReader reads
# An 8B DiT has some 400 tensors and a few dozen fields (one per reshaped tensor in city96's files); language models
# a few thousand tensors. These caps are far above both and far below what would take the reader minutes.
MAX_TENSORS = 1 << 16
MAX_FIELDS = 1 << 16
MAX_ARRAY_ITEMS = 1 << 20  # all arrays together: the reader makes one numpy view per item (a tokenizer has ~150k)
MAX_DEPTH = 3  # arrays of arrays of …
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ELEMENTS = 1 << 40
_FIXED = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


class HeaderError(ValueError):
    """Why the header cannot be read, in words that follow "the file" ("declares …")."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor as the header declares it: its name, dimensions in ggml's order, type number, and data offset."""

    name: str
    dims: tuple[int, ...]
    type_id: int
    offset: int


@dataclass(frozen=True)
class HeaderInfo:
    """What the walk learned: the tensors and where their data starts."""

    tensors: tuple[TensorEntry, ...]
    data_start: int


class _Cursor:
    def __init__(self, buffer, order: str):
        self.buffer, self.order, self.pos = buffer, order, 0

    def left(self) -> int:
        return len(self.buffer) - self.pos

    def read(self, fmt: str):
        size = struct.calcsize(fmt)
        if size > self.left():
            raise HeaderError("a header that ends before its last entry (the file is truncated)")
        value = struct.unpack_from(self.order + fmt, self.buffer, self.pos)[0]
        self.pos += size
        return value

    def skip(self, size: int, what: str) -> None:
        if size > self.left():
            raise HeaderError(f"{what} of {size} bytes, more than the {self.left()} bytes left in the file")
        self.pos += size

    def string(self, what: str) -> bytes:
        size = self.read("Q")
        start = self.pos
        self.skip(size, what)
        return bytes(self.buffer[start:self.pos])


class _Walk:
    def __init__(self, cursor: _Cursor):
        self.cursor, self.items = cursor, 0

    def value(self, kind: int, depth: int = 0):
        """Skip one value of type ``kind``; a u32 is returned (the alignment field is one)."""
        cursor = self.cursor
        if kind in _FIXED:
            return cursor.read(_FIXED[kind])
        if kind == _STRING:
            return cursor.string("a string")
        if kind != _ARRAY:
            raise HeaderError(f"a field of value type {kind}, which GGUF does not have")
        if depth >= MAX_DEPTH:
            raise HeaderError(f"arrays nested more than {MAX_DEPTH} deep")
        item, count = cursor.read("I"), cursor.read("Q")
        self.items += count
        if self.items > MAX_ARRAY_ITEMS:
            raise HeaderError(f"arrays of more than {MAX_ARRAY_ITEMS} items in all (a model file holds far fewer)")
        if item in _FIXED:
            cursor.skip(count * struct.calcsize(_FIXED[item]), f"an array of {count} items")
        else:
            for _ in range(count):
                self.value(item, depth + 1)
        return None


def walk_header(path: Path, block_sizes: dict[int, tuple[int, int]]) -> HeaderInfo:
    """The tensors ``path`` declares, once every count and length in its header fits the file; ``block_sizes``
    maps each GGUF type number to (values per block, bytes per block). Raises ``HeaderError``."""
    with path.open("rb") as f:
        if path.stat().st_size < 24:
            raise HeaderError("fewer bytes than a GGUF header")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
            return _walk(buffer, block_sizes)


def _walk(buffer, block_sizes: dict[int, tuple[int, int]]) -> HeaderInfo:
    if buffer[:4] != MAGIC:
        raise HeaderError(f"no GGUF signature (it starts with {bytes(buffer[:4])!r}, a GGUF file with b'GGUF')")
    order = "<"
    version = struct.unpack_from("<I", buffer, 4)[0]
    if version & 0xFFFF == 0:  # written on a big-endian machine (gguf.GGUFReader reads those too)
        order, version = ">", struct.unpack_from(">I", buffer, 4)[0]
    if version not in VERSIONS:
        raise HeaderError(f"GGUF version {version} (versions {' and '.join(map(str, VERSIONS))} are read)")
    cursor = _Cursor(buffer, order)
    cursor.pos = 8
    tensor_count, field_count = cursor.read("Q"), cursor.read("Q")
    if tensor_count > MAX_TENSORS or field_count > MAX_FIELDS:
        raise HeaderError(f"{tensor_count} tensors and {field_count} fields (a model file has at most "
                          f"{MAX_TENSORS} of each)")
    walk, alignment = _Walk(cursor), 32
    for _ in range(field_count):
        key = cursor.string("a field name")
        kind = cursor.read("I")
        value = walk.value(kind)
        if key == b"general.alignment" and kind == 4:
            alignment = value
    tensors, names = [], set()
    for _ in range(tensor_count):
        name = cursor.string("a tensor name").decode("utf-8", errors="replace")
        rank = cursor.read("I")
        if not 1 <= rank <= MAX_DIMS:
            raise HeaderError(f"the tensor {name} with {rank} dimensions (GGUF tensors have 1 to {MAX_DIMS})")
        dims = tuple(cursor.read("Q") for _ in range(rank))
        type_id, offset = cursor.read("I"), cursor.read("Q")
        if name in names:
            raise HeaderError(f"two tensors named {name}")
        names.add(name)
        tensors.append(TensorEntry(name, dims, type_id, offset))
    if alignment == 0 or alignment & (alignment - 1):
        raise HeaderError(f"a data alignment of {alignment} (it must be a power of two)")
    data_start = -(-cursor.pos // alignment) * alignment
    for tensor in tensors:
        _check_extent(tensor, block_sizes, len(buffer) - data_start)
    return HeaderInfo(tuple(tensors), data_start)


def _check_extent(tensor: TensorEntry, block_sizes: dict[int, tuple[int, int]], data_bytes: int) -> None:
    """The tensor's element count is sane, whole blocks, and its data lies inside the file."""
    if tensor.type_id not in block_sizes:
        return  # named by the caller, which knows the types
    count = 1
    for dim in tensor.dims:
        count *= dim
    values, size = block_sizes[tensor.type_id]
    if count > MAX_ELEMENTS:
        raise HeaderError(f"the tensor {tensor.name} of {count} values (no model tensor has more than "
                          f"{MAX_ELEMENTS})")
    if tensor.dims[0] % values:
        raise HeaderError(f"the tensor {tensor.name} with rows of {tensor.dims[0]} values, which its type stores "
                          f"in blocks of {values}")
    if tensor.offset + count // values * size > data_bytes:
        raise HeaderError(f"the tensor {tensor.name} at bytes the file does not have (it is truncated: an "
                          "interrupted download?)")
