"""A bounded walk over a GGUF file's header, the pack's only parser of it (engine: no ComfyUI here).

``gguf.GGUFReader`` trusts the lengths a header declares (an array said to hold 2^60 items of a file that ends first
makes it loop for ever: gguf 0.19.0, ``_get_field_parts``) and makes numpy views for every item of every array: 2^20
empty strings, an 8 MB header, took it 16 s and 1.6 GB, a 1 MB byte array 9.6 s and 650 MB (issue 41). This walk
holds every count, length and size to what the file can hold and refuses the first that is not, in words a user can
act on. It makes no object per item: a field the caller did not ask for is stepped over (numbers by their size,
strings by their lengths, nested arrays item by item, MAX_DEPTH deep at most); of a field it did ask for, only where
its bytes lie is kept, and ``HeaderInfo.field`` reads it on demand, up to a number of bytes the caller gives.

Before any tensor is read, the tensors' extents are checked: each inside the file, none sharing bytes with another,
all together no more than the data the file holds. A reader allocates every tensor it reads, so a header whose
tensors all point at one blob is a memory bomb (issue 41: 6.6 MiB of file declared 4.4 GiB).

GGUF (versions 2 and 3), little-endian: ``GGUF``, version u32, tensor count u64, field count u64; each field a string
key, a value type u32 and the value; each tensor a string name, a dimension count u32, the dimensions u64 (ggml's
order, innermost first), a type u32 and a data offset u64; the data follows, aligned (``general.alignment``, default
32). GGUF has no byte-order flag: a file written for big-endian machines is told, as ``gguf.GGUFReader`` tells it
(gguf 0.19.0, ``GGUFReader.__init__``: ``if temp_version[0] & 65535 == 0``, "a GGUF file created for the opposite
byte order"), by a version whose low 16 bits read as 0; it is refused by name (``BigEndianError``).
"""

from __future__ import annotations

import itertools
import mmap
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..cancel import check_cancel
from ..errors import quoted

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # what gguf.GGUFReader reads
# An 8B DiT has some 400 tensors and a few dozen fields (one per reshaped tensor in city96's files); language models
# a few thousand tensors. These caps are far above both and far below what would take the walk seconds.
MAX_TENSORS = 1 << 16
MAX_FIELDS = 1 << 16
MAX_ARRAY_ITEMS = 1 << 20  # all arrays together (a tokenizer's tokens, types and merges: some 600k)
MAX_DEPTH = 3  # arrays of arrays of …
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ELEMENTS = 1 << 40
MAX_NAME_BYTES = (1 << 16) - 1  # GGUF's limit for a key; llama.cpp's for a tensor name is 64
_FIXED = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY, _U32 = 8, 9, 4
_LENGTH = struct.Struct("<Q")


class HeaderError(ValueError):
    """Why the header cannot be read, in words that follow "the file" ("declares …")."""


class CraftedHeaderError(HeaderError):
    """A header no writer makes (tensors sharing bytes, more tensor bytes than the file holds): damaged or crafted."""


class BigEndianError(HeaderError):
    """The file is laid out for big-endian machines."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor as the header declares it: its name, dimensions in ggml's order, type number, and data offset."""

    name: str
    dims: tuple[int, ...]
    type_id: int
    offset: int


@dataclass(frozen=True)
class FieldSpan:
    """Where a field's value lies in the file: its GGUF value type and its bytes ``start:end``."""

    kind: int
    start: int
    end: int


@dataclass(frozen=True)
class HeaderInfo:
    """What the walk learned: the tensors, where their data starts, and where the fields asked for lie."""

    path: Path
    tensors: tuple[TensorEntry, ...]
    data_start: int
    fields: dict[str, FieldSpan]

    def field(self, key: str, max_bytes: int):
        """The value of field ``key`` (one the walk was asked for; None where the file has no such field), read from
        the file once its bytes are known to be at most ``max_bytes``: a number, a str, a numpy array of numbers, or
        a list of those. Raises ``HeaderError``."""
        span = self.fields.get(key)
        if span is None:
            return None
        size = span.end - span.start
        if size > max_bytes:
            raise HeaderError(f"the field {quoted(key)} of {size} bytes (at most {max_bytes} are read of it)")
        with self.path.open("rb") as f:
            f.seek(span.start)
            walk = _Walk(_Cursor(f.read(size)))
        value = walk.value(span.kind)
        if walk.cursor.left():
            raise HeaderError(f"the field {quoted(key)} in bytes that changed since its header was read")
        return value


