"""Read a GGUF model file as names, types, shapes and where each tensor's bytes lie (engine: no ComfyUI here; the
``gguf`` package's type table, and torch).

The header is read by the bounded walk (``header.py``), not by ``gguf.GGUFReader``, which makes objects for every
item of every field (issue 41: seconds and gigabytes for a header within the caps); of its fields, only the
architecture and the original shapes are read. Nothing is read of the data until the caller has checked the names
and shapes (``GGUFTensor.read``). Shapes come back in torch's order: GGUF keeps ggml's (innermost first), and city96's
converter stores tensors whose rows do not fill whole 256-value blocks flattened to rows of 256, with the true shape
in a ``comfy.gguf.orig_shape.<name>`` field (ComfyUI-GGUF's tools/convert.py); both are read here.

A tensor's bytes are read into memory of their own, not through the reader's memory map: every page of a mapping
that was touched counts in the process's resident memory until the whole mapping is gone, so a file checked and
copied through it was held twice at the load's peak (8 GB card, Q4_K_M: 16.5 GiB of host RAM, 11.0 of it mapped
files; read so, 11.7: bench/RESULTS.md, sessions 18 and 21). Values are checked before anything is kept
(``first_bad_value``): every block's fp16 scales, and every plain tensor, must be finite.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import numpy as np
import torch

from ..errors import ErnieImageError, quoted
from ..model_files import Header, TensorInfo
from .dequant import BLOCKS, PLAIN, SCALE_OFFSETS, UNSUPPORTED_ADVICE
from .header import BigEndianError, CraftedHeaderError, HeaderError, HeaderInfo, walk_header

ORIG_SHAPE = "comfy.gguf.orig_shape."
ARCHITECTURE = "general.architecture"
MAX_FIELD_BYTES = 1 << 16  # of each field read here: a name or a shape takes tens of bytes
_NO_PACKAGE = ("Reading GGUF files needs the gguf package, which is not installed in ComfyUI's Python (the pack's "
               "requirements.txt lists it: were they installed into another Python?). Install it there (`pip install "
               "gguf`, or `pip install -r requirements.txt` in the pack's folder), then restart ComfyUI.")


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file: its type's name (``Q4_K``, ``F16``, …), its shape in torch's order, and where its
    bytes lie in the file (checked against the file's size by the header walk)."""

    kind: str
    shape: tuple[int, ...]
    path: Path
    offset: int
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def read(self) -> torch.Tensor:
        """The tensor in memory of its own: a plain tensor as numbers of its shape and type, a quantized one as its
        blocks (uint8, one dimension)."""
        data = torch.empty(self.nbytes, dtype=torch.uint8)
        try:
            with open(self.path, "rb") as file:
                file.seek(self.offset)
                read = file.readinto(data.numpy())
        except OSError as error:
            raise _unreadable(self.path, error) from error
        if read != self.nbytes:
            raise _damaged(self.path, f"{self.nbytes} bytes of data at byte {self.offset}, but it ends after {read}")
        if self.kind in PLAIN:
            return data.view(PLAIN[self.kind]).reshape(self.shape)
        return data


@dataclass(frozen=True)
class GGUFFile:
    """A GGUF file's tensors by name and what it says it is (``general.architecture``; community files of other
    models' converters say ``flux`` or ``wan``, so it decides nothing); ``walked``: where the fields its reader asked
    for lie (``field``)."""

    path: Path
    architecture: str | None
    tensors: dict[str, GGUFTensor]
    walked: HeaderInfo | None = None

    def header(self) -> Header:
        """Names, shapes and types, for ``structure``'s checks."""
        return {name: TensorInfo(t.shape, t.kind) for name, t in self.tensors.items()}

    def field(self, key: str, max_bytes: int = MAX_FIELD_BYTES):
        """The value of the field ``key`` (one ``read_gguf`` was asked for; None where the file has none), once it
        is known to take at most ``max_bytes``; an error naming the file where it cannot be read."""
        return _field(self.walked, key, max_bytes)


def _gguf_version() -> str:
    try:
        return metadata.version("gguf")
    except metadata.PackageNotFoundError:  # imported from elsewhere than an installed distribution
        return "of unknown version"


def _damaged(path: Path, why: str) -> ErnieImageError:
    return ErnieImageError(f"Cannot read {path} as a GGUF file: it declares {why}. The file is damaged or not a GGUF "
                           "model file (an interrupted download?): download it again.")


def _crafted(path: Path, why: str) -> ErnieImageError:
    return ErnieImageError(f"Cannot read {path} as a GGUF file: it declares {why}, which no GGUF writer makes (each "
                           "tensor has bytes of its own). The file is damaged or was crafted to exhaust memory: "
                           "download it again from a source you trust.")