class _Cursor:
    def __init__(self, buffer):
        self.buffer, self.pos = buffer, 0

    def left(self) -> int:
        return len(self.buffer) - self.pos

    def read(self, fmt: str):
        size = struct.calcsize(fmt)
        if size > self.left():
            raise HeaderError("a header that ends before its last entry (the file is truncated)")
        value = struct.unpack_from("<" + fmt, self.buffer, self.pos)[0]
        self.pos += size
        return value

    def skip(self, size: int, what: str) -> None:
        if size > self.left():
            raise HeaderError(f"{what} of {size} bytes, more than the {self.left()} bytes left in the file")
        self.pos += size

    def string(self, what: str, most: int | None = None) -> bytes:
        size = self.read("Q")
        if most is not None and size > most:
            raise HeaderError(f"{what} of {size} bytes (GGUF's are at most {most})")
        start = self.pos
        self.skip(size, what)
        return bytes(self.buffer[start:self.pos])

    def skip_strings(self, count: int) -> None:
        """Step over ``count`` strings by their lengths alone (a tokenizer's 131,072 in some 35 ms)."""
        buffer, pos, end = self.buffer, self.pos, len(self.buffer)
        for _ in range(count):
            if pos + 8 > end:
                raise HeaderError(f"an array of {count} strings that runs past the end of the file")
            pos += 8 + _LENGTH.unpack_from(buffer, pos)[0]
        if pos > end:
            raise HeaderError(f"an array of {count} strings that runs past the end of the file")
        self.pos = pos


class _Walk:
    """Values one after another, every array's items counted against MAX_ARRAY_ITEMS."""

    def __init__(self, cursor: _Cursor):
        self.cursor, self.items = cursor, 0

    def skip(self, kind: int, depth: int = 0):
        """Step over one value of type ``kind``, making nothing of it; a number is returned (the alignment is one)."""
        cursor = self.cursor
        if kind in _FIXED:
            return cursor.read(_FIXED[kind])
        if kind == _STRING:
            cursor.skip(cursor.read("Q"), "a string")
            return None
        item, count = self._array(kind, depth)
        if item in _FIXED:
            cursor.skip(count * struct.calcsize(_FIXED[item]), f"an array of {count} items")
        elif item == _STRING:
            cursor.skip_strings(count)
        else:
            for _ in range(count):
                self.skip(item, depth + 1)
        return None

    def value(self, kind: int, depth: int = 0):
        """One value of type ``kind`` in Python: a number, a str, a numpy array of numbers, or a list."""
        cursor = self.cursor
        if kind in _FIXED:
            return cursor.read(_FIXED[kind])
        if kind == _STRING:
            return cursor.string("a string").decode("utf-8", errors="replace")
        item, count = self._array(kind, depth)
        if item in _FIXED:
            dtype, start = np.dtype("<" + _FIXED[item]), cursor.pos
            cursor.skip(count * dtype.itemsize, f"an array of {count} items")
            return np.frombuffer(cursor.buffer, dtype, count, start).copy()
        return [self.value(item, depth + 1) for _ in range(count)]

    def _array(self, kind: int, depth: int) -> tuple[int, int]:
        """An array's item type and count, once they are within the caps."""
        if kind != _ARRAY:
            raise HeaderError(f"a field of value type {kind}, which GGUF does not have")
        if depth >= MAX_DEPTH:
            raise HeaderError(f"arrays nested more than {MAX_DEPTH} deep")
        item, count = self.cursor.read("I"), self.cursor.read("Q")
        self.items += count
        if self.items > MAX_ARRAY_ITEMS:
            raise HeaderError(f"arrays of more than {MAX_ARRAY_ITEMS} items in all (a model file holds far fewer)")
        return item, count


def _nothing(key: str) -> bool:
    return False


def walk_header(path: Path, block_sizes: dict[int, tuple[int, int]],
                wanted: Callable[[str], bool] = _nothing) -> HeaderInfo:
    """The tensors ``path`` declares, once every count, length and extent in its header fits the file, and where the
    fields whose keys ``wanted`` accepts lie; ``block_sizes`` maps each GGUF type number to (values per block, bytes
    per block). Raises ``HeaderError``; calls ``check_cancel`` before each field and tensor."""
    with path.open("rb") as f:
        if path.stat().st_size < 24:
            raise HeaderError("fewer bytes than a GGUF header")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
            return _walk(path, buffer, block_sizes, wanted)


def _walk(path: Path, buffer, block_sizes: dict[int, tuple[int, int]], wanted: Callable[[str], bool]) -> HeaderInfo:
    if buffer[:4] != MAGIC:
        raise HeaderError(f"no GGUF signature (it starts with {bytes(buffer[:4])!r}, a GGUF file with b'GGUF')")
    version = struct.unpack_from("<I", buffer, 4)[0]
    if version & 0xFFFF == 0 and struct.unpack_from(">I", buffer, 4)[0] in VERSIONS:
        raise BigEndianError("a big-endian GGUF")
    if version not in VERSIONS:
        raise HeaderError(f"GGUF version {version} (versions {' and '.join(map(str, VERSIONS))} are read)")
    cursor = _Cursor(buffer)
    cursor.pos = 8
    tensor_count, field_count = cursor.read("Q"), cursor.read("Q")
    if tensor_count > MAX_TENSORS or field_count > MAX_FIELDS:
        raise HeaderError(f"{tensor_count} tensors and {field_count} fields (a model file has at most "
                          f"{MAX_TENSORS} of each)")
    walk, alignment, fields = _Walk(cursor), 32, {}
    for _ in range(field_count):
        check_cancel()
        key = cursor.string("a field name", MAX_NAME_BYTES).decode("utf-8", errors="replace")
        kind = cursor.read("I")
        start = cursor.pos
        value = walk.skip(kind)
        if key == "general.alignment":
            if kind != _U32:
                raise HeaderError(f"general.alignment of value type {kind} (GGUF's is a u32, type {_U32})")
            alignment = value
        if wanted(key):
            if key in fields:
                raise HeaderError(f"two fields named {quoted(key)}")
            fields[key] = FieldSpan(kind, start, cursor.pos)
    tensors, names = [], set()
    for _ in range(tensor_count):
        check_cancel()
        name = cursor.string("a tensor name", MAX_NAME_BYTES).decode("utf-8", errors="replace")
        rank = cursor.read("I")
        if not 1 <= rank <= MAX_DIMS:
            raise HeaderError(f"the tensor {quoted(name)} with {rank} dimensions (GGUF tensors have 1 to {MAX_DIMS})")
        dims = tuple(cursor.read("Q") for _ in range(rank))
        type_id, offset = cursor.read("I"), cursor.read("Q")
        if name in names:
            raise HeaderError(f"two tensors named {quoted(name)}")
        names.add(name)
        tensors.append(TensorEntry(name, dims, type_id, offset))
    if alignment == 0 or alignment & (alignment - 1):
        raise HeaderError(f"a data alignment of {alignment} (it must be a power of two)")
    data_start = -(-cursor.pos // alignment) * alignment
    _check_extents(tensors, block_sizes, max(0, len(buffer) - data_start))  # a file of no tensors may end first
    return HeaderInfo(path, tuple(tensors), data_start, fields)


def _check_extents(tensors: list[TensorEntry], block_sizes: dict[int, tuple[int, int]], data_bytes: int) -> None:
    """Each tensor lies inside the data, and no two share a byte (so all together fit in it)."""
    extents = []
    for tensor in tensors:
        size = _size(tensor, block_sizes, data_bytes)
        if size:
            extents.append((tensor.offset, tensor.offset + size, tensor.name))
    total = sum(end - start for start, end, _ in extents)
    if total > data_bytes:
        raise CraftedHeaderError(f"tensors of {total} bytes in all, more than the {data_bytes} bytes of data it holds")
    extents.sort()
    for (_, end, name), (start, stop, following) in itertools.pairwise(extents):
        if end > start:
            raise CraftedHeaderError(f"the tensors {quoted(name)} and {quoted(following)} in the same bytes (bytes "
                                     f"{start} to {min(end, stop)} of the data)")


def _size(tensor: TensorEntry, block_sizes: dict[int, tuple[int, int]], data_bytes: int) -> int | None:
    """The bytes of the tensor's data, once its element count is sane, whole blocks, and its data lies inside the
    file; None for a type the caller names (it knows the types)."""
    if tensor.type_id not in block_sizes:
        return None
    count = 1
    for dim in tensor.dims:
        count *= dim
    values, size = block_sizes[tensor.type_id]
    if count > MAX_ELEMENTS:
        raise HeaderError(f"the tensor {quoted(tensor.name)} of {count} values (no model tensor has more than "
                          f"{MAX_ELEMENTS})")
    if tensor.dims[0] % values:
        raise HeaderError(f"the tensor {quoted(tensor.name)} with rows of {tensor.dims[0]} values, which its type "
                          f"stores in blocks of {values}")
    nbytes = count // values * size
    if tensor.offset + nbytes > data_bytes:
        raise HeaderError(f"the tensor {quoted(tensor.name)} at bytes the file does not have (it is truncated: an "
                          "interrupted download?)")
    return nbytes