def _big_endian(path: Path) -> ErnieImageError:
    return ErnieImageError(f"{path} is a big-endian GGUF; this pack reads little-endian files: convert it with the "
                           f"gguf package's `gguf-convert-endian {path} little` (it changes the file in place and "
                           "converts F32, F16, BF16, Q8_0, Q4_K and Q6_K tensors), or download the little-endian file.")


def _unreadable(path: Path, error: OSError) -> ErnieImageError:
    return ErnieImageError(f"Cannot read {path} ({error}). Check the file, or download it again.")


def _wanted(key: str) -> bool:
    return key == ARCHITECTURE or key.startswith(ORIG_SHAPE)


def _none(key: str) -> bool:
    return False


def _field(header: HeaderInfo, key: str, max_bytes: int = MAX_FIELD_BYTES):
    try:
        return header.field(key, max_bytes)
    except HeaderError as error:
        raise _damaged(header.path, str(error)) from None
    except OSError as error:
        raise _unreadable(header.path, error) from error


def _described(value) -> str:
    if isinstance(value, np.ndarray):
        return f"an array of {value.dtype}"
    if isinstance(value, list):
        return "an array of strings or arrays"
    return "a string" if isinstance(value, str) else "a single number"


def _orig_shape(header: HeaderInfo, name: str, count: int) -> tuple[int, ...] | None:
    value = _field(header, ORIG_SHAPE + name)
    if value is None:
        return None
    if not isinstance(value, np.ndarray) or value.dtype != np.int32:
        raise _damaged(header.path, f"{ORIG_SHAPE}{quoted(name)} as {_described(value)}, not an array of int32")
    shape = tuple(int(d) for d in value)
    if not shape or len(shape) > 8 or min(shape) < 1 or math.prod(shape) != count:
        raise _damaged(header.path, f"{ORIG_SHAPE}{quoted(name)} = {list(shape)[:8]} for a tensor of {count} values")
    return shape


def read_gguf(path: Path, fields: Callable[[str], bool] = _none) -> GGUFFile:
    """Every tensor of the GGUF file ``path`` (names as the file has them), or an error naming the file. No data
    is read here, only the header (bounded), and of its fields only the architecture and the original shapes; the
    fields whose keys ``fields`` accepts are located for ``GGUFFile.field``."""
    try:
        import gguf
    except ImportError as error:
        raise ErnieImageError(_NO_PACKAGE) from error
    if not path.is_file():
        raise ErnieImageError(f"Model file not found: {path}. Put it there or pick another file.")
    sizes = {int(kind): size for kind, size in gguf.GGML_QUANT_SIZES.items()}
    try:
        header = walk_header(path, sizes, lambda key: _wanted(key) or fields(key))
    except BigEndianError:
        raise _big_endian(path) from None
    except CraftedHeaderError as error:
        raise _crafted(path, str(error)) from None
    except HeaderError as error:
        raise _damaged(path, str(error)) from None
    except OSError as error:
        raise _unreadable(path, error) from error
    unknown = next((t for t in header.tensors if t.type_id not in sizes), None)
    if unknown is not None:
        raise ErnieImageError(
            f"{path} stores {quoted(unknown.name)} in type number {unknown.type_id}, which no GGUF type of the "
            f"installed gguf package ({_gguf_version()}) is: the file is damaged, or in a type newer than this pack "
            f"reads. {UNSUPPORTED_ADVICE}")
    tensors = {}
    for entry in header.tensors:
        count = math.prod(entry.dims)
        values, size = sizes[entry.type_id]
        shape = _orig_shape(header, entry.name, count) or tuple(reversed(entry.dims))
        tensors[entry.name] = GGUFTensor(gguf.GGMLQuantizationType(entry.type_id).name, shape, path,
                                         header.data_start + entry.offset, count // values * size)
    architecture = _field(header, ARCHITECTURE)
    return GGUFFile(path, quoted(architecture) if isinstance(architecture, str) else None, tensors, header)


def first_bad_value(name: str, kind: str, data: torch.Tensor) -> str | None:
    """Why the numbers of tensor ``name`` of GGUF type ``kind``, read as ``data`` (``GGUFTensor.read``), cannot be
    trusted (a NaN or infinite block scale or value), or None."""
    if kind in BLOCKS:
        blocks = data.reshape(-1, BLOCKS[kind][1])
        for offset in SCALE_OFFSETS[kind]:
            scales = blocks[:, offset:offset + 2].contiguous().view(torch.float16)
            bad = ~torch.isfinite(scales)
            if bad.any():
                block = int(bad.any(dim=1).nonzero()[0])
                return (f"the fp16 block scale at byte {offset} of block {block} of {name} is "
                        f"{float(scales[block, 0])}")
        return None
    if not bool(torch.isfinite(data).all()):
        return f"{name} holds NaN or infinite values"
    return None
